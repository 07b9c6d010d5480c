"""Tests of runtime/distributed/weights_file.py and of loading a stage from a whole-model
state dict (``checkpoint_io.load_checkpoint``, what ``DistributedModel.load`` runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.errors import CheckpointError, PartitionError
from partitioner.runtime.distributed.checkpoint_io import load_checkpoint
from partitioner.runtime.distributed.weights_file import read_weights
from partitioner.runtime.tensor_parallel.shard_state import ShardState
from partitioner.runtime.tensor_parallel.sharding import Sharding


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _stage(model: nn.Sequential) -> nn.Module:
    """A stage holding the model's last layer under the model's names (``2.weight``)."""
    stage = nn.Module()
    stage.add_module("2", nn.Linear(6, 3))
    nn.init.zeros_(stage.get_submodule("2").weight)
    return stage


def test_a_torch_save_state_dict_is_read_memory_mapped(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "whole.pt"
    torch.save(_model().state_dict(), path)
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    state = read_weights(path)
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # Memory-mapped and weights only: a tensor is read from the file when touched.
    assert [(c.get("mmap"), c.get("weights_only")) for c in calls] == [(True, True)]


def test_a_missing_weights_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no weights file"):
        read_weights(tmp_path / "absent.pt")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_stage_loads_its_tensors_from_a_whole_model_state_dict(tmp_path: Path,
                                                                suffix: str) -> None:
    model = _model()
    path = tmp_path / f"whole{suffix}"
    if suffix == ".safetensors":
        safetensors_torch = pytest.importorskip("safetensors.torch")
        safetensors_torch.save_file(model.state_dict(), str(path))
    else:
        torch.save(model.state_dict(), path)
    stage = _stage(model)
    assert load_checkpoint(path, stage) == {}
    torch.testing.assert_close(stage.get_submodule("2").weight, model[2].weight)
    torch.testing.assert_close(stage.get_submodule("2").bias, model[2].bias)


def test_a_file_missing_keys_of_the_stage_is_refused_naming_them(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "partial.pt"
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("2.")}, path)
    with pytest.raises(CheckpointError, match=r"lacks 2 keys.*2\.weight, 2\.bias") as caught:
        load_checkpoint(path, _stage(model))
    assert isinstance(caught.value, PartitionError) and isinstance(caught.value, ValueError)


def test_a_file_with_another_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"2.weight": torch.zeros(3, 5), "2.bias": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match=r"2\.weight of shape \(3, 5\).*\(3, 6\)"):
        load_checkpoint(path, _stage(_model()))


def test_an_optimizer_with_a_plain_state_dict_is_refused(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "whole.pt"
    torch.save(model.state_dict(), path)
    stage = _stage(model)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(path, stage, optimizer=optimizer)


def test_a_file_of_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointError, match="neither a partitioner checkpoint nor a state"):
        load_checkpoint(path, _stage(_model()))


def test_a_tensor_parallel_stage_keeps_its_slice_of_each_whole_tensor(tmp_path: Path) -> None:
    """A rank of a split stage reads each whole tensor and keeps its rows (colwise)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    path = tmp_path / "whole.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    stage = nn.Module()
    stage.add_module("2", nn.Linear(6, 2))  # rank 1's half of the rows
    split = Sharding("colwise", 0, 2)
    load_checkpoint(path, stage, shards=ShardState({"2.weight": split, "2.bias": split}, 1))
    torch.testing.assert_close(stage.get_submodule("2").weight, model[2].weight[2:])
    torch.testing.assert_close(stage.get_submodule("2").bias, model[2].bias[2:])
