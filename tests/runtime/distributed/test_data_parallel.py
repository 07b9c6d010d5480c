"""Data-parallel gradient averaging: buckets, order, overlap with backward, unused params."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_harness import launch, results
from torch import nn

from partitioner.runtime.distributed.data_parallel import plan_buckets

WORKER = Path(__file__).with_name("dist_worker.py")


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_buckets_take_parameters_last_first() -> None:
    params = _params(10, 20, 30)
    buckets = plan_buckets(params, bucket_bytes=10**6)
    assert len(buckets) == 1
    assert buckets[0].params == [params[2], params[1], params[0]]
    # One flag per parameter travels with the gradients.
    assert buckets[0].buffer.numel() == 60 + 3


def test_buckets_close_at_the_size_cap_and_big_parameters_go_alone() -> None:
    params = _params(100, 100, 1000, 100)       # float32: 400, 400, 4000, 400 bytes
    buckets = plan_buckets(params, bucket_bytes=800, last_bucket_bytes=800)
    assert [[p.numel() for p in b.params] for b in buckets] == [[100], [1000], [100, 100]]
    assert [b.index for b in buckets] == [0, 1, 2]


@pytest.mark.slow
def test_the_bucket_launched_last_holds_the_first_parameters_and_stays_small() -> None:
    params = _params(*[1000] * 10)              # 4000 bytes each
    buckets = plan_buckets(params, bucket_bytes=12000, last_bucket_bytes=4000)
    order = [[next(k for k, q in enumerate(params) if q is p) for p in b.params]
             for b in buckets]
    assert order == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [0]]


def test_buckets_never_mix_dtypes() -> None:
    params = _params(4, 4) + _params(4, dtype=torch.float64)
    buckets = plan_buckets(params, bucket_bytes=10**6)
    assert sorted(str(b.buffer.dtype) for b in buckets) == ["torch.float32", "torch.float64"]
    for bucket in buckets:
        assert {p.dtype for p in bucket.params} == {bucket.buffer.dtype}


@pytest.fixture(scope="module")
def reduced() -> list[dict]:
    return [r[0] for r in results(launch(WORKER, 2, ["dp", "{}"], timeout=120))]


@pytest.mark.slow
def test_gradients_are_the_average_over_replicas(reduced: list[dict]) -> None:
    for record in reduced:
        used = [d for d in record["diffs"][2:]]
        assert all(d is not None and 0 <= d < 1e-12 for d in used), record["diffs"]


@pytest.mark.slow
def test_a_parameter_no_replica_reached_keeps_no_gradient(reduced: list[dict]) -> None:
    for record in reduced:
        assert record["diffs"][0] is None
        assert record["unused_grad_is_none"]


@pytest.mark.slow
def test_a_parameter_some_replicas_reached_gets_the_average_with_zeros(
        reduced: list[dict]) -> None:
    for record in reduced:
        assert record["diffs"][1] is not None and record["diffs"][1] < 1e-12


@pytest.mark.slow
def test_buckets_start_in_order_during_the_last_backward_only(reduced: list[dict]) -> None:
    for record in reduced:
        assert record["n_buckets"] >= 3
        assert record["events_before_arm"] == []   # once per step, not per micro-batch
        launched = record["launches"]
        assert launched == sorted(launched) and launched[0] == 0
        assert record["launched_before_backward_ended"]
