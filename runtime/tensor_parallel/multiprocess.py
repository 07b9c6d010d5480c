"""One tensor-parallel rank per process: the rank's graph, collectives on a process group.

Each process of a tensor-parallel group holds :class:`DistributedTensorParallel`: its
rank's graph (from the tensor-parallel pass) with its slice of every split weight and a
copy of every other parameter. Collectives run on the group through ``torch.distributed``
(gloo on CPU, NCCL on GPUs) as autograd functions, so ``loss.backward()`` is plain autograd:
no extra thread, no extra step.

``state_dict()`` is a collective: every rank must call it, and every rank gets the whole,
unsplit tensors under the original model's keys. ``load_state_dict`` takes such a state dict
on every rank and keeps the rank's slices (:mod:`partitioner.runtime.tensor_parallel.state`).
``clip_grad_norm_`` is a collective too: the ranks' partial norms are all-reduced over the
group (:class:`~partitioner.runtime.wrapper.GroupNorms`).

Dropout on replicated values draws from a generator seeded alike on every rank (the seed is
agreed once, at construction, from rank 0's global generator), dropout on split values from
a generator of the rank's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioner.runtime import rng
from partitioner.runtime.tensor_parallel.collectives import ProcessGroupCommunicator
from partitioner.runtime.tensor_parallel.sharding import Sharding, unshard
from partitioner.runtime.tensor_parallel.state import TensorParallelState
from partitioner.runtime.wrapper import GroupNorms

__all__ = ["DistributedTensorParallel", "agree_seed"]

_COMM_ATTR = "_tp_comm"


def agree_seed(comm: ProcessGroupCommunicator) -> int:
    """A seed drawn on the group's rank 0 (torch's global generator) and sent to all ranks."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if comm.size > 1:
        group = comm.group if comm.group is not None else dist.group.WORLD
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=comm.group)  # type: ignore[arg-type]
    return int(seed.item())


class DistributedTensorParallel(TensorParallelState):
    """This process's rank of a tensor-parallel model.

    Args:
        graph_factory: given the training flag, the rank's graph (built once per mode; both
            modes' graphs share the rank's tensors).
        comm: the rank's communicator on the tensor-parallel process group.
        shardings: by original state-dict key; keys not named are replicated.
        sources: by original state-dict key, the rank-graph attribute holding it.
        unused: original entries no graph uses (kept whole).
        bind: maps a call's ``(args, kwargs)`` to the graph's placeholder values.
        restructure: maps the graph's output to what the model returns.
        plan: what was decided (kept as ``.plan``), if any.
        training: the model's train/eval mode when it was partitioned (the module starts in
            it, and builds that mode's graph first).
    """

    def __init__(self, graph_factory: Callable[[bool], fx.GraphModule],
                 comm: ProcessGroupCommunicator, shardings: dict[str, Sharding],
                 sources: dict[str, str], unused: dict[str, torch.Tensor],
                 bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]],
                 restructure: Callable[[Any], Any] = lambda out: out,
                 plan: Any = None, training: bool = True) -> None:
        super().__init__(shardings, sources, plan=plan, training=training)
        self.comm = comm
        self._factory = graph_factory
        self._bind = bind
        self._restructure = restructure
        self.graphs = nn.ModuleDict()
        self._keep_unused(unused)
        seed = agree_seed(comm)
        device = next(iter(self._graph(self.training).parameters()),
                      torch.empty(0)).device
        self._combine_norms = GroupNorms(comm.group, device=device)
        self._replicated = torch.Generator(device).manual_seed(seed)
        self._private = torch.Generator(device).manual_seed(seed + 1 + comm.rank)

    @property
    def rank(self) -> int:
        """This process's tensor-parallel rank."""
        return self.comm.rank

    @property
    def tp(self) -> int:
        """The tensor-parallel degree."""
        return self.comm.size

    def _graph(self, training: bool) -> fx.GraphModule:
        mode = "train_mode" if training else "eval_mode"
        if mode not in self.graphs:
            gm = self._factory(training)
            setattr(gm, _COMM_ATTR, self.comm)
            self.graphs[mode] = gm
        return self.graphs[mode]  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_open("run the model")
        gm = self._graph(self.training)
        with rng.use_generator(self._replicated), rng.use_shard_generator(self._private):
            out = gm(*self._bind(args, kwargs))
        return self._restructure(out)

    def local_tensor(self, key: str) -> torch.Tensor:
        """This rank's slice (or copy) of the original entry ``key``."""
        kept = self._unused_tensor(key)
        if kept is not None:
            return kept
        obj: Any = self._graph(self.training)
        for part in self._sources[key].split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]

    def full_tensor(self, key: str, grad: bool = False) -> torch.Tensor | None:
        """The original entry ``key`` (or, with ``grad``, its gradient), whole: a collective,
        every rank must call it. ``None`` for a gradient not computed yet (on every rank)."""
        local = self.local_tensor(key)
        if grad:
            if local.grad is None:
                return None
            local = local.grad
        local = local.detach()
        sharding = self._split_sharding(key)
        if sharding is None:
            return local.clone()
        return unshard(self.comm.all_gather(local, "state_dict"), sharding)

    def _rank_tensors(self, key: str) -> list[tuple[int, torch.Tensor]]:
        return [(self.rank, self.local_tensor(key))]
