"""Tests of passes/annotate_cost.py: FLOPs and bytes per node, counted on fake tensors."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.fx as fx
from torch import nn

import partitioner.passes.annotate_cost
from partitioner.passes.annotate_cost import NodeCost, annotate_cost, total_flops
from partitioner.passes.base import PassError
from partitioner.passes.shape_prop import propagate_shapes


def costed(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, inputs)
    annotate_cost(gm)
    return gm


def cost_of(gm: fx.GraphModule, name: str) -> NodeCost:
    return next(n for n in gm.graph.nodes if n.name == name).meta["cost"]


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Tied(nn.Module):
    """Encoder and decoder share one weight Parameter (like tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x)) + self.fc.bias


def test_linear_costs_match_the_formulas() -> None:
    gm = costed(nn.Sequential(nn.Linear(4, 8)), torch.randn(2, 4))
    assert cost_of(gm, "_0") == NodeCost(
        forward_flops=2 * 2 * 4 * 8,
        backward_flops=2 * (2 * 2 * 4 * 8),
        param_bytes=(4 * 8 + 8) * 4,
        buffer_bytes=0,
        activation_bytes=2 * 8 * 4,
        input_bytes=2 * 4 * 4 + (4 * 8 + 8) * 4,
    )


def test_conv_flops_match_the_formula() -> None:
    gm = costed(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False)), torch.randn(2, 3, 10, 10))
    n, c_in, c_out, k, h_out, w_out = 2, 3, 8, 3, 8, 8
    expected = 2 * n * c_out * h_out * w_out * c_in * k * k
    cost = cost_of(gm, "_0")
    assert cost.forward_flops == expected
    assert cost.backward_flops == 2 * expected
    assert cost.activation_bytes == n * c_out * h_out * w_out * 4


def test_matmul_as_a_function_is_counted() -> None:
    class MatMul(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.matmul(a, b).relu()

    gm = costed(MatMul(), torch.randn(2, 3), torch.randn(3, 5))
    assert cost_of(gm, "matmul").forward_flops == 2 * 2 * 3 * 5
    assert cost_of(gm, "relu").forward_flops == 0
    assert cost_of(gm, "relu").activation_bytes == 2 * 5 * 4
    assert cost_of(gm, "relu").input_bytes == 2 * 5 * 4


def test_element_wise_and_structural_nodes_cost_no_flops() -> None:
    gm = costed(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4))
    assert cost_of(gm, "_1").forward_flops == 0
    assert cost_of(gm, "input_1") == NodeCost()
    assert cost_of(gm, "output") == NodeCost()


def test_tied_weights_are_charged_once() -> None:
    model = Tied()
    gm = costed(model, torch.randn(2, 4))
    assert cost_of(gm, "enc").param_bytes == (16 + 4) * 4
    assert cost_of(gm, "dec").param_bytes == 4 * 4  # only its own bias
    assert sum(n.meta["cost"].param_bytes for n in gm.graph.nodes) == param_bytes(model)


def test_a_reused_module_and_its_attributes_are_charged_once() -> None:
    model = Reused()
    gm = costed(model, torch.randn(2, 4))
    assert cost_of(gm, "fc").param_bytes == param_bytes(model)
    assert cost_of(gm, "fc_1").param_bytes == 0
    assert cost_of(gm, "fc_bias").param_bytes == 0
    assert cost_of(gm, "fc_1").forward_flops == cost_of(gm, "fc").forward_flops


def test_buffers_are_counted_apart_from_parameters() -> None:
    gm = costed(nn.Sequential(nn.BatchNorm1d(3)), torch.randn(4, 3))
    cost = cost_of(gm, "_0")
    assert cost.param_bytes == 2 * 3 * 4
    assert cost.buffer_bytes == 2 * 3 * 4 + 8  # running mean, var and an int64 counter


def test_total_flops_sums_the_forward_flops() -> None:
    gm = costed(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4))
    assert total_flops(gm) == 2 * 3 * 4 * 8 + 2 * 3 * 8 * 2


