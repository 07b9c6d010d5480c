"""Megatron's sequence-parallel mappings (Korthikanti et al. 2022, Megatron-LM's
``tensor_parallel/mappings.py``): the collectives at the edges of a region whose values are
split along the sequence.

Under plain tensor parallelism the norms, residual adds and dropouts between two Megatron
pairs run on the whole activation on every rank, between an all-reduce and a ``copy_to_tp``.
Sequence parallelism runs them on ``s / tp`` tokens each::

    function                forward                        backward
    reduce_scatter_to_sp    sum over ranks, keep a slice   all-gather along dim
    all_gather_from_sp      all-gather along dim           sum over ranks, keep a slice

The reduce-scatter replaces the all-reduce after a row-parallel product, the all-gather the
``copy_to_tp`` before a column-parallel one: the same bytes on a ring, activations divided
by ``tp`` in between. A :class:`~partitioner.runtime.tensor_parallel.collectives.Communicator`
has no reduce-scatter of its own, so this one sums (``all_reduce``) and keeps its slice:
the same values, the sum's transient whole tensor freed at once; the counts name them
``"reduce_scatter"``. :func:`whole_size` answers a shape read of the whole value from a
shard, so that reading a size costs no all-gather.

Example:
    >>> import torch
    >>> from partitioner.runtime.tensor_parallel.collectives import ShapeCommunicator
    >>> comm = ShapeCommunicator(rank=0, size=2)
    >>> reduce_scatter_to_sp(torch.ones(2, 8, 4), comm, 1).shape
    torch.Size([2, 4, 4])
    >>> all_gather_from_sp(torch.ones(2, 4, 4), comm, 1).shape
    torch.Size([2, 8, 4])
"""

from __future__ import annotations

from typing import Any

import torch

from partitioner.errors import ShardSizeError
from partitioner.runtime.tensor_parallel.collectives import Communicator

__all__ = ["reduce_scatter_to_sp", "all_gather_from_sp", "whole_size"]


def _slice(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """This rank's contiguous part of ``x`` along ``dim`` (``dim`` divisible by the size)."""
    step = x.shape[dim] // comm.size
    return x.narrow(dim, comm.rank * step, step).contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int, phase: str) -> torch.Tensor:
    if x.shape[dim] % comm.size:  # before the collective: every rank has this shape
        raise ShardSizeError(
            f"sequence parallelism splits dim {dim} of a {tuple(x.shape)} activation over "
            f"{comm.size} tensor-parallel ranks, but {comm.size} does not divide "
            f"{x.shape[dim]}; pass sequences whose length {comm.size} divides (pad them), "
            "or drop sequence_parallel")
    comm.counts["reduce_scatter", phase] += 1
    comm.counts["all_reduce", phase] -= 1  # the sum below is how, not what, it runs
    return _slice(comm.all_reduce(x, phase), comm, dim)


def _all_gather(x: torch.Tensor, comm: Communicator, dim: int, phase: str) -> torch.Tensor:
    return torch.cat(comm.all_gather(x.contiguous(), phase), dim)


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_gather(grad, ctx.comm, ctx.dim, "backward"), None, None


class _AllGatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _reduce_scatter(grad, ctx.comm, ctx.dim, "backward"), None, None


def reduce_scatter_to_sp(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Leave the tensor-parallel region into the sequence-parallel one: this rank's slice
    along ``dim`` of the sum over ranks; all-gather of the gradient backward."""
    return _ReduceScatterToSP.apply(x, comm, dim)  # type: ignore[no-any-return]


def all_gather_from_sp(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Enter the tensor-parallel region from sequence shards: all-gather along ``dim``
    forward; the gradient summed over ranks and sliced backward (the partial input gradients
    of a column-parallel product)."""
    return _AllGatherFromSP.apply(x, comm, dim)  # type: ignore[no-any-return]


def whole_size(x: torch.Tensor, dim: int, tp: int, which: int | None = None
               ) -> torch.Size | int:
    """The whole value's size (``x.shape``, or ``x.size(which)``) of ``x``, a shard of
    ``1 / tp`` of it along ``dim``: what a shape read of the whole value gives, with no
    all-gather."""
    size = list(x.shape)
    size[dim] *= tp
    return torch.Size(size) if which is None else size[which]
