"""A sharded optimizer for data-parallel replicas (ZeRO stage 1): :class:`ShardedOptimizer`.

Plain data parallelism keeps the whole optimizer state on every replica: with Adam, two
moments per parameter (plus an fp32 master copy under mixed precision) on each of ``dp``
ranks. Here a stage's trainable parameters are moved into one flat buffer per dtype and
device (padded to a multiple of ``dp``), each parameter's ``.data`` a view of it and its
``.grad`` a view of a flat gradient buffer of the same layout (Megatron-LM's
``ParamAndGradBuffer``, DDP's ``gradient_as_bucket_view``); replica ``r`` owns the ``r``-th
of ``dp`` equal slices, stepped as one piece per parameter it overlaps::

    flat parameters   [ w0 w0 w0 | w0 b0 w1 | w1 w1 b1 | b1 .. pad ]
    flat gradients    [ the same layout: w0.grad is a view of its first 4 elements ... ]
    owner             [ replica 0 | replica 1 | replica 2 | replica 3 ]
    pieces            [ w0        | w0 b0 w1 | w1 b1     | b1        ]

A step then runs, allocating nothing of the stage's size:

1. the pipeline's backwards accumulate straight into the flat gradients (autograd adds
   into an existing ``.grad`` in place; fused Linear layers write into their view; the
   ``1 / dp`` of the replica average already rides on the loss weights);
2. :class:`ShardedGradients` (in the place of the all-reduce's
   :class:`~partitioner.runtime.distributed.data_parallel.GradReducer`) sums weights tied
   across stages, then reduces the flat gradients in place so that this replica's slice
   holds their average over replicas: ``reduce_scatter_tensor`` on NCCL (in place, as NCCL
   documents), an ``all_reduce`` on gloo, whose reduce-scatter copies the whole buffer and
   runs 2.5x slower than its in-place all-reduce (measured on 25.7 M floats, 2 ranks);
3. :meth:`ShardedOptimizer.step` runs the user's optimizer class over the pieces (its
   state is ``1 / dp`` of the plain one; its temporaries, such as Adam's ``sqrt`` of the
   second moment, one piece's size). For fp32 (or wider) parameters a piece *is* a view of
   the flat parameters, so the step writes the new weights in place; lower-precision ones
   keep an fp32 copy of each piece (and are reduced in their own dtype, as DDP does). Then
   every replica's slice goes to all others straight into the flat parameters:
   ``all_gather_into_tensor`` in place on NCCL, one broadcast per owner on gloo (its
   all-gather also copies the whole buffer, and is 4x slower).

``zero_grad`` zeroes the flat gradients and keeps the views. Because the reduction
overwrites this replica's slice, a second ``dpm.step`` without ``zero_grad`` (adding onto
reduced gradients) is refused: accumulate over micro-batches (``chunks``) instead.

On NCCL a reduce-scatter plus an all-gather moves the same bytes as the all-reduce of
plain data parallelism (a ring all-reduce *is* the two); on gloo the all-reduce and the
broadcasts move half as much again. Unlike the bucketed all-reduce, the reduction starts
after the step's last backward, not during it.

Elementwise optimizers (SGD, Adam, AdamW, ...) step a slice exactly as they step the whole
tensors: the weights equal plain data parallelism's. Optimizers that look at a whole tensor
(LAMB's trust ratio, Shampoo) would not, and one parameter group holds every parameter.
``docs/benchmarks.md`` ("Data-parallel sharding") measures it against torch's
``ZeroRedundancyOptimizer``.

Example:
    >>> grads = ShardedGradients(stage.named_parameters(), mesh.group("dp"))  # doctest: +SKIP
    >>> optimizer = ShardedOptimizer(grads, torch.optim.AdamW, lr=1e-3)       # doctest: +SKIP
    >>> loss = dpm.step(x, y, loss_fn); optimizer.step(); optimizer.zero_grad()  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import BackwardError, CheckpointError, StrategyError
from partitioner.runtime import fused_linear
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.data_parallel import TiedGradients

__all__ = ["FlatShard", "ShardedGradients", "ShardedOptimizer", "master_dtype"]


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a slice's optimizer state is kept in: fp32, or the parameters' if wider."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


@dataclass
class FlatShard:
    """Parameters of one dtype and device laid end to end; this replica's slice of them.

    The parameters *are* views of ``data`` and their ``.grad`` views of ``grad`` (as
    Megatron-LM's buffers and DDP's ``gradient_as_bucket_view``): backward accumulates into
    the flat gradients, the collectives read and write the flat buffers, and a step copies
    no whole-stage tensor. The optimizer steps this replica's slice as one piece per
    parameter it overlaps (Megatron's per-parameter shards), so an optimizer's temporaries
    (Adam's ``sqrt`` of the second moment) are one piece's size, not the slice's.

    Attributes:
        names: the parameters' names in the stage (the model's).
        params: the parameters, in flat order.
        rank: this replica's index in the data-parallel group.
        size: replicas in the group.
        data: the flat parameters, padded to a multiple of ``size``.
        grad: the flat gradients, the same length.
        spans: per piece of this replica's slice, ``(parameter index, start, end)`` in
            ``data``.
        masters: per piece, what the optimizer steps: a view of ``data`` when the
            parameters are fp32 or wider, else an fp32 copy.
        reached: per parameter, 1 once a backward accumulated its gradient since the last
            ``zero_grad``.
    """

    names: list[str]
    params: list[nn.Parameter]
    rank: int
    size: int
    data: torch.Tensor
    grad: torch.Tensor
    spans: list[tuple[int, int, int]]
    masters: list[nn.Parameter]
    reached: torch.Tensor

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        return self.data.numel()

    @property
    def shares_master(self) -> bool:
        """Whether the masters are views of ``data`` (no fp32 copy to keep in step)."""
        return master_dtype(self.data.dtype) == self.data.dtype

    def flatten(self, tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """One tensor per parameter (``None``: zeros) as a new padded flat tensor (used by
        checkpoints only: a step never makes one)."""
        flat = torch.zeros(self.numel, dtype=dtype, device=self.data.device)
        for view, t in zip(self.split(flat), tensors):
            if t is not None:
                view.copy_(t.reshape(view.shape))
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The padded flat buffer as one view per parameter, shaped like it."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        """This replica's slice of a padded flat buffer."""
        n = self.numel // self.size
        return flat[self.rank * n:(self.rank + 1) * n]

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A padded flat buffer's views of this replica's pieces."""
        return [flat[start:end] for _, start, end in self.spans]

    def attach_grads(self) -> None:
        """Make every parameter's ``.grad`` its view of ``grad`` again: one that autograd
        replaced (after ``zero_grad(set_to_none=True)``) is copied in, a missing one zeroed."""
        with torch.no_grad():
            for p, view in zip(self.params, self.split(self.grad)):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view


def _flat_shards(named: Iterable[tuple[str, nn.Parameter]], rank: int, size: int
                 ) -> list[FlatShard]:
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        if p.requires_grad:
            groups.setdefault((p.dtype, p.device), []).append((name, p))
    return [_flat_shard(members, rank, size) for members in groups.values()]


def _spans(params: list[nn.Parameter], rank: int, n: int) -> list[tuple[int, int, int]]:
    """Where each parameter overlaps the slice ``[rank * n, (rank + 1) * n)``."""
    spans, offset = [], 0
    for k, p in enumerate(params):
        start, end = max(offset, rank * n), min(offset + p.numel(), (rank + 1) * n)
        if start < end:
            spans.append((k, start, end))
        offset += p.numel()
    return spans


def _flat_shard(members: list[tuple[str, nn.Parameter]], rank: int, size: int) -> FlatShard:
    """Move ``members`` into one flat buffer (their ``.data`` become views of it)."""
    dtype, device = members[0][1].dtype, members[0][1].device
    params = [p for _, p in members]
    n = math.ceil(sum(p.numel() for p in params) / size)
    data = torch.zeros(n * size, dtype=dtype, device=device)
    shard = FlatShard([m for m, _ in members], params, rank, size, data, torch.empty(0),
                      _spans(params, rank, n), [],
                      torch.zeros(len(members), dtype=torch.float32, device=device))
    with torch.no_grad():
        for p, view in zip(shard.params, shard.split(data)):
            view.copy_(p)
            p.data = view  # the old storage goes now, before the gradients take their place
        shard.grad = torch.zeros_like(data)
        # fp32 (or wider) parameters are their own master: the step writes into ``data``.
        shard.masters = [nn.Parameter(piece if shard.shares_master
                                      else piece.to(master_dtype(dtype)))
                         for piece in shard.pieces(data)]
    shard.attach_grads()
    for p, view in zip(shard.params, shard.split(shard.grad)):
        fused_linear.use_grad_buffer(p, view)
    return shard


class ShardedGradients:
    """Reduce-scatters a stage's gradients over its replicas: each keeps its slice's average.

    Stands where the pipeline's ``reducer`` stands (``arm``, ``finish``, ``close``); it also
    sums the weights tied across stages first, which must see whole gradients.

    Args:
        named: the stage's ``(name, parameter)`` pairs, in the same order on every replica.
            Their ``.data`` and ``.grad`` become views of flat buffers
            (:class:`FlatShard`).
        group: the data-parallel process group of this rank.
        tied: the tied weights' gradient sums, run before the reduce-scatter.
        counts: whether a parameter's gradient counts towards the model's norm on this rank.
    """

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], group: Any, *,
                 tied: TiedGradients | None = None,
                 counts: Callable[[str], bool] = lambda name: True) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.tied = tied
        self.shards = _flat_shards(named, dist.get_rank(group), self.size)
        self._counted = [[counts(shard.names[k]) for k, _, _ in shard.spans]
                         for shard in self.shards]
        self._versions = [_versions(shard) for shard in self.shards]
        self._handles = [p.register_post_accumulate_grad_hook(_reached(shard, k))
                         for shard in self.shards for k, p in enumerate(shard.params)]
        self._reduced = False  # a reduce-scatter ran since the last zero_grad
        self._gloo = dist.get_backend(group) == "gloo"
        self._owners = [dist.get_global_rank(group, r) for r in range(self.size)]

    def arm(self) -> None:
        """Nothing to start early: the reduce-scatter runs after the last backward."""

    def finish(self) -> None:
        """Sum tied weights, then reduce-scatter each flat gradient buffer in place: this
        replica's slice of it becomes the average over replicas, and the ``.grad`` of its
        pieces' masters.

        Raises:
            CommunicationError: if a collective fails (a replica died).
            BackwardError: if no replica produced a gradient for a parameter (its slice
                would be stepped with a zero gradient, which plain training skips).
        """
        for shard in self.shards:
            shard.attach_grads()
        if self.tied is not None:
            self.tied.reduce()
            tied = {id(p) for p, _ in self.tied.ties}
            for shard in self.shards:
                for k, p in enumerate(shard.params):
                    if id(p) in tied:
                        shard.reached[k] = 1.0
        for shard in self.shards:
            self._check_reached(shard)
            with communicating("reduce-scatter of the gradients over the data-parallel group"):
                if self._gloo:  # in place; gloo's reduce-scatter copies it whole, 2.5x slower
                    dist.all_reduce(shard.grad, group=self.group)
                else:  # in place, as NCCL documents
                    dist.reduce_scatter_tensor(shard.mine(shard.grad), shard.grad,
                                               group=self.group)
            for master, piece in zip(shard.masters, shard.pieces(shard.grad)):
                master.grad = piece if shard.shares_master else piece.to(master.dtype)
        self._reduced = True

    def check_cleared(self) -> None:
        """Refuse a step onto the last step's reduced gradients (before it starts).

        Raises:
            StrategyError: if no ``zero_grad`` ran since the last reduce-scatter: this
                replica's slice holds the average now, no longer its own sum, so a second
                backward cannot add to it.
        """
        if self._reduced:
            raise StrategyError(
                "dpm.step ran twice without zero_grad: with optimizer_sharding=True the "
                "gradients are reduce-scattered in place, so a second step cannot add to "
                "the first; call optimizer.zero_grad() before each dpm.step, and to "
                "accumulate over more rows pass a larger batch (it is cut into chunks)")

    def _check_reached(self, shard: FlatShard) -> None:
        reached = shard.reached.clone()
        with communicating("all-reduce of the gradient flags over the data-parallel group"):
            dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=self.group)
        missing = [name for name, flag in zip(shard.names, reached.tolist()) if flag == 0]
        if missing:
            raise BackwardError(
                f"no replica computed a gradient for {missing[:3]} ({len(missing)} "
                "parameters); the sharded optimizer steps a slice of all parameters at once "
                "and cannot skip them as a plain optimizer does; freeze them "
                "(requires_grad_(False)) before partitioning, or pass "
                "optimizer_sharding=False")

    def zero_grad(self) -> None:
        """Zero the flat gradients (the parameters' ``.grad`` stay their views) and drop the
        slices' gradients."""
        for shard in self.shards:
            shard.grad.zero_()
            shard.attach_grads()
            shard.reached.zero_()
            for master in shard.masters:
                master.grad = None
        self._reduced = False

    def norm_grads(self) -> list[torch.Tensor]:
        """This replica's pieces of the gradients, without those another rank counts."""
        return [m.grad for shard, counted in zip(self.shards, self._counted)
                for m, c in zip(shard.masters, counted) if c and m.grad is not None]

    def grads(self) -> list[torch.Tensor]:
        """This replica's pieces of the gradients (what clipping scales)."""
        return [m.grad for s in self.shards for m in s.masters if m.grad is not None]

    def refresh(self) -> None:
        """Take the parameters as the fp32 slices' values where something else wrote them
        since the last gather (``load_state_dict``, ``dpm.load``, a manual edit): stepping
        the stale slices would silently undo that write. A slice that is a view of the
        parameters sees such writes already."""
        for k, shard in enumerate(self.shards):
            if not shard.shares_master and _versions(shard) != self._versions[k]:
                with torch.no_grad():
                    for master, piece in zip(shard.masters, shard.pieces(shard.data)):
                        master.copy_(piece)
                self._versions[k] = _versions(shard)

    def gather_params(self) -> None:
        """All-gather the updated slices straight into every replica's flat parameters."""
        for k, shard in enumerate(self.shards):
            if not shard.shares_master:
                with torch.no_grad():
                    for master, piece in zip(shard.masters, shard.pieces(shard.data)):
                        piece.copy_(master)
            with communicating("all-gather of the updated parameters over the "
                               "data-parallel group"):
                self._all_gather(shard)
            self._versions[k] = _versions(shard)

    def _all_gather(self, shard: FlatShard) -> None:
        """Every replica's slice of ``shard.data`` from its owner, in place."""
        if not self._gloo:  # the input is the output's own slice, as NCCL documents
            dist.all_gather_into_tensor(shard.data, shard.mine(shard.data), group=self.group)
            return
        # gloo's all-gather copies the whole buffer and is 4x slower than a broadcast from
        # each owner (measured: docs/benchmarks.md, "Data-parallel sharding").
        n = shard.numel // self.size
        works = [dist.broadcast(shard.data[r * n:(r + 1) * n], src=src, group=self.group,
                                async_op=True) for r, src in enumerate(self._owners)]
        for work in works:
            work.wait()

    def close(self) -> None:
        """Remove the hooks and the gradient buffers' registration (the parameters stay
        views of the flat buffers)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for shard in self.shards:
            for p in shard.params:
                fused_linear.release_grad_buffer(p)


def _reached(shard: FlatShard, k: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        shard.reached[k] = 1.0
    return hook


class ShardedOptimizer:
    """The user's optimizer over this replica's slices of a stage's parameters.

    Build it with ``dpm.make_optimizer(torch.optim.AdamW, lr=...)``. ``step()`` steps the
    slices and all-gathers the parameters; ``zero_grad()``, ``param_groups`` (learning-rate
    changes) and ``state_dict()`` (this replica's slice only) work as on the wrapped
    optimizer, which is ``inner`` (give that to a learning-rate scheduler).
    ``dpm.save(path, optimizer)`` writes the whole state, keyed by parameter name as a plain
    optimizer's, and ``dpm.load`` cuts it again for any number of replicas.

    Args:
        grads: the stage's sharded gradients.
        optimizer_class: a ``torch.optim.Optimizer`` subclass acting elementwise.
        **kwargs: its hyperparameters (one parameter group).
    """

    def __init__(self, grads: ShardedGradients, optimizer_class: type[torch.optim.Optimizer],
                 **kwargs: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise StrategyError(f"make_optimizer got {optimizer_class!r}; pass an optimizer "
                                "class such as torch.optim.AdamW and its hyperparameters, "
                                "e.g. make_optimizer(torch.optim.AdamW, lr=1e-3)")
        self.grads = grads
        masters = [m for s in grads.shards for m in s.masters]
        # A replica whose slice is all padding (a tiny stage, many replicas) steps nothing.
        self.inner = optimizer_class(masters or [nn.Parameter(torch.zeros(0))], **kwargs)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (set ``lr`` here)."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (this replica's slices)."""
        return self.inner.state

    def step(self, closure: None = None) -> None:
        """Step this replica's slices, then all-gather every replica's parameters.

        Collective over the data-parallel group: every replica calls it.

        Raises:
            StrategyError: if a closure is passed (the loss comes from ``dpm.step``).
        """
        if closure is not None:
            raise StrategyError("a sharded optimizer's step() takes no closure; compute the "
                                "loss with dpm.step(...) first, then call optimizer.step()")
        self.grads.refresh()
        self.inner.step()
        self.grads.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the slices and of the parameters."""
        self.grads.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """This replica's slice of the state (``dpm.save`` writes the whole one)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a slice's state written by :meth:`state_dict` on the same replica."""
        self.inner.load_state_dict(state)

    def named_state(self) -> dict[str, Any]:
        """The whole state keyed by parameter name, as a plain optimizer's would be
        (collective over the data-parallel group: every replica calls it)."""
        state: dict[str, dict[str, Any]] = {}
        for shard in self.grads.shards:
            for key, (dtype, shared) in sorted(self._layout(shard).items()):
                if dtype is None:  # one value for every parameter (Adam's step)
                    values = [_copy(shared)] * len(shard.params)
                else:
                    values = [v.cpu().clone() for v in shard.split(self._gather(shard, key,
                                                                                 dtype))]
                for name, value in zip(shard.names, values):
                    state.setdefault(name, {})[key] = value
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        names = [name for shard in self.grads.shards for name in shard.names]
        return {"state": state, "param_groups": [{**hyper, "params": names}]}

    def _layout(self, shard: FlatShard) -> dict[str, tuple[torch.dtype | None, Any]]:
        """Per state key, the dtype of a per-element value (or None and the shared value),
        agreed by all replicas (one whose slice is padding holds no state of its own)."""
        local: dict[str, tuple[torch.dtype | None, Any]] = {}
        for master in shard.masters:
            for key, value in self.inner.state.get(master, {}).items():
                per_element = isinstance(value, torch.Tensor) and value.dim() > 0
                local[key] = (value.dtype, None) if per_element else (None, _copy(value))
        layouts: list[Any] = [None] * self.grads.size
        with communicating("all-gather of the optimizer state's keys for a checkpoint"):
            dist.all_gather_object(layouts, local, group=self.grads.group)
        return {k: v for layout in reversed(layouts) for k, v in layout.items()}

    def _gather(self, shard: FlatShard, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The flat buffer of state ``key`` over every replica's pieces."""
        mine = torch.zeros(shard.numel // shard.size, dtype=dtype, device=shard.data.device)
        base = shard.rank * mine.numel()
        for master, (_, start, end) in zip(shard.masters, shard.spans):
            value = self.inner.state.get(master, {}).get(key)
            if value is not None:
                mine[start - base:end - base].copy_(value)
        flat = torch.empty(shard.numel, dtype=dtype, device=shard.data.device)
        with communicating("all-gather of the optimizer state for a checkpoint"):
            dist.all_gather_into_tensor(flat, mine, group=self.grads.group)
        return flat

    def load_named_state(self, named: dict[str, Any],
                         aliases: dict[str, list[str]] | None = None) -> None:
        """Take this replica's pieces of a whole named state (from any number of replicas,
        or from a plain optimizer).

        Args:
            named: ``{"state": {name: {...}}, "param_groups": [...]}``.
            aliases: other names of a parameter (tied weights), tried when its own is absent.

        Raises:
            CheckpointError: if some parameters of a slice have a state entry and others not.
        """
        saved = named["state"]
        for shard in self.grads.shards:
            entries = [_lookup(saved, name, aliases or {}) for name in shard.names]
            present = [e is not None for e in entries]
            if not all(present) and any(present):
                lacking = [n for n, ok in zip(shard.names, present) if not ok]
                raise CheckpointError(f"the checkpoint's optimizer state lacks {lacking[:3]} "
                                      f"but holds their neighbours'; it was saved from "
                                      "another model or optimizer")
            full = [e for e in entries if e is not None]
            pieces: list[dict[str, Any]] = [{} for _ in shard.masters]
            for key in full[0] if full else []:
                for piece, value in zip(pieces, self._cut(shard, [e[key] for e in full])):
                    piece[key] = value
            for master, piece in zip(shard.masters, pieces):
                if piece:
                    self.inner.state[master] = piece
                else:
                    self.inner.state.pop(master, None)
        group = _group_of(named["param_groups"], self.grads.shards[0].names[0]
                          if self.grads.shards else "")
        self.inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})

    def _cut(self, shard: FlatShard, values: list[Any]) -> list[Any]:
        """One state value per parameter as one per piece of this replica's slice."""
        first = values[0]
        # Per element (moments) when shaped like the parameters; else shared (Adam's step).
        if all(isinstance(v, torch.Tensor) and v.shape == p.shape
               for v, p in zip(values, shard.params)) and any(v.dim() for v in values):
            flat = shard.flatten([v.to(shard.data.device) for v in values], first.dtype)
            return [piece.clone() for piece in shard.pieces(flat)]
        device = shard.data.device
        return [_copy(first).to(device) if isinstance(first, torch.Tensor) else first
                for _ in shard.masters]


def _versions(shard: FlatShard) -> list[int]:
    """The parameters' in-place write counters (torch bumps one on every in-place write)."""
    return [p._version for p in shard.params]


def _copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _lookup(saved: dict[str, Any], name: str, aliases: dict[str, list[str]]) -> Any:
    for candidate in [name, *aliases.get(name, [])]:
        if candidate in saved:
            return saved[candidate]
    return None


def _group_of(groups: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next((g for g in groups if name in g.get("params", [])), groups[0] if groups else {})

