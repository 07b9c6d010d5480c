"""Replica sampler: shards by replica, global batches, epochs, padding."""

from __future__ import annotations

from itertools import chain

import pytest

from partitioner.runtime.distributed.sampler import ReplicaSampler, SamplerError, epoch_order


def _shards(n: int, replicas: int, batch: int, **options: object) -> list[list[int]]:
    return [list(ReplicaSampler(range(n), replicas, r, batch_size=batch, **options))
            for r in range(replicas)]


def test_replicas_concatenated_give_the_single_process_batches() -> None:
    n, replicas, batch = 24, 3, 2
    shards = _shards(n, replicas, batch, seed=5)
    order = epoch_order(n, 0, seed=5)
    global_batch = batch * replicas
    for k in range(n // global_batch):
        joined = list(chain.from_iterable(s[k * batch:(k + 1) * batch] for s in shards))
        assert joined == order[k * global_batch:(k + 1) * global_batch]


def test_shards_are_disjoint_and_cover_the_epoch() -> None:
    shards = _shards(20, 4, 5)
    assert sorted(chain.from_iterable(shards)) == list(range(20))


def test_set_epoch_changes_the_permutation_the_same_way_on_every_replica() -> None:
    samplers = [ReplicaSampler(range(16), 2, r, batch_size=4, seed=1) for r in range(2)]
    first = [list(s) for s in samplers]
    for s in samplers:
        s.set_epoch(1)
    second = [list(s) for s in samplers]
    assert first != second
    assert sorted(chain.from_iterable(second)) == list(range(16))
    order = epoch_order(16, 1, seed=1)
    assert second[0] + second[1] == order[0:4] + order[8:12] + order[4:8] + order[12:16]


def test_without_shuffle_the_order_is_the_dataset_order() -> None:
    assert _shards(8, 2, 2, shuffle=False) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_an_incomplete_last_batch_is_padded_evenly_or_dropped() -> None:
    padded = _shards(10, 3, 2, shuffle=False)
    assert [len(s) for s in padded] == [4, 4, 4]   # 2 from the full batch, 2 of the tail
    assert sorted(set(chain.from_iterable(padded))) == list(range(10))
    assert [len(s) for s in padded] == [len(ReplicaSampler(range(10), 3, r, batch_size=2))
                                        for r in range(3)]
    dropped = _shards(10, 3, 2, shuffle=False, drop_last=True)
    assert dropped == [[0, 1], [2, 3], [4, 5]]
    assert len(ReplicaSampler(range(10), 3, 0, batch_size=2, drop_last=True)) == 2


def test_batch_size_one_interleaves_like_distributed_sampler() -> None:
    assert _shards(6, 2, 1, shuffle=False) == [[0, 2, 4], [1, 3, 5]]


def test_bad_options_are_refused() -> None:
    with pytest.raises(SamplerError, match="replica=2 is outside 0..1"):
        ReplicaSampler(range(4), 2, 2)
    with pytest.raises(SamplerError, match="batch_size=0"):
        ReplicaSampler(range(4), 2, 0, batch_size=0)
    with pytest.raises(SamplerError, match="num_replicas=0"):
        ReplicaSampler(range(4), 0, 0)
    assert issubclass(SamplerError, ValueError)
