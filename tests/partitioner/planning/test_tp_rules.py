"""Declarative tensor-parallel rules and the per-parameter shard spec they resolve to."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn
from tp_models import mlp_pair

from partitioner.passes.shape_prop import propagate_shapes
from partitioner.planning.tp_rules import (
    TensorParallelRuleError,
    TensorParallelRules,
    resolve_shardings,
)


class Net(nn.Module):
    """Two blocks of fc1 -> relu -> fc2, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(8, 16),
                                                   "fc2": nn.Linear(16, 8)}) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["fc2"](torch.relu(block["fc1"](x)))
        return self.head(x)


def graph(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (x,))
    return gm


def test_rules_are_globs_and_the_first_match_wins() -> None:
    rules = TensorParallelRules.parse({"blocks.0.*": "replicate", "blocks.*.fc1": "colwise"})
    assert rules.match("blocks.0.fc1") == ("blocks.0.*", "replicate")
    assert rules.match("blocks.1.fc1") == ("blocks.*.fc1", "colwise")
    assert rules.match("head") is None
    # the flattened spelling of flatten_sequential matches too
    assert TensorParallelRules.parse({"0_1": "colwise"}).match("0.1") == ("0_1", "colwise")


def test_spec_lists_every_parameter_under_the_model_names() -> None:
    model = Net()
    plan = resolve_shardings(graph(model, torch.randn(2, 8)), model, 2)
    spec = plan.spec()
    assert set(spec) == {name for name, _ in model.named_parameters()}
    assert spec["blocks.0.fc1.weight"] == {"kind": "colwise", "dim": 0, "tp": 2}
    assert spec["blocks.0.fc1.bias"] == {"kind": "colwise", "dim": 0, "tp": 2}
    assert spec["blocks.0.fc2.weight"] == {"kind": "rowwise", "dim": 1, "tp": 2}
    assert spec["blocks.0.fc2.bias"] == {"kind": "replicate", "dim": None, "tp": 2}
    assert plan.forward_collectives == {"all_reduce": 2, "all_gather": 1}  # head gathered


def test_rules_override_and_the_rest_stays_automatic() -> None:
    model = Net()
    rules = TensorParallelRules.parse({"blocks.1.*": "replicate", "head": "replicate"})
    plan = resolve_shardings(graph(model, torch.randn(2, 8)), model, 2, rules)
    assert plan.layers == {"blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise",
                           "blocks.1.fc1": "replicate", "blocks.1.fc2": "replicate",
                           "head": "replicate"}
    assert plan.forward_collectives == {"all_reduce": 1}
    assert len(plan.split()) == 3


def test_explicit_rules_may_split_against_the_grain() -> None:
    """A user may ask for a row-parallel first layer: the input is sliced to fit."""
    model = mlp_pair()
    rules = TensorParallelRules.parse({"0": "rowwise", "2": "replicate"})
    plan = resolve_shardings(graph(model, torch.randn(2, 16)), model, 2, rules)
    assert plan.shardings["0.weight"].dim == 1 and plan.shardings["0.bias"].kind == "replicate"


def test_rules_for_embeddings() -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))
    x = torch.randint(0, 16, (2, 3))
    for kind, dim in (("rowwise", 0), ("vocab", 0), ("colwise", 1)):
        plan = resolve_shardings(graph(model, x), model, 2,
                                 TensorParallelRules.parse({"0": kind}))
        assert plan.shardings["0.weight"].dim == dim


@pytest.mark.parametrize("rules, message", [
    ({"blocks.*.fc3": "colwise"}, r"'blocks.\*.fc3' names no Linear, Embedding or attention layer; "
                                  r"did you mean blocks.1.fc2"),
    ({"head": "vocab"}, "head is a Linear, which cannot be split 'vocab'"),
    ({"head": "diagonal"}, "kind 'diagonal'; use one of colwise, rowwise, vocab, heads, replicate"),
    ({"": "colwise"}, "give a module-name glob"),
])
def test_rule_errors_say_what_to_write(rules: dict[str, str], message: str) -> None:
    model = Net()
    with pytest.raises(TensorParallelRuleError, match=message) as info:
        resolve_shardings(graph(model, torch.randn(2, 8)), model, 2,
                          TensorParallelRules.parse(rules))
    assert isinstance(info.value, ValueError)


def test_rules_must_be_a_mapping() -> None:
    with pytest.raises(TensorParallelRuleError, match="must map module globs to kinds"):
        TensorParallelRules.parse(["colwise"])  # type: ignore[arg-type]


def test_notes_describe_the_pairs() -> None:
    model = Net()
    plan = resolve_shardings(graph(model, torch.randn(2, 8)), model, 2)
    notes = plan.notes()
    assert notes[0].startswith("tensor parallel tp=2: 8 of 10 parameters split")
    assert "megatron pair: blocks.0.fc1 colwise -> blocks.0.fc2 rowwise" in notes
    assert "head: colwise" in notes
