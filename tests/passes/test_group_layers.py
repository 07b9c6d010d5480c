"""Tests of passes/group_layers.py: contiguous layers, the units a stage boundary falls between."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.fx as fx
from torch import nn

import partitioner.passes.group_layers
from partitioner.passes.base import PassError
from partitioner.passes.flatten_sequential import assign_layer_paths
from partitioner.passes.group_layers import Layer, compute_nodes, group_layers


def grouped(model: nn.Module) -> tuple[fx.GraphModule, tuple[Layer, ...]]:
    gm = fx.symbolic_trace(model)
    paths = {n: [p for p, _ in (n.meta.get("nn_module_stack") or {}).values() if p]
             for n in gm.graph.nodes}
    assign_layer_paths(gm, model, paths)
    result = group_layers(gm)
    assert result.graph_module is gm and not result.modified
    return gm, result.layers


def summary(layers: tuple[Layer, ...]) -> list[tuple[str, list[str]]]:
    return [(layer.name, list(layer.nodes)) for layer in layers]


class Residual(nn.Module):
    """The residual adds are in the root's own forward (the root is expanded)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Reuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x)))


class ConsecutiveReuse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.a(x))


class OrphansFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x * 2).relu()
        return self.b(self.a(x))


def test_residual_adds_of_an_expanded_parent_join_the_previous_layer() -> None:
    _, layers = grouped(Residual())
    assert summary(layers) == [
        ("blocks.0", ["blocks_0", "add"]),
        ("blocks.1", ["blocks_1", "add_1"]),
        ("blocks.2", ["blocks_2", "add_2"]),
        ("head", ["head"]),
    ]


def test_a_module_called_twice_yields_a_second_named_layer() -> None:
    _, layers = grouped(Reuse())
    assert [(layer.name, layer.path) for layer in layers] == [("a", "a"), ("b", "b"),
                                                             ("a#2", "a")]
    assert layers[2].nodes == ("a_1",)


def test_a_module_called_twice_in_a_row_yields_two_layers() -> None:
    _, layers = grouped(ConsecutiveReuse())
    assert [layer.name for layer in layers] == ["a", "a#2"]


def test_orphan_ops_before_the_first_layer_join_the_first_layer() -> None:
    _, layers = grouped(OrphansFirst())
    assert summary(layers) == [("a", ["mul", "relu", "a"]), ("b", ["b"])]
    assert layers[0].path == "a"


def test_a_model_of_orphan_ops_only_is_one_root_layer() -> None:
    class Functional(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.relu() + 1

    _, layers = grouped(Functional())
    assert [(layer.name, layer.path) for layer in layers] == [("<root>", "")]
    assert layers[0].nodes == ("relu", "add")


def test_every_call_node_is_in_exactly_one_layer_in_graph_order() -> None:
    gm, layers = grouped(Residual())
    flat = [name for layer in layers for name in layer.nodes]
    assert flat == [n.name for n in compute_nodes(gm)]


def test_group_layers_writes_the_layer_index_on_each_node() -> None:
    gm, layers = grouped(Residual())
    for index, layer in enumerate(layers):
        for name in layer.nodes:
            assert next(n for n in gm.graph.nodes if n.name == name).meta["layer"] == index
    assert all("layer" not in n.meta for n in gm.graph.nodes if not n.op.startswith("call_"))


def test_compute_nodes_are_the_call_nodes_in_order() -> None:
    gm = fx.symbolic_trace(OrphansFirst())
    assert [n.name for n in compute_nodes(gm)] == ["mul", "relu", "a", "b"]


def test_group_layers_needs_layer_paths() -> None:
    gm = fx.symbolic_trace(Reuse())
    with pytest.raises(PassError, match=r"group_layers needs node.meta\['layer_path'\]"):
        group_layers(gm)


def test_group_layers_rejects_a_graph_without_operations() -> None:
    gm = fx.symbolic_trace(nn.Identity())
    with pytest.raises(PassError, match="no operations to partition"):
        group_layers(gm)


def test_layer_repr_leaves_out_the_node_list() -> None:
    layer = Layer("a#2", "a", ("n1", "n2"))
    assert repr(layer) == "Layer(name='a#2', path='a')"


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.group_layers).failed == 0
