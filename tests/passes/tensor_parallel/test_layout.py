"""Layouts through reshapes and the op rules of tensor-parallel propagation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel.decision import Resize, RuleContext, SizeQuery
from partitioner.passes.tensor_parallel.layout import (
    R_IN,
    R,
    Shard,
    shard_through_view,
    view_groups,
)
from partitioner.passes.tensor_parallel.ops import decide
from partitioner.passes.tensor_parallel.propagate import propagate
from partitioner.runtime.tensor_parallel.sharding import Sharding


def traced(module: Any, *inputs: Any) -> fx.GraphModule:
    gm = fx.symbolic_trace(module)
    propagate_shapes(gm, inputs)
    return gm


def layouts_of(fn: Any, inputs: tuple[torch.Tensor, ...], split: dict[int, Shard],
               tp: int = 2) -> tuple[dict[str, Any], RuleContext]:
    """Decide every node of ``fn`` given the layouts of its inputs (by position)."""
    gm = traced(fn, *inputs)
    ctx = RuleContext(gm, tp, {}, {})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, layout in split.items():
        ctx.layouts[placeholders[k].name] = layout
    decisions = {}
    for node in gm.graph.nodes:
        if node.op.startswith("call_"):
            decision = decide(node, ctx)
            ctx.layouts[node.name] = decision.out
            decisions[node.name] = decision
    return decisions, ctx


def last(decisions: dict[str, Any]) -> Any:
    return list(decisions.values())[-1]


def test_view_groups_pair_runs_of_dimensions() -> None:
    assert view_groups((2, 16, 32), (32, 32)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((2, 1, 6), (2, 6)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((2, 3), (7,)) is None


@pytest.mark.parametrize("a, b, dim, expected", [
    ((2, 16, 32), (2, 16, 4, 8), 2, 2),   # split heads out of the hidden dimension
    ((2, 16, 4, 8), (2, 16, 32), 2, 2),   # and merge them back
    ((2, 16, 32), (32, 32), 2, 1),        # flatten batch and sequence
    ((2, 16, 4, 8), (2, 16, 32), 3, None),  # the inner of two merged dims: not one slice
    ((2, 16, 32), (2, 16, 1, 32), 2, 3),
])
def test_shard_through_view(a: tuple[int, ...], b: tuple[int, ...], dim: int,
                            expected: int | None) -> None:
    assert shard_through_view(a, b, dim) == expected


def test_a_saturating_fill_keeps_the_split_as_masked_fill_does() -> None:
    """Regression: unbake_dtypes's masked_fill_saturated (an export graph's masked_fill with
    finfo(float32).min) had no rule and gathered the split tensor."""
    from partitioner.runtime.precision import masked_fill_saturated

    graph = fx.Graph()
    x, mask = graph.placeholder("x"), graph.placeholder("mask")
    graph.output(graph.call_function(masked_fill_saturated,
                                     (x, mask, torch.finfo(torch.float32).min)))
    gm = fx.GraphModule(nn.Module(), graph)
    propagate_shapes(gm, (torch.randn(2, 3, 8), torch.rand(2, 3, 8) > 0.5))
    ctx = RuleContext(gm, 2, {}, {})
    ctx.layouts.update({"x": Shard(2), "mask": Shard(2)})
    fill = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert decide(fill, ctx).out == Shard(2)


def test_pointwise_keeps_the_split_and_broadcasts_whole_operands() -> None:
    decisions, _ = layouts_of(lambda x, m: F.gelu(x) * 2 + m, (torch.randn(2, 3, 8),
                                                                torch.randn(3, 1)),
                              {0: Shard(2)})
    decision = last(decisions)
    assert decision.out == Shard(2)
    assert list(decision.needs.values())[-1] == R_IN  # size 1 along the split: broadcast


def test_pointwise_slices_a_whole_operand_of_full_size() -> None:
    decisions, _ = layouts_of(lambda x, b: x + b, (torch.randn(2, 8), torch.randn(8)),
                              {0: Shard(1)})
    assert last(decisions).needs == {"x": Shard(1), "b": Shard(0)}


def test_in_place_on_a_whole_tensor_gathers_the_split_operand() -> None:
    decisions, _ = layouts_of(lambda w, x: w.add_(x), (torch.randn(2, 8), torch.randn(2, 8)),
                              {1: Shard(1)})
    assert last(decisions).out == R


def test_view_resizes_the_literal_head_count() -> None:
    decisions, _ = layouts_of(lambda x: x.view(2, 16, 4, 8), (torch.randn(2, 16, 32),),
                              {0: Shard(2)})
    decision = last(decisions)
    assert decision.out == Shard(2)
    assert decision.action == Resize(((("args", 3), None),))


def test_view_with_minus_one_needs_no_resize() -> None:
    decisions, _ = layouts_of(lambda x: x.reshape(2, 16, -1, 8), (torch.randn(2, 16, 32),),
                              {0: Shard(2)})
    assert last(decisions).action == Resize(())


def test_heads_that_do_not_divide_are_a_problem() -> None:
    _, ctx = layouts_of(lambda x: x.view(2, 16, 2, 16), (torch.randn(2, 16, 32),),
                        {0: Shard(2)}, tp=4)
    assert ctx.problems and "2 heads over 4 ranks" in ctx.problems[0]


def test_transpose_and_permute_follow_the_dimension() -> None:
    decisions, _ = layouts_of(lambda x: x.transpose(1, 2).permute(0, 2, 1, 3),
                              (torch.randn(2, 4, 16, 8),), {0: Shard(1)})
    assert [d.out for d in decisions.values()] == [Shard(2), Shard(1)]


def test_split_into_fused_blocks_splits_each_piece() -> None:
    decisions, _ = layouts_of(lambda x: x.split(8, dim=1)[2], (torch.randn(2, 24),),
                              {0: Shard(1, (8, 8, 8))})
    split = next(iter(decisions.values()))
    assert split.out == (Shard(1), Shard(1), Shard(1))
    assert split.action == Resize(((("args", 1), None),))
    assert last(decisions).out == Shard(1)


def test_split_of_a_plain_split_asks_for_blocks() -> None:
    gm = traced(lambda x: x.split(8, dim=1), torch.randn(2, 24))
    ctx = RuleContext(gm, 2, {}, {})
    # Without a producing site the request cannot be placed; the split falls back to whole.
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    ctx.layouts[x.name] = Shard(1)
    node = next(n for n in gm.graph.nodes if n.op == "call_method")
    assert decide(node, ctx).out == (R, R, R)


@pytest.mark.parametrize("fn, split, out", [
    (lambda x: F.softmax(x, dim=-1), Shard(1), Shard(1)),
    (lambda x: F.softmax(x, dim=1), Shard(1), R),
    (lambda x: x.sum(dim=0), Shard(1), Shard(0)),
    (lambda x: x.mean(dim=2, keepdim=True), Shard(1), Shard(1)),
    (lambda x: x.sum(), Shard(1), R),
])
def test_reductions_keep_the_split_unless_they_reduce_it(fn: Any, split: Shard,
                                                        out: Any) -> None:
    decisions, _ = layouts_of(fn, (torch.randn(2, 4, 8),), {0: split})
    assert last(decisions).out == out


def test_layer_norm_over_the_split_dimension_gathers() -> None:
    decisions, _ = layouts_of(lambda x: F.layer_norm(x, (8,)), (torch.randn(2, 4, 8),),
                              {0: Shard(2)})
    assert last(decisions).out == R
    decisions, _ = layouts_of(lambda x: F.layer_norm(x, (8,)), (torch.randn(2, 4, 8),),
                              {0: Shard(1)})
    assert last(decisions).out == Shard(1)


def test_attention_scores_split_by_heads() -> None:
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    decisions, _ = layouts_of(lambda q, k: q @ k.transpose(-2, -1), (q, k),
                              {0: Shard(1), 1: Shard(1)})
    assert last(decisions).out == Shard(1)
    decisions, _ = layouts_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                              (q, k, k.clone()), {0: Shard(1), 1: Shard(1), 2: Shard(1)})
    assert last(decisions).out == Shard(1)


def test_size_queries_answer_with_whole_sizes() -> None:
    decisions, _ = layouts_of(lambda x: x.size(-1), (torch.randn(2, 8),), {0: Shard(1)})
    assert last(decisions).action == SizeQuery("size", 1)
    decisions, _ = layouts_of(lambda x: x.shape, (torch.randn(2, 8),), {0: Shard(1)})
    assert last(decisions).action == SizeQuery("shape", 1)


def test_unknown_operations_gather_their_split_inputs() -> None:
    decisions, _ = layouts_of(lambda x: torch.cumprod(x, 0), (torch.randn(2, 8),),
                              {0: Shard(1)})
    assert last(decisions).out == R and set(last(decisions).needs.values()) == {R}


def test_propagate_records_conversions_and_gathers_outputs() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    gm = traced(model, torch.randn(3, 4))
    result = propagate(gm, {"0.weight": Sharding("colwise", 0, 2),
                            "0.bias": Sharding("colwise", 0, 2)}, tp=2)
    assert [str(c) for c in result.conversions] == ["_0: input_1 R -> R->",
                                                    "output: _1 S(1) -> R"]
    assert result.conversions[-1].gathers and not result.conversions[0].gathers


def test_propagate_from_a_node_stops_when_no_split_value_is_live() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh(),
                          nn.Linear(4, 4))
    gm = traced(model, torch.randn(3, 4))
    shardings = {"0.weight": Sharding("colwise", 0, 2), "2.weight": Sharding("rowwise", 1, 2)}
    result = propagate(gm, shardings, tp=2, start="_0")
    assert set(result.decisions) == {"_0", "_1", "_2"}
