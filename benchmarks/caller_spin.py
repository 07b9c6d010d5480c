"""What the caller's idle OpenMP helpers cost the workers it hands a step to (issue 18).

torch's CPU wheels run intra-op parallelism on GNU OpenMP. Once a parallel op of a thread
ends, its team's helper threads spin-wait for the next one (300,000 turns of ``pause`` by
default) on a core. In a training loop in one process the caller runs the optimizer step
(parallel ops on its own team) and then hands the next step to the stage or replica workers
(one intra-op thread each) and waits: the workers start while a helper still spins.

Three measurements, each the median of ``--rounds``:

1. Two worker threads (one intra-op thread each) run ``n`` products of 128 x 128 each, at
   once: after the caller sat idle (its helpers asleep), right after the caller ran a parallel
   op, and right after that op with the caller's team released first
   (``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0, through ``ctypes``); with the
   gap between the two workers' starts, and what the caller's next parallel op then costs
   (a released team is started anew). The helper's spin, as CPU time, is what two workers
   lose on ``C`` cores: ``C x (after the op - after idle)`` for work longer than the spin.
2. Training steps of a 12-layer MLP of width 64 (batch 1024) as two replicas (``dp=2``) and
   as a two-stage pipeline (1F1B), Adam on the caller, back to back: as the runtime runs
   them, and with the caller's team released before each hand-off to the workers (the
   runtimes patched in this process only).

Run (a quiet machine; about a minute):
    python benchmarks/caller_spin.py
    python benchmarks/caller_spin.py --rounds 50 --steps 200
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner import Mesh, Options, Schedule, partition  # noqa: E402
from partitioner.runtime import local, replicas  # noqa: E402
from partitioner.runtime.worker import Worker  # noqa: E402


def openmp_pause() -> Callable[[int], int] | None:
    """The loaded OpenMP runtime's ``omp_pause_resource_all`` (``None``: not found)."""
    with open("/proc/self/maps") as maps:
        paths = {line.rsplit(None, 1)[-1] for line in maps if "omp" in line}
    for path in sorted(p for p in paths if os.path.basename(p).startswith(
            ("libgomp", "libomp", "libiomp5"))):
        try:
            pause = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def workers_after(state: str, n: int, rounds: int, pause: Callable[[int], int] | None
                  ) -> tuple[float, float, float]:
    """Milliseconds two workers take for ``n`` products each, the gap between their starts
    and the caller's next parallel op, the caller ``state`` before it hands them the work."""
    workers = [Worker(torch.device("cpu"), 1) for _ in range(2)]
    y, big = torch.randn(128, 128), torch.randn(1_000_000)

    def work(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            y @ y
        return start
    for _ in range(3):
        [f.result() for f in [w.submit(work, 10) for w in workers]]
    total, gap, after = [], [], []
    for _ in range(rounds):
        time.sleep(0.03)  # longer than the helpers spin: they sleep
        if state != "idle":
            big.mul_(1.0)  # a parallel op on the caller, as the optimizer step is
        begin = time.perf_counter()
        if state == "released" and pause is not None:
            pause(1)
        starts = [f.result() for f in [w.submit(work, n) for w in workers]]
        end = time.perf_counter()
        big.mul_(1.0)
        after.append(time.perf_counter() - end)
        total.append(end - begin)
        gap.append(max(starts) - min(starts))
    for w in workers:
        w.close()
    return tuple(statistics.median(v) * 1e3 for v in (total, gap, after))  # type: ignore


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def step_time(options: Options, steps: int) -> tuple[float, float]:
    """Median milliseconds of a training step of the MLP partitioned with ``options``, and
    the model's prediction."""
    torch.manual_seed(0)
    x = torch.randn(1024, 64)
    pm = partition(_mlp(), ["cpu", "cpu"], example_inputs=(x,), options=options)
    optimizer = torch.optim.Adam(pm.parameters(), lr=1e-6)
    targets = torch.randint(0, 10, (1024,))
    loss = nn.CrossEntropyLoss()
    times = []
    for _ in range(steps + 10):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        pm.step((x,), targets, loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
    pm.close()
    return statistics.median(times[10:]) * 1e3, pm.plan.predicted_step_time * 1e3


def _released(method: Callable, pause: Callable[[int], int]) -> Callable:
    def run(*args, **kwargs):
        pause(1)
        return method(*args, **kwargs)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    pause = openmp_pause()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, caller threads "
          f"{torch.get_num_threads()}, omp_pause_resource_all "
          f"{'found' if pause else 'not found'}")
    print("\ntwo workers, n products of 128 x 128 each       total   start gap  next op (ms)")
    spins = []
    for n in (20, 100, 400):
        rows = {s: workers_after(s, n, args.rounds, pause)
                for s in ("idle", "after op", "released")}
        for s, (total, gap, after) in rows.items():
            print(f"  n={n:<4} caller {s:<10}                  {total:8.2f}  {gap:8.2f}  "
                  f"{after:8.2f}")
        spins.append((os.cpu_count() or 1) * (rows["after op"][0] - rows["idle"][0]))
    print(f"the helper's spin, C x (after op - idle) at n=400: {spins[-1]:.1f} ms of a core")
    if pause is None:
        return
    print("\ntraining step of the MLP (ms)              as the runtime runs  released  "
          "predicted")
    cases = {"dp=2 (replicas)": (Options(mesh=Mesh(dp=2)), replicas.ReplicatedModule, "_run"),
             "pp=2 1F1B, 2 micro-batches": (
                 Options(mesh=Mesh(pp=2), schedule=Schedule("1f1b", chunks=2)),
                 local.LocalPipeline, "_execute")}
    for label, (options, cls, name) in cases.items():
        plain, predicted = step_time(options, args.steps)
        method = getattr(cls, name)
        setattr(cls, name, _released(method, pause))
        try:
            released, _ = step_time(options, args.steps)
        finally:
            setattr(cls, name, method)
        print(f"  {label:<40} {plain:10.2f}  {released:8.2f}  {predicted:9.2f}")


if __name__ == "__main__":
    main()
