"""When a rank fails, the others stop within a bound, naming it; mismatched plans refused."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import RankRun, base_env, collect, describe, free_port, launch

from partitioner.errors import CommunicationError, PartitionError
from partitioner.runtime.distributed.checkpoint_io import atomic_save, read_checkpoint
from partitioner.runtime.distributed.failure import FailurePolicy, Watchdog

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


def _records(runs: list[RankRun]) -> list[dict[str, object]]:
    records = [json.loads(line[7:]) for run in runs for line in run.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(records) == len(runs), describe(runs)
    return records


@pytest.mark.slow
def test_ranks_asked_for_different_splits_refuse_to_start() -> None:
    args = json.dumps({"balances": [[4, 5], [5, 4]]})
    for record in _records(launch(WORKER, 2, ["mismatch", args], timeout=120)):
        assert record["type"] == "PlanMismatchError"
        assert "balance: rank 0 asked for [4, 5], rank 1 for [5, 4]" in str(record["error"])
        assert "launch all of them with the same command line" in str(record["error"])


@pytest.mark.slow
def test_ranks_that_built_different_plans_refuse_to_start() -> None:
    # Same options, another model on rank 1: the plans' digests differ.
    args = json.dumps({"balances": [[5, 4], [5, 4]], "widths": [16, 12]})
    for record in _records(launch(WORKER, 2, ["mismatch", args], timeout=120)):
        assert record["type"] == "PlanMismatchError"
        assert "ranks [0] have plan" in str(record["error"])
        assert "ranks [1] have plan" in str(record["error"])
        assert "fix the split with balance=" in str(record["error"])


@pytest.mark.slow
def test_ranks_asked_for_different_pipeline_degrees_are_refused_not_left_waiting() -> None:
    # Regression: --pp 2 on one rank and --pp 1 on the other hung with no output (the
    # pp=1 rank adopted rank 0's two-stage plan and left; rank 0 waited in new_group).
    args = json.dumps({"per_rank": [{"pp": 2}, {"pp": 1}]})
    for record in _records(launch(WORKER, 2, ["settings", args], timeout=120)):
        assert record["type"] == "PlanMismatchError"
        assert "pp: rank 0 asked for 2, rank 1 for 1" in str(record["error"])


@pytest.mark.slow
def test_a_mesh_of_another_shape_on_one_rank_is_refused_on_every_rank() -> None:
    args = json.dumps({"shapes": [[2, 1, 1], [1, 2, 1]]})
    for record in _records(launch(WORKER, 2, ["mesh_mismatch", args], timeout=90)):
        assert record["type"] == "PlanMismatchError"
        assert "different mesh shapes: dp: rank 0 asked for 1, rank 1 for 2; pp: rank 0 " \
               "asked for 2, rank 1 for 1" in str(record["error"])


@pytest.mark.slow
def test_ranks_launched_with_different_world_sizes_are_refused_not_left_waiting() -> None:
    # Regression: WORLD_SIZE=2 on rank 0 and 3 on rank 1 waited in init_process_group for
    # its 30-minute timeout, saying nothing.
    port, start = free_port(), time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), "settings", json.dumps({"per_rank": [{}, {}, {}]})],
        env=base_env(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank, size in enumerate([2, 3])]
    for record in _records(collect(procs, start, timeout=90)):
        assert record["type"] == "DistributedInitError"
        assert "launched with different world sizes (rank 0: 2, rank 1: 3)" in \
            str(record["error"])


@pytest.mark.slow
def test_a_rank_killed_before_the_loss_all_reduce_is_named_by_every_other_rank() -> None:
    # Regression: the others' loss all-reduce raised gloo's bare RuntimeError, so rank 1
    # reported itself as failed and rank 3 blamed rank 1.
    runs = _fail(4, victim=2, mode="kill", at=2, pp=2, dp=2, where="reduce")
    assert runs[2].returncode == -9, describe(runs)
    _others_stopped_naming(runs, 2, "stopping because rank 2 failed: no heartbeat")
    for run in runs:
        assert "Traceback" not in run.stderr, describe(runs)


@pytest.mark.slow
def test_a_rank_that_raises_in_its_first_step_stops_every_other_rank() -> None:
    runs = _fail(2, victim=1, mode="raise", at=0, pp=2, dp=1)
    assert "[partitioner] rank 1 failed" in runs[1].stderr, describe(runs)
    _others_stopped_naming(runs, 1, "stopping because rank 1 failed")
    assert "injected failure on rank 1" in runs[0].stderr


@pytest.mark.slow
def test_the_store_host_raising_while_partitioning_stops_the_others_naming_it() -> None:
    # Rank 0 fails before the others reach the first collective, and takes the store along.
    runs = _fail(2, victim=0, mode="raise", at=0, pp=1, dp=2, where="start")
    assert "[partitioner] rank 0 failed" in runs[0].stderr, describe(runs)
    assert "injected failure on rank 0" in runs[0].stderr
    _others_stopped_naming(runs, 0, "stopping because rank 0 failed")


@pytest.mark.slow
def test_a_rank_that_ends_its_program_early_is_named() -> None:
    # Regression: rank 0's receive failed when rank 1 exited cleanly after 2 of 6 steps; no
    # failure was published, so rank 0 reported itself as the failed rank.
    runs = _fail(2, victim=1, mode="exit", at=2, pp=2, dp=1)
    assert runs[1].returncode == 0, describe(runs)
    _others_stopped_naming(runs, 1, "stopping because rank 1 failed: rank 1 ended its program "
                                    "normally while rank 0 still needed it")
    assert "make every rank make the same calls" in runs[0].stderr


@pytest.mark.slow
def test_the_store_host_ending_its_program_early_says_so() -> None:
    runs = _fail(2, victim=0, mode="exit", at=2, pp=2, dp=1)
    assert runs[0].returncode == 0, describe(runs)
    assert runs[1].returncode == EXIT, describe(runs)
    assert "stopping because rank 0 failed: " in runs[1].stderr, describe(runs)
    assert "ended its program" in runs[1].stderr, describe(runs)


@pytest.mark.slow
def test_rank_0_killed_while_saving_is_named_and_its_temporary_removed_next_time(
        tmp_path: Path) -> None:
    # Regression: the peer exited with gloo's traceback from the barrier, naming no rank.
    runs = launch(WORKER, 2, ["save_dies", json.dumps({"dir": str(tmp_path)})], timeout=120)
    assert runs[0].returncode == -9, describe(runs)
    peer = runs[1]
    assert peer.returncode == EXIT, describe(runs)
    assert "rank 0 has most likely failed" in peer.stderr or \
        "stopping because rank 0 failed" in peer.stderr, describe(runs)
    assert "Traceback" not in peer.stderr and "RESULT" not in peer.stdout, describe(runs)
    path = tmp_path / "ckpt.pt"
    assert read_checkpoint(path)["extra"]["steps"] == 0      # the first save, whole
    [leftover] = [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]   # killed: no cleanup
    atomic_save({"w": torch.ones(1)}, path)                   # the next save clears it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert leftover.name.startswith(".ckpt.pt.w")


def test_policy_is_validated() -> None:
    with pytest.raises(PartitionError, match="must exceed 2 \\* interval"):
        FailurePolicy(timeout=1.0, interval=0.5)
    with pytest.raises(ValueError, match="exit_code=0"):
        FailurePolicy(exit_code=0)
    with pytest.raises(ValueError, match="interval=0"):
        FailurePolicy(interval=0)


# Without processes: a watchdog over an in-memory store, its stopping recorded, not done.

GLOO = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4331. This "
        "is typically caused by a remote worker crashing.")


class Stopped(Exception):
    """Raised where the watchdog would end the process."""


def _watchdog(rank: int, world: int, policy: FailurePolicy | None = None
              ) -> tuple[Watchdog, list[tuple[int, str]]]:
    watchdog = Watchdog(dist.HashStore(), rank, world, policy or FailurePolicy(
        timeout=0.3, interval=0.05), "127.0.0.1:1, hosted by rank 0")
    stops: list[tuple[int, str]] = []

    def die(cause: tuple[int, str], echo: BaseException | None = None) -> None:
        stops.append(cause)
        raise Stopped(cause)

    watchdog._die = die  # type: ignore[method-assign]
    return watchdog, stops


def test_a_raw_gloo_error_in_a_step_names_the_rank_that_failed_not_this_one() -> None:
    # Regression: the loss all-reduce raised gloo's bare RuntimeError, which the guard took
    # for this rank's own failure; rank 1 then named itself and rank 3 blamed rank 1.
    watchdog, stops = _watchdog(1, 4)
    watchdog.store.compare_set(watchdog._key("failed"), "",
                               json.dumps({"rank": 2, "reason": "no heartbeat for 4.0 s"}))
    with pytest.raises(Stopped):
        with watchdog.guard():
            raise RuntimeError(GLOO)
    assert stops == [(2, "no heartbeat for 4.0 s")]
    assert watchdog.cause() == (2, "no heartbeat for 4.0 s")


def test_this_rank_s_own_error_is_published_as_the_failure() -> None:
    watchdog, stops = _watchdog(1, 2)
    with pytest.raises(ValueError, match="loss is nan"):
        with watchdog.guard():
            raise ValueError("loss is nan")
    assert stops == []
    assert watchdog.cause() == (1, "ValueError: loss is nan")


def test_a_peer_that_ended_its_program_is_named_when_an_exchange_with_it_fails() -> None:
    watchdog, stops = _watchdog(0, 2)
    watchdog.store.add(watchdog._key("exit", 1), 1)
    watchdog.store.add(watchdog._key("exited"), 1)
    with pytest.raises(Stopped):
        with watchdog.guard():
            raise CommunicationError("receiving gradients of micro-batch 0 from rank 1 failed")
    [(rank, reason)] = stops
    assert rank == 1
    assert "rank 1 ended its program normally while rank 0 still needed it" in reason
    assert "make every rank make the same calls" in reason


def test_a_peer_that_ended_its_program_while_this_rank_waits_in_a_step_is_named() -> None:
    # Nothing fails here: the main thread just waits (as in a receive that never completes)
    # until the watchdog thread, having seen the exit, stops the process.
    watchdog, stops = _watchdog(1, 2)
    stopped = threading.Event()

    def die_in_thread(cause: tuple[int, str], echo: BaseException | None = None) -> None:
        stops.append(cause)
        stopped.set()
        watchdog._stop.set()    # the thread ends instead of the process

    watchdog._die = die_in_thread  # type: ignore[method-assign]
    watchdog.store.add(watchdog._key("exit", 0), 1)
    watchdog.store.add(watchdog._key("exited"), 1)
    watchdog.start()
    try:
        with watchdog.guard():
            assert stopped.wait(30), "the watchdog never named the rank that exited"
    finally:
        watchdog._stop.set()
    assert stops[0][0] == 0 and "still waiting for it after" in stops[0][1]


def test_a_rank_that_exited_cleanly_is_no_failure_outside_a_step() -> None:
    watchdog, stops = _watchdog(1, 2)
    watchdog.store.add(watchdog._key("exit", 0), 1)
    watchdog.store.add(watchdog._key("exited"), 1)
    watchdog.start()
    try:
        time.sleep(1.0)     # several timeouts (0.3 s) of watching, not in a guarded block
    finally:
        watchdog._stop.set()
    assert stops == [] and watchdog.cause() is None
