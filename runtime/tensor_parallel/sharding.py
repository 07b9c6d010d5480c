"""How one tensor is split over the tensor-parallel ranks, and how to split and rejoin it.

A :class:`Sharding` says which dimension of a parameter is split over ``tp`` ranks and under
which Megatron name (``colwise``: a Linear's output features, ``rowwise``: its input
features, ``vocab``: an Embedding's rows, ``replicate``: not split). Rank ``r`` holds the
``r``-th of ``tp`` equal slices of that dimension.

A fused projection (one Linear computing q, k and v, then split three ways) needs each rank
to hold its slice of *each* part, not one contiguous third of the whole: ``blocks`` lists the
parts' sizes along the split dimension, and each part is sliced separately::

    blocks=(4, 4, 4), tp=2:   global rows  q0 q1 q2 q3 | k0 k1 k2 k3 | v0 v1 v2 v3
                              rank 0 holds q0 q1 k0 k1 v0 v1;  rank 1 holds q2 q3 k2 k3 v2 v3

Example:
    >>> import torch
    >>> s = Sharding("colwise", dim=0, tp=2, blocks=(2, 2))
    >>> w = torch.arange(4.0)
    >>> [shard_tensor(w, s, r).tolist() for r in range(2)]
    [[0.0, 2.0], [1.0, 3.0]]
    >>> unshard([shard_tensor(w, s, r) for r in range(2)], s).tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partitioner.errors import ShardSizeError, TensorParallelError

__all__ = ["Sharding", "KINDS", "SPLIT_KINDS", "REPLICATE", "HEADS",
           "TensorParallelError", "ShardSizeError",
           "shard_tensor", "unshard", "local_slices", "block_sizes"]

#: The ways a parameter is split, Megatron's names: ``colwise`` splits a Linear's output
#: features, ``rowwise`` its input features, ``vocab`` an embedding's rows. This is the one
#: definition of the split kinds: plans, plan files (``plan_schema.json``, checked by a test),
#: tensor-parallel rules and the passes all import it.
SPLIT_KINDS = ("colwise", "rowwise", "vocab")
#: Every rank holds all of the parameter.
REPLICATE = "replicate"
#: An attention module split by heads (a rule and site kind; its parameters split colwise/rowwise).
HEADS = "heads"
#: The ways a parameter can be held over ranks: split, or replicated.
KINDS = (*SPLIT_KINDS, REPLICATE)


@dataclass(frozen=True)
class Sharding:
    """How a tensor is split over ``tp`` ranks.

    Attributes:
        kind: one of :data:`KINDS`.
        dim: the split dimension (``None`` for ``replicate``).
        tp: the number of ranks.
        blocks: sizes of the parts along ``dim`` that are split separately (a fused qkv
            projection has three); ``None`` means one part.
    """

    kind: str
    dim: int | None
    tp: int
    blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in KINDS:
            problems.append(f"kind={self.kind!r}; use one of {KINDS}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            problems.append(f"tp={self.tp!r}; use an int >= 1")
        if (self.kind == REPLICATE) != (self.dim is None):
            problems.append(f"kind={self.kind!r} with dim={self.dim!r}; replicate has no dim "
                            "and every other kind needs one")
        if self.dim is not None and (isinstance(self.dim, bool) or not isinstance(self.dim, int)
                                     or self.dim < 0):
            problems.append(f"dim={self.dim!r}; use a tensor dimension >= 0")
        if self.blocks is not None:
            if not self.blocks or any(not isinstance(b, int) or b < 1 for b in self.blocks):
                problems.append(f"blocks={self.blocks!r}; use positive sizes")
            else:
                object.__setattr__(self, "blocks", tuple(self.blocks))
        if problems:
            raise TensorParallelError("invalid sharding: " + "; ".join(problems))

    @property
    def is_split(self) -> bool:
        """Whether ranks hold different slices (not ``replicate``, and ``tp > 1``)."""
        return self.dim is not None and self.tp > 1

    def check(self, shape: Sequence[int], name: str) -> list[str]:
        """Problems splitting a tensor of ``shape`` (named ``name``) this way, if any."""
        if self.dim is None:
            return []
        if self.dim >= len(shape):
            return [f"{name} has {len(shape)} dimensions, so it cannot be split along dim "
                    f"{self.dim}"]
        size = int(shape[self.dim])
        parts = block_sizes(self, size)
        if sum(parts) != size:
            return [f"{name}: blocks {self.blocks} sum to {sum(parts)} but dim {self.dim} has "
                    f"size {size}"]
        bad = [p for p in parts if p % self.tp]
        if bad:
            return [f"{name}: dim {self.dim} of size {size}"
                    + (f" (parts {list(parts)})" if len(parts) > 1 else "")
                    + f" does not divide by tp={self.tp}"]
        return []

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape one rank holds of a tensor of ``shape``."""
        out = [int(s) for s in shape]
        if self.dim is not None:
            out[self.dim] //= self.tp
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """``{"kind", "dim", "tp"}`` plus ``"blocks"`` for fused parts (JSON-ready)."""
        out: dict[str, Any] = {"kind": self.kind, "dim": self.dim, "tp": self.tp}
        if self.blocks is not None:
            out["blocks"] = list(self.blocks)
        return out


def block_sizes(sharding: Sharding, size: int) -> tuple[int, ...]:
    """The global sizes of the separately split parts of a dimension of ``size``."""
    return sharding.blocks if sharding.blocks is not None else (size,)


def local_slices(sharding: Sharding, size: int, rank: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each piece rank ``rank`` holds along the split dimension."""
    pieces, offset = [], 0
    for block in block_sizes(sharding, size):
        step = block // sharding.tp
        pieces.append((offset + rank * step, step))
        offset += block
    return pieces


def shard_tensor(tensor: torch.Tensor, sharding: Sharding, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``tensor`` (a new, contiguous tensor; a copy if replicated).

    Raises:
        ShardSizeError: if the split dimension does not divide.
    """
    if not 0 <= rank < sharding.tp:
        raise TensorParallelError(f"rank {rank} is outside 0..{sharding.tp - 1}")
    problems = sharding.check(tensor.shape, "tensor")
    if problems:
        raise ShardSizeError(problems[0])
    data = tensor.detach()
    if sharding.dim is None:
        return data.clone()
    pieces = [data.narrow(sharding.dim, start, length)
              for start, length in local_slices(sharding, tensor.shape[sharding.dim], rank)]
    return torch.cat(pieces, sharding.dim) if len(pieces) > 1 else pieces[0].clone()


def unshard(parts: Sequence[torch.Tensor], sharding: Sharding) -> torch.Tensor:
    """Rejoin the ranks' slices (in rank order) into the whole tensor.

    Replicated tensors return rank 0's (every rank holds the same values).
    """
    if len(parts) != sharding.tp:
        raise TensorParallelError(f"{len(parts)} parts for tp={sharding.tp}")
    if sharding.dim is None:
        return parts[0].detach().clone()
    dim = sharding.dim
    if sharding.blocks is None:
        return torch.cat([p.detach() for p in parts], dim)
    local = parts[0].shape[dim]
    n_blocks = len(sharding.blocks)
    steps = [b // sharding.tp for b in sharding.blocks]
    if sum(steps) != local:
        raise TensorParallelError(f"a part has {local} entries along dim {dim} but the blocks "
                                  f"{sharding.blocks} over tp={sharding.tp} need {sum(steps)}")
    split = [torch.split(p.detach(), steps, dim) for p in parts]
    return torch.cat([split[r][k] for k in range(n_blocks) for r in range(sharding.tp)], dim)
