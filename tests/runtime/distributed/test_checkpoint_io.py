"""Consolidated checkpoints: atomic writes, named optimizer state, exact resume."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_harness import launch, results
from torch import nn

from partitioner.errors import CommunicationError
from partitioner.runtime.distributed.checkpoint_io import (
    CheckpointError,
    CheckpointWriteError,
    atomic_save,
    load_checkpoint,
    load_named_optimizer_state,
    merge_optimizer_states,
    named_optimizer_state,
    read_checkpoint,
    save_checkpoint,
)

WORKER = Path(__file__).with_name("dist_worker.py")


def test_a_crash_while_writing_leaves_the_previous_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save({"w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj: Any, handle: Any) -> None:
        handle.write(b"half a checkpoint")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"w": torch.zeros(3)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path)["w"].tolist() == [1.0, 1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_named_optimizer_state_round_trips_into_another_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    twin = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    named = named_optimizer_state(optimizer, model)
    assert sorted(named["state"]) == sorted(n for n, _ in model.named_parameters())
    assert named["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    other = torch.optim.Adam(twin.parameters(), lr=0.5)
    load_named_optimizer_state(other, twin, named)
    assert other.param_groups[0]["lr"] == 0.1
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], other.state[q][key])


def test_merging_stages_concatenates_groups_and_unions_state() -> None:
    a = {"state": {"x": {"m": 1}}, "param_groups": [{"lr": 0.1, "params": ["x"]}]}
    b = {"state": {"y": {"m": 2}}, "param_groups": [{"lr": 0.1, "params": ["y"]}]}
    merged = merge_optimizer_states([a, b])
    assert merged == {"state": {"x": {"m": 1}, "y": {"m": 2}},
                      "param_groups": [{"lr": 0.1, "params": ["x", "y"]}]}


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    model, stranger = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *stranger.parameters()], lr=0.1)
    with pytest.raises(CheckpointError, match="2 parameters that are not this rank's"):
        named_optimizer_state(optimizer, model)


def test_reading_something_else_says_what_it_is(tmp_path: Path) -> None:
    torch.save({"weight": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not a partitioner checkpoint"):
        read_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        read_checkpoint(tmp_path / "missing.pt")


def test_another_models_state_dict_with_an_extra_layer_is_refused_naming_it(
        tmp_path: Path) -> None:
    """Issue #19: only missing keys and shapes were checked, so a bigger model's file loaded
    without a word."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    bigger = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))
    torch.save(bigger.state_dict(), tmp_path / "bigger.pt")
    stage = nn.Sequential()  # this rank's stage: layer 0, under the model's names
    stage.add_module("0", model[0])
    before = model[0].weight.detach().clone()
    keys = model.state_dict().keys()
    with pytest.raises(CheckpointError, match=r"2 keys this model lacks: 3\.weight, 3\.bias"):
        load_checkpoint(tmp_path / "bigger.pt", stage, model_keys=keys)
    assert torch.equal(model[0].weight, before)
    load_checkpoint(tmp_path / "bigger.pt", stage, model_keys=keys, strict=False)
    assert torch.equal(model[0].weight, bigger[0].weight)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("ckpt")
    args = json.dumps({"pp": 2, "dp": 2, "dir": str(directory)})
    per_rank = results(launch(WORKER, 4, ["checkpoint", args], timeout=180))
    assert all(records == [] for records in per_rank[1:])
    return per_rank[0][0]


@pytest.mark.slow
def test_resuming_from_a_checkpoint_is_exact(resumed: dict[str, Any]) -> None:
    # Training 2 steps, saving, training 2 more equals loading that file into a fresh,
    # differently initialised pp=2 x dp=2 run and training the same 2 steps: bit for bit,
    # the model and Adam's moments.
    assert resumed["model_equal"] and resumed["optimizer_equal"]
    assert resumed["steps_after_load"] == 2 and resumed["saved_steps"] == 4


@pytest.mark.slow
def test_the_file_loads_into_the_unpartitioned_model(resumed: dict[str, Any]) -> None:
    assert resumed["same_keys"]
    assert len(resumed["optimizer_params"]) == 12   # every stage's parameters, by name
    # The file's "model" equals single-process training of the same 2 steps (float64;
    # micro-batching and replica averaging only reorder sums).
    assert resumed["unpartitioned_diff"] < 1e-12
    assert resumed["leftovers"] == []


def test_a_failed_write_is_a_checkpoint_write_error_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    atomic_save({"w": torch.ones(2)}, path)

    def disk_full(obj: Any, handle: Any) -> None:
        handle.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointWriteError, match="No space left on device.*keeps its "
                                                   "previous contents; free disk space"):
        atomic_save({"w": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert torch.load(path)["w"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_the_next_save_removes_temporaries_of_dead_writers_on_this_host(tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    dead = int(finished.stdout)
    host = socket.gethostname()
    stale = tmp_path / f".ckpt.pt.w{dead}@{host}.k3j2h1g0.tmp"
    alive = tmp_path / f".ckpt.pt.w{os.getppid()}@{host}.a1b2c3d4.tmp"   # a running writer
    remote = tmp_path / f".ckpt.pt.w{dead}@another-host.e5f6g7h8.tmp"   # cannot be checked
    other = tmp_path / f".other.pt.w{dead}@{host}.i9j8k7l6.tmp"          # another target
    for leftover in (stale, alive, remote, other):
        leftover.write_bytes(b"half a checkpoint")
    atomic_save({"w": torch.ones(1)}, tmp_path / "ckpt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt.pt", alive.name, remote.name, other.name])


@pytest.mark.slow
def test_a_writer_stopped_by_the_watchdog_removes_its_temporary(tmp_path: Path) -> None:
    # The watchdog ends a process with os._exit, which runs no finally block: the
    # temporary of a save in progress goes through undo_on_abort.
    script = f"""
import torch, torch.distributed as dist
from partitioner.runtime.distributed.checkpoint_io import atomic_save
from partitioner.runtime.distributed.failure import FailurePolicy, Watchdog

watchdog = Watchdog(dist.HashStore(), 0, 1, FailurePolicy(exit_code=23))

def stopped_mid_write(obj, handle):
    handle.write(b"half a checkpoint")
    handle.flush()
    watchdog.exit_now()   # as when another rank failed

torch.save = stopped_mid_write
atomic_save({{"w": torch.ones(1)}}, {str(tmp_path / "ckpt.pt")!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 23, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_peer_waiting_for_rank_0_to_write_names_rank_0(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    # Regression: rank 0 died while saving and the peer's barrier raised gloo's bare
    # RuntimeError, naming no rank.
    def dead_writer(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    monkeypatch.setattr(dist, "barrier", dead_writer)
    with pytest.raises(CommunicationError, match="waiting for rank 0 to write the file failed"
                                                 ".*rank 0, which writes the checkpoint"):
        save_checkpoint(tmp_path / "ckpt.pt", nn.Linear(2, 2), contributes=False, group=None,
                        base_state={})
