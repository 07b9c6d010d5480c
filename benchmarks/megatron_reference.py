"""The cost model against Megatron-LM's weak-scaling table, and strategy="auto" on the same.

For each row of ``tests/partitioner/data/megatron_table1_subset.csv`` (Narayanan et al.,
SC'21, Table 1): the published configuration run as Megatron-LM ran it (interleaved 1F1B,
micro-batch 1, two chunks per device where the layers divide, full recomputation, blocking
sends, gradient all-reduce after the backward; see ``tests/partitioner/
test_megatron_reference.py``) is predicted analytically and by the event simulation, and
its throughput per GPU (the paper's FLOP count over the step time) compared with the
published figure. Then ``partitioner.auto.search`` plans the same model, batch and cluster
from scratch (same training settings), and its best configuration, throughput and planning
time are reported.

Run:
    python benchmarks/megatron_reference.py
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "partitioner"))

from test_megatron_reference import ROWS  # noqa: E402

from partitioner.auto import search  # noqa: E402
from partitioner.predict import predict  # noqa: E402
from partitioner.simulate import simulate  # noqa: E402
from partitioner.transformer_model import gpt_workload, megatron_boundaries  # noqa: E402


def main() -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}; A100-80GB preset "
          "(8 per node, NVLink 3, 8 x HDR InfiniBand per node)\n")
    print("| model | GPUs | t x p x d | published TFLOP/s | predicted | error | simulated | "
          "error | auto's choice | auto TFLOP/s | auto / published | planning (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for row in ROWS:
        workload = gpt_workload(row.shape, row.batch)
        config = row.config()
        published = predict(workload, row.cluster, config,
                            megatron_boundaries(row.shape, config.stages))
        simulated = simulate(published, row.cluster)
        start = time.perf_counter()
        result = search(workload, row.cluster, optimizer="fused_adam",
                        overlap_grad_reduce=False, overlap_p2p=False, budget=None)
        planning = time.perf_counter() - start
        ours = row.tflops_of(published.step_time)
        sim = row.tflops_of(simulated.step_time)
        auto = row.tflops_of(result.best.step_time)
        print(f"| {row.params:g}B | {row.gpus} | {config.tp} x {config.pp} x {config.dp} | "
              f"{row.tflops:g} | {ours:.1f} | {ours / row.tflops - 1:+.1%} | {sim:.1f} | "
              f"{sim / row.tflops - 1:+.1%} | {result.best.config.label()} | {auto:.1f} | "
              f"{auto / row.tflops:.2f} | {planning:.2f} |")
    print("\ncommand: python benchmarks/megatron_reference.py")


if __name__ == "__main__":
    main()
