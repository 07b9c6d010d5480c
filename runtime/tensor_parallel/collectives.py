"""Autograd-aware collectives over a tensor-parallel group, in one process or across many.

A tensor-parallel graph talks to its peers through four functions, Megatron's mappings
between the replicated and the parallel region, each with the backward that makes gradients
exact::

    function        forward                         backward
    copy_to_tp      identity                        all-reduce (sum)
    reduce_from_tp  all-reduce (sum)                identity
    gather_from_tp  all-gather along a dim          keep this rank's slice
    scatter_to_tp   keep this rank's slice          all-gather along a dim

They call a :class:`Communicator`, one per rank:

- :class:`ThreadGroup` members, for ranks that are threads of one process (one per device);
  an all-reduce is a copy of every rank's tensor to this rank's device and a sum in rank
  order, so every rank gets bit-identical results;
- :class:`ProcessGroupCommunicator`, for ranks that are processes: ``torch.distributed`` on
  the tensor-parallel process group (gloo on CPU, NCCL on GPUs).

Every communicator counts the collectives it runs, by name and autograd phase, so tests can
check that a transformer block's forward runs exactly two all-reduces.

Example:
    >>> import torch
    >>> comm = ShapeCommunicator(rank=0, size=2)
    >>> x = torch.ones(2, 3, requires_grad=True)
    >>> reduce_from_tp(copy_to_tp(x, comm), comm).shape
    torch.Size([2, 3])
    >>> comm.counts["all_reduce", "forward"]
    1
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from partitioner.errors import CollectiveAborted
from partitioner.runtime.tensor_parallel.sharding import Sharding, local_slices

__all__ = ["Communicator", "ThreadGroup", "ThreadCommunicator", "ProcessGroupCommunicator",
           "ShapeCommunicator", "UnboundCommunicator", "CollectiveAborted", "copy_to_tp",
           "reduce_from_tp", "gather_from_tp", "scatter_to_tp", "gather_blocks", "slice_blocks"]


class Communicator(Protocol):
    """One rank's handle on its tensor-parallel group."""

    rank: int
    size: int
    counts: Counter[tuple[str, str]]

    def all_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        """The sum of every rank's ``x`` (a new tensor; ``x`` is not modified)."""

    def all_gather(self, x: torch.Tensor, phase: str) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order, on this rank's device."""


class ThreadGroup:
    """A tensor-parallel group whose ranks are threads of this process.

    Each collective is a rendezvous: every rank deposits its tensor, waits for the others,
    reads all of them, and waits again so that no rank reuses its tensor while a peer may
    still be reading it. When a rank fails, :meth:`abort` releases the others with
    :class:`CollectiveAborted` instead of letting them wait forever.

    Args:
        devices: one device per rank.
        timeout: seconds a rank waits for its peers before the group is broken.
    """

    def __init__(self, devices: Sequence[torch.device], timeout: float = 300.0) -> None:
        if not devices:
            raise ValueError("a thread group needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        self.size = len(self.devices)
        self.timeout = timeout
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots: list[torch.Tensor | None] = [None] * self.size
        self.members = [ThreadCommunicator(self, r) for r in range(self.size)]

    def exchange(self, rank: int, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Deposit ``x`` and return every rank's deposit (rank order)."""
        self._slots[rank] = x
        self._wait(rank, what)
        parts = [s for s in self._slots if s is not None]
        return parts

    def release(self, rank: int, what: str) -> None:
        """Wait until every rank has read the deposits, then clear this rank's slot."""
        self._wait(rank, what)
        self._slots[rank] = None

    def _wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveAborted(
                f"tensor-parallel rank {rank} of {self.size} was waiting in {what} when the "
                f"group broke: another rank failed, or a peer did not arrive within "
                f"{self.timeout:g} s") from None

    def abort(self) -> None:
        """Release every rank waiting in a collective (they raise :class:`CollectiveAborted`)."""
        self._barrier.abort()

    def reset(self) -> None:
        """Make the group usable again after :meth:`abort` (call when no rank is inside)."""
        if self._barrier.broken:
            self._barrier.reset()
        self._slots = [None] * self.size


class ThreadCommunicator:
    """Rank ``rank`` of a :class:`ThreadGroup`: collectives as copies and sums."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.size = group.size
        self.device = group.devices[rank]
        self.counts: Counter[tuple[str, str]] = Counter()

    def all_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        self.counts["all_reduce", phase] += 1
        what = f"all_reduce ({phase})"
        parts = self.group.exchange(self.rank, x, what)
        total = parts[0].to(self.device, copy=True)
        for part in parts[1:]:
            total += part.to(self.device)
        self.group.release(self.rank, what)
        return total

    def all_gather(self, x: torch.Tensor, phase: str) -> list[torch.Tensor]:
        self.counts["all_gather", phase] += 1
        what = f"all_gather ({phase})"
        parts = self.group.exchange(self.rank, x, what)
        # Copies, so that no rank keeps a reference into a peer's tensor.
        out = [p.to(self.device, copy=True) for p in parts]
        self.group.release(self.rank, what)
        return out


class ProcessGroupCommunicator:
    """This process's rank in a ``torch.distributed`` tensor-parallel group.

    Args:
        group: the tensor-parallel process group (``None``: the default, whole world).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.counts: Counter[tuple[str, str]] = Counter()

    def all_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        self.counts["all_reduce", phase] += 1
        out = x.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, phase: str) -> list[torch.Tensor]:
        self.counts["all_gather", phase] += 1
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x, group=self.group)
        return out


