"""Split call arguments into micro-batches along dim 0 and join outputs back.

Every tensor whose dim 0 equals the batch size (that of the first tensor with a batch
dimension) is split into ``chunks`` pieces with ``torch.tensor_split`` semantics, so an
uneven batch gives an uneven last chunk; other leaves (non-tensors, tensors without that
dim 0) go to every micro-batch unchanged. Outputs are joined by concatenating tensor leaves
along dim 0; non-tensor leaves are taken from the first micro-batch.

Example:
    >>> import torch
    >>> parts = scatter([torch.arange(5), "mode"], 2)
    >>> [p[0].tolist() for p in parts], parts[1][1]
    ([[0, 1, 2], [3, 4]], 'mode')
    >>> gather([torch.ones(2), torch.ones(1)]).shape
    torch.Size([3])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.errors import ChunksError

__all__ = ["batch_size", "scatter", "gather"]


def batch_size(values: Any) -> int | None:
    """Dim 0 of the first tensor leaf that has a dim 0, or None."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def scatter(values: list[Any], chunks: int) -> list[list[Any]]:
    """Split ``values`` (one entry per graph input) into ``chunks`` micro-batches.

    Raises:
        ChunksError: if ``chunks`` < 1 or exceeds the batch size.
    """
    if chunks < 1:
        raise ChunksError(f"chunks={chunks}; pass chunks >= 1 (the number of micro-batches)")
    batch = batch_size(values)
    if batch is None:
        if chunks > 1:
            raise ChunksError(f"chunks={chunks} but no input tensor has a batch dimension to "
                              "split; pass chunks=1 or batched inputs")
        return [list(values)]
    if chunks > batch:
        raise ChunksError(f"chunks={chunks} is larger than the batch size {batch}; pass "
                          f"chunks <= {batch}")
    leaves, spec = pytree.tree_flatten(values)
    pieces = [_split(leaf, batch, chunks) for leaf in leaves]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(chunks)]


def _split(leaf: Any, batch: int, chunks: int) -> list[Any]:
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
        return list(torch.tensor_split(leaf, chunks))
    return [leaf] * chunks


def gather(outputs: list[Any]) -> Any:
    """Join per-micro-batch outputs (pytrees of one structure) along dim 0.

    Raises:
        ValueError: if a tensor output is 0-dimensional (it has no batch to join).
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    joined = []
    for position, first in enumerate(flat[0][0]):
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                raise ValueError(f"output leaf {position} is a 0-dim tensor; a pipelined "
                                 "model must return batched tensors (compute a loss outside)")
            joined.append(torch.cat([leaves[position] for leaves, _ in flat]))
        else:
            joined.append(first)
    return pytree.tree_unflatten(joined, spec)
