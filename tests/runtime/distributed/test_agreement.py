"""Ranks compare what they were asked for through the store, with a bounded wait."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch.distributed as dist

from partitioner.errors import CommunicationError
from partitioner.runtime.distributed.agreement import exchange, mismatches


def _on_ranks(world: int, fn: Any) -> list[Any]:
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_every_rank_gets_every_rank_s_value_in_rank_order() -> None:
    store = dist.HashStore()
    got = _on_ranks(3, lambda r: exchange(store, "demo", r, 3, f"value {r}", timeout=20))
    assert got == [["value 0", "value 1", "value 2"]] * 3
    # A second round under the same name does not see the first round's values.
    again = _on_ranks(3, lambda r: exchange(store, "demo", r, 3, str(r * 10), timeout=20))
    assert again == [["0", "10", "20"]] * 3


def test_a_rank_that_never_arrives_is_named_after_the_bounded_wait() -> None:
    store = dist.HashStore()
    with pytest.raises(CommunicationError, match=r"ranks \[1, 2\] did not reach the demo check "
                                                 r"within 0 s \(rank 0 did\)"):
        exchange(store, "demo", 0, 3, "x", timeout=0.2)


def test_mismatches_name_which_rank_asked_for_what() -> None:
    per_rank = [{"pp": 2, "dp": None, "chunks": 4}, {"pp": 1, "dp": None, "chunks": 4},
                {"pp": 1, "dp": None, "chunks": 4}]
    assert mismatches(per_rank) == ["pp: rank 0 asked for 2, ranks [1, 2] for 1"]
    assert mismatches(per_rank[1:]) == []


def test_mismatches_compare_nested_plans_key_by_key_and_whole_values() -> None:
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"   # alike in what a message shows
    per_rank = [{"plan": {"chunks": 4, "balance": [3, 3]}, "note": long_a},
                {"plan": {"chunks": 2, "balance": [3, 3]}, "note": long_b}]
    problems = mismatches(json.loads(json.dumps(per_rank)))
    assert problems[0].startswith("note: rank 0 asked for \"xxx")
    assert problems[0].endswith("...")
    assert problems[1] == "plan.chunks: rank 0 asked for 4, rank 1 for 2"
    assert len(problems) == 2
