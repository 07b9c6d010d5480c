"""What the host pays to launch one op on a GPU, alone and from two threads at once.

The presets charge ``op_overhead`` (5 us) per op: the launch as NVIDIA quotes it. Eager
PyTorch pays more on the host, in Python, the dispatcher and (under autocast) the casts,
and a one-process pipeline's stage threads share the interpreter's lock. When the GPU's
kernels are short, the step is this host time, not the kernels'. Three figures, each the
median over ``--reps`` runs of ``--ops`` launches (the GPU kept ahead: no synchronisation
inside a run):

* ``add``: ``y = x + 1`` on a (64,) tensor;
* ``linear bf16``: ``F.linear`` of a (8, 64) input by a (64, 64) fp32 weight under
  ``torch.autocast(dtype=bfloat16)`` (a cast of each operand, then the product);
* ``add, 2 threads``: ``add`` from two threads at once, per op of the two together;
* ``training step, per kernel``: what the host-bound term of the cost model needs, measured
  on a model of its own (not the check's cases, which it is to predict): a training step
  (forward, backward, ``Adam(foreach=True)``) of 24 ``Linear(64, 64)`` + ReLU on 8 rows,
  whose kernels take a few microseconds, so the step is the host's; its median step time
  over the kernels ``torch.profiler`` counts in one step, in fp32 and under bf16 autocast.
  Beside it, the non-view ATen ops a ``TorchDispatchMode`` counts in the same step (what
  the planner can count on a CPU, ``docs/benchmarks.md``: 366 of them against 638 kernels
  for the check's fp32 model, Adam's 308 apart).

Run by ``benchmarks/gpu_check.py`` (or alone: ``python benchmarks/gpu_dispatch.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def per_op(run: Callable[[int], None], ops: int, reps: int, threads: int = 1) -> float:
    """Median host seconds per op of ``run(ops)`` called on ``threads`` threads at once."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        workers = [threading.Thread(target=run, args=(ops,)) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append((time.perf_counter() - start) / (ops * threads))
    torch.cuda.synchronize()
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_dispatch: skipped, no CUDA device here")
        return 0
    dev = torch.device("cuda:0")
    x = torch.zeros(64, device=dev)
    a = torch.randn(8, 64, device=dev)
    w = torch.randn(64, 64, device=dev)

    def add(n: int) -> None:
        for _ in range(n):
            x + 1

    def linear(n: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(n):
                F.linear(a, w)
    rows = [("add", per_op(add, args.ops, args.reps)),
            ("linear bf16 (autocast)", per_op(linear, args.ops, args.reps)),
            ("add, 2 threads", per_op(add, args.ops, args.reps, threads=2))]
    print(f"Host time per op on {torch.cuda.get_device_name(0)} "
          "(`python benchmarks/gpu_dispatch.py`):\n\n| op | us per op |\n|---|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e6:.1f} |")
    print("\n| training step (host-bound) | step | kernels | us per kernel | ATen ops |"
          "\n|---|---:|---:|---:|---:|")
    for bf16 in (False, True):
        step, kernels, ops = training_step(dev, bf16, args.reps)
        print(f"| {'bf16 autocast' if bf16 else 'fp32'} | {step * 1e3:.2f} ms | {kernels} | "
              f"{step / max(kernels, 1) * 1e6:.1f} | {ops} |")
    return 0


def training_step(dev: torch.device, bf16: bool, reps: int) -> tuple[float, int, int]:
    """(median seconds, kernels, non-view ATen ops) of one training step of a model whose
    kernels are tiny: 24 ``Linear(64, 64)`` + ReLU on 8 rows, Adam (multi-tensor)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(24):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(8, 64, device=dev)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        out.float().square().mean().backward()
        optimizer.step()
    for _ in range(5):
        step()
    times = []
    for _ in range(max(reps, 3) * 4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA"))
    return statistics.median(times), kernels, aten_ops(step)


def aten_ops(fn: Callable[[], None]) -> int:
    """Non-view ATen ops ``fn`` dispatches on this thread."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not func.is_view:
                self.n += 1
            return func(*args, **(kwargs or {}))
    counter = Count()
    with counter:
        fn()
    return counter.n


if __name__ == "__main__":
    sys.exit(main())
