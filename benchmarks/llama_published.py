"""make_plan's Llama costs against published bf16 H100 training runs of Llama 3.

For each row of ``tests/llama_published.py`` (torchtitan's Llama 3.1 8B and 70B tables, the
Llama 3 paper's 405B pretraining on 8,192 and 16,384 GPUs), the published mesh is planned
by the planner on its GPUs' preset (``H100-HBM2e-500W`` for torchtitan's Grand Teton
H100s, ``H100-SXM`` for the Llama 3 paper's) with no memory reserve, and predicted tokens per
second per GPU and peak memory are printed beside the published ones. ``implied MAMF`` is
the matmul efficiency of the products (the presets' is 0.801, Stas Bekman's measured H100
SXM figure) that would make the prediction exact, everything else (attention, element-wise
traffic, communication) as modelled: the step is planned again with half the efficiency and
taken as ``A + B / efficiency`` between the two.

By default the model is not captured (the analytic path after the capture, as the tests
run it, a few seconds a row). ``--capture`` runs ``make_plan`` itself on a
``LlamaForCausalLM`` built on the meta device from the published config, sequences of
8192 tokens (minutes for 405B: the capture runs every layer on fake tensors).

``--teton-peak`` plans the rows on torchtitan's 500 W H100s with another dense bf16 peak
(every tensor-core rate scaled alike): their files say the peak "is between SXM and NVL",
so ``--teton-peak 835e12`` (H100 NVL's datasheet figure, the range's lower end) bounds what
the device figure alone can explain; the preset keeps SXM's 989e12.

Run:
    python benchmarks/llama_published.py              # analytic, about a minute
    python benchmarks/llama_published.py --capture    # through make_plan on meta models
    python benchmarks/llama_published.py --rows FSDP --teton-peak 835e12
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from llama_published import ROWS, SEQ, SHAPES, Row, planned  # noqa: E402

from partitioner import Cluster, make_plan  # noqa: E402
from partitioner.plans.plan import Plan  # noqa: E402

GIB = 2**30


TETON = "H100-HBM2e-500W"
SXM_PEAK = 989e12


def cluster_of(row: Row, teton_peak: float = SXM_PEAK) -> Cluster:
    """``row``'s cluster; torchtitan's 500 W parts at ``teton_peak`` dense bf16 FLOP/s."""
    cluster = Cluster.preset(row.device, nodes=max(1, row.gpus // 8))
    if row.device != TETON or teton_peak == SXM_PEAK:
        return cluster
    device = cluster.device
    peaks = tuple((k, v * teton_peak / SXM_PEAK) for k, v in device.peak_flops)
    return replace(cluster, device=replace(device, peak_flops=peaks))


def captured_plan(row: Row, cluster: Cluster) -> Plan:
    """``make_plan`` on a meta-built ``LlamaForCausalLM`` of ``row``'s model."""
    import transformers

    shape = SHAPES[row.model]
    config = transformers.LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=SEQ, rope_theta=500000.0, use_cache=False,
        tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        tokens = torch.randint(0, shape.vocab, (row.batch, SEQ))
    return make_plan(model, cluster, example_inputs=(tokens,), mesh=row.mesh, precision="bf16",
                     memory_reserve=0.0, checkpoint=row.checkpoint, compiled=row.fused)


def implied_mamf(row: Row, step: float, cluster: Cluster) -> float:
    """The products' matmul efficiency that makes the step the published one: the row is
    planned again at half its preset's efficiency and the step taken as ``A + B / eff``."""
    eff = cluster.device.matmul_efficiency
    half = replace(cluster, device=replace(cluster.device, matmul_efficiency=eff / 2))
    slow = planned(row, half).predicted_step_time
    assert slow is not None
    b = (slow - step) / (2 / eff - 1 / eff)
    published = row.batch * SEQ / row.published_tokens / row.gpus
    return b / (published - (step - b / eff))


def report(row: Row, capture: bool, teton_peak: float = SXM_PEAK) -> float:
    """Print one table row; return predicted over published tokens per second."""
    cluster = cluster_of(row, teton_peak)
    start = time.perf_counter()
    plan = captured_plan(row, cluster) if capture else planned(row, cluster)
    seconds = time.perf_counter() - start
    record = plan.candidates[0]
    assert plan.predicted_step_time is not None
    tokens = row.batch * SEQ / plan.predicted_step_time / row.gpus
    ratio = tokens / row.published_tokens
    mamf = implied_mamf(row, plan.predicted_step_time, cluster)
    llama = next((n for n in plan.notes if n.startswith("costed as Llama")), "captured costs")
    run = llama.split("(")[1].split(")")[0] if "(" in llama else llama
    memory = f"{row.memory_gib:g}" if row.memory_gib is not None else "--"
    mesh = f"dp{row.mesh.dp} pp{row.mesh.pp} tp{row.mesh.tp}"
    row_source = f"{row.source}, {row.device}"
    print(f"| {row.name} | {row_source} | {mesh} | {row.batch} | {run} | {record['label']} "
          f"| {row.published_tokens:,.0f} | {tokens:,.0f} | {ratio:.2f} | {mamf:.2f} "
          f"| {memory} | {record['peak_memory'] / GIB:.1f} | {seconds:.0f} s |")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", action="store_true",
                        help="run make_plan on meta-built LlamaForCausalLM models")
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    parser.add_argument("--teton-peak", type=float, default=SXM_PEAK,
                        help="dense bf16 FLOP/s of torchtitan's 500 W H100s (default: SXM's "
                             "989e12; their range's other end is NVL's 835e12)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}; each row's preset "
          "(8 per node, NVLink 4, NDR InfiniBand), no memory reserve, "
          f"{'make_plan on meta models' if args.capture else 'analytic (after the capture)'}"
          + (f"; {TETON} at {args.teton_peak / 1e12:g} TFLOP/s bf16"
             if args.teton_peak != SXM_PEAK else "") + "\n")
    print("| row | source | mesh | batch | costed as | planned | published tokens/s/GPU "
          "| predicted | ratio | implied MAMF | published GiB | predicted GiB | planning |\n"
          "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios = [report(row, args.capture, args.teton_peak) for row in ROWS
              if args.rows in row.name]
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"\n{within} of {len(ratios)} rows within 15%")
    print(f"\ncommand: python benchmarks/llama_published.py{' --capture' * args.capture}"
          + (f" --rows '{args.rows}'" if args.rows else "")
          + (f" --teton-peak {args.teton_peak:g}" if args.teton_peak != SXM_PEAK else ""))


if __name__ == "__main__":
    main()
