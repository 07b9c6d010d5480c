"""Ranks launched into different worlds are refused before the process group starts."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from partitioner.errors import DistributedInitError, PartitionError
from partitioner.runtime.distributed.rendezvous import check_same_world


def _ranks(sizes: list[int], timeout: float = 20) -> list[Any]:
    store = dist.HashStore()
    results: list[Any] = [None] * len(sizes)

    def run(rank: int) -> None:
        try:
            check_same_world(store, rank, sizes[rank], timeout, poll=0.01)
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_ranks_of_one_world_go_on() -> None:
    assert _ranks([3, 3, 3]) == [None, None, None]


@pytest.mark.parametrize("sizes", [[2, 3], [3, 2]])
def test_every_rank_names_each_rank_s_world_size(sizes: list[int]) -> None:
    # Whichever rank arrives first, neither waits for a rank that will never come.
    errors = _ranks(sizes)
    for error in errors:
        assert isinstance(error, DistributedInitError) and isinstance(error, PartitionError)
        assert f"different world sizes (rank 0: {sizes[0]}, rank 1: {sizes[1]})" in str(error)
        assert "--nproc-per-node" in str(error)


def test_a_rank_that_never_starts_is_counted_after_the_timeout() -> None:
    with pytest.raises(DistributedInitError, match="only 1 of 2 ranks started within 0 s"):
        check_same_world(dist.HashStore(), 0, 2, 0.1, poll=0.01)


def test_a_restarted_attempt_keeps_its_keys_apart_from_the_failed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: torchrun's agent keeps its store across --max-restarts; the process
    group's keys ("default_pg", gloo's addresses of the dead ranks) were shared by all
    attempts, and a restarted world connected to dead ranks."""
    from datetime import timedelta

    from distributed_harness import free_port

    from partitioner.runtime.distributed.rendezvous import attempt_prefix, rendezvous_store

    port = free_port()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    stores = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        assert attempt_prefix("default_pg") == f"default_pg/attempt_{attempt}"
        store = rendezvous_store(f"tcp://127.0.0.1:{port}", 0, 1, timedelta(seconds=10))
        store.set("address", f"of attempt {attempt}")
        stores.append(store)
    assert bytes(stores[0].get("address")) == b"of attempt 0"
    assert bytes(stores[1].get("address")) == b"of attempt 1"


def test_the_store_host_stays_until_every_rank_has_read_the_sizes() -> None:
    """Regression (the slow tier, 2026-12-04): rank 0 hosts the store and left as soon as
    it saw the mismatch; rank 1, still reading the world sizes, failed with "Connection
    reset by peer" instead of naming them."""
    import time

    shared = dist.HashStore()
    done: dict[int, float] = {}

    class Slow:  # rank 1's reads of the sizes take a while
        def __getattr__(self, name: str) -> Any:
            return getattr(shared, name)

        def get(self, key: str) -> Any:
            time.sleep(0.2)
            return shared.get(key)

    def run(rank: int, size: int) -> None:
        try:
            check_same_world(shared if rank == 0 else Slow(), rank, size, 20, poll=0.01,
                             hosts_store=rank == 0)
        except DistributedInitError:
            done[rank] = time.monotonic()

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in ((0, 2), (1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(done) == {0, 1}
    assert done[0] >= done[1] - 0.05  # the host left after rank 1 had the sizes
