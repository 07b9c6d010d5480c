"""partition(..., tensor_parallel=...) in one process: transparency, plans, state dicts, errors."""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from tp_models import Block, LlamaBlock, TinyGPT, batch_for, gpt2, mlp_pair

from partitioner import PartitionError, partition
from partitioner.errors import DeviceError, ExampleInputsError, StrategyError
from partitioner.planning.tp_rules import TensorParallelRuleError
from partitioner.plans.plan import Plan, ShardSpec
from partitioner.runtime.tensor_parallel.sharding import ShardSizeError


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _loss(out: Any) -> torch.Tensor:
    return _logits(out).float().pow(2).mean()


def check_transparent(model: nn.Module, x: torch.Tensor, devices: Any, tensor_parallel: Any,
                      steps: int = 3, **options: Any) -> Any:
    """Outputs and gradients equal the unsplit model's; after ``steps`` SGD steps the
    gathered weights are equal too."""
    reference = copy.deepcopy(model)
    pm = partition(model, devices, tensor_parallel=tensor_parallel, example_inputs=(x,),
                   **options)
    ours = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        out, expected = pm(x), reference(x)
        torch.testing.assert_close(_logits(out), _logits(expected))
        _loss(out).backward()
        _loss(expected).backward()
        if step == 0:
            for key, param in reference.named_parameters():
                torch.testing.assert_close(pm.full_tensor(key, grad=True), param.grad,
                                           msg=lambda m, k=key: f"{k}: {m}")
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    state, expected_state = pm.state_dict(), reference.state_dict()
    assert list(state) == list(expected_state)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")
    return pm


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_pair_transparent(tp: int) -> None:
    model = mlp_pair()
    pm = check_transparent(model, batch_for(model), ["cpu"] * tp, tp)
    assert pm.plan.shard_specs["0.weight"] == ShardSpec(0, "colwise")
    assert pm.plan.shard_specs["2.weight"] == ShardSpec(1, "rowwise")
    pm.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_block_transparent(tp: int) -> None:
    model = Block()
    pm = check_transparent(model, batch_for(model), ["cpu"] * tp, tp)
    # The fused q, k, v projection is split per part: each rank holds heads of q, k and v.
    assert pm.shardings["attn.c_attn.weight"].blocks == (32, 32, 32)
    pm.close()


def test_llama_block_transparent() -> None:
    """Separate q, k, v (all column-parallel), eager attention, SwiGLU (w1, w3 column)."""
    model = LlamaBlock()
    pm = check_transparent(model, batch_for(model), ["cpu"] * 2, 2)
    kinds = {name: s.kind for name, s in pm.shardings.items()}
    assert [kinds[f"{n}.weight"] for n in ("q", "k", "v", "o", "w1", "w3", "w2")] == \
        ["colwise"] * 3 + ["rowwise"] + ["colwise"] * 2 + ["rowwise"]
    pm.close()


