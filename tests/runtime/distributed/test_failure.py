"""When a rank fails, the others stop within a bound, naming it; mismatched plans refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed_harness import RankRun, describe, launch

from partitioner.errors import PartitionError
from partitioner.runtime.distributed.failure import FailurePolicy

WORKER = Path(__file__).with_name("dist_worker.py")
EXIT = 17          # the workers' FailurePolicy(exit_code=17)
BOUND = 30.0       # seconds; the workers detect a kill after 4 s of silence


def _fail(world: int, **args: object) -> list[RankRun]:
    return launch(WORKER, world, ["fail", json.dumps({"steps": 6, **args})], timeout=150)


def _others_stopped_naming(runs: list[RankRun], victim: int, phrase: str) -> None:
    victim_end = runs[victim].elapsed
    for run in runs:
        if run.rank == victim:
            continue
        assert run.returncode == EXIT, describe(runs)
        assert phrase in run.stderr, describe(runs)
        assert run.elapsed - victim_end < BOUND, describe(runs)
        assert "RESULT" not in run.stdout   # nobody finished training


@pytest.mark.slow
def test_a_rank_that_raises_mid_step_stops_every_other_rank() -> None:
    runs = _fail(2, victim=1, mode="raise", at=2, pp=2, dp=1)
    assert runs[1].returncode == EXIT, describe(runs)
    assert "[partitioner] rank 1 failed" in runs[1].stderr
    assert "injected failure on rank 1" in runs[1].stderr
    _others_stopped_naming(runs, 1, "stopping because rank 1 failed")
    assert "injected failure on rank 1" in runs[0].stderr


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_stops_every_other_rank() -> None:
    runs = _fail(4, victim=2, mode="kill", at=2, pp=2, dp=2)
    assert runs[2].returncode == -9, describe(runs)
    _others_stopped_naming(runs, 2, "stopping because rank 2 failed: no heartbeat")


@pytest.mark.slow
def test_losing_the_store_host_names_rank_0() -> None:
    runs = _fail(2, victim=0, mode="kill", at=1, pp=2, dp=1)
    assert runs[0].returncode == -9, describe(runs)
    _others_stopped_naming(runs, 0, "rank 0 has most likely failed")


@pytest.mark.slow
def test_ranks_with_different_plans_refuse_to_start() -> None:
    args = json.dumps({"balances": [[4, 5], [5, 4]]})
    runs = launch(WORKER, 2, ["mismatch", args], timeout=120)
    records = [json.loads(line[7:]) for run in runs for line in run.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(records) == 2, describe(runs)
    for record in records:
        assert record["type"] == "PlanMismatchError"
        assert "ranks [0] have plan" in record["error"] and "balance (4, 5)" in record["error"]
        assert "ranks [1] have plan" in record["error"] and "balance (5, 4)" in record["error"]
        assert "fix the split with balance=" in record["error"]


def test_policy_is_validated() -> None:
    with pytest.raises(PartitionError, match="must exceed 2 \\* interval"):
        FailurePolicy(timeout=1.0, interval=0.5)
    with pytest.raises(ValueError, match="exit_code=0"):
        FailurePolicy(exit_code=0)
    with pytest.raises(ValueError, match="interval=0"):
        FailurePolicy(interval=0)