def test_meta_models_cost_what_real_models_cost() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 4))

    real = build()
    with torch.device("meta"):
        meta = build()
    x = torch.randn(2, 3, 6, 6)
    real_costs = [n.meta["cost"] for n in costed(real, x).graph.nodes]
    meta_costs = [n.meta["cost"] for n in costed(meta, x).graph.nodes]
    assert real_costs == meta_costs
    assert sum(c.forward_flops for c in real_costs) > 0
    assert all(p.is_meta for p in meta.parameters())


def test_a_cnn_with_a_flatten_module_is_costed() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    gm = costed(model, torch.randn(2, 3, 6, 6))
    assert cost_of(gm, "_2").forward_flops == 0
    assert cost_of(gm, "_3").forward_flops == 2 * 2 * 64 * 2


def test_annotate_cost_leaves_weights_statistics_and_train_flags_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = costed(model, torch.randn(4, 3) + 5)
    assert model.training and model[1].training
    assert all(m.training for m in gm.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_annotate_cost_does_not_modify_attributes_updated_in_place() -> None:
    class ParamUser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.scale.mul_(2.0)
            return x * self.scale

    model = ParamUser()
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (torch.randn(2, 3),))
    with torch.no_grad():
        model.scale.fill_(1.0)  # whatever shape propagation did, cost annotation must not write
    annotate_cost(gm)
    assert torch.equal(model.scale, torch.ones(3))


def test_annotate_cost_needs_shape_propagation() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8)))
    with pytest.raises(PassError, match=r"annotate_cost needs node.meta\['val'\].*_0"):
        annotate_cost(gm)


def test_annotate_cost_returns_the_module_unmodified() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 8)))
    propagate_shapes(gm, (torch.randn(2, 4),))
    code = gm.code
    result = annotate_cost(gm)
    assert result.graph_module is gm
    assert not result.modified
    assert gm.code == code


def test_node_cost_rejects_negative_values() -> None:
    with pytest.raises(ValueError, match="NodeCost.param_bytes is -1"):
        NodeCost(param_bytes=-1)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.annotate_cost).failed == 0


def test_counts_kept_for_an_op_on_the_same_shapes_are_those_of_a_fresh_count() -> None:
    # The count of a node is kept by its op, module configuration and input shapes: a
    # second analysis gets the same counts, and another shape or configuration its own.
    import partitioner.passes.annotate_cost as annotate

    def counts(model: torch.nn.Module, x: torch.Tensor) -> list[int]:
        gm = torch.fx.symbolic_trace(model)
        propagate_shapes(gm, (x,))
        annotate_cost(gm)
        return [n.meta["cost"].forward_flops for n in gm.graph.nodes]

    annotate._COUNTED.clear()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Conv1d(2, 3, 3))
    x = torch.randn(5, 2, 4)
    first = counts(model, x)
    assert annotate._COUNTED  # kept
    assert counts(model, x) == first
    annotate._COUNTED.clear()
    assert counts(model, x) == first
    # Another batch, width or kernel: counted afresh, not read from the kept ones.
    assert counts(model, torch.randn(7, 2, 4)) == [c * 7 // 5 for c in first]
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Conv1d(2, 3, 3, padding=1))
    annotate._COUNTED.clear()
    fresh = counts(other, x)
    counts(model, x)
    assert counts(other, x) == fresh != first


class _Attention(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def test_a_module_setting_outside_its_repr_keeps_counts_apart() -> None:
    # batch_first is not in nn.MultiheadAttention's repr; it decides which dim is the
    # sequence, so a count kept for one setting must not serve the other.
    import partitioner.passes.annotate_cost as annotate

    def flops(batch_first: bool) -> int:
        gm = fx.symbolic_trace(_Attention(batch_first))
        propagate_shapes(gm, (torch.randn(2, 8, 16),))
        annotate_cost(gm)
        return total_flops(gm)

    annotate._COUNTED.clear()
    first = flops(True)
    kept = len(annotate._COUNTED)
    assert kept and flops(True) == first and len(annotate._COUNTED) == kept
    flops(False)
    assert len(annotate._COUNTED) == kept + 1  # the attention node counted afresh
