"""Point-to-point transfers between adjacent pipeline stages in different processes.

Stage ``j`` sends its outputs for micro-batch ``i`` to stage ``j + 1`` and receives their
gradients back; nothing else crosses. What crosses one boundary for one micro-batch is a
:class:`Boundary`: the pytree structure of the values, and per leaf either a
:class:`TensorMeta` (shape, dtype) or the non-tensor value itself (an ``int`` from
``x.size(1)``, say). Boundaries come from shape propagation on the stage graphs, before any
data moves, so a receiver allocates its buffers and posts its receives with no per-step
shape handshake; a sender checks what it actually produced against the prediction.

Each tensor leaf travels as one message tagged with (direction, boundary, micro-batch,
leaf), so messages may be matched in any order (gloo), and messages of different virtual
stages between the same two ranks (interleaved schedules) never match each other. Who is
at the other end of a boundary is the schedule's placement (``stage_ranks``): a V puts
virtual stage ``k + 1`` on either side of ``k``'s rank, or on the same rank, where the
values are handed over in memory, with no message (its turn, stages ``P - 1`` and ``P``). On NCCL,
where sends and receives to one peer run in order on one stream, :class:`PipeLinks` with
``batched=True`` queues operations and posts them together with ``dist.batch_isend_irecv``
(a send of one action with the receive of the next, as torch.distributed.pipelining's 1F1B
does), so neighbours sending to each other at the same time cannot deadlock.

Example:
    >>> import torch
    >>> b = Boundary.of((torch.zeros(2, 3), 4))
    >>> b.leaves[0], b.leaves[1], b.grad_positions
    (TensorMeta(shape=(2, 3), dtype=torch.float32), 4, (0,))
    >>> b.assemble([torch.ones(2, 3)])[1]
    4
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partitioner.errors import BoundaryMismatchError, ChunksError, ScheduleError
from partitioner.runtime.distributed.comm_failure import communicating

__all__ = ["TensorMeta", "Boundary", "BoundaryMismatchError", "PipeLinks", "Pending",
           "FORWARD", "BACKWARD", "message_tag"]

FORWARD, BACKWARD = 0, 1
_MAX_LEAVES = 1 << 10
_MAX_BOUNDARIES = 1 << 7
_MAX_MICROBATCHES = 1 << 13
"""Tags are C ``int`` s (31 bits): 10 for the leaf, 1 for the direction, 7 for the
boundary, 13 for the micro-batch."""


@dataclass(frozen=True)
class TensorMeta:
    """The shape and dtype of a tensor that will cross a boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """The meta of ``tensor`` (real, fake or meta)."""
        return cls(tuple(int(s) for s in tensor.shape), tensor.dtype)

    def empty(self, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer of this shape and dtype on ``device``."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    @property
    def differentiable(self) -> bool:
        """Whether gradients flow back through such a tensor."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Boundary:
    """What crosses one stage boundary for one micro-batch.

    Attributes:
        spec: the pytree structure of the values.
        leaves: per leaf, a :class:`TensorMeta` for a tensor or the value itself otherwise.
    """

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]

    @classmethod
    def of(cls, values: Any) -> Boundary:
        """The boundary of ``values`` (tensors may be real, fake or meta)."""
        leaves, spec = pytree.tree_flatten(values)
        return cls(spec, tuple(TensorMeta.of(v) if isinstance(v, torch.Tensor) else v
                               for v in leaves))

    @property
    def tensor_positions(self) -> tuple[int, ...]:
        """Leaf positions that are tensors (each one message)."""
        return tuple(k for k, v in enumerate(self.leaves) if isinstance(v, TensorMeta))

    @property
    def grad_positions(self) -> tuple[int, ...]:
        """Leaf positions whose gradients travel back (floating-point tensors)."""
        return tuple(k for k, v in enumerate(self.leaves)
                     if isinstance(v, TensorMeta) and v.differentiable)

    def metas(self, positions: Sequence[int]) -> list[TensorMeta]:
        """The tensor metas at ``positions``."""
        return [self.leaves[k] for k in positions]

    def assemble(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The values, from received tensors (in :attr:`tensor_positions` order)."""
        leaves = list(self.leaves)
        for k, tensor in zip(self.tensor_positions, tensors):
            leaves[k] = tensor
        return pytree.tree_unflatten(leaves, self.spec)

    def check(self, values: Any, where: str) -> list[torch.Tensor]:
        """The tensor leaves of ``values``, after checking them against this boundary.

        Raises:
            BoundaryMismatchError: naming ``where`` and every leaf that differs.
        """
        leaves, spec = pytree.tree_flatten(values)
        if spec != self.spec:
            raise BoundaryMismatchError(
                f"{where} produced values of structure {spec} but shape propagation "
                f"predicted {self.spec}; make the stage's outputs depend only on input shapes")
        problems = []
        for k, (value, expected) in enumerate(zip(leaves, self.leaves)):
            if isinstance(expected, TensorMeta):
                if not isinstance(value, torch.Tensor) or TensorMeta.of(value) != expected:
                    got = str(TensorMeta.of(value)) if isinstance(value, torch.Tensor) \
                        else repr(value)
                    problems.append(f"leaf {k} is {got}, predicted {expected}")
            elif isinstance(value, torch.Tensor) or value != expected:
                problems.append(f"leaf {k} is {value!r}, predicted {expected!r}")
        if problems:
            raise BoundaryMismatchError(
                f"{where}: {'; '.join(problems)}. Shapes are predicted from the micro-batch "
                "inputs, so every rank of a replica must call step() with the same batch, "
                "and values crossing stages must not depend on the data")
        return [leaves[k] for k in self.tensor_positions]


def message_tag(direction: int, microbatch: int, leaf: int, boundary: int = 0) -> int:
    """The tag of one tensor message: direction, the boundary it crosses (virtual stage
    ``boundary`` to ``boundary + 1``), micro-batch and leaf, packed in a 31-bit int.

    Raises:
        BoundaryMismatchError: If a boundary carries more than 1024 tensors.
        ScheduleError: If the pipeline has more than 128 virtual stages.
        ChunksError: If a step has more than 8192 micro-batches.

    Example:
        >>> message_tag(BACKWARD, 3, 2, boundary=1) != message_tag(BACKWARD, 3, 2, boundary=3)
        True
    """
    if not 0 <= leaf < _MAX_LEAVES:
        raise BoundaryMismatchError(f"a boundary with more than {_MAX_LEAVES} tensors; "
                                    "move the stage boundary where fewer values are live")
    if not 0 <= boundary < _MAX_BOUNDARIES:
        raise ScheduleError(f"stage boundary {boundary}: message tags hold at most "
                            f"{_MAX_BOUNDARIES} virtual stages; use fewer stages or "
                            "virtual stages")
    if not 0 <= microbatch < _MAX_MICROBATCHES:
        raise ChunksError(f"micro-batch {microbatch}: message tags hold at most "
                          f"{_MAX_MICROBATCHES} micro-batches per step; pass fewer chunks")
    return ((microbatch * _MAX_BOUNDARIES + boundary) * 2 + direction) * _MAX_LEAVES + leaf


class Pending:
    """Receives posted (or queued) for one micro-batch; :meth:`wait` gives the tensors.

    With ``local`` (the tags of a hand-over within this rank), the tensors are the ones
    this rank's earlier stage left in its links' mailbox, taken at :meth:`wait`.
    """

    def __init__(self, links: PipeLinks, tensors: list[torch.Tensor], peer: int,
                 what: str, local: Sequence[int] = ()) -> None:
        self._links = links
        self.tensors = tensors
        self.works: list[Any] | None = None
        self.peer = peer
        self.what = what
        self.local = tuple(local)

    def wait(self) -> list[torch.Tensor]:
        """Block until every tensor has arrived; return them."""
        if self.local:
            self.tensors = self._links.take_local(self.local, self.what)
            self.local = ()
        if self.works is None:
            self._links.flush()
        assert self.works is not None
        for work in self.works:
            _wait(work, f"receiving {self.what} from rank {self.peer}")
        return self.tensors


def _wait(work: Any, what: str) -> None:
    with communicating(what):
        work.wait()


class PipeLinks:
    """A stage's links to its neighbours on the pipeline axis.

    Args:
        group: the pipeline-axis process group (the ranks of one replica, one per stage).
        prev_rank: global rank of stage ``j - 1`` (None on the first stage; the last
            stage's rank when virtual stages make the links a ring).
        next_rank: global rank of stage ``j + 1`` (None on the last stage; the first
            stage's rank in a ring).
        device: where received tensors are allocated.
        batched: queue operations until :meth:`flush` and post them as one batch (NCCL).
        stage_ranks: per virtual stage ``k``, the global rank holding it (the schedule's
            placement on this replica's ranks); when given, each boundary's peer comes from
            it instead of ``prev_rank`` and ``next_rank``.
        rank: this rank, with ``stage_ranks``: a boundary between two of its own stages
            is handed over in memory.
        reverse_group: a second group of the same ranks for the messages going to a lower
            rank (:meth:`ProcessMesh.reverse_group`), so that no gloo pair carries messages
            both ways at once; None: ``group`` carries both (needs ``rank``).

    Example:
        >>> links = PipeLinks(None, None, None, torch.device("cpu"),
        ...                   stage_ranks=(0, 1, 1, 0), rank=1)
        >>> b = Boundary.of(torch.zeros(2))
        >>> pending = links.recv_activations(1, 0, b)  # stage 1 to 2: both on rank 1
        >>> links.send_activations(1, 0, b, [torch.ones(2)])
        >>> pending.wait()[0].tolist()
        [1.0, 1.0]
    """

    def __init__(self, group: Any, prev_rank: int | None, next_rank: int | None,
                 device: torch.device, *, batched: bool = False,
                 stage_ranks: Sequence[int] | None = None, rank: int | None = None,
                 reverse_group: Any = None) -> None:
        if reverse_group is not None and (rank is None or batched):
            raise ValueError("reverse_group needs this rank (rank=) and unbatched links: "
                             "it routes each message by the direction between two ranks")
        self.group = group
        self.reverse_group = reverse_group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self.batched = batched
        self.stage_ranks = None if stage_ranks is None else tuple(stage_ranks)
        self.rank = rank
        self._queue: list[tuple[dist.P2POp, Pending | None]] = []
        self._sends: list[tuple[Any, torch.Tensor, str]] = []
        self._mailbox: dict[int, torch.Tensor] = {}

    def _peer(self, stage: int, line: int | None) -> int | None:
        """The rank of virtual stage ``stage`` (``line``: the neighbour without a map)."""
        return line if self.stage_ranks is None else self.stage_ranks[stage]

    def _group(self, sender: int | None, receiver: int | None) -> Any:
        """The group a message from ``sender`` to ``receiver`` travels on: both ends agree
        (with a reverse group, ``rank`` is known, so both are)."""
        if self.reverse_group is None or sender is None or receiver is None:
            return self.group
        return self.group if sender < receiver else self.reverse_group

    def take_local(self, tags: Sequence[int], what: str) -> list[torch.Tensor]:
        """The tensors this rank handed itself under ``tags`` (a :class:`Pending`'s wait).

        Raises:
            ScheduleError: If the sending stage has not run yet: its list puts the receiver
                first, which a validated schedule never does.
        """
        missing = [tag for tag in tags if tag not in self._mailbox]
        if missing:
            raise ScheduleError(f"{what}: both stages are on this rank, but the sender has not "
                                "run yet; the rank's list must run a stage's forward before "
                                "the next stage's (and backwards the other way)")
        return [self._mailbox.pop(tag) for tag in tags]

    def _post(self, ops: list[tuple[dist.P2POp, Pending | None]]) -> None:
        if not ops:
            return
        peers = sorted({op.peer for op, _ in ops})
        with communicating(f"posting sends and receives to rank(s) {peers}"):
            if self.batched:
                works = dist.batch_isend_irecv([op for op, _ in ops])
            else:
                works = [op.op(op.tensor, op.peer, op.group, op.tag) for op, _ in ops]
        for (op, pending), work in zip(ops, works):
            if pending is None:
                self._sends.append((work, op.tensor, f"rank {op.peer}"))
            else:
                assert pending.works is not None
                pending.works.append(work)

    def _enqueue(self, ops: list[tuple[dist.P2POp, Pending | None]],
                 pending: Pending | None) -> None:
        if pending is not None:
            pending.works = [] if not self.batched else None
        if self.batched:
            self._queue += ops
        else:
            self._post(ops)

    def flush(self) -> None:
        """Post every queued operation (batched mode), as one batch."""
        queued, self._queue = self._queue, []
        for _, pending in queued:
            if pending is not None and pending.works is None:
                pending.works = []
        self._post(queued)

    def _recv(self, peer: int | None, direction: int, b: int, i: int,
              metas: Sequence[TensorMeta], positions: Sequence[int], what: str) -> Pending:
        if peer is None:
            raise BoundaryMismatchError(f"no neighbour to receive {what} from")
        if peer == self.rank:  # a hand-over within this rank: nothing to post
            local = Pending(self, [], peer, what,
                            [message_tag(direction, i, k, b) for k in positions])
            local.works = []
            return local
        tensors = [meta.empty(self.device) for meta in metas]
        pending = Pending(self, tensors, peer, what)
        group = self._group(peer, self.rank)
        ops: list[tuple[dist.P2POp, Pending | None]] = [
            (dist.P2POp(dist.irecv, t, peer, group, message_tag(direction, i, k, b)),
             pending)
            for t, k in zip(tensors, positions) if t.numel()]
        self._enqueue(ops, pending)
        if not ops:
            pending.works = []
        return pending

    def _send(self, peer: int | None, direction: int, b: int, i: int,
              tensors: Sequence[torch.Tensor], positions: Sequence[int]) -> None:
        if peer is None:
            raise BoundaryMismatchError("no neighbour to send to")
        if peer == self.rank:
            for t, k in zip(tensors, positions):
                self._mailbox[message_tag(direction, i, k, b)] = t.detach()
            return
        ops: list[tuple[dist.P2POp, Pending | None]] = []
        group = self._group(self.rank, peer)
        for t, k in zip(tensors, positions):
            if t.numel():
                t = t.detach().contiguous()
                ops.append((dist.P2POp(dist.isend, t, peer, group,
                                       message_tag(direction, i, k, b)), None))
        self._enqueue(ops, None)

    def recv_activations(self, b: int, i: int, boundary: Boundary) -> Pending:
        """Post the receives of micro-batch ``i``'s values crossing from virtual stage ``b``
        (on the previous rank) to ``b + 1``."""
        positions = boundary.tensor_positions
        return self._recv(self._peer(b, self.prev_rank), FORWARD, b, i,
                          boundary.metas(positions), positions,
                          f"activations of micro-batch {i} from stage {b}")

    def send_activations(self, b: int, i: int, boundary: Boundary,
                         tensors: Sequence[torch.Tensor]) -> None:
        """Send micro-batch ``i``'s outputs of virtual stage ``b`` (the tensor leaves of
        ``boundary``) on to ``b + 1``."""
        self._send(self._peer(b + 1, self.next_rank), FORWARD, b, i, tensors,
                   boundary.tensor_positions)

    def recv_grads(self, b: int, i: int, boundary: Boundary) -> Pending:
        """Post the receives of the gradients of micro-batch ``i``'s outputs of virtual
        stage ``b`` (from ``b + 1`` on the next rank)."""
        positions = boundary.grad_positions
        return self._recv(self._peer(b + 1, self.next_rank), BACKWARD, b, i,
                          boundary.metas(positions), positions,
                          f"gradients of micro-batch {i} from stage {b + 1}")

    def send_grads(self, b: int, i: int, boundary: Boundary,
                   grads: Sequence[torch.Tensor | None]) -> None:
        """Send the gradients of micro-batch ``i``'s inputs of virtual stage ``b + 1`` back
        to ``b`` (zeros where None)."""
        positions = boundary.grad_positions
        tensors = [g if g is not None else meta.empty(self.device).zero_()
                   for g, meta in zip(grads, boundary.metas(positions))]
        self._send(self._peer(b, self.prev_rank), BACKWARD, b, i, tensors, positions)

    def finish(self) -> None:
        """Post what is queued and wait until every send has completed."""
        self.flush()
        sends, self._sends = self._sends, []
        for work, _, peer in sends:
            _wait(work, f"sending to {peer}")
