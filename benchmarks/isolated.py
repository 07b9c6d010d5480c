"""Contenders timed each in a process of its own, a burst of steps at a time, in rounds.

Several partitioned modules alive in one process slow each other even while idle: on the
2-core VM the unpartitioned MLP of ``regret.py`` took 7.5 ms a step alone, 10.0 ms while a
``dp=2 x pp=2`` module of the same model sat idle beside it, and 8.5 ms once that module
was closed (docs/benchmarks.md, "auto's regret", 2026-12-03 18:20 UTC). A user runs one
plan in a process, so each contender here lives in its own process (``spawn``) and the
parent asks them in turn for a burst of training steps: drift in the machine's speed still
hits every contender alike, and no contender's threads or allocator state weigh on another's.

A burst is what a training loop runs: steps back to back. One step timed after the process
sat idle is not: on this VM the second step after 0.3 s of idle took 20-24 ms for a
``dp=2 x pp=2`` plan that runs 14-17 ms a step back to back, and 17-19 ms for a ``pp=4``
one that runs 16.5 ms (docs/benchmarks.md, "Timed in bursts"), which ranked the two the
wrong way round.

The child builds its contender from a picklable description (:class:`Spec`) with a builder
function importable by name (its ``predicted`` attribute, if any, goes back to the parent),
runs warm-up steps, then answers each ``("burst", seconds)`` with the median of the steps it
ran back to back for that long (after an untimed lead-in step, at least one timed) and the
share of the cores other processes kept busy meanwhile (the parent and the idle siblings
wait on pipes and use none).

Example (not run here: it spawns processes)::

    pool = Isolated([Spec("regret", "contender_module", ("mlp", 2, record))])
    seconds, foreign = pool.step(0, burst=0.2)
    pool.close()
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["Spec", "Isolated"]

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Spec:
    """How a child builds its contender: ``module.function(*args)`` (``module`` importable
    from ``benchmarks/``) returns an object with a ``step()`` method."""

    module: str
    function: str
    args: tuple[Any, ...]


def _child(spec: Spec, warmup: int, conn: Connection) -> None:
    for path in (str(HERE.parent), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)
    from machine_load import cpu_sample, foreign_share
    try:
        contender = getattr(importlib.import_module(spec.module), spec.function)(*spec.args)
        for _ in range(warmup):
            contender.step()
    except Exception:
        conn.send(("error", traceback.format_exc(limit=3)))
        return
    conn.send(("ready", getattr(contender, "predicted", None)))
    while True:
        command = conn.recv()
        if not (isinstance(command, tuple) and command[0] == "burst"):
            break
        try:
            contender.step()  # lead-in: the timed steps follow one of their own
            load = cpu_sample()
            times: list[float] = []
            begin = time.perf_counter()
            while not times or time.perf_counter() - begin < command[1]:
                start = time.perf_counter()
                contender.step()
                times.append(time.perf_counter() - start)
        except Exception:
            conn.send(("error", traceback.format_exc(limit=3)))
            return
        conn.send(("step", (statistics.median(times), foreign_share(load) or 0.0)))
    close = getattr(contender, "close", None)
    if callable(close):
        close()


class Isolated:
    """One process per contender, built (``built`` says which) and warmed up.

    Args:
        specs: how each contender is built.
        warmup: untimed steps each runs once built.
        at_once: children building at the same time (each imports torch and builds its
            module; more at once only competes for the cores and memory).
        settle: seconds of quiet before each step: the previous contender's OpenMP threads
            spin-wait for more work after its step (GNU OpenMP's default spin, measured at
            up to about 15 ms of a core on this VM), and a step started at once shares
            the cores with them.
    """

    def __init__(self, specs: list[Spec], warmup: int = 2, at_once: int = 2,
                 settle: float = 0.05) -> None:
        context = mp.get_context("spawn")
        self.settle = settle
        self.errors: dict[int, str] = {}
        #: Per built contender, what its ``predicted`` attribute said (``None``: none).
        self.predicted: dict[int, Any] = {}
        self._children: dict[int, tuple[Any, Connection]] = {}
        pending = list(enumerate(specs))
        while pending:
            batch, pending = pending[:at_once], pending[at_once:]
            started = []
            for i, spec in batch:
                parent, child = context.Pipe()
                process = context.Process(target=_child, args=(spec, warmup, child),
                                          daemon=True)
                process.start()
                child.close()
                started.append((i, process, parent))
            for i, process, parent in started:
                kind, detail = _receive(parent, process)
                if kind == "ready":
                    self._children[i] = (process, parent)
                    self.predicted[i] = detail
                else:
                    self.errors[i] = str(detail)
                    process.join(timeout=5)

    @property
    def built(self) -> list[int]:
        return sorted(self._children)

    def step(self, i: int, burst: float = 0.0) -> tuple[float, float]:
        """Timed training steps of contender ``i`` run back to back for ``burst`` seconds
        (at least one, right after an untimed one, as in a training loop), once the machine
        had :attr:`settle` seconds of quiet: (their median seconds, share of the cores other
        processes kept busy meanwhile).

        Raises:
            RuntimeError: the contender failed (it is dropped from :attr:`built`).
        """
        process, conn = self._children[i]
        time.sleep(self.settle)
        conn.send(("burst", burst))
        kind, detail = _receive(conn, process)
        if kind != "step":
            del self._children[i]
            self.errors[i] = str(detail)
            raise RuntimeError(str(detail))
        return detail

    def close(self) -> None:
        for _, conn in self._children.values():
            try:
                conn.send("close")
            except OSError:
                pass
        for process, _ in self._children.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._children.clear()


def _receive(conn: Connection, process: Any) -> tuple[str, Any]:
    try:
        return conn.recv()
    except EOFError:
        process.join(timeout=5)
        return "error", f"the contender's process ended (exit code {process.exitcode})"
