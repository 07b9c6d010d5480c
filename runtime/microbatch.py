"""Split call arguments into micro-batches along dim 0 and join outputs back.

Every tensor whose dim 0 equals the batch size (that of the first tensor with a batch
dimension) is split into ``chunks`` pieces with ``torch.tensor_split`` semantics, so an
uneven batch gives an uneven last chunk; other leaves (non-tensors, tensors without that
dim 0) go to every micro-batch unchanged.

Outputs are joined leaf by leaf (:func:`join_rules`), so that the result is what the model
returns for the whole batch:

- a tensor with a batch dimension (dim 0 is the micro-batch's samples times a fixed number
  of rows per sample, the capture's finding where it has one) is concatenated along dim 0;
- a floating-point tensor without one (an auxiliary loss of shape ``()``, a per-expert load
  of shape ``(E,)``) is averaged over the micro-batches, each weighted by its share of the
  samples: the whole batch's value for any mean over samples, and what Megatron-LM does
  with per-micro-batch auxiliary losses; where the capture found it made by a ``sum`` over
  the batch, the micro-batches' values are summed instead;
- any other tensor without one (integer counts) is refused with an
  :class:`~partitioner.errors.OutputError`, as are shapes that differ between micro-batches;
- a non-tensor leaf is taken from the first micro-batch.

Example:
    >>> import torch
    >>> parts = scatter([torch.arange(5), "mode"], 2)
    >>> [p[0].tolist() for p in parts], parts[1][1]
    ([[0, 1, 2], [3, 4]], 'mode')
    >>> gather([torch.ones(2), torch.ones(1)]).shape
    torch.Size([3])
    >>> gather([(torch.ones(2, 1), torch.tensor(1.0)), (torch.ones(1, 1), torch.tensor(4.0))],
    ...        sizes=[2, 1])[1]
    tensor(2.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.errors import ChunksError, OutputError

__all__ = ["batch_size", "scatter", "gather", "join_rules", "split_grad", "mean_weights", "CAT",
           "MEAN", "SUM", "FIRST", "OutputHint"]

#: Per output leaf, what the capture found: the rows of dim 0 per sample (an ``int``), or,
#: for a leaf without a batch dimension, :data:`MEAN` or :data:`SUM` (how it was reduced
#: over the batch), or ``None`` (unknown: decided from the micro-batches).
OutputHint = int | str | None

SUM = "sum"
"""Join rule of a leaf without a batch dimension made by a sum over the batch: summed."""
CAT = "cat"
"""Join rule of a batched tensor leaf: concatenated along dim 0."""
MEAN = "mean"
"""Join rule of a floating-point leaf without a batch dimension: averaged, weighted by samples."""
FIRST = "first"
"""Join rule of a non-tensor leaf: the first micro-batch's."""


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
            kinds = ", ".join(type(v).__name__ for v in values)
            raise ChunksError(f"chunks={chunks} but no input tensor has a batch dimension to "
                              f"split (the inputs are: {kinds}); pass torch tensors with the "
                              "batch as dim 0, or chunks=1")
        return [list(values)]
    if batch == 0:
        raise ChunksError(f"the batch is empty (dim 0 of the inputs has size 0) and "
                          f"chunks={chunks} micro-batches need at least one sample each; "
                          f"call with a batch of {chunks} or more samples")
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


def join_rules(outputs: Sequence[Any], sizes: Sequence[int],
               rows: Sequence[OutputHint] | None = None) -> list[str]:
    """How each leaf of the per-micro-batch ``outputs`` joins: :data:`CAT`, :data:`MEAN`,
    :data:`SUM` or :data:`FIRST` (see the module doc).

    Args:
        outputs: one output pytree per micro-batch (or replica), of one structure.
        sizes: the samples of each micro-batch.
        rows: per output leaf, what the capture found (:data:`OutputHint`); ignored unless
            it has one entry per leaf.

    Raises:
        OutputError: A leaf without a batch dimension that is not a floating-point tensor,
            or whose shape differs between micro-batches.
    """
    flat = [pytree.tree_leaves(out) for out in outputs]
    if len(flat) == 1:  # nothing to join: the one output is the whole batch's
        return [FIRST if not isinstance(leaf, torch.Tensor) else CAT if leaf.dim() else MEAN
                for leaf in flat[0]]
    hints = list(rows) if rows is not None and len(rows) == len(flat[0]) else None
    return [_rule(k, [leaves[k] for leaves in flat], sizes, hints[k] if hints else None)
            for k in range(len(flat[0]))]


