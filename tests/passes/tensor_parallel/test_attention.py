"""nn.MultiheadAttention sites: found, split by heads, rewritten; heads that don't divide."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from thread_ranks import on_threads
from torch import nn

from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel.attention import heads_problem
from partitioner.passes.tensor_parallel.layout import R, Shard
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.passes.tensor_parallel.shard_graph import choose_shardings, shard_graph
from partitioner.passes.tensor_parallel.sites import find_sites
from partitioner.runtime.tensor_parallel.attention import head_parallel_attention
from partitioner.runtime.tensor_parallel.sharding import (
    Sharding,
    ShardSizeError,
    TensorParallelError,
    shard_tensor,
)


class Block(nn.Module):
    """Self-attention then a Linear; ``weights`` says which attention weights it returns."""

    def __init__(self, embed: int = 16, heads: int = 4, weights: str = "none",
                 **options: Any) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(embed, heads, batch_first=True, **options)
        self.head = nn.Linear(embed, embed)
        self.weights = weights

    def forward(self, x: torch.Tensor) -> Any:
        if self.weights == "none":
            return self.head(self.attn(x, x, x, need_weights=False)[0])
        out, weights = self.attn(x, x, x, average_attn_weights=self.weights == "mean")
        return self.head(out), weights


def traced(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (x,))
    return gm


def test_an_attention_call_is_one_site_split_by_heads() -> None:
    x = torch.randn(2, 5, 16)
    gm = traced(Block(), x)
    site = find_sites(gm)[0]
    assert (site.op, site.name, site.heads, site.layout) == ("attention", "attn", 4, "heads")
    assert site.parts == (("attn.in_proj_weight", "colwise", 0, (16, 16, 16)),
                          ("attn.in_proj_bias", "colwise", 0, (16, 16, 16)),
                          ("attn.out_proj.weight", "rowwise", 1, None))
    choice = choose_shardings(gm, 2)
    assert choice.kinds == {"attn": "heads", "head": "colwise"}
    assert choice.shardings["attn.in_proj_weight"] == Sharding("colwise", 0, 2, (16, 16, 16))
    assert choice.shardings["attn.out_proj.weight"] == Sharding("rowwise", 1, 2)
    assert "attn.out_proj.bias" not in choice.shardings  # whole: added once after the sum
    assert choice.forward_collectives == {"all_reduce": 1, "all_gather": 1}


@pytest.mark.parametrize("options, parts", [
    ({"kdim": 12, "vdim": 8}, ["attn.q_proj_weight", "attn.k_proj_weight",
                               "attn.v_proj_weight", "attn.in_proj_bias",
                               "attn.out_proj.weight"]),
    ({"add_bias_kv": True, "bias": False}, ["attn.in_proj_weight", "attn.bias_k",
                                            "attn.bias_v", "attn.out_proj.weight"])])
def test_separate_projections_and_key_value_biases_split_too(options: dict[str, Any],
                                                             parts: list[str]) -> None:
    model = Block(**options)
    x = torch.randn(2, 5, 16)
    if "kdim" in options:  # key and value of their own sizes
        class Cross(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.attn = model.attn

            def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
                return self.attn(q, k, v)[0]
        gm = fx.symbolic_trace(Cross())
        propagate_shapes(gm, (x, torch.randn(2, 3, 12), torch.randn(2, 3, 8)))
    else:
        gm = traced(model, x)
    site = find_sites(gm)[0]
    assert [p[0] for p in site.parts] == parts
    dims = {p[0]: p[2] for p in site.parts}
    assert dims.get("attn.bias_k", 2) == 2 and dims["attn.out_proj.weight"] == 1


def run_ranks(gm: fx.GraphModule, shardings: dict[str, Sharding], tp: int,
              x: torch.Tensor) -> tuple[list[Any], list[fx.GraphModule]]:
    ranks = [shard_graph(gm, shardings, r).graph_module for r in range(tp)]

    def one(r: int, member: Any) -> Any:
        setattr(ranks[r], COMM_ATTR, member)
        out = ranks[r](x)
        first = out[0] if isinstance(out, tuple) else out
        first.pow(2).sum().backward()
        return out
    return on_threads(tp, one), ranks


@pytest.mark.parametrize("weights", ["none", "mean", "per_head"])
def test_rank_graphs_equal_the_whole_graph(weights: str) -> None:
    torch.manual_seed(0)
    model = Block(weights=weights)
    x = torch.randn(2, 5, 16)
    gm = traced(model, x)
    choice = choose_shardings(gm, 2)
    outs, ranks = run_ranks(gm, choice.shardings, 2, x)
    expected = model(x)
    (expected[0] if isinstance(expected, tuple) else expected).pow(2).sum().backward()
    for out in outs:
        torch.testing.assert_close(out, expected)
    blocks = choice.shardings["attn.in_proj_weight"]
    for r, rank in enumerate(ranks):
        held = rank.get_submodule("attn")
        torch.testing.assert_close(held.in_proj_weight, shard_tensor(model.attn.in_proj_weight,
                                                                     blocks, r))
        torch.testing.assert_close(held.in_proj_weight.grad,
                                   shard_tensor(model.attn.in_proj_weight.grad, blocks, r))
        call = next(n for n in rank.graph.nodes if n.target is head_parallel_attention)
        assert call.kwargs["need_weights"] is (weights != "none")
    layouts = choice.propagation.layouts
    attn = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "attn")
    assert layouts[attn] == (R, Shard(1) if weights == "per_head" else R)
    reduces = {"none": 1, "mean": 2, "per_head": 1}[weights]
    assert choice.forward_collectives["all_reduce"] == reduces


def test_heads_that_do_not_divide_name_the_module_heads_degree_and_fix() -> None:
    gm = traced(Block(embed=12, heads=3), torch.randn(2, 5, 12))
    site = find_sites(gm)[0]
    assert heads_problem(site, 3) is None
    with pytest.raises(ShardSizeError) as info:
        choose_shardings(gm, 2)
    message = str(info.value)
    for part in ("attn (nn.MultiheadAttention, 3 heads)", "tensor_parallel=2",
                 "dividing 3 (1, 3)", "tensor_parallel={'attn': 'replicate'}"):
        assert part in message
    choice = choose_shardings(gm, 2, fixed={site.node: "replicate"})
    assert not choice.shardings["attn.in_proj_weight"].is_split


def test_shardings_that_split_part_of_an_attention_are_refused() -> None:
    x = torch.randn(2, 5, 16)
    gm = traced(Block(), x)
    with pytest.raises(TensorParallelError, match=r"(?s)attn: an nn.MultiheadAttention "
                                                  r"splits only by heads.*'replicate'"):
        shard_graph(gm, {"attn.out_proj.weight": Sharding("rowwise", 1, 2)}, rank=0)


def test_an_inlined_attention_keeps_its_projections_whole() -> None:
    """Without fold_attention, export inlines the attention: its in-projection is no site."""
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    gm = torch.export.export(layer, (torch.randn(2, 5, 16),), strict=False).module()
    names = {s.name for s in find_sites(gm, layer)}
    assert "self_attn" not in names
    assert {"linear1", "linear2"} <= names
