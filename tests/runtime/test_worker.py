"""Worker threads: device context, and intra-op threads shared among CPU workers."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import fx, nn

from partitioner.errors import PartitionError
from partitioner.runtime.local import LocalPipeline, thread_plan
from partitioner.runtime.schedule_generators import gpipe
from partitioner.runtime.worker import Worker, shared_threads


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


class _Probe(nn.Module):
    """Records the intra-op threads its forward and backward ran with."""

    def __init__(self, seen: list[tuple[str, int]], name: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen, self.name = seen, name

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        self.seen.append((f"{self.name}F", torch.get_num_threads()))
        return (torch.relu(self.linear(x)),)


def test_thread_plan_shares_the_budget_among_stages_busy_together() -> None:
    plan = {str(a): n for a, n in thread_plan(gpipe(2, 3), [True, True], budget=4).items()}
    assert plan["0F0"] == 4  # alone in the fill
    assert plan["0F1"] == plan["1F0"] == 2  # together
    assert plan["0B0"] == 4  # alone in the drain
    # a stage not on the CPU takes no share
    assert {str(a): n for a, n in thread_plan(gpipe(2, 3), [True, False], 4).items()}[
        "0F1"] == 4


def test_pipeline_actions_run_with_the_planned_threads(four_threads: None) -> None:
    seen: list[tuple[str, int]] = []
    stages = [_Probe(seen, "0"), _Probe(seen, "1")]
    pipe = LocalPipeline(stages, [torch.device("cpu")] * 2, chunks=3,  # type: ignore[arg-type]
                         threads="schedule")
    fresh = _fresh_thread_count()
    try:
        pipe.run([torch.randn(6, 8)])[0].sum().backward()
    finally:
        pipe.close()
    forwards = [n for name, n in seen if name == "0F"]
    assert forwards == [4, 2, 2]  # 0F0 alone, then alongside stage 1
    assert [n for name, n in seen if name == "1F"] == [2, 2, 4]  # 1F2: stage 0 done
    assert torch.get_num_threads() == 4 and _fresh_thread_count() == fresh


def test_by_default_every_action_keeps_its_workers_share(four_threads: None) -> None:
    # A worker that once ran with more threads keeps an OpenMP team, which slows every
    # parallel op of the process (runtime/local.py, ``threads``): the default never varies.
    seen: list[tuple[str, int]] = []
    stages = [_Probe(seen, "0"), _Probe(seen, "1")]
    pipe = LocalPipeline(stages, [torch.device("cpu")] * 2, chunks=3)  # type: ignore[arg-type]
    try:
        pipe.run([torch.randn(6, 8)])[0].sum().backward()
    finally:
        pipe.close()
    assert {n for _, n in seen} == {2}
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("threads", [0, -1, "alone", 1.5, True])
def test_a_thread_count_that_is_not_a_positive_int_or_schedule_is_refused(threads: object
                                                                          ) -> None:
    stages = [fx.symbolic_trace(_Stage()) for _ in range(2)]
    with pytest.raises(PartitionError, match="threads="):
        LocalPipeline(stages, [torch.device("cpu")] * 2, threads=threads)  # type: ignore[arg-type]
