"""A sharded optimizer for data-parallel replicas (ZeRO stage 1): :class:`ShardedOptimizer`.

Plain data parallelism keeps the whole optimizer state on every replica: with Adam, two
moments per parameter (plus an fp32 master copy under mixed precision) on each of ``dp``
ranks. Here a stage's trainable parameters are laid end to end in one flat buffer per dtype
and device (padded to a multiple of ``dp``), and replica ``r`` owns the ``r``-th of ``dp``
equal slices, like Megatron-LM's distributed optimizer::

    flat parameters   [ w0 w0 w0 | w0 b0 w1 | w1 w1 b1 | b1 .. pad ]
    owner             [ replica 0 | replica 1 | replica 2 | replica 3 ]

A step then runs:

1. the pipeline's backwards accumulate each parameter's ``.grad`` as usual (the ``1 / dp``
   of the replica average already rides on the loss weights);
2. :class:`ShardedGradients` (in the place of the all-reduce's
   :class:`~partitioner.runtime.distributed.data_parallel.GradReducer`) sums weights tied
   across stages, then ``reduce_scatter_tensor`` leaves on each replica the average gradient
   of its slice only, in the master dtype, and drops the parameters' ``.grad``;
3. :meth:`ShardedOptimizer.step` runs the user's optimizer class over the slice (its state
   is ``1 / dp`` of the plain one), then ``all_gather_into_tensor`` puts the updated slices
   back into every replica's parameters.

Both collectives run on gloo (torch >= 2.x implements them there) and on NCCL; a
reduce-scatter plus an all-gather moves the same bytes as the all-reduce they replace (a
ring all-reduce *is* the two). Unlike the bucketed all-reduce, the reduce-scatter starts
after the step's last backward, not during it.

Elementwise optimizers (SGD, Adam, AdamW, ...) step a slice exactly as they step the whole
tensors: the weights equal plain data parallelism's. Optimizers that look at a whole tensor
(LAMB's trust ratio, Shampoo) would not, and one parameter group holds every parameter.

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
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.data_parallel import TiedGradients

__all__ = ["FlatShard", "ShardedGradients", "ShardedOptimizer", "master_dtype"]


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a slice's optimizer state is kept in: fp32, or the parameters' if wider."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


@dataclass
class FlatShard:
    """Parameters of one dtype and device laid end to end; this replica's slice of them.

    Attributes:
        names: the parameters' names in the stage (the model's).
        params: the parameters, in flat order.
        rank: this replica's index in the data-parallel group.
        size: replicas in the group.
        master: this replica's slice of the flat parameters (what the optimizer steps).
        counts: per element of the slice, 1 where the gradient counts towards the model's
            norm on this rank, else 0 (a copy another rank counts).
    """

    names: list[str]
    params: list[nn.Parameter]
    rank: int
    size: int
    master: nn.Parameter
    counts: torch.Tensor

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        return self.master.numel() * self.size

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One tensor per parameter (``None``: zeros) as the padded flat buffer."""
        flat = torch.zeros(self.numel, dtype=self.master.dtype, device=self.master.device)
        offset = 0
        for p, t in zip(self.params, tensors):
            if t is not None:
                flat[offset:offset + p.numel()].copy_(t.reshape(-1))
            offset += p.numel()
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
        n = self.master.numel()
        return flat[self.rank * n:(self.rank + 1) * n]


def _flat_shards(named: Iterable[tuple[str, nn.Parameter]], rank: int, size: int,
                 counts: Callable[[str], bool]) -> list[FlatShard]:
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        if p.requires_grad:
            groups.setdefault((p.dtype, p.device), []).append((name, p))
    shards = []
    for (dtype, device), members in groups.items():
        total = sum(p.numel() for _, p in members)
        n = math.ceil(total / size)
        shard = FlatShard([m for m, _ in members], [p for _, p in members], rank, size,
                          nn.Parameter(torch.zeros(n, dtype=master_dtype(dtype),
                                                   device=device)),
                          torch.zeros(n, dtype=master_dtype(dtype), device=device))
        with torch.no_grad():
            shard.master.copy_(shard.mine(shard.flatten([p.detach() for _, p in members])))
            weights = [torch.full_like(p, float(counts(m)), dtype=shard.master.dtype)
                       for m, p in members]
            shard.counts.copy_(shard.mine(shard.flatten(list(weights))))
        shards.append(shard)
    return shards


