"""Rank graphs: run them on threads and compare with the whole graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from thread_ranks import on_threads
from torch import nn

from partitioner.passes.base import PassError
from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel import ops as tp_ops
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.passes.tensor_parallel.shard_graph import choose_shardings, shard_graph
from partitioner.runtime.tensor_parallel import collectives
from partitioner.runtime.tensor_parallel.collectives import CollectiveAborted
from partitioner.runtime.tensor_parallel.sharding import Sharding, TensorParallelError


def traced(model: nn.Module, *inputs: Any) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, inputs)
    return gm


def run_ranks(gm: fx.GraphModule, shardings: dict[str, Sharding], tp: int,
              *inputs: torch.Tensor) -> tuple[list[torch.Tensor], list[fx.GraphModule]]:
    """Every rank's output (after a backward of its sum), each rank on its own thread."""
    ranks = [shard_graph(gm, shardings, r).graph_module for r in range(tp)]

    def one(r: int, member: Any) -> torch.Tensor:
        setattr(ranks[r], COMM_ATTR, member)
        out = ranks[r](*inputs)
        out.sum().backward()
        return out  # type: ignore[no-any-return]

    outs = on_threads(tp, one)
    return outs, ranks


class Conv1DMLP(nn.Module):
    """transformers' Conv1D layers (weight (in, out)) called as modules."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D
        self.fc = Conv1D(32, 8)   # nf=32 outputs, nx=8 inputs
        self.proj = Conv1D(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


class SizeUser(nn.Module):
    """Uses the size of a split tensor: the rank must see the whole size."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h / h.size(-1) + h.shape[-1]
        return self.down(h)


class PaddedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, padding_idx=5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) * 2


@pytest.mark.parametrize("model, x", [
    (Conv1DMLP(), torch.randn(2, 3, 8)),
    (SizeUser(), torch.randn(3, 4)),
    (PaddedEmbedding(), torch.tensor([[0, 5, 7], [3, 4, 1]])),
], ids=["conv1d", "size_query", "padded_vocab"])
def test_rank_graphs_compute_the_whole_graph(model: nn.Module, x: torch.Tensor) -> None:
    tp = 2
    gm = traced(model, x)
    choice = choose_shardings(gm, tp, root=model)
    assert any(s.is_split for s in choice.shardings.values())
    outs, ranks = run_ranks(gm, choice.shardings, tp, x)
    expected = model(x)
    expected.sum().backward()
    for out in outs:
        torch.testing.assert_close(out, expected)
    for name, param in model.named_parameters():
        sharding = choice.shardings.get(name)
        parts = [rank.get_parameter(name).grad for rank in ranks]
        if sharding is not None and sharding.is_split:
            from partitioner.runtime.tensor_parallel.sharding import unshard
            torch.testing.assert_close(unshard(parts, sharding), param.grad)
        else:
            torch.testing.assert_close(parts[0], param.grad)


def test_padding_row_gets_no_gradient() -> None:
    model = PaddedEmbedding()
    x = torch.tensor([[5, 5, 6]])
    gm = traced(model, x)
    choice = choose_shardings(gm, 2, root=model)
    assert choice.shardings["emb.weight"].kind == "vocab"
    _, ranks = run_ranks(gm, choice.shardings, 2, x)
    grad = ranks[1].get_parameter("emb.weight").grad  # rows 4..7: padding row 5 is local 1
    assert torch.equal(grad[1], torch.zeros(4)) and grad[2].abs().sum() > 0


def test_row_parallel_linear_adds_its_bias_once_after_the_all_reduce() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    gm = traced(model, torch.randn(2, 4))
    choice = choose_shardings(gm, 2)
    rank = shard_graph(gm, choice.shardings, 1).graph_module
    calls = [n.target for n in rank.graph.nodes if n.op == "call_function"]
    reduce_at = calls.index(collectives.reduce_from_tp)
    assert calls[:reduce_at].count(collectives.copy_to_tp) == 1
    assert "add" in getattr(calls[reduce_at + 1], "__name__", "")
    assert tuple(rank.get_submodule("2").weight.shape) == (4, 4)


def test_a_rank_graph_without_a_group_says_so() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    gm = traced(model, torch.randn(2, 4))
    rank = shard_graph(gm, choose_shardings(gm, 2).shardings, 0).graph_module
    with pytest.raises(CollectiveAborted, match="bound to no group"):
        rank(torch.randn(2, 4))


def test_weight_and_bias_split_differently_are_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    gm = traced(model, torch.randn(2, 4))
    shardings = {"0.weight": Sharding("colwise", 0, 2, blocks=(4, 4)),
                 "0.bias": Sharding("colwise", 0, 2), "2.weight": Sharding("rowwise", 1, 2)}
    with pytest.raises(TensorParallelError, match="bias 0.bias is split as"):
        shard_graph(gm, shardings, 0)


class Transposer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x).transpose(0, 1)


def test_shape_postcondition_catches_a_wrong_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Transposer()
    gm = traced(model, torch.randn(2, 4))
    shardings = choose_shardings(gm, 2).shardings
    shard_graph(gm, shardings, 0)  # the real rule: fine
    monkeypatch.setattr(tp_ops, "permute", lambda node, ctx: tp_ops.Decision(
        {node.args[0].name: ctx.layout(node.args[0])}, ctx.layout(node.args[0])))
    with pytest.raises(PassError, match="wrong shape"):
        shard_graph(gm, shardings, 0)
