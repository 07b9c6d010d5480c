"""The cost model against published bf16 training runs on H100 (Megatron-Core GPT models).

For each row of ``tests/partitioner/cost/data/h100_reference.csv`` (NVIDIA/Megatron-LM's
README: the weak-scaling table, 1.7B to 462B parameters on 48 to 6,144 H100-SXM, and the end
points of the GPT-3 175B strong-scaling run on 96 and 4,608 GPUs), the published configuration
is predicted analytically and by the event simulation, with attention as one fused kernel
(``fused_attention_workload`` in ``tests/partitioner/cost/test_h100_reference.py``, which
also fixes what the README leaves unpublished: micro-batch 1, the virtual pipeline size, no
recomputation, overlapped gradient all-reduce and sends). Two more readings help to place
the errors: the 2021 layer of ``gpt_workload`` (attention scores written to memory), and the
fused layer with tensor-parallel communication made free (what ``--tp-comm-overlap`` hides at
best). No device figure was chosen by looking at these rows (``partitioner/cost/devices.py``
cites each).

Run:
    python benchmarks/h100_reference.py            # a few seconds
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "partitioner" / "cost"))

from test_h100_reference import (  # noqa: E402
    ROWS,
    H100Row,
    fused_attention_workload,
    predicted,
)

from partitioner.cost.devices import LinkSpec  # noqa: E402
from partitioner.cost.transformer_model import megatron_boundaries  # noqa: E402
from partitioner.planning.predict import predict  # noqa: E402

IDEAL = LinkSpec("free", 1e18, 0.0, 1.0)


def without_tp_comm(row: H100Row) -> float:
    """TFLOP/s per GPU with the intra-node link free (with t = 8 it carries only TP traffic)."""
    cluster = replace(row.cluster, intra_node=IDEAL)
    config = row.config()
    prediction = predict(fused_attention_workload(row.shape, row.batch), cluster, config,
                         megatron_boundaries(row.shape, config.stages), capacity=math.inf)
    return row.tflops_of(prediction.step_time)


def report(row: H100Row) -> float:
    """Print one table row; return the analytic prediction's relative error."""
    prediction, ours, sim = predicted(row)
    _, unfused, _ = predicted(row, fused=False)
    free = without_tp_comm(row)
    config = row.config()
    peak = max(sum((m.params, m.grads, m.optimizer, m.activations)) for m in prediction.memory)
    pub = row.tflops
    print(f"| {row.name} | {row.source} | {row.gpus} | {config.tp} x {config.pp} x {config.dp} "
          f"| m={config.chunks} v={config.virtual} | {pub:g} | {ours:.1f} | {ours / pub - 1:+.1%} "
          f"| {sim:.1f} | {sim / pub - 1:+.1%} | {unfused / pub - 1:+.1%} "
          f"| {free / pub - 1:+.1%} | {peak / 2**30:.0f} |")
    return ours / pub - 1


def main() -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}; H100-SXM preset "
          "(8 per node, NVLink 4, 8 x NDR InfiniBand per node)\n")
    print("| row | source | GPUs | t x p x d | assumed | published TFLOP/s | predicted | error "
          "| simulated | error | 2021 layer | no TP comm | peak memory (GiB) |\n"
          "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors = [report(row) for row in ROWS]
    within = sum(abs(e) <= 0.15 for e in errors)
    print(f"\nmedian error {statistics.median(errors):+.1%}, median |error| "
          f"{statistics.median(abs(e) for e in errors):.1%}, largest "
          f"{max(errors, key=abs):+.1%}; {within} of {len(errors)} rows within 15%")
    print("\ncommand: python benchmarks/h100_reference.py")


if __name__ == "__main__":
    main()
