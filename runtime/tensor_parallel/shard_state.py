"""Whole tensors from a tensor-parallel rank's slices, and slices from whole tensors.

A process running one rank of a split stage holds, for each split parameter, only its slice.
Checkpoints and ``state_dict()`` speak of whole tensors under the model's keys, so on the way
out every rank gathers its group's slices (a collective: all ranks of the tensor-parallel
group call it, in the same order), and on the way in each rank cuts its slice out of the whole
tensor. Optimizer state follows its parameter: a state tensor shaped like the parameter's
slice (Adam's moments) is gathered and cut like it; anything else (a step count) is the same
on every rank and passes through.

Example:
    >>> import torch
    >>> from partitioner.runtime.tensor_parallel.sharding import Sharding
    >>> state = ShardState({"w": Sharding("colwise", 0, 2)}, rank=1)
    >>> whole = torch.arange(8.0).reshape(4, 2)
    >>> state.split({"w": whole, "b": torch.ones(2)})["w"].tolist()
    [[4.0, 5.0], [6.0, 7.0]]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from partitioner.runtime.tensor_parallel.collectives import Communicator
from partitioner.runtime.tensor_parallel.sharding import Sharding, shard_tensor, unshard

__all__ = ["ShardState"]


class ShardState:
    """One rank's view of which entries are split, and how.

    Args:
        shardings: by state-dict key, how the entry is split (keys not named, or not split,
            are replicated: every rank holds the whole tensor).
        rank: this process's tensor-parallel rank.
        comm: its communicator on the tensor-parallel group (needed to gather).
    """

    def __init__(self, shardings: Mapping[str, Sharding], rank: int,
                 comm: Communicator | None = None) -> None:
        self.shardings = {k: s for k, s in shardings.items() if s.is_split}
        self.rank = rank
        self.comm = comm

    def _gather(self, local: torch.Tensor, sharding: Sharding, what: str) -> torch.Tensor:
        if self.comm is None:
            raise ValueError(f"gathering {what} needs the tensor-parallel communicator; "
                             "pass comm= when making the ShardState")
        return unshard(self.comm.all_gather(local.detach(), "state_dict"), sharding)

    def gather(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with every split entry whole (collective over the group)."""
        out = dict(state)
        for key in sorted(k for k in state if k in self.shardings):
            out[key] = self._gather(state[key], self.shardings[key], key)
        return out

    def split(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (whole tensors) with every split entry cut to this rank's slice."""
        return {k: shard_tensor(v, self.shardings[k], self.rank)
                if k in self.shardings and isinstance(v, torch.Tensor) else v
                for k, v in state.items()}

    def gather_optimizer(self, named: Mapping[str, Any],
                         local_params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """A named optimizer state
        (``partitioner.runtime.distributed.checkpoint_io.named_optimizer_state``) with the
        state of split parameters whole (collective over the group)."""
        state = dict(named["state"])
        for name in sorted(n for n in state if n in self.shardings):
            shape = local_params[name].shape
            entry = dict(state[name])
            for field in sorted(entry):
                value = entry[field]
                if isinstance(value, torch.Tensor) and value.shape == shape:
                    entry[field] = self._gather(value, self.shardings[name], f"{name}.{field}")
            state[name] = entry
        return {**named, "state": state}

    def split_optimizer(self, named: Mapping[str, Any],
                        whole_params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """A named optimizer state of whole tensors cut to this rank's slices."""
        state = dict(named["state"])
        for name in [n for n in state if n in self.shardings and n in whole_params]:
            shape = whole_params[name].shape
            state[name] = {field: shard_tensor(value, self.shardings[name], self.rank)
                           if isinstance(value, torch.Tensor) and value.shape == shape
                           else value for field, value in state[name].items()}
        return {**named, "state": state}
