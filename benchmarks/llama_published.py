"""make_plan's Llama costs against published bf16 H100 training runs of Llama 3.

For each row of ``tests/llama_published.py`` (torchtitan's Llama 3.1 8B and 70B tables, the
Llama 3 paper's 405B pretraining on 8,192 and 16,384 GPUs), the published mesh is planned
by the planner on the ``H100-SXM`` preset with no memory reserve, and predicted tokens per
second per GPU and peak memory are printed beside the published ones. ``implied MAMF`` is
the matmul efficiency (the preset's is 0.801, Stas Bekman's measured H100 SXM figure) that
would make the prediction exact if the step were all products: where a row is off, it says
how fast the run's GPUs actually multiplied.

By default the model is not captured (the analytic path after the capture, as the tests
run it, a few seconds a row). ``--capture`` runs ``make_plan`` itself on a
``LlamaForCausalLM`` built on the meta device from the published config, sequences of
8192 tokens (minutes for 405B: the capture runs every layer on fake tensors).

Run:
    python benchmarks/llama_published.py              # analytic, about a minute
    python benchmarks/llama_published.py --capture    # through make_plan on meta models
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from llama_published import ROWS, SEQ, SHAPES, Row, planned  # noqa: E402

from partitioner import Cluster, make_plan  # noqa: E402
from partitioner.cost.devices import DEVICES  # noqa: E402
from partitioner.plans.plan import Plan  # noqa: E402

GIB = 2**30


def captured_plan(row: Row) -> Plan:
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
    return make_plan(model, Cluster.preset("H100-SXM", nodes=max(1, row.gpus // 8)),
                     example_inputs=(tokens,), mesh=row.mesh, precision="bf16",
                     memory_reserve=0.0, checkpoint=row.checkpoint)


def report(row: Row, capture: bool) -> float:
    """Print one table row; return predicted over published tokens per second."""
    start = time.perf_counter()
    plan = captured_plan(row) if capture else planned(row)
    seconds = time.perf_counter() - start
    record = plan.candidates[0]
    assert plan.predicted_step_time is not None
    tokens = row.batch * SEQ / plan.predicted_step_time / row.gpus
    ratio = tokens / row.published_tokens
    mamf = DEVICES["H100-SXM"].matmul_efficiency / ratio
    llama = next((n for n in plan.notes if n.startswith("costed as Llama")), "captured costs")
    run = llama.split("(")[1].split(")")[0] if "(" in llama else llama
    memory = f"{row.memory_gib:g}" if row.memory_gib is not None else "--"
    mesh = f"dp{row.mesh.dp} pp{row.mesh.pp} tp{row.mesh.tp}"
    print(f"| {row.name} | {row.source} | {mesh} | {row.batch} | {run} | {record['label']} "
          f"| {row.published_tokens:,.0f} | {tokens:,.0f} | {ratio:.2f} | {mamf:.2f} "
          f"| {memory} | {record['peak_memory'] / GIB:.1f} | {seconds:.0f} s |")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", action="store_true",
                        help="run make_plan on meta-built LlamaForCausalLM models")
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}; H100-SXM preset "
          "(80 GiB, 8 per node, NVLink 4, NDR InfiniBand), no memory reserve, "
          f"{'make_plan on meta models' if args.capture else 'analytic (after the capture)'}"
          "\n")
    print("| row | source | mesh | batch | costed as | planned | published tokens/s/GPU "
          "| predicted | ratio | implied MAMF | published GiB | predicted GiB | planning |\n"
          "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios = [report(row, args.capture) for row in ROWS if args.rows in row.name]
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"\n{within} of {len(ratios)} rows within 15%")
    print(f"\ncommand: python benchmarks/llama_published.py{' --capture' * args.capture}"
          + (f" --rows '{args.rows}'" if args.rows else ""))


if __name__ == "__main__":
    main()