class ShardedGradients:
    """Reduce-scatters a stage's gradients over its replicas: each keeps its slice's average.

    Stands where the pipeline's ``reducer`` stands (``arm``, ``finish``, ``close``); it also
    sums the weights tied across stages first, which must see whole gradients.

    Args:
        named: the stage's ``(name, parameter)`` pairs, in the same order on every replica.
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
        self.shards = _flat_shards(named, dist.get_rank(group), self.size, counts)
        self._versions = [_versions(shard) for shard in self.shards]

    def arm(self) -> None:
        """Nothing to start early: the reduce-scatter runs after the last backward."""

    def finish(self) -> None:
        """Sum tied weights, reduce-scatter every gradient, add the slice to ``master.grad``.

        Raises:
            CommunicationError: if a collective fails (a replica died).
            BackwardError: if no replica produced a gradient for a parameter (its slice
                would be stepped with a zero gradient, which plain training skips).
        """
        if self.tied is not None:
            self.tied.reduce()
        for shard in self.shards:
            self._check_reached(shard)
            flat = shard.flatten([p.grad for p in shard.params])
            mine = torch.empty_like(shard.master)
            with communicating("reduce-scatter of the gradients over the data-parallel group"):
                dist.reduce_scatter_tensor(mine, flat, group=self.group)
            if shard.master.grad is None:
                shard.master.grad = mine
            else:
                shard.master.grad.add_(mine)
            for p in shard.params:
                p.grad = None

    def _check_reached(self, shard: FlatShard) -> None:
        reached = torch.tensor([p.grad is not None for p in shard.params],
                               dtype=torch.float32, device=shard.master.device)
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
        """Drop the slices' gradients and any parameter gradient not reduced yet."""
        for shard in self.shards:
            shard.master.grad = None
            for p in shard.params:
                p.grad = None

    def norm_grads(self) -> list[torch.Tensor]:
        """This replica's slices of the gradients, zero where another rank counts them."""
        return [s.master.grad * s.counts for s in self.shards if s.master.grad is not None]

    def grads(self) -> list[torch.Tensor]:
        """This replica's slices of the gradients (what clipping scales)."""
        return [s.master.grad for s in self.shards if s.master.grad is not None]

    def refresh(self) -> None:
        """Take the parameters as the slices' values where something else wrote them since
        the last gather (``load_state_dict``, ``dpm.load``, a manual edit): stepping the
        stale slices would silently undo that write."""
        for k, shard in enumerate(self.shards):
            if _versions(shard) != self._versions[k]:
                with torch.no_grad():
                    shard.master.copy_(shard.mine(shard.flatten(
                        [p.detach() for p in shard.params])))
                self._versions[k] = _versions(shard)

    def gather_params(self) -> None:
        """All-gather the updated slices into every replica's parameters."""
        for k, shard in enumerate(self.shards):
            flat = torch.empty(shard.numel, dtype=shard.master.dtype,
                               device=shard.master.device)
            with communicating("all-gather of the updated parameters over the "
                               "data-parallel group"):
                dist.all_gather_into_tensor(flat, shard.master.detach(), group=self.group)
            with torch.no_grad():
                for p, value in zip(shard.params, shard.split(flat)):
                    p.copy_(value)
            self._versions[k] = _versions(shard)

    def close(self) -> None:
        """Nothing to remove: no hooks were registered."""


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
        self.inner = optimizer_class([s.master for s in grads.shards], **kwargs)

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
            own = self.inner.state.get(shard.master, {})
            for key in sorted(own):
                value = own[key]
                if isinstance(value, torch.Tensor) and value.shape == shard.master.shape:
                    flat = torch.empty(shard.numel, dtype=value.dtype, device=value.device)
                    with communicating("all-gather of the optimizer state for a checkpoint"):
                        dist.all_gather_into_tensor(flat, value.contiguous(),
                                                    group=self.grads.group)
                    pieces = [v.detach().cpu().clone() for v in shard.split(flat)]
                else:
                    pieces = [_copy(value)] * len(shard.params)
                for name, piece in zip(shard.names, pieces):
                    state.setdefault(name, {})[key] = piece
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        names = [name for shard in self.grads.shards for name in shard.names]
        return {"state": state, "param_groups": [{**hyper, "params": names}]}

    def load_named_state(self, named: dict[str, Any],
                         aliases: dict[str, list[str]] | None = None) -> None:
        """Take this replica's slice of a whole named state (from any number of replicas,
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
            if not any(present):
                self.inner.state.pop(shard.master, None)
                continue
            if not all(present):
                lacking = [n for n, ok in zip(shard.names, present) if not ok]
                raise CheckpointError(f"the checkpoint's optimizer state lacks {lacking[:3]} "
                                      f"but holds their neighbours'; it was saved from "
                                      "another model or optimizer")
            full = [e for e in entries if e is not None]
            self.inner.state[shard.master] = {
                key: self._slice(shard, [e[key] for e in full]) for key in full[0]}
        group = _group_of(named["param_groups"], self.grads.shards[0].names[0]
                          if self.grads.shards else "")
        self.inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})

    def _slice(self, shard: FlatShard, values: list[Any]) -> Any:
        first = values[0]
        # Per element (moments) when shaped like the parameters; else shared (Adam's step).
        if all(isinstance(v, torch.Tensor) and v.shape == p.shape
               for v, p in zip(values, shard.params)) and any(v.dim() for v in values):
            flat = shard.flatten([v.to(shard.master.device) for v in values])
            return shard.mine(flat).clone().to(first.dtype)
        return _copy(first).to(shard.master.device) if isinstance(first, torch.Tensor) \
            else first


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

