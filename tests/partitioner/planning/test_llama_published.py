"""make_plan's Llama costs against published bf16 H100 runs (llama_published.py), and the
path that takes a meta-built ``LlamaForCausalLM`` to them (partitioner/planning/llama_plan.py,
partitioner/cost/llama_model.py). Analytic only: no capture of the large models here
(``benchmarks/llama_published.py --capture`` runs ``make_plan`` on them)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from llama_published import (
    ROWS,
    SHAPES,
    Row,
    captured_names,
    captured_workload,
    planned,
    tokens_per_second,
)

from partitioner import Cluster, Mesh, make_plan
from partitioner.cost.devices import REFERENCE_CPU
from partitioner.cost.llama_model import LlamaModel, llama_variants
from partitioner.cost.transformer_model import LlamaRun, llama_workload
from partitioner.errors import MemoryLimitError
from partitioner.planning.llama_plan import workload_variants

GIB = 2**30
PAPER = [row for row in ROWS if row.model == "405B"]


planned = functools.cache(planned)  # each row's plan once per session


# The 405B rows take about 5 s each to plan: the slow tier runs them (the default tier
# stays under its 5 minutes).
_ROWS = [pytest.param(r, marks=pytest.mark.slow, id=r.name) if r.name.startswith("405B")
         else pytest.param(r, id=r.name) for r in ROWS]


@pytest.mark.parametrize("row", _ROWS)
def test_every_published_mesh_fits_80_gb(row: Row) -> None:
    plan = planned(row)
    record = plan.candidates[0]
    assert plan.mesh == row.mesh
    assert record["fits"] and record["peak_memory"] <= 80 * GIB  # even an 80 GB H100's
    if row.memory_gib is not None:  # the run fitted its 96 GB: so does the prediction
        assert record["peak_memory"] <= 96 * GIB


@pytest.mark.slow
@pytest.mark.parametrize("row", PAPER, ids=lambda r: r.name)
def test_llama3_405b_throughput_within_15_percent(row: Row) -> None:
    ratio = tokens_per_second(planned(row), row) / row.published_tokens
    assert 0.85 <= ratio <= 1.15


@pytest.mark.slow
@pytest.mark.slow
def test_405b_needs_what_the_cost_model_now_has() -> None:
    """The paper's mesh with unsharded state and no sequence parallelism does not fit: the
    FSDP and sequence-parallel terms are what let it."""
    row = PAPER[0]
    shape = SHAPES[row.model]
    plain = llama_workload(shape, row.batch, tp=8, run=LlamaRun(attention="flash",
                                                                recompute="full"))
    sharded = llama_workload(shape, row.batch, tp=8, fsdp=True,
                             run=LlamaRun(True, "flash", "full"))
    block, sp_block = plain.layers[1], sharded.layers[1]
    assert sp_block.activations_on(8) == pytest.approx(block.activations_on(8) / 8)
    assert planned(row).candidates[0]["peak_memory"] < 70 * GIB
    from partitioner.planning.planner import given_mesh_plan
    names = [layer.name for layer in plain.layers]
    with pytest.raises(MemoryLimitError):
        given_mesh_plan(plain, names, Cluster.preset("H100-SXM", nodes=1024), row.mesh,
                        checkpoint="never", reserve=0.0)


def test_torchtitan_rows_are_costed_on_their_parts_as_they_ran() -> None:
    """Grand Teton's 96 GB HBM2e 500 W H100s; eager rows with eager element-wise kernels,
    compiled rows fused; the paper's rows on 700 W SXM parts."""
    for row in ROWS:
        assert row.device == ("H100-SXM" if row.model == "405B" else "H100-HBM2e-500W")
        assert row.fused == ("eager" not in row.name)
    notes = {row.name: next(n for n in planned(row).notes if n.startswith("costed as Llama"))
             for row in ROWS[:2]}
    assert "eager element-wise" in notes["8B FSDP8 eager"]
    assert "eager element-wise" not in notes["8B FSDP8 compile"]


def test_published_rows_are_the_sources() -> None:
    """The figures as published (a typo here would move every ratio)."""
    by_name = {row.name: row for row in ROWS}
    assert by_name["8B FSDP8 eager"].tokens == 5762
    assert by_name["70B FSDP32 TP8"].tokens == 597.3
    assert by_name["405B 8,192 GPUs"].tflops == 430
    assert by_name["405B 16,384 GPUs"].mesh == Mesh(dp=128, pp=16, tp=8)
    assert all(row.batch * 8192 == 16 * 2**20 for row in PAPER)  # 16M tokens per step


def _tiny_llama(attn: str = "sdpa") -> tuple[torch.nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1024,
                                      max_position_embeddings=128, use_cache=False,
                                      attn_implementation=attn)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        tokens = torch.randint(0, 1024, (32, 128))
    return model, tokens


def test_make_plan_on_a_meta_llama_uses_the_llama_workload() -> None:
    model, tokens = _tiny_llama()
    plan = make_plan(model, Cluster.preset("H100-SXM", nodes=2), example_inputs=(tokens,),
                     mesh=Mesh(dp=2, pp=4, tp=2), precision="bf16")
    assert plan.mesh == Mesh(dp=2, pp=4, tp=2)
    assert any(note.startswith("costed as Llama (sp, flash, none recompute, FSDP")
               for note in plan.notes), plan.notes


def test_this_machine_keeps_the_captured_costs() -> None:
    """On this machine's devices the runtimes run the captured graph: its costs stay."""
    row = ROWS[0]
    analysis = SimpleNamespace(llama=LlamaModel(SHAPES[row.model], "flash"),
                               layer_names=captured_names(SHAPES[row.model]))
    request = SimpleNamespace(checkpoint=None, mesh=None, compiled=None)
    captured = captured_workload(SHAPES[row.model], 8)
    here = Cluster.local_devices(["cpu", "cpu"], [REFERENCE_CPU] * 2)
    assert workload_variants(analysis, request, here,
                             captured) == [(captured, None)]
    found = workload_variants(analysis, request, Cluster.preset("H100-SXM"), captured)
    assert [w.fsdp for w, _ in found] == [True, True, True]
    assert [c for _, c in found] == ["never", "never", "never"]


@pytest.mark.slow
def test_make_plan_recomputes_every_layer_when_asked() -> None:
    model, tokens = _tiny_llama("eager")
    plan = make_plan(model, Cluster.preset("H100-SXM", nodes=2), example_inputs=(tokens,),
                     mesh=Mesh(dp=2, pp=4, tp=2), checkpoint="always", precision="bf16")
    assert any(note.startswith("costed as Llama (sp, eager, full recompute")
               for note in plan.notes), plan.notes
    # The layers replay their forward themselves: no stage-level replay on top.
    assert plan.candidates[0]["config"]["checkpoint"] == "never"


def test_checked_splits_do_not_cap_a_cluster_plan() -> None:
    """The analysis checks a capture for at most 256 pieces of the batch; a Llama capture
    that held for all of them holds for any (dp 64 x 32 micro-batches is 2048 pieces)."""
    from dataclasses import replace

    shape = SHAPES["8B"]
    names = captured_names(shape)
    model = LlamaModel(shape, "flash")
    held = replace(captured_workload(shape, 2048), splits=tuple(range(1, 257)))
    guarded = replace(held, splits=(1, 2, 4))
    assert [w.splits for w in llama_variants(model, names, held, tp=8, recompute=["none"])] \
        == [None]
    assert [w.splits for w in llama_variants(model, names, guarded, tp=8,
                                             recompute=["none"])] == [(1, 2, 4)]
