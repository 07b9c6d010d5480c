"""Tests of passes/flatten_sequential.py: flattening containers and labelling layer units."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.fx as fx
from torch import nn

import partitioner.passes.flatten_sequential
from partitioner.passes.flatten_sequential import (
    assign_layer_paths,
    display_name,
    expanded_modules,
    flatten_sequential,
)


def module_paths(gm: fx.GraphModule) -> dict[fx.Node, list[str]]:
    """Each node's enclosing module names, outermost first, as capture records them."""
    return {n: [path for path, _ in (n.meta.get("nn_module_stack") or {}).values() if path]
            for n in gm.graph.nodes}


def layer_paths(model: nn.Module) -> dict[str, str]:
    gm = fx.symbolic_trace(model)
    assign_layer_paths(gm, model, module_paths(gm))
    return {n.name: n.meta["layer_path"] for n in gm.graph.nodes if n.op.startswith("call_")}


def seeds_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5)),
        nn.Sequential(nn.Tanh(), nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2)),
    )


class ResidualBlock(nn.Module):
    """A ResNet-style block: its downsample is a heterogeneous Sequential (conv, bn)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.downsample = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + self.downsample(x))


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 1)
        self.layer1 = nn.Sequential(ResidualBlock(), ResidualBlock())
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer1(self.stem(x)).mean((2, 3)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Body(nn.Module):
    """Holds repeated blocks, like GPT-2's ``transformer`` holding ``h``."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(3)])
        self.ln_f = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPTLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.body = Body()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


# flatten_sequential


def test_flatten_sequential_names_children_like_the_seeds() -> None:
    flat = flatten_sequential(seeds_model())
    assert list(dict(flat.named_children())) == ["0_0", "0_1", "0_2", "1_0", "1_1", "1_2", "1_3"]


def test_flatten_sequential_shares_the_leaf_modules() -> None:
    model = seeds_model()
    flat = flatten_sequential(model)
    assert flat[0] is model[0][0]
    assert flat[4] is model[1][1]
    assert {id(p) for p in flat.parameters()} == {id(p) for p in model.parameters()}


def test_flatten_sequential_computes_what_the_original_computes() -> None:
    model = seeds_model()
    x = torch.randn(3, 4)
    torch.testing.assert_close(flatten_sequential(model)(x), model(x), rtol=0, atol=0)


def test_flatten_sequential_flattens_any_depth() -> None:
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.ReLU(), nn.Tanh()), nn.ReLU()), nn.ReLU())
    assert list(dict(flatten_sequential(model).named_children())) == ["0_0_0", "0_0_1", "0_1", "1"]


def test_flatten_sequential_keeps_non_sequential_children_whole() -> None:
    block = ResidualBlock()
    flat = flatten_sequential(nn.Sequential(block, nn.ReLU()))
    assert list(dict(flat.named_children())) == ["0", "1"]
    assert flat[0] is block


def test_flatten_sequential_rejects_non_sequential_naming_its_type() -> None:
    with pytest.raises(TypeError, match="got ModuleList"):
        flatten_sequential(nn.ModuleList([nn.ReLU()]))  # type: ignore[arg-type]


def test_display_name_spells_paths_with_underscores() -> None:
    assert display_name("layer1.0.conv") == "layer1_0_conv"
    assert display_name("head") == "head"


# expanded_modules


def test_expanded_modules_includes_the_root_and_a_modulelist_of_blocks() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 2)

    assert expanded_modules(Net()) == {"", "blocks"}


def test_expanded_modules_keeps_a_residual_block_with_a_heterogeneous_sequential_whole() -> None:
    expanded = expanded_modules(ResNetLike())
    assert "layer1" in expanded
    assert "layer1.0" not in expanded
    assert "layer1.1" not in expanded
    assert "stem" not in expanded


def test_expanded_modules_looks_through_a_module_holding_repeated_blocks() -> None:
    expanded = expanded_modules(GPTLike())
    assert {"", "body", "body.h"} <= expanded
    assert "body.h.0" not in expanded
    assert "embed" not in expanded


# assign_layer_paths


def test_assign_layer_paths_makes_each_block_of_a_sequential_a_unit() -> None:
    paths = layer_paths(ResNetLike())
    assert paths["stem"] == "stem"
    assert paths["head"] == "head"
    assert paths["mean"] == ""
    block0 = {name: path for name, path in paths.items() if name.startswith("layer1_0")}
    assert block0 and set(block0.values()) == {"layer1.0"}


def test_assign_layer_paths_gives_the_downsample_to_its_block() -> None:
    paths = layer_paths(ResNetLike())
    assert paths["layer1_0_downsample_0"] == "layer1.0"
    assert paths["layer1_0_downsample_1"] == "layer1.0"
    assert paths["layer1_1_downsample_1"] == "layer1.1"
    # the residual add and relu of a whole block's own forward belong to the block
    assert paths["add"] == "layer1.0"
    assert paths["relu_1"] == "layer1.1"


def test_assign_layer_paths_looks_through_a_module_holding_repeated_blocks() -> None:
    paths = layer_paths(GPTLike())
    assert paths["embed"] == "embed"
    assert paths["mul"] == ""  # an op of Body's own forward: owned by no unit
    assert paths["body_h_0_ln"] == "body.h.0"
    assert paths["add"] == "body.h.0"
    assert paths["body_h_2_fc"] == "body.h.2"
    assert paths["body_ln_f"] == "body.ln_f"
    assert paths["head"] == "head"


def test_assign_layer_paths_on_a_sequential_without_module_stacks() -> None:
    model = seeds_model()
    gm = fx.symbolic_trace(model)
    result = assign_layer_paths(gm, model, {})
    assert result.graph_module is gm
    assert not result.modified
    paths = [n.meta["layer_path"] for n in gm.graph.nodes if n.op == "call_module"]
    assert paths == ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2", "1.3"]


def test_assign_layer_paths_labels_only_call_nodes() -> None:
    model = GPTLike()
    gm = fx.symbolic_trace(model)
    assign_layer_paths(gm, model, module_paths(gm))
    unlabelled = [n.op for n in gm.graph.nodes if "layer_path" not in n.meta]
    assert set(unlabelled) == {"placeholder", "output"}


def test_assign_layer_paths_ignores_paths_naming_no_module() -> None:
    model = ResNetLike()
    gm = fx.symbolic_trace(model)
    paths = module_paths(gm)
    node = next(n for n in gm.graph.nodes if n.name == "layer1_0_conv")
    paths[node] = ["synthetic", *paths[node]]
    assign_layer_paths(gm, model, paths)
    assert node.meta["layer_path"] == "layer1.0"


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.flatten_sequential).failed == 0
