"""Tests of passes/split_stages.py: one graph per stage, run in sequence = the whole model."""

from __future__ import annotations

import doctest
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import partitioner.passes.split_stages
from partitioner.passes.base import PassError
from partitioner.passes.split_stages import StageSplit, split_stages


class LongSkip(nn.Module):
    """Four layers; the first layer's output is used again in the fourth (stage 0 -> stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(4, 4)
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l3 = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.tanh(self.l0(x) + self.bias)
        b = torch.tanh(self.l1(a))
        c = torch.tanh(self.l2(b))
        d = self.l3(c) * y + a + self.bias
        return d, b


#: the stage of every call node of LongSkip's graph
STAGES = {"l0": 0, "add": 0, "tanh": 0, "l1": 1, "tanh_1": 1, "l2": 2, "tanh_2": 2,
          "l3": 3, "mul": 3, "add_1": 3, "add_2": 3}


def traced() -> tuple[LongSkip, fx.GraphModule]:
    model = LongSkip()
    return model, fx.symbolic_trace(model)


def assignment(gm: fx.GraphModule, stages: dict[str, int]) -> dict[fx.Node, int]:
    return {n: stages[n.name] for n in gm.graph.nodes if n.name in stages}


def run(split: StageSplit, *inputs: Any) -> Any:
    """Runs the stages in sequence, feeding each one's outputs to the next."""
    values: Any = inputs
    for stage in split.stages:
        values = stage.graph_module(*values)
    return values


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4), torch.randn(3, 4)


def problems(gm: fx.GraphModule, stages: dict[str, int], n_stages: int) -> str:
    with pytest.raises(PassError) as caught:
        split_stages(gm, assignment(gm, stages), n_stages)
    return str(caught.value)


def test_stages_run_in_sequence_equal_the_model_exactly() -> None:
    model, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    x, y = inputs()
    expected = model(x, y)
    got = run(split, x, y)
    assert len(got) == 2
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_stages_run_in_sequence_give_the_model_gradients() -> None:
    model, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    x, y = inputs()
    sum(o.sum() for o in model(x, y)).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    sum(o.sum() for o in run(split, x, y)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)


def test_a_skip_over_three_stages_is_relayed_by_the_stages_between() -> None:
    _, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    assert [s.inputs for s in split.stages] == [
        ("x", "y"),
        ("y", "tanh"),
        ("y", "tanh", "tanh_1"),
        ("y", "tanh", "tanh_1", "tanh_2"),
    ]
    assert ["tanh" in s.outputs for s in split.stages] == [True, True, True, False]


def test_each_stage_sends_what_the_next_receives() -> None:
    _, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    for before, after in zip(split.stages, split.stages[1:]):
        assert before.outputs == after.inputs
    assert [s.is_last for s in split.stages] == [False, False, False, True]
    assert split.stages[-1].outputs == ()


def test_stage_graphs_take_and_return_their_interface() -> None:
    _, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    for stage in split.stages:
        placeholders = stage.graph_module.graph.find_nodes(op="placeholder")
        assert len(placeholders) == len(stage.inputs)
    x, y = inputs()
    sent = split.stages[0].graph_module(x, y)
    assert isinstance(sent, tuple) and len(sent) == len(split.stages[0].outputs)


def test_stage_graphs_share_the_model_parameters() -> None:
    model, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    originals = dict(model.named_parameters())
    seen = set()
    for stage in split.stages:
        for name, p in stage.graph_module.named_parameters():
            assert p is originals[name], name
            seen.add(name)
    assert seen == set(originals)


def test_an_attribute_is_fetched_by_each_stage_that_uses_it() -> None:
    _, gm = traced()
    split = split_stages(gm, assignment(gm, STAGES), 4)
    uses = [len(s.graph_module.graph.find_nodes(op="get_attr")) for s in split.stages]
    assert uses == [1, 0, 0, 1]
    assert all("bias" not in s.inputs for s in split.stages)


def test_split_stages_leaves_the_whole_graph_untouched() -> None:
    _, gm = traced()
    code = gm.code
    names = [n.name for n in gm.graph.nodes]
    result = split_stages(gm, assignment(gm, STAGES), 4)
    assert result.graph_module is gm and result.modified
    assert gm.code == code
    assert [n.name for n in gm.graph.nodes] == names


def test_one_stage_is_the_whole_model() -> None:
    model, gm = traced()
    split = split_stages(gm, {n: 0 for n in gm.graph.nodes if n.op.startswith("call_")}, 1)
    (stage,) = split.stages
    assert stage.is_last and stage.inputs == ("x", "y") and stage.outputs == ()
    x, y = inputs()
    for g, e in zip(stage.graph_module(x, y), model(x, y), strict=True):
        assert torch.equal(g, e)


def test_split_stages_rejects_a_decreasing_assignment() -> None:
    _, gm = traced()
    message = problems(gm, {**STAGES, "tanh_1": 0}, 4)
    assert "node tanh_1 is in stage 0 after a node of stage 1" in message


def test_split_stages_rejects_an_empty_stage() -> None:
    _, gm = traced()
    stages = {name: (3 if j == 2 else j) for name, j in STAGES.items()}
    assert "stages [2] own no operation" in problems(gm, stages, 4)
    assert "stages [4] own no operation" in problems(gm, STAGES, 5)


def test_split_stages_rejects_a_node_without_a_stage() -> None:
    _, gm = traced()
    stages = dict(STAGES)
    del stages["l2"]
    assert "node l2 has no stage" in problems(gm, stages, 4)


def test_split_stages_rejects_a_stage_out_of_range() -> None:
    _, gm = traced()
    message = problems(gm, {**STAGES, "add_2": 4}, 4)
    assert "node add_2 is given stage 4 outside 0..3" in message


def test_split_stages_reports_every_problem_at_once() -> None:
    _, gm = traced()
    stages = {**STAGES, "tanh_1": 0}
    del stages["l2"]
    message = problems(gm, stages, 5)
    assert message.startswith("split_stages: ")
    for part in ("node tanh_1 is in stage 0", "node l2 has no stage", "stages [4] own no"):
        assert part in message


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(4, 4)
        self.l1 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l0(x)
        a.relu_()  # its result is unused: the effect is the write into a
        return self.l1(a)


def test_an_in_place_op_whose_result_is_unused_survives_the_split() -> None:
    model = InPlace()
    gm = fx.symbolic_trace(model)
    split = split_stages(gm, assignment(gm, {"l0": 0, "relu_": 0, "l1": 1}), 2)
    x = torch.randn(3, 4)
    assert torch.equal(run(split, x), model(x))


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.split_stages).failed == 0


def test_an_argument_with_a_default_used_by_a_later_stage() -> None:
    """``forward(x, scale=2.0)`` (every timm ViT): stage 1 receives ``scale`` before values
    without defaults; a copied default made its code a SyntaxError."""
    from models import Scaled

    model = Scaled()
    gm = fx.symbolic_trace(model)
    calls = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    stage_of = {n: (0 if k < 2 else 1) for k, n in enumerate(calls)}
    split = split_stages(gm, stage_of, 2)
    assert "scale" in split.stages[1].inputs
    x = torch.randn(3, 8)
    out0 = split.stages[0].graph_module(x, 3.0, True)
    torch.testing.assert_close(split.stages[1].graph_module(*out0), model(x, 3.0))
