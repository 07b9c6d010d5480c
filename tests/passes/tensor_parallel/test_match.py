"""Finding sites and choosing what to split: Megatron pairs, fused blocks, vocab, lone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from tp_models import Block, LlamaBlock, TinyGPT, batch_for, gpt2, mlp_pair

from partitioner.capture import capture
from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel.match import choose, site_shardings
from partitioner.passes.tensor_parallel.shard_graph import choose_shardings
from partitioner.passes.tensor_parallel.sites import find_sites
from partitioner.runtime.tensor_parallel.sharding import TensorParallelError


def captured(model: nn.Module, x: Any) -> fx.GraphModule:
    cap = capture(model, (x,))
    propagate_shapes(cap.graph_module, cap.placeholder_values((x,), {}))
    return cap.graph_module


def kinds(model: nn.Module, tp: int = 2, fixed: dict[str, str] | None = None) -> dict[str, str]:
    gm = captured(model, batch_for(model))
    sites = find_sites(gm, model)
    by_name = {s.name: s.node for s in sites}
    choice = choose(gm, sites, tp, {by_name[k]: v for k, v in (fixed or {}).items()})
    names = {s.node: s.name for s in sites}
    return {names[node]: kind for node, kind in choice.kinds.items()}


class Spellings(nn.Module):
    """Linear layers written four ways, and an embedding written functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.table)
        x = F.linear(x, self.w, self.b)
        x = x @ self.w
        x = torch.addmm(self.b, x.view(-1, 4), self.w).view(x.shape)
        return self.lin(x) + self.w.sum()  # a product of parameters is no layer call


def test_find_sites_in_every_spelling() -> None:
    model = Spellings()
    gm = captured(model, torch.randint(0, 10, (2, 3)))
    sites = [(s.op, s.name, s.layout, s.bias) for s in find_sites(gm, model)]
    assert sites == [("embedding", "table", "table", None), ("linear", "w", "out_in", "b"),
                     ("linear", "w", "in_out", None), ("linear", "w", "in_out", "b"),
                     ("linear", "lin", "out_in", "lin.bias")]


def test_find_sites_names_a_tied_embedding_by_the_module_that_runs_it() -> None:
    model = gpt2()
    gm = captured(model, batch_for(model))
    names = [(s.name, s.weight) for s in find_sites(gm, model) if s.weight == "lm_head.weight"]
    assert names == [("transformer.wte", "lm_head.weight"), ("lm_head", "lm_head.weight")]


def test_mlp_pair_is_one_megatron_pair() -> None:
    assert kinds(mlp_pair()) == {"0": "colwise", "2": "rowwise"}


def test_a_chain_pairs_from_the_front_and_leaves_the_last_linear_column_wise() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    assert kinds(model) == {"0": "colwise", "2": "rowwise", "4": "colwise"}


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def test_a_lone_linear_feeding_a_residual_stream_stays_whole() -> None:
    """Split column-wise, the stem's output would meet each block's whole output at the
    residual add and keep the stream split (a gather before every norm, no stage boundary
    possible between blocks): the stem stays whole; the head, only gathered, splits."""
    model = nn.Sequential(nn.Linear(8, 16), _Residual(16), _Residual(16), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    gm = captured(model, x)
    sites = find_sites(gm, model)
    names = {s.node: s.name for s in sites}
    got = {names[n]: k for n, k in choose(gm, sites, 2).kinds.items()}
    assert got == {"0": "replicate", "1.fc1": "colwise", "1.fc2": "rowwise",
                   "2.fc1": "colwise", "2.fc2": "rowwise", "3": "colwise"}


def test_fused_qkv_gets_blocks_and_the_projection_is_row_wise() -> None:
    model = Block()
    gm = captured(model, batch_for(model))
    choice = choose_shardings(gm, 2, root=model)
    assert choice.kinds == {"attn.c_attn": "colwise", "attn.c_proj": "rowwise",
                            "mlp.0": "colwise", "mlp.2": "rowwise"}
    assert choice.shardings["attn.c_attn.weight"].blocks == (32, 32, 32)
    assert choice.shardings["attn.c_attn.bias"].blocks == (32, 32, 32)
    assert choice.forward_collectives == {"all_reduce": 2}


def test_separate_qkv_and_swiglu_join_their_regions() -> None:
    found = kinds(LlamaBlock())
    assert found == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise",
                     "w1": "colwise", "w3": "colwise", "w2": "rowwise"}


def test_gpt2_conv1d_pairs_and_tied_vocabulary() -> None:
    found = kinds(gpt2())
    assert found["transformer.h.0.attn.c_attn"] == "colwise"
    assert found["transformer.h.1.mlp.c_proj"] == "rowwise"
    assert (found["transformer.wte"], found["lm_head"]) == ("vocab", "colwise")
    assert found["transformer.wpe"] == "replicate"


def test_largest_embedding_splits_by_vocabulary_and_the_head_is_gathered() -> None:
    model = TinyGPT()
    gm = captured(model, batch_for(model))
    choice = choose_shardings(gm, 2, root=model)
    assert (choice.kinds["wte"], choice.kinds["wpe"], choice.kinds["lm_head"]) == \
        ("vocab", "replicate", "colwise")
    # per block two all-reduces, one for the vocabulary lookup; one gather of the logits
    assert choice.forward_collectives == {"all_reduce": 5, "all_gather": 1}


def test_fixed_kinds_are_kept_and_the_search_works_around_them() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                          nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    assert kinds(model, fixed={"0": "replicate"}) == {
        "0": "replicate", "2": "colwise", "4": "rowwise", "6": "colwise"}


def test_a_region_that_does_not_close_leaves_its_linear_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    assert kinds(model) == {"0": "colwise", "2": "colwise"}


def test_site_kinds_are_checked() -> None:
    model = mlp_pair()
    gm = captured(model, batch_for(model))
    linear = find_sites(gm, model)[0]
    with pytest.raises(TensorParallelError, match="a Linear cannot be split 'vocab'"):
        site_shardings(linear, "vocab", 2)


def test_a_shared_weight_split_two_ways_is_refused() -> None:
    model = gpt2()
    gm = captured(model, batch_for(model))
    sites = find_sites(gm, model)
    node = {s.name: s.node for s in sites}
    fixed = {node["transformer.wte"]: "colwise", node["lm_head"]: "colwise"}
    with pytest.raises(TensorParallelError, match="share lm_head.weight"):
        choose_shardings(gm, 2, root=model, fixed=fixed, sites=sites)
