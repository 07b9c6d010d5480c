"""Tests of passes/dead_code.py: unused pure nodes go, side effects stay."""

from __future__ import annotations

import doctest

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import partitioner.passes.dead_code
from partitioner.passes.dead_code import eliminate_dead_code


def ops(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op.startswith("call_")]


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused = self.spare(x).relu() * 2  # noqa: F841
        return self.fc(x) + 1


def test_eliminate_dead_code_removes_unused_pure_nodes() -> None:
    gm = fx.symbolic_trace(Unused())
    result = eliminate_dead_code(gm)
    assert result.graph_module is gm and result.modified
    assert ops(gm) == ["fc", "add"]
    assert "spare" not in gm.code  # recompiled


def test_eliminate_dead_code_keeps_the_output() -> None:
    model = Unused()
    gm = fx.symbolic_trace(model)
    eliminate_dead_code(gm)
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), model(x))


def test_eliminate_dead_code_reports_no_change_on_a_live_graph() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    code = gm.code
    result = eliminate_dead_code(gm)
    assert not result.modified
    assert gm.code == code


def test_eliminate_dead_code_keeps_side_effectful_calls() -> None:
    class Checked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._assert(x.dim() == 2, "x must be a matrix")
            return x + 1

    gm = fx.symbolic_trace(Checked())
    eliminate_dead_code(gm)
    assert "_assert" in ops(gm)


def test_eliminate_dead_code_keeps_in_place_aten_ops() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops.aten.add_.Tensor, (x, 1.0))
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)))
    gm = fx.GraphModule(nn.Module(), graph)
    eliminate_dead_code(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        torch.ops.aten.add_.Tensor, torch.ops.aten.mul.Tensor]
    assert torch.equal(gm(torch.zeros(2)), torch.full((2,), 2.0))


def test_eliminate_dead_code_keeps_impure_modules() -> None:
    class Counter(nn.Module):
        _is_impure = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    root = nn.Module()
    root.count = Counter()
    root.spare = nn.Identity()
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_module("count", (x,))
    graph.call_module("spare", (x,))
    graph.output(x)
    gm = fx.GraphModule(root, graph)
    assert eliminate_dead_code(gm).modified
    assert ops(gm) == ["count"]


class InPlaceMethod(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # its result is unused: the effect is the write into x
        return x * 2


class InPlaceFunction(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F.relu(x, inplace=True)
        return x * 2


def test_eliminate_dead_code_keeps_in_place_method_calls() -> None:
    model = InPlaceMethod()
    gm = fx.symbolic_trace(model)
    eliminate_dead_code(gm)
    assert ops(gm) == ["add_", "mul"]
    assert torch.equal(gm(torch.zeros(2)), model(torch.zeros(2)))


def test_eliminate_dead_code_keeps_inplace_keyword_calls() -> None:
    model = InPlaceFunction()
    gm = fx.symbolic_trace(model)
    eliminate_dead_code(gm)
    x = torch.tensor([-1.0, 1.0])
    assert torch.equal(gm(x.clone()), model(x.clone()))


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.dead_code).failed == 0
