"""Read a transformers-style folder of safetensors shards as one lazy state dict.

``model.save_pretrained(folder, max_shard_size=...)`` (and the Hugging Face hub) store a
model as several ``.safetensors`` files plus ``model.safetensors.index.json``, whose
``weight_map`` names the file holding each key. :class:`ShardedSafetensors` opens a shard
when one of its tensors is first asked for and reads only that tensor, so a rank reads the
keys of its stage and nothing else. A folder holding one ``.safetensors`` file and no index
(what ``save_pretrained`` writes for a small model) is that file.

Refused, each naming what to fix: a folder without an index and with several (or no)
safetensors files, an index naming a shard that is not in the folder, an unreadable index.

Example:
    >>> import json, os, tempfile, torch
    >>> from safetensors.torch import save_file
    >>> folder = tempfile.mkdtemp()
    >>> save_file({"a": torch.ones(2)}, os.path.join(folder, "part-1.safetensors"))
    >>> save_file({"b": torch.zeros(1)}, os.path.join(folder, "part-2.safetensors"))
    >>> index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    >>> with open(os.path.join(folder, INDEX), "w") as handle:
    ...     json.dump(index, handle)
    >>> state = read_folder(folder)
    >>> sorted(state), state["a"].tolist()
    (['a', 'b'], [1.0, 1.0])
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from partitioner.errors import CheckpointError
from partitioner.runtime.distributed.weights_file import SafetensorsState

__all__ = ["INDEX", "ShardedSafetensors", "read_folder"]

INDEX = "model.safetensors.index.json"
"""The index file transformers writes beside the shards."""


class ShardedSafetensors(Mapping[str, torch.Tensor]):
    """The shards an index names, as one read-only mapping; a shard is opened when first
    used and a tensor read when it is looked up.

    Args:
        folder: the folder holding the index and the shards.
        weight_map: each key's shard file, relative to ``folder``.
    """

    def __init__(self, folder: Path, weight_map: Mapping[str, str]) -> None:
        self._folder = folder
        self._map = dict(weight_map)
        self._open: dict[str, SafetensorsState] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        name = self._map[key]  # KeyError for a key no shard holds, as a dict
        if name not in self._open:
            self._open[name] = SafetensorsState(self._folder / name)
        return self._open[name][key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


def read_folder(path: str | os.PathLike[str]) -> Mapping[str, torch.Tensor]:
    """The state dict a folder of safetensors shards holds, read lazily.

    Raises:
        CheckpointError: no index and not exactly one ``.safetensors`` file; an index that
            is not JSON with a ``weight_map``; a shard the index names missing.
    """
    folder = Path(path)
    index = folder / INDEX
    if not index.exists():
        return _single_file(folder)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot read {index} as a safetensors index ({error!r}); "
                              "it must be JSON with a 'weight_map' of key -> shard file, as "
                              "save_pretrained writes it") from error
    missing = sorted({name for name in weight_map.values() if not (folder / name).is_file()})
    if missing:
        keys = sorted(k for k, name in weight_map.items() if name == missing[0])
        raise CheckpointError(
            f"{index} names {len(missing)} shard files missing from {folder}: "
            f"{', '.join(missing[:4])} (holding {', '.join(keys[:3])}"
            f"{', ...' if len(keys) > 3 else ''}); copy every shard the index lists into "
            "the folder (an interrupted download or copy leaves some out)")
    return ShardedSafetensors(folder, weight_map)


def _single_file(folder: Path) -> Mapping[str, torch.Tensor]:
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(files) == 1:
        return SafetensorsState(folder / files[0])
    found = f"{len(files)} safetensors files ({', '.join(files[:4])})" if files \
        else "no safetensors file"
    raise CheckpointError(
        f"{folder} is a folder without {INDEX} and holds {found}; pass a folder written by "
        "model.save_pretrained(folder) (its shards and their index), one .safetensors file, "
        "or the file torch.save(model.state_dict(), path) wrote")
