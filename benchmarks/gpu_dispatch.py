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
* ``add, 2 threads``: ``add`` from two threads at once, per op of the two together.

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
