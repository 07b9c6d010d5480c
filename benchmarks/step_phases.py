"""Predicted against measured, phase by phase: forward, backward and Adam step of one plan.

The model of ``predicted_vs_measured.py``'s first case, 16 x (Linear(1024, 1024), ReLU)
with batch 64, is partitioned onto one ``"cpu"`` device with one micro-batch. Its plan's
stage forward and backward and its optimizer step are set against the median of the same
phases, timed apart in training steps (``zero_grad``, forward + MSE loss, backward,
``torch.optim.Adam`` step). The CPU spec is the median of ``--calibration-runs`` runs in a
cache of this run's own, as in ``predicted_vs_measured.py``.

Run:
    python benchmarks/step_phases.py
    python benchmarks/step_phases.py --steps 40 --calibration-runs 5
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
from partitioner.planning.records import from_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed training steps")
    parser.add_argument("--calibration-runs", type=int, default=3)
    args = parser.parse_args()
    os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="calibration-")
    for _ in range(args.calibration_runs):
        measure_cpu.cache_clear()
        spec = measure_cpu()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(1024, 1024), nn.ReLU())])
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    pm = partition(model, ["cpu"], strategy="pipeline", example_inputs=(x,), chunks=1)
    prediction, _ = from_record(pm.plan.candidates[0])
    stage = prediction.stages[0]
    predicted = {"forward": stage.forward, "backward": stage.backward,
                 "Adam step": prediction.optimizer_times[0]}
    optimizer = torch.optim.Adam(pm.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {name: [] for name in predicted}
    for step in range(args.warmup + args.steps):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = F.mse_loss(pm(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        if step >= args.warmup:
            times["forward"].append(forward - start)
            times["backward"].append(backward - forward)
            times["Adam step"].append(end - backward)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, intra-op threads "
          f"{torch.get_num_threads()}; spec: {spec.flops() / 1e9:.0f} GFLOP/s, weight "
          f"repacking {spec.pack_bandwidth / 1e9:.1f} GB/s, optimizer "
          f"{spec.optimizer_rate / 1e9:.0f} GB/s, {spec.action_overhead * 1e3:.3f} ms per "
          "action")
    print("\n| phase | predicted (ms) | measured min (ms) | measured median (ms) | error |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds in predicted.items():
        median = statistics.median(times[name])
        print(f"| {name} | {seconds * 1e3:.1f} | {min(times[name]) * 1e3:.1f} | "
              f"{median * 1e3:.1f} | {seconds / median - 1:+.0%} |")
    print("command: python benchmarks/step_phases.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
