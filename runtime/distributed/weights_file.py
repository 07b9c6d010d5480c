"""Read a weights file lazily: each rank reads only the tensors of its stage.

A rank of a model too big for one device must fill its stage from a file holding the whole
model without reading the whole model into memory:

- a ``torch.save`` file (this project's checkpoint, or a plain ``model.state_dict()``) is
  opened with ``torch.load(..., mmap=True, weights_only=True)``: its tensors map the file,
  and only the pages a rank copies from are read;
- a safetensors file (``.safetensors``; needs the ``safetensors`` package) is opened with
  ``safetensors.safe_open``, and a tensor is read when it is asked for.

Example:
    >>> import tempfile, os, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
    >>> torch.save({"w": torch.ones(2), "b": torch.zeros(1)}, path)
    >>> state = read_weights(path)
    >>> sorted(state), state["w"].tolist()
    (['b', 'w'], [1.0, 1.0])
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from partitioner.errors import CheckpointError

__all__ = ["read_weights", "SafetensorsState"]


class SafetensorsState(Mapping[str, torch.Tensor]):
    """A safetensors file as a read-only mapping; a tensor is read when it is looked up.

    Raises:
        CheckpointError: if the ``safetensors`` package is missing or the file is unreadable.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from safetensors import safe_open
        except ImportError as error:
            raise CheckpointError(f"{path} is a safetensors file but the safetensors package "
                                  "is not installed; pip install safetensors (or save the "
                                  "weights with torch.save)") from error
        try:
            self._handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {path} as safetensors: {error}; pass a file "
                                  "written by safetensors.torch.save_file") from error
        self._keys = list(self._handle.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        tensor: torch.Tensor = self._handle.get_tensor(key)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def read_weights(path: str | os.PathLike[str]) -> Any:
    """What ``path`` holds, tensors left in the file until used: a :class:`SafetensorsState`
    for a ``.safetensors`` file, else ``torch.load``'s result, memory-mapped.

    Raises:
        CheckpointError: if there is no file at ``path`` or it cannot be read.
    """
    if not Path(path).exists():
        raise CheckpointError(f"no weights file at {path}; pass the path save() or "
                              "torch.save(model.state_dict(), path) wrote")
    if Path(path).is_dir():
        raise CheckpointError(f"{path} is a folder, not a weights file; pass the file save() "
                              "or torch.save(model.state_dict(), path) wrote")
    if str(path).endswith(".safetensors"):
        return SafetensorsState(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError):
        # A legacy (non-zip) torch.save file cannot be memory-mapped: read it whole. A
        # truncated one fails both ways (an OSError here), and is named below.
        pass
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"cannot read {path} with torch.load(weights_only=True): "
                              f"{error}; pass a checkpoint, a state dict saved with "
                              "torch.save, or a .safetensors file") from error
