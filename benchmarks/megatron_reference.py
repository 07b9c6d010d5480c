"""The cost model against Megatron-LM's weak-scaling table, and strategy="auto" on the same.

For each row of ``tests/partitioner/cost/data/megatron_table1_subset.csv`` (Narayanan et al.,
SC'21, Table 1), then for rows of the same table kept out of that file (``HELD_OUT`` in
``tests/partitioner/cost/test_megatron_reference.py``, plus two rows whose published figure is
quoted from the paper without a second source here, marked "unverified"): the published
configuration run as Megatron-LM ran it (interleaved 1F1B, micro-batch 1, two chunks per
device where the layers divide, full recomputation, blocking sends, gradient all-reduce
after the backward; see the test) is predicted analytically and by the event simulation,
and its throughput per GPU (the paper's FLOP count over the step time) compared with the
published figure. Then ``partitioner.planning.auto.search`` plans the same model, batch and cluster
from scratch (same training settings), and its best configuration, throughput and planning
time are reported. No device figure was chosen by looking at these rows
(``partitioner/cost/devices.py`` cites each).

Run:
    python benchmarks/megatron_reference.py            # about 1 minute of CPU (2 min loaded)
    python benchmarks/megatron_reference.py --no-auto  # predictions only, a few seconds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "partitioner" / "cost"))

from test_megatron_reference import HELD_OUT, ROWS, Row  # noqa: E402

from partitioner.cost.transformer_model import gpt_workload, megatron_boundaries  # noqa: E402
from partitioner.planning.auto import search  # noqa: E402
from partitioner.planning.predict import predict  # noqa: E402
from partitioner.planning.simulate import simulate  # noqa: E402

# Two more rows of Table 1 whose throughput is quoted from the paper (138 TFLOP/s, 44% of
# peak, 8.8 PFLOP/s aggregate; 155, 50%, 297.4) with no second source at hand.
UNVERIFIED = [Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
              Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-auto", action="store_true", help="skip strategy='auto'")
    return parser.parse_args()


def report(row: Row, kind: str, auto: bool) -> float:
    """Print one table row; return the analytic prediction's relative error."""
    workload = gpt_workload(row.shape, row.batch)
    config = row.config()
    published = predict(workload, row.cluster, config,
                        megatron_boundaries(row.shape, config.stages))
    simulated = simulate(published, row.cluster)
    ours = row.tflops_of(published.step_time)
    sim = row.tflops_of(simulated.step_time)
    line = (f"| {row.params:g}B | {kind} | {row.gpus} | {config.tp} x {config.pp} x {config.dp} "
            f"| {row.tflops:g} | {ours:.1f} | {ours / row.tflops - 1:+.1%} | {sim:.1f} | "
            f"{sim / row.tflops - 1:+.1%} |")
    if auto:
        start = time.perf_counter()
        result = search(workload, row.cluster, optimizer="fused_adam",
                        overlap_grad_reduce=False, overlap_p2p=False, budget=None)
        planning = time.perf_counter() - start
        best = row.tflops_of(result.best.step_time)
        start = time.perf_counter()
        budgeted = search(workload, row.cluster, optimizer="fused_adam",
                          overlap_grad_reduce=False, overlap_p2p=False)  # the default 5 s
        seconds = time.perf_counter() - start
        lost = result.best.step_time and budgeted.best.step_time / result.best.step_time - 1
        line += (f" {result.best.config.label()} | {best:.1f} | {best / row.tflops:.2f} | "
                 f"{planning:.2f} | {seconds:.2f} | {budgeted.gap:.1%} | {lost:+.1%} |")
    print(line)
    return ours / row.tflops - 1


def main() -> None:
    args = parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}; A100-80GB preset "
          "(8 per node, NVLink 3, 8 x HDR InfiniBand per node)\n")
    head = ("| model | row | GPUs | t x p x d | published TFLOP/s | predicted | error | "
            "simulated | error |")
    rule = "|---|---|---:|---|---:|---:|---:|---:|---:|"
    if not args.no_auto:
        head += (" auto's choice | auto TFLOP/s | auto / published | planning (s) | "
                 "with the 5 s budget (s) | its gap to the bound | its best vs unbounded |")
        rule += "---|---:|---:|---:|---:|---:|---:|"
    print(head + "\n" + rule)
    errors = {kind: [report(row, kind, not args.no_auto) for row in rows]
              for kind, rows in (("CSV", ROWS), ("held out", HELD_OUT),
                                 ("unverified", UNVERIFIED))}
    print()
    for kind, errs in errors.items():
        print(f"{kind}: median error {statistics.median(errs):+.1%}, largest "
              f"{max(errs, key=abs):+.1%}")
    print("\ncommand: python benchmarks/megatron_reference.py")


if __name__ == "__main__":
    main()