@pytest.mark.parametrize("tp", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_gpt2_transparent(tp: int) -> None:
    """transformers' GPT-2 (captured by torch.export): Conv1D layers, tied embeddings."""
    model = gpt2()
    pm = check_transparent(model, batch_for(model), ["cpu"] * tp, tp)
    assert pm.plan.capture == "export"
    specs = pm.plan.shard_specs
    assert specs["transformer.h.0.attn.c_attn.weight"] == ShardSpec(1, "colwise")  # (in, out)
    assert specs["transformer.h.0.attn.c_proj.weight"] == ShardSpec(0, "rowwise")
    assert specs["transformer.wte.weight"] == specs["lm_head.weight"] == ShardSpec(0, "vocab")
    pm.close()


def _forward_counts(pm: Any) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for stage in pm.stages.values():
        for s in stage:
            counts.update(s.group.members[0].counts)
    return counts


@pytest.mark.parametrize("blocks", [1, 3])
def test_each_block_forward_runs_exactly_two_all_reduces(blocks: int) -> None:
    model = nn.Sequential(*[Block() for _ in range(blocks)])
    x = torch.randn(2, 8, 32)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    with torch.no_grad():
        pm(x)
    assert _forward_counts(pm) == Counter({("all_reduce", "forward"): 2 * blocks})
    out = pm(x)
    out.sum().backward()
    counts = _forward_counts(pm)
    assert counts["all_reduce", "forward"] == 4 * blocks  # two forwards
    assert counts["all_reduce", "backward"] == 2 * blocks  # Megatron's f, once per pair
    assert counts["all_gather", "forward"] == counts["all_gather", "backward"] == 0
    pm.close()


@pytest.mark.parametrize("make", [TinyGPT, pytest.param(gpt2, marks=pytest.mark.slow)],
                         ids=["tiny_gpt", "gpt2"])
def test_pipeline_stages_of_tensor_parallel_ranks(make: Any) -> None:
    model = make()
    x = batch_for(model)
    pm = check_transparent(model, x, ["cpu"] * 4, 2, chunks=2, checkpoint="always")
    assert (pm.plan.mesh.pp, pm.plan.mesh.tp) == (2, 2)
    assert [len(d) for d in pm.devices] == [2, 2]
    pm.close()


def test_nested_devices_name_each_stage() -> None:
    model = TinyGPT()
    pm = partition(model, [["cpu", "cpu"], ["cpu", "cpu"]], tensor_parallel=2,
                   example_inputs=(batch_for(model),), split_points=["h.1"])
    assert pm.plan.stages[1].layers[0] == "h.1"
    pm.close()


def test_boundaries_never_fall_inside_a_megatron_pair() -> None:
    """Each Linear of an nn.Sequential is a layer; the pair's Linears stay in one."""
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh(),
                          nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 8)
    pm = check_transparent(model, x, ["cpu"] * 4, 2, steps=1)
    assert pm.plan.layers == ("0", "3", "4")  # 0..2 and 4..6 each one layer
    pm.close()


def test_rules_override_the_automatic_choice() -> None:
    model = mlp_pair()
    x = batch_for(model)
    pm = check_transparent(model, x, ["cpu"] * 2, {"2": "replicate"}, steps=1)
    assert pm.shardings["2.weight"].kind == "replicate"
    assert pm.shardings["0.weight"].kind == "colwise"  # the lone Linear, gathered after
    pm.close()


def test_state_dict_loads_into_the_unsplit_model_and_back() -> None:
    model, other = gpt2(), gpt2()
    x = batch_for(model)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    pm.load_state_dict(other.state_dict())  # a full state dict is split on load
    torch.testing.assert_close(_logits(pm(x)), _logits(other(x)))
    fresh = gpt2()
    fresh.load_state_dict(pm.state_dict())
    torch.testing.assert_close(_logits(fresh(x)), _logits(other(x)))
    pm.close()


def test_state_dict_of_a_nested_tensor_parallel_module() -> None:
    model = mlp_pair()
    x = batch_for(model)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    outer = nn.ModuleDict({"net": pm})
    assert sorted(outer.state_dict()) == sorted(f"net.{k}" for k in model.state_dict())
    replacement = {f"net.{k}": torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    outer.load_state_dict(replacement)
    torch.testing.assert_close(pm.full_tensor("0.weight"), torch.full((64, 16), 0.5))
    result = outer.load_state_dict({"net.0.weight": torch.zeros(64, 16)}, strict=False)
    assert sorted(result.missing_keys) == ["net.0.bias", "net.2.bias", "net.2.weight"]
    assert result.unexpected_keys == []
    pm.close()


def test_plan_records_mesh_and_shard_specs_and_round_trips() -> None:
    model = Block()
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(batch_for(model),))
    plan = pm.plan
    assert plan.mesh.tp == 2
    assert plan.shard_specs["attn.c_attn.weight"] == ShardSpec(0, "colwise")
    assert "attn.c_proj.bias" not in plan.shard_specs  # added after the all-reduce, whole
    assert any("megatron pair" in note for note in plan.notes)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.shard_specs == plan.shard_specs
    pm.close()


@pytest.mark.parametrize("make", [Block, pytest.param(gpt2, marks=pytest.mark.slow)],
                         ids=["fx", "export"])
def test_eval_mode_and_inference(make: Any) -> None:
    model = make()
    x = batch_for(model)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    pm.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(pm(x)), _logits(model(x)))
    pm.train()
    pm.close()