class ShapeCommunicator:
    """A stand-in group of ``size`` ranks that only gets shapes right (every peer holds
    this rank's values); used to check a rank graph's shapes without peers."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.counts: Counter[tuple[str, str]] = Counter()

    def all_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        self.counts["all_reduce", phase] += 1
        return x.clone()

    def all_gather(self, x: torch.Tensor, phase: str) -> list[torch.Tensor]:
        self.counts["all_gather", phase] += 1
        return [x.clone() for _ in range(self.size)]


class UnboundCommunicator:
    """The group of a rank graph not yet bound to one: any collective raises."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size
        self.counts: Counter[tuple[str, str]] = Counter()

    def _fail(self) -> Any:
        raise CollectiveAborted(
            f"tensor-parallel rank {self.rank} of {self.size} ran a collective but its graph "
            "is bound to no group; set graph._tp_comm to a communicator (the runtime does)")

    def all_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        return self._fail()  # type: ignore[no-any-return]

    def all_gather(self, x: torch.Tensor, phase: str) -> list[torch.Tensor]:
        return self._fail()  # type: ignore[no-any-return]


def slice_blocks(x: torch.Tensor, dim: int, blocks: tuple[int, ...] | None, rank: int,
                 size: int) -> torch.Tensor:
    """Rank ``rank``'s part of a whole tensor ``x`` split along ``dim`` (see Sharding)."""
    sharding = Sharding("colwise", dim, size, blocks)
    pieces = [x.narrow(dim, start, length)
              for start, length in local_slices(sharding, x.shape[dim], rank)]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def gather_blocks(parts: Sequence[torch.Tensor], dim: int,
                  blocks: tuple[int, ...] | None) -> torch.Tensor:
    """Rejoin the ranks' parts (rank order) into the whole tensor along ``dim``."""
    if blocks is None:
        return torch.cat(list(parts), dim)
    steps = [b // len(parts) for b in blocks]
    split = [torch.split(p, steps, dim) for p in parts]
    return torch.cat([s[k] for k in range(len(blocks)) for s in split], dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.comm.all_reduce(grad, "backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return comm.all_reduce(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int,
                blocks: tuple[int, ...] | None) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.blocks = comm, dim, blocks
        return gather_blocks(comm.all_gather(x, "forward"), dim, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        comm = ctx.comm
        part = slice_blocks(grad, ctx.dim, ctx.blocks, comm.rank, comm.size)
        return part.contiguous(), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int,
                blocks: tuple[int, ...] | None) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.blocks = comm, dim, blocks
        return slice_blocks(x, dim, blocks, comm.rank, comm.size).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        parts = ctx.comm.all_gather(grad, "backward")
        return gather_blocks(parts, ctx.dim, ctx.blocks), None, None, None


def copy_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Enter the parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, comm)  # type: ignore[no-any-return]


def reduce_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Leave it by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, comm)  # type: ignore[no-any-return]


def gather_from_tp(x: torch.Tensor, comm: Communicator, dim: int,
                   blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """Leave it by concatenating slices along ``dim``: all-gather forward, slice backward."""
    return _GatherFromTP.apply(x, comm, dim, blocks)  # type: ignore[no-any-return]


def scatter_to_tp(x: torch.Tensor, comm: Communicator, dim: int,
                  blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """Enter it by keeping this rank's slice: slice forward, all-gather backward."""
    return _ScatterToTP.apply(x, comm, dim, blocks)  # type: ignore[no-any-return]
