"""When routing Linear layers through ``fused_linear`` pays, and when it only costs (issue 18).

``partitioner.runtime.fused_linear`` adds each weight gradient into ``.grad`` in place, which
saves a fresh gradient tensor and its addition when gradients accumulate over micro-batches,
at the price of a Python autograd function per call. ``passes/fuse_weight_grads.py`` uses it
where it pays (``fusion_threshold``). This benchmark measures both sides, on one thread:

1. one micro-batch: forward and backward of an MLP of ``--depth`` x Linear(``--width``) on
   ``--batch`` rows, called eagerly, as a plain fx graph, and with every Linear fused
   (gradients set to ``None`` before each step, as ``zero_grad`` does);
2. four micro-batches of 8 rows through one Linear of each width, gradients accumulating:
   plain ``nn.Linear`` against fused, per micro-batch.

Run (about 30 s):
    python benchmarks/fused_linear_cost.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner.passes.fuse_weight_grads import fuse_weight_grads  # noqa: E402
from partitioner.runtime.fused_linear import linear_module  # noqa: E402


def _median_ms(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Each run timed in turn, ``rounds`` times after 3 warm-ups: median milliseconds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for k in range(rounds + 3):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if k >= 3:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def one_micro_batch(args: argparse.Namespace) -> None:
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    graph = fx.symbolic_trace(copy.deepcopy(model))
    fused = fx.symbolic_trace(copy.deepcopy(model))
    fuse_weight_grads(fused)
    x = torch.randn(args.batch, args.width)

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module.zero_grad(set_to_none=True)
            module(x).pow(2).mean().backward()
        return run
    found = _median_ms({"eager": step(model), "fx graph": step(graph),
                        "fused": step(fused)}, args.rounds)
    print(f"one micro-batch, {args.depth} x Linear({args.width}), {args.batch} rows: "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in found.items()))


def _accumulate(layer: nn.Module, call: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        layer.zero_grad(set_to_none=True)
        for _ in range(4):
            call().sum().backward()
    return run


def accumulating(args: argparse.Namespace) -> None:
    print("4 micro-batches of 8 rows, gradients accumulating, per micro-batch:")
    for width in (64, 128, 256, 512, 1024, 2048):
        layer, x = nn.Linear(width, width), torch.randn(8, width)
        found = _median_ms({"plain": _accumulate(layer, lambda lay=layer, x=x: lay(x)),
                            "fused": _accumulate(layer, lambda lay=layer, x=x: linear_module(
                                x, lay))}, args.rounds)
        print(f"  Linear({width}, {width}) ({width * width:>9,} weights): plain "
              f"{found['plain'] / 4 * 1e3:8.1f} us, fused {found['fused'] / 4 * 1e3:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=13)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    one_micro_batch(args)
    accumulating(args)


if __name__ == "__main__":
    main()