def test_dropout_keeps_replicated_values_identical_across_ranks() -> None:
    """Replicated dropout draws alike on every rank: the ranks' copies of a replicated
    parameter get bit-identical gradients (they would diverge otherwise)."""
    torch.manual_seed(1)
    model = TinyGPT(n_layer=1, dropout=0.3)
    x = batch_for(model)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    pm(x).pow(2).mean().backward()
    stage = pm.stages["train_mode"][0]
    for name, param in stage.ranks[0].named_parameters():
        if pm.shardings.get(name) is not None and not pm.shardings[name].is_split:
            twin = stage.ranks[1].get_parameter(name)
            assert torch.equal(param.grad, twin.grad), name
    pm.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), model(x))
    pm.close()


def test_sizes_that_do_not_divide_name_the_layer_and_sizes() -> None:
    model = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
    with pytest.raises(ShardSizeError, match=r"(?s)0 \(colwise.*size 30.*tp=4"):
        partition(model, ["cpu"] * 4, tensor_parallel=4, example_inputs=(torch.randn(2, 8),))


def test_heads_that_do_not_divide_name_the_attention() -> None:
    model = Block(n_embd=32, n_head=2)
    with pytest.raises(ShardSizeError, match=r"(?s)attn.*2 heads over 4 ranks") as info:
        partition(model, ["cpu"] * 4, tensor_parallel=4, example_inputs=(batch_for(model),))
    assert isinstance(info.value, PartitionError) and isinstance(info.value, ValueError)


def test_device_and_option_errors() -> None:
    model = mlp_pair()
    x = (batch_for(model),)
    with pytest.raises(DeviceError, match="3 devices do not make groups of tensor_parallel=2"):
        partition(model, ["cpu"] * 3, tensor_parallel=2, example_inputs=x)
    with pytest.raises(DeviceError, match="same number"):
        partition(model, [["cpu"], ["cpu", "cpu"]], tensor_parallel=2, example_inputs=x)
    with pytest.raises(PartitionError, match="tensor_parallel='two'"):
        partition(model, ["cpu"] * 2, tensor_parallel="two", example_inputs=x)  # type: ignore
    with pytest.raises(ExampleInputsError, match="example_inputs"):
        partition(model, ["cpu"] * 2, tensor_parallel=2)
    with pytest.raises(StrategyError, match="not both"):
        partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=x,  # type: ignore
                  plan={"stages": [{"layers": "*"}]})


def test_rule_errors_name_the_pattern() -> None:
    model = mlp_pair()
    x = (batch_for(model),)
    with pytest.raises(TensorParallelRuleError, match=r"'fc1' names no Linear.*layers are 0, 2"):
        partition(model, ["cpu"] * 2, tensor_parallel={"fc1": "colwise"}, example_inputs=x)
    with pytest.raises(TensorParallelRuleError, match="cannot be split 'vocab'"):
        partition(model, ["cpu"] * 2, tensor_parallel={"0": "vocab"}, example_inputs=x)


def test_the_user_model_is_left_alone() -> None:
    """Ranks own copies: switching the tensor-parallel module to eval, or training it, does
    not touch the model it was made from."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 8))
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 8)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    pm.eval()
    assert model[1].training
    pm.train()
    pm(x).sum().backward()
    torch.optim.SGD(pm.parameters(), lr=1.0).step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert not torch.equal(pm.state_dict()["0.weight"], before["0.weight"])
    pm.close()


def test_degree_one_is_the_unsplit_model() -> None:
    model = mlp_pair()
    x = batch_for(model)
    pm = partition(model, ["cpu"], tensor_parallel=1, example_inputs=(x,))
    assert pm.plan.shard_specs == {} and pm.plan.mesh.tp == 1
    torch.testing.assert_close(pm(x), model(x))
    pm.close()


def test_a_fixed_tensor_parallel_pipeline_is_costed_split() -> None:
    """strategy='pipeline' with tensor_parallel=2 costs each stage's layers split over its
    two ranks, as the search does (before, the stage was costed whole: every parameter,
    activation and FLOP on each rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    plans = {}
    for strategy in ("pipeline", "auto"):
        pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,), chunks=1,
                       checkpoint="never", strategy=strategy)
        plans[strategy] = pm.plan
        pm.close()
    fixed, searched = plans["pipeline"].stages[0], plans["auto"].stages[0]
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert fixed.param_bytes < 0.6 * whole
    assert (fixed.param_bytes, fixed.predicted_memory, fixed.predicted_time) == \
        (searched.param_bytes, searched.predicted_memory, searched.predicted_time)
