"""One tensor-parallel stage in one process: its rank graphs on threads, as one autograd node.

A stage split over ``tp`` devices runs rank ``r``'s graph on device ``r``; rank 0 runs on
the calling thread (a pipeline worker, or the user's), ranks 1.. on a worker thread each.
The ranks meet in collectives (``partitioner.runtime.tensor_parallel.collectives.ThreadGroup``),
forward and backward,
so their backward passes must run concurrently too: autograd alone would run every CPU
backward on one thread, and the first collective would wait forever. So the stage enters
autograd as one ``Function`` (the same design as the pipeline's, ``docs/design/001``): its
forward runs the ranks' forwards, its backward runs the ranks' backwards, each on its thread.

Inputs and outputs of a stage are replicated (the tensor-parallel pass makes them so): each
rank gets its own copy of the inputs, and the stage returns rank 0's outputs. Parameters
accumulate their gradients into ``.grad`` on their rank's thread.

Dropout on replicated values draws, on every rank, from one generator seeded alike, so
replicated activations stay identical; dropout on split values draws from a generator of
the rank's own (Megatron's model-parallel RNG). Both are seeded per call from the caller's
generator, so a checkpointed replay draws the very same masks.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    >>> stage = TensorParallelStage([gm], [torch.device("cpu")])
    >>> stage(torch.ones(3, 2)).shape
    torch.Size([3, 2])
    >>> stage.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.errors import TensorParallelError, TensorParallelExecutionError
from partitioner.runtime import rng
from partitioner.runtime.device import is_accelerator
from partitioner.runtime.stage import locate_node
from partitioner.runtime.tensor_parallel.collectives import CollectiveAborted, ThreadGroup
from partitioner.runtime.worker import Worker

__all__ = ["TensorParallelStage", "TensorParallelExecutionError", "rank_device_problem"]


def rank_device_problem(devices: Sequence[torch.device | str]) -> str | None:
    """Why tensor-parallel ranks on ``devices`` cannot run in one process, or ``None``.

    Ranks on one CPU run: a CPU backward runs on the thread that calls it. On a GPU the
    autograd engine runs every backward of that device on one thread of its own, so two
    ranks on one GPU would wait for each other's all-reduce inside it forever (seen on an
    H200 with ``tp=2`` on ``cuda:0`` twice).

    Example:
        >>> rank_device_problem(["cpu", "cpu"]) is None
        True
        >>> rank_device_problem(["cuda:0", "cuda:1"]) is None
        True
        >>> print(rank_device_problem(["cuda:0", "cuda:0"]).split(":")[0])
        tensor-parallel ranks share cuda
    """
    seen = [torch.device(d) for d in devices]
    shared = sorted({str(d) for d in seen if is_accelerator(d) and seen.count(d) > 1})
    if not shared:
        return None
    return (f"tensor-parallel ranks share {shared[0]}: autograd runs every backward of one "
            "GPU on a single thread, where one rank's all-reduce would wait forever for "
            "another's; give each rank of a stage its own GPU, or run replicas or a pipeline "
            "on the shared one")

_COMM_ATTR = "_tp_comm"


class TensorParallelStage(nn.Module):
    """Rank graphs of one stage on their devices, called like the unsplit stage.

    Args:
        ranks: one graph per rank (from the tensor-parallel pass), already on its device.
        devices: one device per rank.
        timeout: seconds a rank waits for its peers in a collective.
    """

    def __init__(self, ranks: Sequence[fx.GraphModule], devices: Sequence[torch.device],
                 timeout: float = 300.0) -> None:
        super().__init__()
        if len(ranks) != len(devices) or not ranks:
            raise ValueError(f"{len(ranks)} rank graphs for {len(devices)} devices")
        problem = rank_device_problem(devices)
        if problem is not None:
            raise TensorParallelError(problem)
        self.ranks = nn.ModuleList(ranks)
        self.devices = [torch.device(d) for d in devices]
        self.group = ThreadGroup(self.devices, timeout)
        for gm, member in zip(ranks, self.group.members):
            setattr(gm, _COMM_ATTR, member)
        self._workers: list[Worker] | None = None
        #: intra-op threads of the rank workers (set by whoever knows how many threads share
        #: the cores, e.g. ``TensorParallelModule.pipeline``); ``None``: torch's default.
        self.threads: int | None = None

    @property
    def graph(self) -> fx.Graph:
        """Rank 0's graph (all ranks have the same nodes)."""
        gm: fx.GraphModule = self.ranks[0]  # type: ignore[assignment]
        return gm.graph

    @property
    def tp(self) -> int:
        return len(self.ranks)

    def workers(self) -> list[Worker]:
        """The threads of ranks 1.. (started on first use)."""
        if self._workers is None:
            self._workers = [Worker(d, self.threads if d.type == "cpu" else None)
                             for d in self.devices[1:]]
        return self._workers

    def forward(self, *inputs: Any) -> Any:
        leaves, spec = pytree.tree_flatten(list(inputs))
        seed = rng.draw_seed(rng.current_generator())
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or any(isinstance(v, torch.Tensor) and v.requires_grad for v in leaves))
        if not grad:
            return self.run(leaves, spec, seed, grad=False)[0][0]
        positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box: dict[str, Any] = {}
        # Parameters are not inputs of the Function; without an input that requires grad,
        # autograd would not record it and the ranks' backward would never run.
        phony = torch.empty(0, requires_grad=True)
        outs = _StageFunction.apply(self, (leaves, spec, positions, seed, box), phony,
                                    *[leaves[k] for k in positions])
        out_leaves = list(box["leaves"])
        for k, tensor in zip(box["positions"], outs):
            out_leaves[k] = tensor
        return pytree.tree_unflatten(out_leaves, box["spec"])

    def run(self, leaves: list[Any], spec: pytree.TreeSpec, seed: int,
            grad: bool) -> list[tuple[Any, list[Any]]]:
        """Every rank's ``(outputs, input leaves)`` for one call."""
        def one(r: int) -> tuple[Any, list[Any]]:
            device = self.devices[r]
            mine = [_to(v, device, grad) for v in leaves]
            replicated = torch.Generator(device).manual_seed(seed)
            private = torch.Generator(device).manual_seed(seed + 1 + r)
            with torch.set_grad_enabled(grad), rng.use_generator(replicated), \
                    rng.use_shard_generator(private):
                out = self._call(r, pytree.tree_unflatten(mine, spec))
            return out, mine
        return self._on_all(one)

    def backward_ranks(self, ranks: list[tuple[Any, list[Any]]],
                       grads: list[torch.Tensor | None]) -> list[Any]:
        """Back-propagate every rank's outputs; return rank 0's input-leaf gradients."""
        def one(r: int) -> list[Any]:
            outs, mine = ranks[r]
            tensors, incoming = [], []
            for out, g in zip(pytree.tree_leaves(outs), grads):
                if isinstance(out, torch.Tensor) and out.requires_grad and g is not None:
                    tensors.append(out)
                    incoming.append(g.to(self.devices[r]))
            if tensors:
                torch.autograd.backward(tensors, incoming)
            return [v.grad if isinstance(v, torch.Tensor) and v.requires_grad else None
                    for v in mine]
        return self._on_all(one)[0]

    def _call(self, r: int, inputs: list[Any]) -> Any:
        gm: fx.GraphModule = self.ranks[r]  # type: ignore[assignment]
        try:
            return type(gm).forward(gm, *inputs)
        except CollectiveAborted:
            raise
        except Exception as error:
            node = locate_node(gm, error)
            where = f", node {node}" if node else ""
            raise TensorParallelExecutionError(
                f"tensor-parallel rank {r} on {self.devices[r]}{where} raised "
                f"{type(error).__name__}: {error}") from error

    def _on_all(self, fn: Any) -> list[Any]:
        """Run ``fn(r)`` for every rank at once; on a failure release the waiting ranks."""
        futures: list[Future[Any]] = []
        for r, worker in enumerate(self.workers(), start=1):
            futures.append(worker.submit(self._guarded, fn, r))
        results: list[Any] = [None] * self.tp
        errors: list[BaseException] = []
        try:
            results[0] = fn(0)
        except BaseException as error:
            self.group.abort()
            errors.append(error)
        for r, future in enumerate(futures, start=1):
            try:
                results[r] = future.result()
            except BaseException as error:
                errors.append(error)
        if errors:
            self.group.reset()
            own = [e for e in errors if not isinstance(e, CollectiveAborted)]
            raise (own or errors)[0]
        return results

    def _guarded(self, fn: Any, r: int) -> Any:
        try:
            return fn(r)
        except BaseException:
            self.group.abort()
            raise

    def close(self) -> None:
        """Stop the rank threads (they also stop when the stage is collected)."""
        if self._workers is not None:
            for worker in self._workers:
                worker.close()
            self._workers = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _to(value: Any, device: torch.device, grad: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().to(device)
    if grad and value.requires_grad:
        copy.requires_grad_(True)
    return copy


class _StageFunction(torch.autograd.Function):
    """The stage as one autograd node: forward and backward of every rank, concurrently."""

    @staticmethod
    def forward(ctx: Any, stage: TensorParallelStage, call: tuple[Any, ...],
                phony: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves, spec, positions, seed, box = call
        ranks = stage.run(leaves, spec, seed, grad=True)
        out_leaves, out_spec = pytree.tree_flatten(ranks[0][0])
        out_positions = [k for k, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
        box.update(leaves=out_leaves, spec=out_spec, positions=out_positions)
        ctx.stage, ctx.ranks, ctx.n_leaves = stage, ranks, len(out_leaves)
        ctx.out_positions, ctx.in_positions = out_positions, positions
        outputs = tuple(out_leaves[k].detach() for k in out_positions)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        per_leaf: list[torch.Tensor | None] = [None] * ctx.n_leaves
        for k, g in zip(ctx.out_positions, grads):
            per_leaf[k] = g
        leaf_grads = ctx.stage.backward_ranks(ctx.ranks, per_leaf)
        ctx.ranks = None  # free the ranks' graphs
        return (None, None, None, *[leaf_grads[k] for k in ctx.in_positions])