def _rule(k: int, pieces: list[Any], sizes: Sequence[int], hint: OutputHint) -> str:
    first = pieces[0]
    if not isinstance(first, torch.Tensor):
        return FIRST
    rows = hint if isinstance(hint, int) else 0 if hint is not None else None
    if rows is None and first.dim() > 0 and sizes[0] and first.shape[0] % sizes[0] == 0:
        rows = first.shape[0] // sizes[0]
    if rows and all(p.dim() > 0 and p.shape[0] == rows * n for p, n in zip(pieces, sizes)):
        return CAT
    shapes = [tuple(p.shape) for p in pieces]
    if any(shape != shapes[0] for shape in shapes):
        raise OutputError(f"output leaf {k} has shapes {shapes} in the micro-batches of "
                          f"{list(sizes)} samples: neither one batch dimension (dim 0 a fixed "
                          "number of rows per sample) nor one shape to average; return "
                          "batched tensors (dim 0 the batch) or fixed-shape statistics")
    if not (first.is_floating_point() or first.is_complex()):
        raise OutputError(f"output leaf {k} is a {first.dtype} tensor of shape {shapes[0]} "
                          f"without a batch dimension (dim 0 is not the {sizes[0]} samples of "
                          "a micro-batch), which cannot be averaged over micro-batches or "
                          "replicas; return it per sample (dim 0 the batch) or as a float "
                          "mean over the batch, or partition with chunks=1 and dp=1")
    return SUM if hint == SUM else MEAN


def mean_weights(sizes: Sequence[int]) -> list[float]:
    """Each micro-batch's share of the samples (equal shares if none has any)."""
    total = sum(sizes)
    return [n / total for n in sizes] if total else [1.0 / len(sizes)] * len(sizes)


def gather(outputs: list[Any], sizes: Sequence[int] | None = None,
           rows: Sequence[OutputHint] | None = None, device: torch.device | None = None,
           rules: Sequence[str] | None = None) -> Any:
    """Join per-micro-batch outputs (pytrees of one structure) into the whole batch's.

    Args:
        outputs: one output per micro-batch.
        sizes: the samples of each micro-batch (default: dim 0 of each output's first
            tensor leaf with one).
        rows: what the capture found of each output leaf (:func:`join_rules`).
        device: where the joined tensors go (default: where they are).
        rules: the join rules, if already decided (:func:`join_rules`).

    Raises:
        OutputError: A leaf that cannot be joined (:func:`join_rules`).
    """
    if len(outputs) == 1:
        return outputs[0]
    if sizes is None:
        sizes = [batch_size(out) or 1 for out in outputs]
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    rules = rules if rules is not None else join_rules(outputs, sizes, rows)
    weights = mean_weights(sizes)
    joined = []
    for k, rule in enumerate(rules):
        pieces = [leaves[k] for leaves, _ in flat]
        if rule == FIRST:
            joined.append(pieces[0])
            continue
        target = device or pieces[0].device
        moved = [p.to(target) for p in pieces]
        if rule == CAT:
            joined.append(torch.cat(moved))
        else:
            factors = weights if rule == MEAN else [1.0] * len(moved)
            joined.append(sum((p * w for p, w in zip(moved[1:], factors[1:])),
                              moved[0] * factors[0]).to(pieces[0].dtype))
    return pytree.tree_unflatten(joined, spec)


def split_grad(grad: torch.Tensor, rule: str, lengths: Sequence[int],
               sizes: Sequence[int]) -> list[torch.Tensor]:
    """The gradient of a joined leaf, given back to each micro-batch's leaf: its
    ``lengths[i]`` rows for :data:`CAT`, the gradient times its weight for :data:`MEAN`,
    the gradient itself for :data:`SUM`."""
    if len(sizes) == 1:
        return [grad]
    if rule == CAT:
        return list(torch.split(grad, list(lengths)))
    if rule == SUM:
        return [grad] * len(sizes)
    return [grad * w for w in mean_weights(sizes)]
