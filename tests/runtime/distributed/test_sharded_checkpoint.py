"""Checkpoints that never gather: DCP folders resume on any mesh and convert offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results

import partitioner
from partitioner.errors import CheckpointError
from partitioner.runtime.distributed.checkpoint_io import read_checkpoint
from partitioner.runtime.distributed.sharded_checkpoint import (
    read_sharded_checkpoint,
    writes_one_file,
)

WORKER = Path(__file__).resolve().parent / "dcp_worker.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import mlp  # noqa: E402

WIDTHS = (8, 16, 16, 16, 16, 8)


def _run(mesh: dict[str, int], folder: Path, *, write: bool, sharding: str | None = None,
         one_file: Path | None = None) -> list[dict[str, Any]]:
    world = mesh.get("pp", 1) * mesh.get("dp", 1) * mesh.get("tp", 1)
    args = {"mesh": mesh, "write": write, "folder": str(folder), "sharding": sharding,
            "one_file": str(one_file) if one_file else None}
    return [r for records in results(launch(WORKER, world, [json.dumps(args)], timeout=300))
            for r in records]


@pytest.fixture(scope="module")
def saved_at_pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[float]]:
    root = tmp_path_factory.mktemp("dcp")
    folder, one_file = root / "ckpt", root / "whole.pt"
    written = _run({"pp": 2}, folder, write=True, one_file=one_file)
    return folder, one_file, written[0]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "sharding"), [({"dp": 2}, None), ({"tp": 2}, None),
                                                ({"dp": 2}, "fsdp")],
                         ids=["dp2", "tp2", "dp2-fsdp"])
def test_a_folder_saved_at_pp2_resumes_on_another_mesh(
        saved_at_pp2: tuple[Path, Path, list[float]], mesh: dict[str, int],
        sharding: str | None) -> None:
    folder, _, written = saved_at_pp2
    for record in _run(mesh, folder, write=False, sharding=sharding):
        # Steps 3 and 4 after the load: weights, AdamW moments and step counts all resumed.
        assert record["losses"] == pytest.approx(written, abs=1e-10, rel=0), record
        assert record["steps"] == 4


@pytest.mark.slow
def test_every_rank_writes_its_own_stage(saved_at_pp2: tuple[Path, Path, list[float]]
                                         ) -> None:
    folder, _, _ = saved_at_pp2
    files = sorted(p.name for p in folder.glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]  # one per rank, none gathered


@pytest.mark.slow
def test_the_folder_converts_offline_to_the_models_state_dict(
        saved_at_pp2: tuple[Path, Path, list[float]]) -> None:
    folder, one_file, _ = saved_at_pp2
    state = partitioner.checkpoint_to_state_dict(folder)
    model = mlp(WIDTHS).double()
    model.load_state_dict(state, strict=True)
    whole = read_checkpoint(one_file)   # the same step, gathered the old way
    for key, value in whole["model"].items():
        assert torch.equal(state[key], value), key
    converted = read_sharded_checkpoint(folder)
    assert converted["extra"]["steps"] == 2
    ours, theirs = converted["optimizer"], whole["optimizer"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for name, entries in theirs["state"].items():
        for key, value in entries.items():
            assert torch.equal(ours["state"][name][key], value), (name, key)
    assert ours["param_groups"] == theirs["param_groups"]


@pytest.mark.slow
def test_an_fsdp_folder_resumes_as_a_pipeline(tmp_path: Path) -> None:
    written = _run({"dp": 2}, tmp_path / "ckpt", write=True, sharding="fsdp")
    for record in _run({"pp": 2}, tmp_path / "ckpt", write=False):
        assert record["losses"] == pytest.approx(written[0]["losses"], abs=1e-10, rel=0)


def test_only_pt_and_pth_names_write_one_file() -> None:
    assert writes_one_file("ckpt.pt") and writes_one_file(Path("a/b.pth"))
    assert not writes_one_file("ckpt") and not writes_one_file("run/step-100")


def test_a_path_that_is_not_a_sharded_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a sharded checkpoint folder"):
        partitioner.checkpoint_to_state_dict(tmp_path)
    with pytest.raises(CheckpointError, match="not a sharded checkpoint folder"):
        partitioner.checkpoint_to_state_dict(tmp_path / "missing")
