"""Llama-shaped attention in the tensor-parallel pass: rotary embeddings, grouped-query and
multi-query attention, SwiGLU, and the degrees that split no attention's heads."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from thread_ranks import on_threads
from torch import nn

from partitioner import PartitionError
from partitioner.capture import capture
from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel.decision import RuleContext
from partitioner.passes.tensor_parallel.heads import find_attention_heads, heads_problems
from partitioner.passes.tensor_parallel.layout import R, Shard
from partitioner.passes.tensor_parallel.ops import decide
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.passes.tensor_parallel.shard_graph import choose_shardings, shard_graph
from partitioner.passes.tensor_parallel.sites import find_sites
from partitioner.runtime.tensor_parallel import collectives
from partitioner.runtime.tensor_parallel.sharding import Sharding, ShardSizeError


def llama(heads: int, kv_heads: int, hidden: int = 64, layers: int = 1) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=176,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=32,
                         use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def captured(model: nn.Module) -> fx.GraphModule:
    ids = torch.randint(0, 96, (2, 8))
    cap = capture(model, (ids,))
    propagate_shapes(cap.graph_module, cap.placeholder_values((ids,), {}))
    return cap.graph_module


def kinds(heads: int, kv_heads: int, tp: int, hidden: int = 64) -> dict[str, str]:
    model = llama(heads, kv_heads, hidden)
    choice = choose_shardings(captured(model), tp, root=model)
    return {name.rpartition(".")[2]: kind for name, kind in choice.kinds.items()
            if name.startswith("model.layers.0.")}


def last_decision(fn: Any, inputs: tuple[torch.Tensor, ...], split: dict[int, Shard]) -> Any:
    gm = fx.symbolic_trace(fn)
    propagate_shapes(gm, inputs)
    ctx = RuleContext(gm, 2, {}, {})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, layout in split.items():
        ctx.layouts[placeholders[k].name] = layout
    decision = None
    for node in gm.graph.nodes:
        if node.op.startswith("call_"):
            decision = decide(node, ctx)
            ctx.layouts[node.name] = decision.out
    return decision


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def test_rotary_concatenation_keeps_the_head_split() -> None:
    x = torch.randn(2, 4, 8, 16)  # (B, heads, T, head_dim)
    decision = last_decision(rotate_half, (x,), {0: Shard(1)})
    assert decision.out == Shard(1)
    whole = last_decision(lambda a, b: torch.cat((a, b), dim=-1), (x, x.clone()), {0: Shard(1)})
    assert whole.out == Shard(1) and list(whole.needs.values()) == [Shard(1), Shard(1)]


def test_concatenating_along_the_split_dimension_gathers_first() -> None:
    x = torch.randn(2, 4, 8)
    decision = last_decision(lambda a, b: torch.cat((a, b), dim=1), (x, x.clone()),
                             {0: Shard(1), 1: Shard(1)})
    assert decision.out == R and set(decision.needs.values()) == {R}


def test_stack_moves_the_split_past_the_new_dimension() -> None:
    x = torch.randn(2, 4, 8)
    assert last_decision(lambda a, b: torch.stack((a, b), dim=0), (x, x.clone()),
                         {0: Shard(1)}).out == Shard(2)
    assert last_decision(lambda a, b: torch.stack((a, b), dim=-1), (x, x.clone()),
                         {0: Shard(1)}).out == Shard(1)


SPLIT_KV = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise",
            "o_proj": "rowwise", "gate_proj": "colwise", "up_proj": "colwise",
            "down_proj": "rowwise"}
WHOLE_KV = {**SPLIT_KV, "k_proj": "replicate", "v_proj": "replicate"}


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    pytest.param(4, 4, 2, SPLIT_KV, marks=pytest.mark.slow),   # multi-head attention
    (4, 2, 2, SPLIT_KV),   # grouped-query, tp divides the KV heads
    pytest.param(8, 4, 4, SPLIT_KV, marks=pytest.mark.slow),
    (8, 2, 4, WHOLE_KV),   # tp divides the query heads only: KV projections whole
    pytest.param(4, 1, 2, WHOLE_KV, marks=pytest.mark.slow),   # multi-query attention
])
def test_llama_layers_split_by_heads(heads: int, kv_heads: int, tp: int,
                                     expected: dict[str, str]) -> None:
    assert kinds(heads, kv_heads, tp) == expected


def test_norm_weights_stay_whole_and_each_layer_all_reduces_twice() -> None:
    model = llama(8, 2, layers=2)
    choice = choose_shardings(captured(model), 4, root=model)
    assert not any("norm" in name for name, s in choice.shardings.items() if s.is_split)
    # two per layer, one for the vocabulary-parallel embedding; the LM head is gathered
    assert choice.forward_collectives == {"all_reduce": 5, "all_gather": 1}


def test_attention_heads_are_found_with_their_kv_heads() -> None:
    model = llama(8, 2)
    gm = captured(model)
    [found] = find_attention_heads(gm, find_sites(gm, model))
    assert (found.query.name, found.heads, found.kv_heads) == (
        "model.layers.0.self_attn.q_proj", 8, 2)
    assert found.key is not None and found.key.name == "model.layers.0.self_attn.k_proj"


def test_a_degree_dividing_neither_heads_nor_kv_heads_is_refused() -> None:
    model = llama(6, 2, hidden=96)
    with pytest.raises(ShardSizeError) as info:
        choose_shardings(captured(model), 4, root=model)
    message = str(info.value)
    assert isinstance(info.value, PartitionError) and isinstance(info.value, ValueError)
    assert "model.layers.*.self_attn: 6 query heads and 2 KV heads" in message
    assert "tensor_parallel=4" in message and "(1, 2, 3, 6)" in message
    assert "{'model.layers.*.self_attn.*': 'replicate'}" in message


def test_a_rule_keeping_the_attention_whole_is_not_refused() -> None:
    model = llama(6, 2, hidden=96)
    gm = captured(model)
    sites = find_sites(gm, model)
    fixed = {s.node: "replicate" for s in sites if ".self_attn." in s.name}
    assert heads_problems(gm, sites, 4, fixed) == []
    choice = choose_shardings(gm, 4, root=model, fixed=fixed)
    assert choice.kinds["model.layers.0.mlp.down_proj"] == "rowwise"


class GroupedQueryAttention(nn.Module):
    """Separate projections, KV heads repeated to the query heads (transformers'
    ``repeat_kv``), SDPA; returns the attention's output per head, before ``o_proj``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.dim).transpose(1, 2)  # (B, a, T, d)
        k = self.k(x).view(B, T, self.kv_heads, self.dim).transpose(1, 2)  # (B, kv, T, d)
        v = self.v(x).view(B, T, self.kv_heads, self.dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k = k[:, :, None].expand(B, self.kv_heads, group, T, self.dim).reshape(
            B, self.heads, T, self.dim)
        v = v[:, :, None].expand(B, self.kv_heads, group, T, self.dim).reshape(
            B, self.heads, T, self.dim)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              scale=1 / math.sqrt(self.dim))


