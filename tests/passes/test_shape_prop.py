"""Tests of passes/shape_prop.py: shapes on fake or meta tensors, without real compute."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import partitioner.passes.shape_prop
from partitioner.passes.base import PassError
from partitioner.passes.shape_prop import propagate_shapes, tensor_bytes
from partitioner.passes.unlift import unlift

SEEN: list[object] = []


def record(x: torch.Tensor) -> torch.Tensor:
    """Remembers what it was called with (wrapped, so the graph calls it at run time)."""
    SEEN.append(x)
    return x


fx.wrap("record")


def shapes(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    return {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


class Recording(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return record(x) + 1


class ParamUser(nn.Module):
    """Reads a parameter directly (a ``get_attr`` node) and updates it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(2.0)
        return x * self.scale


def test_propagate_shapes_on_an_mlp() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    result = propagate_shapes(gm, (torch.randn(5, 4),))
    assert result.graph_module is gm
    assert not result.modified
    assert shapes(gm) == {"input_1": (5, 4), "_0": (5, 8), "_1": (5, 8), "_2": (5, 3),
                          "output": (5, 3)}


def test_propagate_shapes_on_a_cnn() -> None:
    gm = fx.symbolic_trace(cnn())
    propagate_shapes(gm, (torch.randn(2, 3, 8, 8),))
    assert shapes(gm) == {"input_1": (2, 3, 8, 8), "_0": (2, 8, 8, 8), "_1": (2, 8, 8, 8),
                          "_2": (2, 8, 8, 8), "_3": (2, 8, 4, 4), "_4": (2, 128), "_5": (2, 5),
                          "output": (2, 5)}


def test_propagate_shapes_keeps_dtypes() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8)).double())
    propagate_shapes(gm, (torch.randn(5, 4, dtype=torch.float64),))
    assert all(n.meta["val"].dtype == torch.float64 for n in gm.graph.nodes)


def test_propagate_shapes_handles_pytree_outputs_and_non_tensor_args() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
            return x.split(k, dim=1)

    gm = fx.symbolic_trace(Split())
    propagate_shapes(gm, (torch.randn(2, 5), 2))
    out = next(n for n in gm.graph.nodes if n.op == "output").meta["val"]
    assert [tuple(t.shape) for t in out] == [(2, 2), (2, 2), (2, 1)]
    assert tensor_bytes(out) == 2 * 5 * 4


def test_propagate_shapes_analyses_a_meta_model_without_allocating() -> None:
    with torch.device("meta"):
        # ~40 GB of float32 weights if it were real
        model = nn.Sequential(nn.Linear(100_000, 100_000), nn.ReLU(), nn.Linear(100_000, 10))
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (torch.randn(2, 100_000),))
    assert shapes(gm)["_2"] == (2, 10)
    assert all(p.is_meta for p in model.parameters())
    assert all(n.meta["val"].is_meta for n in gm.graph.nodes)


def test_propagate_shapes_runs_no_real_compute() -> None:
    SEEN.clear()
    gm = fx.symbolic_trace(Recording())
    propagate_shapes(gm, (torch.randn(3),))
    assert len(SEEN) == 1
    assert isinstance(SEEN[0], FakeTensor)
    assert isinstance(gm.graph.find_nodes(op="output")[0].meta["val"], FakeTensor)


def test_propagate_shapes_leaves_batch_norm_statistics_and_train_flags_alone() -> None:
    model = cnn()
    model.train()
    bn = model[1].eval()  # a mixed state must come back exactly as it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = fx.symbolic_trace(model)
    flags = {name: m.training for name, m in gm.named_modules()}
    propagate_shapes(gm, (torch.randn(4, 3, 8, 8) * 10 + 3,))
    assert {name: m.training for name, m in gm.named_modules()} == flags
    assert not bn.training and model[0].training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_propagate_shapes_leaves_batch_norm_in_train_mode_alone() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3)).train()
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (torch.randn(4, 3) + 5,))
    assert torch.equal(model[0].running_mean, torch.zeros(3))
    assert int(model[0].num_batches_tracked) == 0
    assert model.training and model[0].training


def test_propagate_shapes_records_fake_values_for_attributes() -> None:
    gm = fx.symbolic_trace(ParamUser())
    propagate_shapes(gm, (torch.randn(2, 3),))
    (attr,) = gm.graph.find_nodes(op="get_attr")
    assert isinstance(attr.meta["val"], FakeTensor)


def test_propagate_shapes_does_not_modify_attributes_updated_in_place() -> None:
    model = ParamUser()
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (torch.randn(2, 3),))
    assert torch.equal(model.scale, torch.ones(3))


def test_propagate_shapes_names_the_node_whose_shapes_mismatch() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(5, 2)))
    with pytest.raises(PassError, match="shape propagation failed at node _2") as caught:
        propagate_shapes(gm, (torch.randn(3, 4),))
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_propagate_shapes_refuses_integers_into_a_linear_layer(capture: str) -> None:
    """Regression: fake kernels let an int64 input meet a float weight; the real one fails
    at call time."""
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randint(0, 5, (3, 4))
    gm = fx.symbolic_trace(model) if capture == "fx" else \
        unlift(torch.export.export(model, (x.float(),), strict=False)).graph_module
    with pytest.raises(PassError, match="int64 and torch.float32"):
        propagate_shapes(gm, (x,))
    propagate_shapes(gm, (x.float(),))


def test_propagate_shapes_rejects_a_wrong_number_of_inputs() -> None:
    gm = fx.symbolic_trace(nn.Linear(4, 8))
    with pytest.raises(PassError, match="2 inputs for 1 placeholders"):
        propagate_shapes(gm, (torch.randn(3, 4), torch.randn(3, 4)))


def test_tensor_bytes_counts_every_tensor_leaf() -> None:
    value = {"a": torch.zeros(2, 3), "b": [torch.zeros(4, dtype=torch.float16), 7, "x"]}
    assert tensor_bytes(value) == 2 * 3 * 4 + 4 * 2
    assert tensor_bytes(torch.zeros(5, 5, device="meta")) == 100
    assert tensor_bytes(None) == 0


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.shape_prop).failed == 0
