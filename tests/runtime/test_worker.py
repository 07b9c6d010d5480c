"""Worker threads: device context, and intra-op threads shared among CPU workers."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import fx, nn

from runtime.local import LocalPipeline
from runtime.worker import Worker, shared_threads


def _fresh_thread_count() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def four_threads() -> Iterator[None]:
    """The caller has 4 intra-op threads (restored afterwards, here and for new threads)."""
    before, default = torch.get_num_threads(), _fresh_thread_count()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)
    done = threading.Thread(target=lambda: torch.set_num_threads(default))
    done.start()
    done.join()


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.relu(self.linear(x)),)


def test_shared_threads_divides_the_callers_threads_among_cpu_workers(four_threads: None
                                                                      ) -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert shared_threads([cpu]) == 4
    assert shared_threads([cpu, cpu]) == 2
    assert shared_threads([cpu, cpu, cpu]) == 1
    assert shared_threads([cpu] * 8) == 1  # never below one
    assert shared_threads([cpu, meta, meta]) == 4  # only CPU workers share the cores


def test_worker_threads_apply_to_its_thread_only() -> None:
    main, fresh = torch.get_num_threads(), _fresh_thread_count()
    worker = Worker(torch.device("cpu"), threads=1)
    try:
        assert worker.submit(torch.get_num_threads).result() == 1
        assert worker.submit(lambda: torch.ones(64, 64).sum().item()).result() == 4096
        assert worker.submit(torch.get_num_threads).result() == 1
    finally:
        worker.close()
    assert torch.get_num_threads() == main
    assert _fresh_thread_count() == fresh  # the default of later threads is unchanged


def test_worker_rejects_non_positive_threads() -> None:
    with pytest.raises(ValueError, match="threads=0"):
        Worker(torch.device("cpu"), threads=0)


def test_pipeline_workers_share_threads_and_still_compute_the_same(four_threads: None
                                                                   ) -> None:
    torch.manual_seed(0)
    stages = [fx.symbolic_trace(_Stage()) for _ in range(2)]
    x = torch.randn(6, 8)
    expected = stages[1](*stages[0](x))[0]
    shared = LocalPipeline(stages, [torch.device("cpu")] * 2, chunks=3)
    pinned = LocalPipeline(stages, [torch.device("cpu")] * 2, chunks=3, threads=3)
    try:
        assert [w.submit(torch.get_num_threads).result() for w in shared.workers] == [2, 2]
        assert [w.submit(torch.get_num_threads).result() for w in pinned.workers] == [3, 3]
        torch.testing.assert_close(shared.run([x])[0], expected)
        torch.testing.assert_close(pinned.run([x])[0], expected)
    finally:
        shared.close()
        pinned.close()
    assert torch.get_num_threads() == 4