@pytest.mark.parametrize("heads, kv_heads, tp", [(8, 2, 4), (4, 1, 2), (8, 4, 4)])
def test_each_rank_pairs_its_query_heads_with_their_kv_heads(heads: int, kv_heads: int,
                                                             tp: int) -> None:
    """Rank r holds query heads h in [r a/tp, (r+1) a/tp) and uses KV head h // (a/kv)
    for each: its share of the per-head output is the unsplit model's."""
    model = GroupedQueryAttention(32, heads, kv_heads).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (x,))
    kv = "colwise" if kv_heads % tp == 0 else "replicate"
    shardings = {"q.weight": Sharding("colwise", 0, tp),
                 "k.weight": Sharding(kv, 0 if kv == "colwise" else None, tp),
                 "v.weight": Sharding(kv, 0 if kv == "colwise" else None, tp)}
    ranks = [shard_graph(gm, shardings, r).graph_module for r in range(tp)]
    attention = next(n.name for n in gm.graph.nodes
                     if n.target is F.scaled_dot_product_attention)
    local: list[torch.Tensor] = [torch.empty(0)] * tp

    def one(r: int, member: Any) -> torch.Tensor:
        setattr(ranks[r], COMM_ATTR, member)
        out, local[r] = _run_watching(ranks[r], attention, x)
        out.sum().backward()
        return out

    outs = on_threads(tp, one)
    expected = model(x)
    expected.sum().backward()
    share = heads // tp
    for r in range(tp):
        torch.testing.assert_close(outs[r], expected)
        torch.testing.assert_close(local[r], expected[:, r * share:(r + 1) * share].detach())
        for name in ("k.weight", "v.weight"):
            grad = ranks[r].get_parameter(name).grad
            assert grad is not None and grad.shape[0] == kv_heads * 32 // heads // (
                tp if kv == "colwise" else 1)
            if kv == "replicate":  # whole KV weights get the whole gradient on every rank
                torch.testing.assert_close(grad, model.get_parameter(name).grad)
    slices = [n for n in ranks[0].graph.nodes if n.target is collectives.scatter_to_tp]
    assert len(slices) == (2 if kv == "replicate" else 0)  # the repeated keys and values


def _run_watching(gm: fx.GraphModule, source: str,
                  *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gm``'s output and the local value of the node made from ``source``."""
    seen: dict[str, torch.Tensor] = {}

    class Watch(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.meta.get("tp_source") == source:
                seen[source] = out.detach()
            return out

    return Watch(gm).run(*inputs), seen[source]
