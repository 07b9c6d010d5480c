"""The calibration cache: this machine's quiet CPU calibration runs, in one small file.

One JSON file per CPU model, core count, torch version and thread count, in
``$PARTITIONER_CACHE_DIR`` (else ``~/.cache/partitioner``; ``PARTITIONER_CALIBRATION_CACHE=0``
disables it)::

    {"format": 2, "torch": "2.5.1",
     "runs": [{"at": 1764700000.0, "foreign": 0.03, "timings": {"few": 0.0001, ...}}, ...]}

``at`` is when a run was taken, ``foreign`` the share of the cores other processes kept busy
meanwhile (``null``: unknown). Only quiet runs are written (:mod:`partitioner.cost.measure`).
A file that cannot be used -- not JSON, another format, another torch version, a run without
a timing -- is reported on stderr once per process and replaced by the next measurement,
never silently ignored.

Processes of one host that need the calibration at once (the ranks ``torchrun`` starts) hold
:func:`cache_lock` while they measure: one measures, the others wait and read its run.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "cpu.json"
    >>> write_runs(path, [Run({"few": 1e-4}, at=0.0, foreign=0.02)])
    True
    >>> read_runs(path, ["few"]).runs[0].timings
    {'few': 0.0001}
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from partitioner.cost.cpu_load import cpu_sample, foreign_share
from partitioner.runtime.host_memory import cpu_host_memory_mode

__all__ = ["CACHE_FORMAT", "KEPT_RUNS", "QUIET", "Run", "Cached", "cache_file", "read_runs",
           "write_runs", "report_problem", "cache_lock", "is_quiet", "quiet_run", "runs_to_use"]

CACHE_FORMAT = 3
"""1: a bare list of timings (no torch version, no load); 2: ``{"format", "torch", "runs"}``;
3: the same, runs also timing bf16 and fp16 products (``partitioner.cost.measure``)."""
KEPT_RUNS = 9
"""The most runs a cache file keeps (the newest): the spec is their median."""
QUIET = 0.15
"""The most of all cores other processes may keep busy during a run that is kept."""
_ATTEMPTS = 3
_STARTED = time.time()  # runs taken since are another process's, shared (runs_to_use)


@dataclass(frozen=True)
class Run:
    """One calibration run.

    Attributes:
        timings: seconds per timed piece of work (see ``partitioner.cost.measure``).
        at: when it was taken (``time.time()``).
        foreign: the share of all cores other processes kept busy meanwhile; ``None``:
            unknown (no ``/proc/stat``).
    """

    timings: dict[str, float]
    at: float
    foreign: float | None

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "foreign": self.foreign, "timings": self.timings}

    @classmethod
    def from_json(cls, data: Any, keys: Collection[str]) -> Run:
        """The run ``data`` holds, its timings checked against ``keys``.

        Raises:
            ValueError: ``data`` is not such a run (the message says what is wrong).
        """
        if not isinstance(data, dict) or not isinstance(data.get("timings"), dict):
            raise ValueError(f"{type(data).__name__} without timings")
        timings = data["timings"]
        missing = sorted(set(keys) - set(timings))
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"no timing {', '.join(missing[:3])}{more}")
        bad = [k for k, v in timings.items() if not _seconds(v)]
        if bad:
            raise ValueError(f"timing {bad[0]}={timings[bad[0]]!r} is not seconds")
        foreign = data.get("foreign")
        if foreign is not None and not _seconds(foreign):
            raise ValueError(f"foreign={foreign!r} is not a share")
        at = data.get("at")
        if at is None or not _seconds(at):
            raise ValueError(f"at={at!r} is not a time")
        return cls({k: float(v) for k, v in timings.items()}, float(at),
                   None if foreign is None else float(foreign))


def _seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


@dataclass(frozen=True)
class Cached:
    """What a cache file holds.

    Attributes:
        path: the file.
        runs: its usable runs, oldest first (none when it is missing or unusable).
        problem: why the file cannot be used (``"is corrupt (...)"``), or ``None``.
    """

    path: Path
    runs: list[Run] = field(default_factory=list)
    problem: str | None = None


def cache_file() -> Path | None:
    """Where this machine's calibration runs are kept (``None``: the cache is disabled)."""
    if os.environ.get("PARTITIONER_CALIBRATION_CACHE", "1") == "0":
        return None
    root = os.environ.get("PARTITIONER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "partitioner")
    # "runs": a list of runs; "shared-by-size": stages running at once share the intra-op
    # threads, timed for products of four sizes and element-wise streams; the Adam step is
    # timed after a backward; "host": how glibc keeps freed memory, "system", "steady" or
    # "kept" (partitioner.runtime.host_memory). Runs timed otherwise must not be mixed in.
    key = (f"{_cpu_model()}|{os.cpu_count()}|{torch.__version__}|{torch.get_num_threads()}"
           f"|runs|median|shared-by-size-1024|adam-after-backward|action|fresh"
           f"|host-{cpu_host_memory_mode()}|caller-spin-settled|lone-at-full-rate")
    return Path(root) / f"cpu-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_runs(path: Path, keys: Collection[str]) -> Cached:
    """The runs kept in ``path``, each with every timing in ``keys``; a missing file has
    none, an unusable one none and its ``problem``."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Cached(path)
    except (OSError, UnicodeDecodeError) as error:
        return Cached(path, problem=f"cannot be read ({error})")
    try:
        data = json.loads(text)
    except ValueError as error:
        return Cached(path, problem=f"is corrupt (not JSON: {error})")
    if not isinstance(data, dict) or "format" not in data:
        return Cached(path, problem="is corrupt or from an older partitioner (no format)")
    if data["format"] != CACHE_FORMAT:
        return Cached(path, problem=f"has format {data['format']!r}, not {CACHE_FORMAT}")
    if data.get("torch") != torch.__version__:
        return Cached(path, problem=f"was measured with torch {data.get('torch')}, not "
                                    f"{torch.__version__}")
    if not isinstance(data.get("runs"), list):
        return Cached(path, problem="is corrupt (no list of runs)")
    try:
        runs = [Run.from_json(run, keys) for run in data["runs"]]
    except ValueError as error:
        return Cached(path, problem=f"is corrupt (a run has {error})")
    return Cached(path, runs)


def write_runs(path: Path, runs: Sequence[Run]) -> bool:
    """Replace ``path`` with ``runs`` (at once: a reader never sees half a file); ``False``
    (and a line on stderr) when it cannot be written."""
    data = {"format": CACHE_FORMAT, "torch": torch.__version__,
            "runs": [run.to_json() for run in runs]}
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps(data, indent=1))
        os.replace(part, path)
    except OSError as error:
        _say(f"cannot write the calibration cache {path} ({error.strerror or error}); "
             "set PARTITIONER_CACHE_DIR to a folder you can write to")
        return False
    return True


_REPORTED: set[tuple[Path, str]] = set()


def report_problem(cached: Cached) -> None:
    """Say on stderr (once per process and problem) why a cache file is not used."""
    if cached.problem is None or (cached.path, cached.problem) in _REPORTED:
        return
    _REPORTED.add((cached.path, cached.problem))
    _say(f"the calibration cache {cached.path} {cached.problem}; measuring the CPU again "
         "and rewriting the file")


def _say(message: str) -> None:
    sys.stderr.write(f"partitioner: {message}\n")
    sys.stderr.flush()


@contextmanager
def cache_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Hold an exclusive lock on ``path``'s lock file (``<path>.lock``, beside it) while the
    ``with`` block runs; yields whether another process held it first.

    ``on_wait`` is called before waiting for another holder. Where files cannot be locked
    (no ``fcntl``, an unwritable folder) the block runs unlocked.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        yield False
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield False
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = True
        try:
            yield waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_quiet(run: Run) -> bool:
    """Whether other processes left the cores alone while ``run`` was taken (an unknown load
    counts as quiet: nothing better can be had)."""
    return run.foreign is None or run.foreign <= QUIET


def quiet_run(time_once: Callable[[], dict[str, float]]) -> Run:
    """A run of ``time_once``, taken again (3 times at most, each after waiting up to 3 s for
    a quiet moment) while other processes load the cores; the last when none was quiet,
    said on stderr."""
    for attempt in range(1, _ATTEMPTS + 1):
        start = cpu_sample()
        timings = time_once()
        run = Run(timings, time.time(), foreign_share(start))
        if is_quiet(run):
            return run
        busy = (f"other processes kept {run.foreign:.0%} of the cores busy while the CPU "
                "was measured")
        if attempt < _ATTEMPTS and _quiet_moment():
            _say(f"{busy}; measuring again ({attempt + 1}/{_ATTEMPTS})")
            continue
        _say(f"{busy}; this process plans with that run, which is not kept in the "
             "calibration cache (partitioner calibrate --measure on a quiet machine keeps one)")
        break
    return run


def _quiet_moment(wait: float = 3.0, window: float = 0.5) -> bool:
    """Wait up to ``wait`` seconds for ``window`` seconds in which other processes left the
    cores alone; whether one came."""
    end = time.perf_counter() + wait
    while time.perf_counter() < end:
        start = cpu_sample()
        time.sleep(window)
        share = foreign_share(start)
        if share is None or share <= QUIET:
            return True
    return False


def runs_to_use(path: Path | None, take_run: Callable[[], Run], keys: Collection[str], *,
                share: bool = True) -> list[Run]:
    """The runs a spec is the median of: a new one from ``take_run`` and the last kept in
    ``path`` (``None``: no cache, the new one alone), the new one written there if quiet.

    Measuring holds :func:`cache_lock`, so processes of one host measure in turn; with
    ``share``, a process that finds a run taken since it started (while it waited, another
    process measured) uses the kept runs instead of measuring.
    """
    if path is None:
        return [take_run()]
    with cache_lock(path, on_wait=lambda: _say("another process of this host is measuring "
                                               "the CPU; waiting for its result")):
        cached = read_runs(path, keys)
        report_problem(cached)
        if share and any(run.at >= _STARTED for run in cached.runs):
            return cached.runs[-KEPT_RUNS:]
        kept = cached.runs[-(KEPT_RUNS - 1):]
        run = take_run()
        if is_quiet(run):
            write_runs(path, [*kept, run])
        elif cached.problem is not None:
            write_runs(path, [])  # the unusable file goes; the loaded run is not kept
    return [*kept, run]
