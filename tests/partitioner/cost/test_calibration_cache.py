"""Tests of partitioner/cost/calibration_cache.py: a versioned cache of quiet runs only."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import partitioner.cost.calibration_cache as cache
import partitioner.cost.measure as measure
from partitioner.cost.calibration_cache import CACHE_FORMAT, Run, read_runs, write_runs

TIMINGS = {**dict.fromkeys(measure.TIMING_KEYS, 1e-3),
           "few": 1e-4, "some": 8e-4, "many": 3.2e-3, "fresh": 2e-3}


@pytest.fixture
def path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PARTITIONER_CALIBRATION_CACHE", raising=False)
    found = measure.cache_file()
    assert found is not None and found.parent == tmp_path
    return found


class Machine:
    """A fake calibration: each run takes no time and counts; ``loads`` are the foreign
    shares the load samples report, in turn (the last repeats)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs = 0
        self.loads = [0.02]
        monkeypatch.setattr(measure, "_timings", self.timings)
        monkeypatch.setattr(cache, "foreign_share", self.share)

    def timings(self, progress: object) -> dict[str, float]:
        self.runs += 1
        return {**TIMINGS, "many": TIMINGS["many"] * self.runs}  # each run its own

    def share(self, start: object, end: object = None) -> float:
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Machine]:
    yield Machine(monkeypatch)


def measure_once() -> object:
    return measure.measure_cpu.__wrapped__(False)  # measure_cpu without its once-per-process


def test_tests_never_use_the_user_s_cache() -> None:
    # conftest.py points the cache at a folder of the test session's own.
    found = measure.cache_file()
    assert found is not None
    assert not found.is_relative_to(Path.home() / ".cache")
    assert found.is_relative_to(tempfile.gettempdir())
    assert os.environ["PARTITIONER_CACHE_DIR"] in str(found)


def test_a_quiet_run_is_kept_with_format_and_torch_version(path: Path,
                                                           machine: Machine) -> None:
    spec = measure_once()
    data = json.loads(path.read_text())
    assert data["format"] == CACHE_FORMAT and data["torch"] == torch.__version__
    assert len(data["runs"]) == 1 and data["runs"][0]["foreign"] == 0.02
    assert data["runs"][0]["timings"] == TIMINGS
    assert machine.runs == 1 and measure.cached_cpu_spec() == spec


def test_the_spec_is_the_median_of_the_kept_runs(path: Path, machine: Machine) -> None:
    write_runs(path, [Run({**TIMINGS, "add": t}, at=0.0, foreign=0.0) for t in (1e-3, 9e-3)])
    measure_once()  # a third run, "add" 1e-3: the median is 1e-3
    runs = read_runs(path, measure.TIMING_KEYS).runs
    assert [run.timings["add"] for run in runs] == [1e-3, 9e-3, 1e-3]
    assert machine.runs == 1
    spec = measure.cached_cpu_spec()
    assert spec is not None
    assert spec.memory_bandwidth == pytest.approx(3 * 16 * 2**20 * 4 / 1e-3)


def test_the_cache_keeps_the_newest_runs(path: Path, machine: Machine) -> None:
    write_runs(path, [Run(TIMINGS, at=float(k), foreign=0.0) for k in range(cache.KEPT_RUNS)])
    measure_once()
    runs = read_runs(path, measure.TIMING_KEYS).runs
    assert len(runs) == cache.KEPT_RUNS and runs[0].at == 1.0 and runs[-1].at > 1e9


