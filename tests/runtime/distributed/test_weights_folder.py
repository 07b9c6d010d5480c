"""runtime/distributed/weights_folder.py: a transformers-style folder of safetensors shards
loads into a stage (through ``checkpoint_io.load_checkpoint``, what ``dpm.load`` runs);
a folder without its index or missing a shard, and another model's weights, are refused
by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.errors import CheckpointError, PartitionError
from partitioner.runtime.distributed.checkpoint_io import load_checkpoint
from partitioner.runtime.distributed.weights_folder import INDEX, read_folder

safetensors_torch = pytest.importorskip("safetensors.torch")


def _model(width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


def _stage(width: int = 6) -> nn.Module:
    """A stage holding the model's last layer under the model's names (``2.weight``)."""
    stage = nn.Module()
    stage.add_module("2", nn.Linear(width, 3))
    nn.init.zeros_(stage.get_submodule("2").weight)
    return stage


def _sharded(folder: Path, model: nn.Module) -> Path:
    """The model's state dict as two shards and their index, as save_pretrained writes."""
    folder.mkdir()
    state = model.state_dict()
    shards = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias"],
              "model-00002-of-00002.safetensors": ["2.weight", "2.bias"]}
    for name, keys in shards.items():
        safetensors_torch.save_file({k: state[k] for k in keys}, str(folder / name))
    weight_map = {k: name for name, keys in shards.items() for k in keys}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_a_stage_loads_its_tensors_from_a_sharded_folder(tmp_path: Path) -> None:
    model = _model()
    stage = _stage()
    load_checkpoint(_sharded(tmp_path / "w", model), stage,
                    model_keys=model.state_dict().keys())
    torch.testing.assert_close(stage.state_dict()["2.weight"], model[2].weight)


def test_only_the_shards_a_stage_uses_are_opened(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "w", _model())
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"not safetensors")
    state = read_folder(folder)
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert state["2.bias"].shape == (3,)  # the other shard is never read


def test_transformers_save_pretrained_shards_load(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "w", max_shard_size="20KB")
    state = read_folder(tmp_path / "w")
    assert set(state) == set(model.state_dict())
    torch.testing.assert_close(state["lm_head.weight"], model.lm_head.weight)


def test_a_shard_missing_from_the_folder_is_named(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "w", _model())
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, _stage())
    message = str(info.value)
    assert "model-00002-of-00002.safetensors" in message and "2.bias" in message
    assert "copy every shard" in message


def test_a_folder_without_an_index_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "w", _model())
    (folder / INDEX).unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, _stage())
    assert f"without {INDEX}" in str(info.value) and "2 safetensors files" in str(info.value)
    assert "save_pretrained" in str(info.value)


def test_a_folder_with_one_safetensors_file_and_no_index_is_that_file(tmp_path: Path) -> None:
    """What save_pretrained writes for a model under its shard size."""
    model = _model()
    (tmp_path / "w").mkdir()
    safetensors_torch.save_file(model.state_dict(), str(tmp_path / "w" / "model.safetensors"))
    stage = _stage()
    load_checkpoint(tmp_path / "w", stage)
    torch.testing.assert_close(stage.state_dict()["2.weight"], model[2].weight)


def test_an_unreadable_index_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "w", _model())
    (folder / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="weight_map"):
        read_folder(folder)


@pytest.mark.parametrize("kind", ["pt", "folder"])
def test_another_models_weights_are_refused_naming_the_key_and_shapes(tmp_path: Path,
                                                                     kind: str) -> None:
    other = _model(width=8)  # same keys, other shapes
    if kind == "pt":
        path = tmp_path / "other.pt"
        torch.save(other.state_dict(), path)
    else:
        path = _sharded(tmp_path / "w", other)
    with pytest.raises(PartitionError) as info:
        load_checkpoint(path, _stage(), model_keys=_model().state_dict().keys())
    message = str(info.value)
    assert "2.weight" in message and "(3, 8)" in message and "(3, 6)" in message
    assert "pass a file of this model's state dict" in message
