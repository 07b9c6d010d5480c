"""One tensor-parallel stage on threads: autograd, errors naming the rank, shard store."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel.shard_graph import choose_shardings, shard_graph
from partitioner.runtime.tensor_parallel.module import ShardStore
from partitioner.runtime.tensor_parallel.sharding import Sharding, TensorParallelError
from partitioner.runtime.tensor_parallel.stage import (
    TensorParallelExecutionError,
    TensorParallelStage,
)


def mlp_stage(tp: int) -> tuple[nn.Module, TensorParallelStage]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (torch.randn(3, 4),))
    shardings = choose_shardings(gm, tp).shardings
    ranks = [shard_graph(gm, shardings, r).graph_module for r in range(tp)]
    return model, TensorParallelStage(ranks, [torch.device("cpu")] * tp, timeout=120)


def test_stage_is_one_autograd_node_over_all_ranks() -> None:
    model, stage = mlp_stage(2)
    x = torch.randn(3, 4, requires_grad=True)
    reference = x.detach().clone().requires_grad_(True)
    out = stage(x)
    torch.testing.assert_close(out, model(reference))
    out.pow(2).sum().backward()
    model(reference).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)
    for rank in stage.ranks:  # every rank's slice got its gradient
        assert all(p.grad is not None for p in rank.parameters())
    stage.close()


def test_stage_without_grad_runs_forward_only() -> None:
    model, stage = mlp_stage(2)
    x = torch.randn(3, 4)
    with torch.no_grad():
        out = stage(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x))
    stage.close()


def test_an_error_names_the_rank_and_releases_its_peers() -> None:
    """Rank 1 fails inside its row-parallel product; rank 0, waiting for it in the
    all-reduce, is released instead of hanging, and the stage works again afterwards."""
    _, stage = mlp_stage(2)
    broken = stage.ranks[1].get_submodule("2")
    good = broken.weight
    broken.weight = nn.Parameter(torch.randn(4, 3))
    with pytest.raises(TensorParallelExecutionError,
                       match=r"tensor-parallel rank 1 on cpu, node linear.*RuntimeError"):
        stage(torch.randn(3, 4))
    broken.weight = good
    torch.testing.assert_close(stage(torch.randn(2, 4)).shape, torch.Size([2, 4]))
    stage.close()


def test_shard_store_makes_each_tensor_once_per_rank() -> None:
    store = ShardStore({"w": Sharding("colwise", 0, 2)})
    w = nn.Parameter(torch.arange(8.0).view(4, 2))
    cpu = torch.device("cpu")
    first = store.tensor("w", w, 0, cpu)
    assert store.tensor("w", w, 0, cpu) is first
    assert isinstance(first, nn.Parameter) and first.shape == (2, 2)
    assert torch.equal(store.tensor("w", w, 1, cpu), w.detach()[2:])
    with pytest.raises(TensorParallelError, match="tied weights across devices"):
        store.tensor("w", w, 0, torch.device("meta"))


def test_ranks_sharing_one_gpu_are_refused_before_they_deadlock() -> None:
    """Seen on an H200: tp=2 on ``cuda:0`` twice hung in the first backward (autograd runs a
    GPU's backward on one thread, where rank 0's all-reduce waited for rank 1 forever)."""
    gm = fx.symbolic_trace(nn.Linear(4, 4))
    with pytest.raises(TensorParallelError, match=r"ranks share cuda:0.*its own GPU"):
        TensorParallelStage([gm, gm], [torch.device("cuda:0")] * 2)