def test_a_loaded_run_is_measured_again_and_the_quiet_one_kept(
        path: Path, machine: Machine, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_quiet_moment", lambda: True)
    machine.loads = [0.6, 0.05]
    measure_once()
    assert machine.runs == 2
    runs = read_runs(path, measure.TIMING_KEYS).runs
    assert [run.foreign for run in runs] == [0.05]
    assert runs[0].timings["many"] == 2 * TIMINGS["many"]  # the second run's
    assert "kept 60% of the cores busy" in capsys.readouterr().err


def test_a_run_that_stays_loaded_is_used_but_never_cached(
        path: Path, machine: Machine, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_quiet_moment", lambda: True)
    write_runs(path, [Run(TIMINGS, at=0.0, foreign=0.0)])
    before = path.read_text()
    machine.loads = [0.5]
    spec = measure_once()
    assert machine.runs == 3  # retried twice
    assert path.read_text() == before
    loaded = Run({**TIMINGS, "many": 3 * TIMINGS["many"]}, 0.0, 0.5)
    assert spec == measure.median_spec([Run(TIMINGS, 0.0, 0.0), loaded])  # this process's
    err = capsys.readouterr().err
    assert "not kept in the calibration cache" in err and "50%" in err


def test_no_quiet_moment_stops_retrying(path: Path, machine: Machine,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_quiet_moment", lambda: False)
    machine.loads = [0.5]
    measure_once()
    assert machine.runs == 1 and not path.exists()


def test_a_quiet_moment_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    loads = [0.9, 0.9, 0.0]
    monkeypatch.setattr(cache, "foreign_share", lambda start: loads.pop(0))
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    assert cache._quiet_moment() and loads == []
    monkeypatch.setattr(cache, "foreign_share", lambda start: 0.9)
    assert not cache._quiet_moment(wait=0.05)


def test_an_unknown_load_counts_as_quiet() -> None:
    assert cache.is_quiet(Run(TIMINGS, 0.0, None)) and cache.is_quiet(Run(TIMINGS, 0.0, 0.1))
    assert not cache.is_quiet(Run(TIMINGS, 0.0, 0.2))


BAD_FILES: dict[str, Callable[[], str]] = {
    "not JSON": lambda: '{"format": 2, "runs": [',
    "the old format": lambda: json.dumps([TIMINGS, TIMINGS]),
    "another format": lambda: json.dumps({"format": 99, "torch": torch.__version__,
                                          "runs": []}),
    "another torch": lambda: json.dumps({"format": CACHE_FORMAT, "torch": "1.0.0",
                                         "runs": [{"at": 0.0, "foreign": 0.0,
                                                   "timings": TIMINGS}]}),
    "a run without a timing": lambda: json.dumps(
        {"format": CACHE_FORMAT, "torch": torch.__version__,
         "runs": [{"at": 0.0, "foreign": 0.0, "timings": {"few": 1e-4}}]}),
    "a negative timing": lambda: json.dumps(
        {"format": CACHE_FORMAT, "torch": torch.__version__,
         "runs": [{"at": 0.0, "foreign": 0.0, "timings": {**TIMINGS, "add": -1.0}}]}),
}
SAID = {"not JSON": "is corrupt (not JSON", "the old format": "no format",
        "another format": f"has format 99, not {CACHE_FORMAT}", "another torch": "torch 1.0.0, not",
        "a run without a timing":
            "no timing " + ", ".join(sorted(set(measure.TIMING_KEYS) - {"few"})[:3])
            + f" and {len(measure.TIMING_KEYS) - 4} more",
        "a negative timing": "add=-1.0"}


@pytest.mark.parametrize("bad", BAD_FILES)
def test_an_unusable_cache_is_said_measured_again_and_rewritten(
        bad: str, path: Path, machine: Machine, capsys: pytest.CaptureFixture[str]) -> None:
    path.write_text(BAD_FILES[bad]())
    assert measure.cached_cpu_spec() is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(path) in err[0] and SAID[bad] in err[0], err
    assert "measuring the CPU again" in err[0]
    measure_once()
    assert machine.runs == 1
    assert capsys.readouterr().err == ""  # said once per process
    data = json.loads(path.read_text())
    assert data["format"] == CACHE_FORMAT and len(data["runs"]) == 1


def test_an_unusable_cache_goes_even_when_the_new_run_is_loaded(
        path: Path, machine: Machine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_quiet_moment", lambda: False)
    path.write_text("garbage")
    machine.loads = [0.9]
    measure_once()
    assert read_runs(path, measure.TIMING_KEYS) == cache.Cached(path, [], None)


def test_a_run_taken_since_this_process_started_is_shared(path: Path,
                                                          machine: Machine) -> None:
    # Another rank of this host measured while this one waited for the lock.
    write_runs(path, [Run(TIMINGS, at=time.time(), foreign=0.0)])
    assert measure_once() == measure.median_spec([Run(TIMINGS, 0.0, 0.0)])
    assert machine.runs == 0
    measure.remeasure_cpu()  # partitioner calibrate --measure always measures
    assert machine.runs == 1 and len(read_runs(path, measure.TIMING_KEYS).runs) == 2


def test_a_disabled_cache_measures_and_writes_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, machine: Machine) -> None:
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PARTITIONER_CALIBRATION_CACHE", "0")
    assert measure.cache_file() is None and measure.cached_cpu_spec() is None
    measure_once()
    assert machine.runs == 1 and list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_is_said(path: Path, machine: Machine,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path.parent.joinpath("blocker").write_text("")
    target = path.parent / "blocker" / "cpu.json"
    assert not write_runs(target, [Run(TIMINGS, 0.0, 0.0)])
    err = capsys.readouterr().err
    assert str(target) in err and "PARTITIONER_CACHE_DIR" in err


def test_the_lock_says_whether_another_holder_came_first(tmp_path: Path) -> None:
    target = tmp_path / "cpu.json"
    with cache.cache_lock(target) as waited:
        assert not waited and (tmp_path / "cpu.json.lock").exists()
    with cache.cache_lock(target) as waited:
        assert not waited  # released
