"""Tests of passes/liveness.py: which values cross which boundary of a chain of units."""

from __future__ import annotations

import doctest

import torch
import torch.fx as fx
from torch import nn

import partitioner.passes.liveness
from partitioner.passes.liveness import live_values, transported


class Chain(nn.Module):
    """Four linear layers; the first one's output is added after the fourth."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(4, 4)
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l3 = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.l0(x)
        b = self.l1(a)
        unused = b * 3  # noqa: F841 - a dead value stays out of every boundary
        c = self.l2(b + y + self.bias)
        return self.l3(c) + a, b


def traced() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    gm = fx.symbolic_trace(Chain())
    return gm, {n.name: n for n in gm.graph.nodes}


def units_by_name(gm: fx.GraphModule, names: dict[str, int]) -> dict[fx.Node, int]:
    return {n: names[n.name] for n in gm.graph.nodes if n.name in names}


def names(live: list[list[fx.Node]]) -> list[list[str]]:
    return [[n.name for n in values] for values in live]


CHAIN_UNITS = {"l0": 0, "l1": 1, "mul": 1, "add": 2, "add_1": 2, "l2": 2, "l3": 3, "add_2": 3}


def test_a_skip_spanning_three_units_crosses_every_boundary_between() -> None:
    gm, _ = traced()
    live = names(live_values(gm, units_by_name(gm, CHAIN_UNITS), 4))
    assert [("l0" in values) for values in live] == [True, True, True]


def test_live_values_lists_each_boundary_in_graph_order() -> None:
    gm, _ = traced()
    live = names(live_values(gm, units_by_name(gm, CHAIN_UNITS), 4))
    assert live == [["y", "l0"], ["y", "l0", "l1"], ["l0", "l1", "l2"]]


def test_placeholders_live_from_unit_zero_until_their_last_use() -> None:
    gm, _ = traced()
    live = names(live_values(gm, units_by_name(gm, CHAIN_UNITS), 4))
    assert ["y" in values for values in live] == [True, True, False]
    assert not any("x" in values for values in live)  # used only in unit 0


def test_a_value_the_model_returns_lives_until_the_last_unit() -> None:
    gm, _ = traced()
    live = names(live_values(gm, units_by_name(gm, CHAIN_UNITS), 4))
    assert ["l1" in values for values in live] == [False, True, True]


def test_attributes_are_never_transported() -> None:
    gm, nodes = traced()
    assert nodes["bias"].op == "get_attr"
    assert not transported(nodes["bias"])
    assert not transported(nodes["output"])
    assert all(transported(nodes[name]) for name in ("x", "l0", "add", "mul"))
    live = live_values(gm, units_by_name(gm, CHAIN_UNITS), 4)
    assert all(v.op != "get_attr" for values in live for v in values)


def test_a_value_nobody_uses_is_not_live() -> None:
    gm, _ = traced()
    live = names(live_values(gm, units_by_name(gm, {**CHAIN_UNITS, "mul": 0, "l0": 0}), 4))
    assert not any("mul" in values for values in live)


def test_one_unit_has_no_boundaries() -> None:
    gm, _ = traced()
    units = {n: 0 for n in gm.graph.nodes if n.op.startswith("call_")}
    assert live_values(gm, units, 1) == []


def test_values_used_only_in_their_own_unit_cross_nothing() -> None:
    gm, _ = traced()
    units = {n: 0 for n in gm.graph.nodes if n.op.startswith("call_")}
    units[next(n for n in gm.graph.nodes if n.name == "add_2")] = 1
    # l2, add, add_1 are made and used in unit 0; l0 and l3 feed add_2, l1 is returned
    assert names(live_values(gm, units, 2)) == [["l0", "l1", "l3"]]


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.liveness).failed == 0
