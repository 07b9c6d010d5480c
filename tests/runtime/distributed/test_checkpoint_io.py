"""Consolidated checkpoints: atomic writes, named optimizer state, exact resume."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results
from torch import nn

from partitioner.runtime.distributed.checkpoint_io import (
    CheckpointError,
    atomic_save,
    load_named_optimizer_state,
    merge_optimizer_states,
    named_optimizer_state,
    read_checkpoint,
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
