"""The operations a tensor-parallel rank graph calls besides the collectives.

The tensor-parallel pass rewrites a graph into one rank's program; where a plain torch call
no longer fits a rank's slice, it calls one of these instead:

- :func:`vocab_embedding`: a lookup in this rank's rows of the vocabulary; ids outside them
  give zeros, so summing over ranks (``reduce_from_tp``) gives the whole lookup;
- :func:`global_shape`, :func:`global_size`, :func:`global_numel`: sizes of a split tensor as
  the unsplit model sees them, so every size a graph computes keeps its meaning;
- :func:`in_out_linear`: ``x @ w + b`` for layers storing their weight as ``(in, out)``
  (transformers' ``Conv1D``);
- :func:`sharded_dropout`: dropout on a split tensor, drawing from a generator of this rank's
  own (Megatron's "model-parallel" RNG), while dropout on replicated tensors keeps drawing
  from the generator all ranks share, so replicated activations stay identical. Both
  generators are installed through ``partitioner.runtime.rng`` (:func:`use_shard_generator` is
  ``partitioner.runtime.rng.use_shard_generator``, kept here too for the runtimes that import it
  here).

Example:
    >>> import torch
    >>> w = torch.eye(4)[2:]                      # rank 1 of 2 holds rows 2 and 3
    >>> vocab_embedding(torch.tensor([0, 3]), w, 2).tolist()
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.runtime import rng
from partitioner.runtime.rng import use_shard_generator

__all__ = ["vocab_embedding", "global_shape", "global_size", "global_numel", "in_out_linear",
           "sharded_dropout", "sharded_dropout_module", "use_shard_generator", "divide_entry"]


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int,
                    padding_idx: int | None = None, scale_grad_by_freq: bool = False,
                    sparse: bool = False) -> torch.Tensor:
    """Look ``ids`` up in the rows ``start .. start + len(weight)`` of a split table.

    Rows this rank does not hold give zeros (and no gradient), so the sum over ranks is the
    whole table's lookup. ``padding_idx`` is the global index of the padding row.
    """
    rows = weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= rows)
    local = local.masked_fill(outside, 0)
    pad = None
    if padding_idx is not None and start <= padding_idx < start + rows:
        pad = padding_idx - start
    out = F.embedding(local, weight, pad, None, 2.0, scale_grad_by_freq, sparse)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def global_shape(x: torch.Tensor, dim: int, tp: int) -> torch.Size:
    """``x.shape`` with dimension ``dim`` (split over ``tp`` ranks) at its whole size."""
    shape = list(x.shape)
    shape[dim] *= tp
    return torch.Size(shape)


def global_size(x: torch.Tensor, query: int, dim: int, tp: int) -> int:
    """``x.size(query)`` as the unsplit tensor has it (``dim`` is split over ``tp``)."""
    size = int(x.size(query))
    return size * tp if query % x.dim() == dim else size


def global_numel(x: torch.Tensor, tp: int) -> int:
    """``x.numel()`` of the unsplit tensor."""
    return x.numel() * tp


def in_out_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight + bias`` for a weight stored ``(in_features, out_features)``."""
    return F.linear(x, weight.t(), bias)


def sharded_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout on a split tensor, with a mask from this rank's own generator (installed
    with :func:`use_shard_generator`; without one, the thread's shared generator)."""
    with rng.use_generator(rng.current_shard_generator() or rng.current_generator()):
        return rng.dropout(x, p, training)


def sharded_dropout_module(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """:func:`sharded_dropout` with an ``nn.Dropout``'s ``p`` and train/eval mode."""
    return sharded_dropout(x, float(module.p), module.training)  # type: ignore[arg-type]


def divide_entry(shape: Sequence[int], index: int, tp: int) -> tuple[int, ...]:
    """``shape`` with entry ``index`` divided by ``tp`` (a whole size become one rank's)."""
    out = [int(s) for s in shape]
    if out[index] != -1:
        out[index] //= tp
    return tuple(out)
