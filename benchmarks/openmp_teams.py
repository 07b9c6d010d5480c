"""What a worker thread's OpenMP team costs every other op of the process (issue 18).

GNU OpenMP (the runtime of torch's CPU wheels) counts the threads of every team in the
process; once they outnumber the cores, every team waits at its barriers by sleeping instead
of spinning. A thread that ran one parallel op with two intra-op threads keeps its team for
its life. This benchmark times a training step of a model called directly on the caller's
thread (``torch.get_num_threads()`` threads):

1. in a fresh process;
2. after two worker threads each ran one op with two intra-op threads and went back to one
   (the workers still alive), and the voluntary context switches per step;
3. after those workers exited.

Then, for a partitioned pipeline, once with the default fixed share of threads per worker and
once with ``threads="schedule"`` (a stage alone in the fill or drain takes every thread):
the pipeline's own step, and the same direct step timed after it, in a process of its own.
Last, a pipeline on one CPU device: its actions on the caller's thread (the default) and on
a worker thread holding every intra-op thread (as before that default).

Run (a quiet machine; about a minute):
    python benchmarks/openmp_teams.py
    python benchmarks/openmp_teams.py --width 64 --depth 12 --batch 1024 --chunks 4
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _timed(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """Median milliseconds of ``step`` and voluntary context switches per step."""
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    switches = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / steps
    return statistics.median(times) * 1e3, switches


def _direct_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
    return step


def teams(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model, x = _model(args.width, args.depth), torch.randn(args.batch, args.width)
    step = _direct_step(model, x)
    fresh = _timed(step, args.steps)
    workers = [ThreadPoolExecutor(1) for _ in range(2)]

    def two_then_one() -> None:
        torch.set_num_threads(2)
        torch.randn(1 << 16).add_(1.0)  # one parallel op: the thread's team starts
        torch.set_num_threads(1)
    for worker in workers:
        worker.submit(two_then_one).result()
    held = _timed(step, args.steps)
    for worker in workers:
        worker.shutdown()
    released = _timed(step, args.steps)
    print(f"direct step, {args.depth} x Linear({args.width}), batch {args.batch}, "
          f"{torch.get_num_threads()} intra-op threads:")
    for label, (ms, switches) in (("fresh process", fresh),
                                  ("2 worker threads holding teams", held),
                                  ("after those workers exited", released)):
        print(f"  {label:<34} {ms:8.2f} ms  {switches:7.1f} voluntary switches a step")


def pipeline(args: argparse.Namespace, threads: str) -> None:
    """One contender in a process of its own (a team, once made, stays)."""
    import partitioner.runtime.local as local
    from partitioner import partition
    from partitioner.planning.tune import synthetic_loss
    made = local.LocalPipeline.__init__
    if threads == "schedule":
        def by_schedule(self: local.LocalPipeline, *a: object, **k: object) -> None:
            made(self, *a, **{**k, "threads": "schedule"})  # type: ignore[arg-type]
        local.LocalPipeline.__init__ = by_schedule  # type: ignore[method-assign]
    if threads == "one-worker":  # as before: the one device's actions on its worker thread
        def on_worker(self: local.LocalPipeline, *a: object, **k: object) -> None:
            made(self, *a, **k)  # type: ignore[arg-type]
            self._inline = False
        local.LocalPipeline.__init__ = on_worker  # type: ignore[method-assign]
    torch.manual_seed(0)
    model, x = _model(args.width, args.depth), torch.randn(args.batch, args.width)
    devices = ["cpu"] if threads.startswith("one") else ["cpu"] * 2
    pm = partition(copy.deepcopy(model), devices, "pipeline", chunks=args.chunks,
                   schedule="1f1b", checkpoint="never", example_inputs=(x,))
    optimizer = torch.optim.Adam(pm.parameters(), lr=1e-6)
    targets = torch.zeros(args.batch)

    def piped() -> None:
        optimizer.zero_grad(set_to_none=True)
        pm.step((x,), targets, synthetic_loss)
        optimizer.step()
    own, switches = _timed(piped, args.steps)
    after, after_switches = _timed(_direct_step(model, x), args.steps)
    print(f"  {threads:<10} pipeline step {own:8.2f} ms ({switches:6.1f} switches), then the "
          f"direct step {after:8.2f} ms ({after_switches:6.1f} switches)")
    pm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--contender", choices=("fixed", "schedule", "one", "one-worker"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        pipeline(args, args.contender)
        return
    teams(args)
    print(f"2-stage 1F1B pipeline of the same model, {args.chunks} micro-batches, each "
          "contender in its own process:")
    for contender in ("fixed", "schedule"):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--contender", contender],
                       check=True)
    print(f"one-device pipeline (partition(model, ['cpu'], chunks={args.chunks})): its actions "
          "on the caller's thread (default) or on a worker thread with every intra-op thread "
          "(before):")
    for contender in ("one", "one-worker"):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--contender", contender],
                       check=True)


if __name__ == "__main__":
    main()
