"""Predicted against measured step time of one plan in fp32, bf16 and fp16 on this CPU.

``precision="bf16"`` runs the stages' products under autocast in bfloat16. A CPU with bf16
instructions multiplies bf16 several times faster than fp32; a CPU without an fp16 path
multiplies fp16 an order of magnitude slower. ``measure_cpu()`` times both since issue 18
(before, both were costed at the fp32 rate). This benchmark partitions
16 x (Linear(1024, 1024), ReLU), batch 64, onto one ``"cpu"`` device with one micro-batch in
each precision, and sets the plan's predicted step time against the median of timed
training steps (``zero_grad``, forward + MSE loss in autocast, backward, Adam). The CPU spec
is the median of ``--calibration-runs`` runs in a cache of this run's own.

Run:
    python benchmarks/precision_predicted.py
    python benchmarks/precision_predicted.py --steps 20 --precisions fp32 bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner import partition
from partitioner.cost.measure import measure_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed training steps")
    parser.add_argument("--calibration-runs", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="calibration-")
    for _ in range(args.calibration_runs):
        measure_cpu.cache_clear()
        spec = measure_cpu()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, intra-op threads "
          f"{torch.get_num_threads()}; spec: fp32 {spec.flops('fp32') / 1e9:.0f}, bf16 "
          f"{spec.flops('bf16') / 1e9:.0f}, fp16 {spec.flops('fp16') / 1e9:.1f} GFLOP/s; "
          f"load at start {os.getloadavg()[0]:.2f}")
    print("\n| precision | predicted (ms) | measured median (ms) | measured / predicted |")
    print("|---|---:|---:|---:|")
    for precision in args.precisions:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(16)
                                for m in (nn.Linear(1024, 1024), nn.ReLU())])
        x, y = torch.randn(64, 1024), torch.randn(64, 1024)
        pm = partition(model, ["cpu"], strategy="pipeline", example_inputs=(x,), chunks=1,
                       precision=precision,
                       loss_scale=None if precision != "fp16" else "dynamic")
        predicted = pm.plan.predicted_step_time or float("nan")
        optimizer = torch.optim.Adam(pm.parameters(), lr=1e-4)
        times = []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(pm(x).float(), y)
            loss.backward()
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        measured = statistics.median(times)
        print(f"| {precision} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
              f"{measured / predicted:.2f} |", flush=True)
        pm.close()
    print(f"\nload at end {os.getloadavg()[0]:.2f}; command: python "
          "benchmarks/precision_predicted.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
