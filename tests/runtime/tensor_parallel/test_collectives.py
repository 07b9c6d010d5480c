"""Shardings, the in-process thread group, and the autograd-aware collectives."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from thread_ranks import on_threads

from partitioner.runtime.tensor_parallel.collectives import (
    CollectiveAborted,
    ThreadGroup,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from partitioner.runtime.tensor_parallel.sharding import (
    Sharding,
    ShardSizeError,
    TensorParallelError,
    shard_tensor,
    unshard,
)


@pytest.mark.parametrize("sharding", [Sharding("colwise", 0, 2), Sharding("rowwise", 1, 3),
                                      Sharding("colwise", 0, 2, blocks=(4, 2, 2)),
                                      Sharding("replicate", None, 4)])
def test_shard_then_unshard_is_the_identity(sharding: Sharding) -> None:
    w = torch.randn(8, 6)
    parts = [shard_tensor(w, sharding, r) for r in range(sharding.tp)]
    assert all(p.shape == sharding.local_shape(w.shape) for p in parts)
    torch.testing.assert_close(unshard(parts, sharding), w)


def test_fused_blocks_give_each_rank_a_slice_of_every_part() -> None:
    s = Sharding("colwise", 0, 2, blocks=(4, 4, 4))  # q, k, v of 4 rows each
    rows = torch.arange(12.0)
    assert shard_tensor(rows, s, 1).tolist() == [2, 3, 6, 7, 10, 11]


def test_sharding_errors() -> None:
    with pytest.raises(TensorParallelError, match="replicate has no dim"):
        Sharding("colwise", None, 2)
    with pytest.raises(TensorParallelError, match="kind='diagonal'"):
        Sharding("diagonal", 0, 2)
    with pytest.raises(ShardSizeError, match="dim 0 of size 6 does not divide by tp=4"):
        shard_tensor(torch.zeros(6, 2), Sharding("colwise", 0, 4), 0)
    assert Sharding("vocab", 0, 2).to_dict() == {"kind": "vocab", "dim": 0, "tp": 2}


def test_all_reduce_gives_every_rank_the_same_sum() -> None:
    sums = on_threads(3, lambda r, comm: comm.all_reduce(torch.full((2,), float(r + 1)),
                                                         "forward"))
    assert all(torch.equal(s, torch.full((2,), 6.0)) for s in sums)


def test_all_gather_is_in_rank_order_and_counted() -> None:
    def gather(r: int, comm: Any) -> tuple[list[float], Any]:
        parts = comm.all_gather(torch.tensor([float(r)]), "forward")
        return [p.item() for p in parts], dict(comm.counts)
    results = on_threads(2, gather)
    assert results[0] == ([0.0, 1.0], {("all_gather", "forward"): 1})


def test_megatron_mappings_have_exact_gradients() -> None:
    """f = copy (backward all-reduce), g = reduce (backward identity), gather, scatter."""
    x_full = torch.randn(4, 6)

    def step(r: int, comm: Any) -> dict[str, torch.Tensor]:
        x = x_full.clone().requires_grad_(True)
        # copy then a rank-dependent use: the input's gradient is the sum over ranks
        copy_to_tp(x, comm).mul(r + 1).sum().backward()
        grads = {"copy": x.grad}
        y = torch.ones(2, requires_grad=True)
        reduce_from_tp(y * (r + 1), comm).sum().backward()
        grads["reduce"] = y.grad
        local = scatter_to_tp(x_full.clone().requires_grad_(True), comm, 1, (4, 2))
        whole = gather_from_tp(local, comm, 1, (4, 2))
        grads["roundtrip"] = whole.detach()
        part = x_full[:, 3 * r:3 * r + 3].clone().requires_grad_(True)
        (gather_from_tp(part, comm, 1) * torch.arange(6.0)).sum().backward()
        grads["gather"] = part.grad
        return grads

    results = on_threads(2, step)
    for r, grads in enumerate(results):
        torch.testing.assert_close(grads["copy"], torch.full((4, 6), 3.0))  # 1 + 2
        torch.testing.assert_close(grads["reduce"], torch.full((2,), float(r + 1)))
        torch.testing.assert_close(grads["roundtrip"], x_full)
        torch.testing.assert_close(grads["gather"],
                                   torch.arange(6.0)[3 * r:3 * r + 3].expand(4, 3))


def test_a_failing_rank_releases_its_peers() -> None:
    """Rank 0 fails before the collective; rank 1, already waiting, is released with an
    error instead of hanging (the group's timeout is only a safety net here)."""
    started = threading.Event()

    def step(r: int, comm: Any) -> Any:
        if r == 0:
            started.wait(30)
            raise ValueError("rank 0 broke")
        started.set()
        return comm.all_reduce(torch.ones(1), "forward")

    with pytest.raises(ValueError, match="rank 0 broke"):
        on_threads(2, step, timeout=120)


def test_a_released_rank_says_where_it_waited() -> None:
    group = ThreadGroup([torch.device("cpu")] * 2, timeout=120)
    group.abort()
    with pytest.raises(CollectiveAborted, match="rank 1 of 2 was waiting in all_reduce"):
        group.members[1].all_reduce(torch.ones(1), "forward")
    group.reset()
    assert on_threads(1, lambda r, comm: comm.all_reduce(torch.ones(1), "x")).pop() == 1
