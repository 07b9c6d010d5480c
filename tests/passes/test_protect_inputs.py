"""Tests of passes/protect_inputs.py: a stage copies an input it would modify in place."""

from __future__ import annotations

import doctest

import torch
import torch.fx as fx
from torch import nn

import partitioner.passes.protect_inputs
from partitioner.passes.protect_inputs import mutates_first_argument, protect_inputs


class AddInPlace(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.add_(y) * 2


def first_users(gm: fx.GraphModule, name: str) -> list[str]:
    node = next(n for n in gm.graph.nodes if n.name == name)
    return [user.name for user in node.users]


def test_an_input_mutated_first_gets_a_clone() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 3)))
    result = protect_inputs(gm)
    assert result.graph_module is gm and result.modified
    assert first_users(gm, "input_1") == ["clone"]
    assert first_users(gm, "clone") == ["_0"]


def test_protected_inputs_keep_the_caller_tensor_and_gradients() -> None:
    gm = protect_inputs(fx.symbolic_trace(AddInPlace())).graph_module
    x = torch.randn(4, requires_grad=True)  # a leaf: without the clone add_ would raise
    y = torch.randn(4)
    before = x.detach().clone()
    out = gm(x, y)
    out.sum().backward()
    assert torch.equal(out, (before + y) * 2)
    assert torch.equal(x.detach(), before)
    assert torch.equal(x.grad, torch.full((4,), 2.0))


def test_inputs_used_out_of_place_are_not_copied() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Linear(3, 3)))
    code = gm.code
    assert not protect_inputs(gm).modified
    assert gm.code == code


def test_an_input_read_by_an_in_place_op_on_another_tensor_is_not_copied() -> None:
    gm = fx.symbolic_trace(AddInPlace())
    protect_inputs(gm)
    assert first_users(gm, "y") == ["add_"]
    assert first_users(gm, "x") == ["clone"]


def test_mutates_first_argument_recognises_each_spelling() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    cases = {
        graph.call_method("mul_", (x, 2)): True,
        graph.call_method("mul", (x, 2)): False,
        graph.call_method("__add__", (x, 2)): False,
        graph.call_function(torch.relu_, (x,)): True,
        graph.call_function(torch.relu, (x,)): False,
        graph.call_function(torch.nn.functional.relu, (x,), {"inplace": True}): True,
        graph.call_function(torch.ops.aten.add_.Tensor, (x, x)): True,
        graph.call_function(torch.ops.aten.add.Tensor, (x, x)): False,
    }
    root = nn.Module()
    root.inplace = nn.ReLU(inplace=True)
    root.outplace = nn.ReLU()
    cases[graph.call_module("inplace", (x,))] = True
    cases[graph.call_module("outplace", (x,))] = False
    gm = fx.GraphModule(root, graph)
    assert {n.name: mutates_first_argument(gm, n) for n in cases} == \
        {n.name: expected for n, expected in cases.items()}


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.protect_inputs).failed == 0
