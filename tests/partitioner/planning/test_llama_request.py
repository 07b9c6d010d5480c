"""What a caller tells make_plan about a Llama run beyond this machine: ``checkpoint=
"selective"`` (torchtitan's per-op recomputation) and ``compiled=`` (element-wise steps
fused by torch.compile, or eager), and the refusals where neither can mean anything
(partitioner/request.py, partitioner/planning/llama_plan.py, runtime/checkpointing.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import Cluster, Mesh, Options, make_plan, partition, partition_distributed
from partitioner.errors import OptionsError, StrategyError

MESH = Mesh(dp=2, pp=4, tp=2)


def _tiny_llama() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=1024,
                                      max_position_embeddings=128, use_cache=False,
                                      attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        tokens = torch.randint(0, 1024, (32, 128))
    return model, tokens


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.Tensor]:
    return _tiny_llama()


def _plan(llama: tuple[nn.Module, torch.Tensor], **kwargs: object):  # type: ignore[no-untyped-def]
    model, tokens = llama
    return make_plan(model, Cluster.preset("H100-SXM", nodes=2), example_inputs=(tokens,),
                     mesh=MESH, precision="bf16", **kwargs)  # type: ignore[arg-type]


def _llama_note(plan) -> str:  # type: ignore[no-untyped-def]
    notes = [n for n in plan.notes if n.startswith("costed as Llama")]
    assert len(notes) == 1, plan.notes
    return notes[0]


def test_make_plan_costs_the_run_it_is_told_of(llama) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(llama, checkpoint="selective", compiled=False)
    note = _llama_note(plan)
    assert "selective recompute" in note and "eager element-wise" in note, note
    assert plan.checkpoint == "never"


@pytest.mark.slow
def test_selective_is_planned_as_asked(llama) -> None:  # type: ignore[no-untyped-def]
    chosen = _plan(llama)  # None: the first mode that fits; this small model keeps all
    selective = _plan(llama, checkpoint="selective")
    assert "none recompute" in _llama_note(chosen)
    assert "selective recompute" in _llama_note(selective)
    # Recomputation is inside the layers: no stage-level replay on top of it.
    assert selective.checkpoint == "never"
    # Replaying part of each block costs time: the plan is slower than keeping everything.
    assert selective.predicted_step_time > chosen.predicted_step_time


@pytest.mark.slow
def test_eager_element_wise_steps_cost_more_than_compiled(llama) -> None:  # type: ignore[no-untyped-def]
    compiled = _plan(llama)
    also_compiled = _plan(llama, compiled=True)
    eager = _plan(llama, options=Options(compiled=False))
    assert "eager element-wise" not in _llama_note(compiled)
    assert "eager element-wise" in _llama_note(eager)
    assert also_compiled.predicted_step_time == compiled.predicted_step_time
    assert eager.predicted_step_time > compiled.predicted_step_time


def test_selective_for_a_model_the_planner_cannot_see_inside_is_refused() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    with pytest.raises(StrategyError, match="costed for transformers Llama models"):
        make_plan(model, Cluster.preset("H100-SXM"), example_inputs=(torch.randn(64, 64),),
                  checkpoint="selective")


def test_selective_with_a_fixed_split_is_refused(llama) -> None:  # type: ignore[no-untyped-def]
    model, tokens = llama
    with pytest.raises(StrategyError, match="strategy='auto' plans"):
        make_plan(model, Cluster.preset("H100-SXM"), "pipeline", example_inputs=(tokens,),
                  checkpoint="selective")


@pytest.mark.parametrize("kwargs, match", [
    ({"checkpoint": "selective"}, "replay a whole stage's forward"),
    ({"compiled": False}, "Cluster beyond this machine"),
])
def test_this_machine_refuses_what_only_a_cluster_plan_reads(kwargs, match) -> None:  # type: ignore[no-untyped-def]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with pytest.raises(StrategyError, match=match):
        make_plan(model, ["cpu", "cpu"], example_inputs=(x,), **kwargs)
    with pytest.raises(StrategyError, match="partition: .*" + match):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), options=Options(**kwargs))
    # Refused before torch.distributed is started: nothing collective has run.
    with pytest.raises(StrategyError, match="partition_distributed: .*" + match):
        partition_distributed(model, example_inputs=(x,), pp=1, dp=1,
                              options=Options(**kwargs))


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_compiled_must_be_a_bool(value: object) -> None:
    with pytest.raises(OptionsError, match=f"compiled={value!r}; pass True"):
        Options(compiled=value)  # type: ignore[arg-type]


def test_an_unknown_checkpoint_lists_selective() -> None:
    with pytest.raises(StrategyError, match="'never', 'selective'"):
        Options(checkpoint="sometimes")
