"""Run one rank's stage of a pipeline across processes: its actions, P2P, the loss.

Every rank holds one stage ``j`` and runs that stage's list of a validated schedule (one
``partitioner.runtime.schedule_registry`` says this runtime executes: GPipe or 1F1B), one
action at a time, with the same :class:`~partitioner.runtime.stage.StageRunner` as the
one-process runtime doing each micro-batch's forward, checkpointed replay and backward::

    1f1b, P=2, m=4      rank of stage 0:  0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
                        rank of stage 1:  1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    F: receive inputs (stage > 0), forward, send outputs (stage < P-1)
    B: receive output gradients (stage < P-1), backward, send input gradients (stage > 0)

The loss is computed on the last stage, per micro-batch, as soon as that micro-batch's
output exists (the seeds' ``DataParallelCriterion`` idea: the loss runs where the output
lives, so outputs never travel back to one device). Each micro-batch's loss is weighted by
its share of the batch, ``n_i / N`` for a mean-reduced loss, so the accumulated gradients
equal full-batch training, and with data parallelism the replicas' gradients are then
averaged (``partitioner.runtime.distributed.data_parallel``). The step's loss is summed over
micro-batches,
averaged over replicas, and returned on every rank.

Receives are posted before they are needed: on gloo, those of the next ``LOOKAHEAD``
actions, so transfers overlap compute while buffers stay few; on NCCL they are batched
with the previous action's sends (see ``partitioner.runtime.distributed.p2p``).

Example:
    >>> pipe = DistributedPipeline(runner, n_stages=2, links=links,
    ...                            interfaces=predict, schedule="1f1b", chunks=4)  # doctest: +SKIP
    >>> loss = pipe.step([x], y, torch.nn.functional.cross_entropy, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partitioner.errors import (
    ChunksError,
    LossError,
    StageExecutionError,
    StrategyError,
)
from partitioner.runtime.checkpointing import checkpoint_problem, checkpoint_stop
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.data_parallel import GradReducer, TiedGradients
from partitioner.runtime.distributed.p2p import Boundary, Pending, PipeLinks
from partitioner.runtime.microbatch import batch_size, scatter
from partitioner.runtime.schedule import Action, Phase, validate
from partitioner.runtime.schedule_registry import Runtime, make_schedule, runtime_problem
from partitioner.runtime.stage import StageRunner
from partitioner.runtime.transfer import move_leaves

__all__ = ["DistributedPipeline", "StageInterface", "LossError", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")
LOOKAHEAD = 2
"""Actions ahead of the running one whose receives are already posted (gloo)."""


@dataclass(frozen=True)
class StageInterface:
    """What one stage receives and sends for one micro-batch.

    Attributes:
        inputs: the boundary before the stage (None for stage 0, which reads the batch).
        outputs: the boundary after it (None for the last stage).
    """

    inputs: Boundary | None
    outputs: Boundary | None


InterfaceFn = Callable[[list[list[Any]]], Sequence[StageInterface]]
"""Given the micro-batches of stage 0's inputs, this stage's interface per micro-batch."""


class DistributedPipeline:
    """One rank's part of a multi-process pipeline.

    Args:
        runner: this rank's stage.
        n_stages: ``P``.
        links: P2P links to the neighbouring stages of this replica.
        interfaces: predicts the boundaries of each micro-batch from stage 0's inputs.
        schedule: a schedule the multi-process runtime executes (``"gpipe"`` or ``"1f1b"``;
            ``Runtime.MULTI_PROCESS`` in ``partitioner.runtime.schedule_registry``).
        chunks: micro-batches per step.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        restructure: turns the last stage's output into what the model returns.
        reducer: averages gradients over replicas (None without data parallelism).
        tied: sums the gradients of weights this stage shares with others (None if none).
        dp_size: replicas per stage (the returned loss is averaged over them).
        loss_rank: whether this rank contributes its loss to the returned value (the last
            stage, one shard per replica).
        loss_reduction: how ``loss_fn`` reduces over a micro-batch's samples, ``"mean"``
            (micro-batch losses weighted by their share of the batch) or ``"sum"``.
        grad_scale: a factor on the gradients only (not the returned loss): ``1 / dp``
            lets a ``GradReducer(predivided=True)`` sum instead of average, saving a pass.
    """

    def __init__(self, runner: StageRunner, *, n_stages: int, links: PipeLinks,
                 interfaces: InterfaceFn, schedule: str = "1f1b", chunks: int = 1,
                 checkpoint: str = "never", restructure: Callable[[Any], Any] = lambda o: o,
                 reducer: GradReducer | None = None, tied: TiedGradients | None = None,
                 dp_size: int = 1,
                 loss_rank: bool | None = None, loss_reduction: str = "mean",
                 grad_scale: float = 1.0) -> None:
        problems = [p for p in (runtime_problem(schedule, Runtime.MULTI_PROCESS),
                                checkpoint_problem(checkpoint)) if p is not None]
        if loss_reduction not in LOSS_REDUCTIONS:
            problems.append(f"loss_reduction={loss_reduction!r}; use one of {LOSS_REDUCTIONS}")
        if problems:
            raise StrategyError("; ".join(problems))
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ChunksError(f"chunks={chunks!r}; pass a positive int")
        self.runner = runner
        self.stage = runner.index
        self.n_stages = n_stages
        self.links = links
        self.interfaces = interfaces
        self.schedule = schedule
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.restructure = restructure
        self.reducer = reducer
        self.tied = tied
        self.dp_size = dp_size
        self.is_last = self.stage == n_stages - 1
        self.loss_rank = self.is_last if loss_rank is None else loss_rank
        self.loss_reduction = loss_reduction
        self.grad_scale = grad_scale
        #: The most micro-batches this stage held activations for at once, last step.
        self.peak_in_flight = 0
        self._actions: dict[int, tuple[Action, ...]] = {}

    def actions(self, n_microbatches: int) -> tuple[Action, ...]:
        """This stage's actions for ``n_microbatches`` (the schedule is validated once)."""
        if n_microbatches not in self._actions:
            schedule = make_schedule(self.schedule, self.n_stages, n_microbatches)
            validate(schedule, self.n_stages, n_microbatches)
            self._actions[n_microbatches] = schedule[self.stage]
        return self._actions[n_microbatches]

    def step(self, values: list[Any], targets: Any, loss_fn: Callable[[Any, Any], Any], *,
             seed: int) -> float:
        """Run one training step's forwards and backwards; return the step's loss.

        ``values`` are stage 0's placeholder values for the whole local batch (every rank of
        a replica passes the same batch; only stage 0 reads the data, the others its shapes).
        Gradients accumulate into the parameters' ``.grad``, averaged over replicas.
        """
        return self._run(values, targets, loss_fn, seed=seed, training=True)

    def evaluate(self, values: list[Any], targets: Any, loss_fn: Callable[[Any, Any], Any], *,
                 seed: int) -> float:
        """Run the forwards only, without autograd; return the loss."""
        with torch.no_grad():
            return self._run(values, targets, loss_fn, seed=seed, training=False)

    def _run(self, values: list[Any], targets: Any, loss_fn: Callable[[Any, Any], Any], *,
             seed: int, training: bool) -> float:
        micro = scatter(values, self.chunks)
        m = len(micro)
        if training:
            actions = self.actions(m)
        else:
            actions = tuple(Action(self.stage, Phase.FORWARD, i) for i in range(m))
        run = _Run(self, micro, self.interfaces(micro), training,
                   checkpoint_stop(self.checkpoint, m) if training else 0)
        if self.is_last:
            run.targets = [_to_device(t, self.runner.device)
                           for t in _split_targets(targets, m, batch_size(values))]
            run.weights = self._weights(micro, values)
            run.loss_fn = loss_fn
        self.runner.reset(seed)
        self.peak_in_flight = 0
        last = len(actions) - 1
        for k, action in enumerate(actions):
            run.before(actions, k)
            if action.phase is Phase.FORWARD:
                run.forward(action.microbatch)
                self.peak_in_flight = max(self.peak_in_flight, self.runner.in_flight)
            else:
                if k == last and self.reducer is not None:
                    self.reducer.arm()
                run.backward(action.microbatch)
        self.links.finish()
        if training and self.reducer is not None:
            self.reducer.finish()
        if training and self.tied is not None:
            self.tied.reduce()
        return self._reduce_loss(run.loss)

    def _weights(self, micro: list[list[Any]], values: list[Any]) -> list[float]:
        if self.loss_reduction == "sum":
            return [1.0] * len(micro)
        total = batch_size(values)
        if total is None:
            return [1.0 / len(micro)] * len(micro)
        return [(batch_size(mb) or 0) / total for mb in micro]

    def _reduce_loss(self, local: float) -> float:
        """The step's loss on every rank: the last stages' losses summed over the world.

        Raises:
            CommunicationError: if the all-reduce fails (a rank died), like any exchange.
        """
        if not dist.is_initialized():  # a world of one process
            return local / self.dp_size
        device = self.runner.device if dist.get_backend() == "nccl" else torch.device("cpu")
        value = torch.tensor([local if self.loss_rank else 0.0], dtype=torch.float64,
                             device=device)
        with communicating(f"the loss all-reduce over every rank (stage {self.stage})"):
            dist.all_reduce(value)
        return float(value.item()) / self.dp_size


def _split_targets(targets: Any, m: int, batch: int | None) -> list[Any]:
    if targets is None:
        return [None] * m
    size = batch_size(targets)
    if m > 1 and size != batch:
        raise ChunksError(f"targets have batch size {size} but the inputs {batch}; pass "
                          "targets with one row per sample of the batch")
    return [parts[0] for parts in scatter([targets], m)]


def _to_device(values: Any, device: torch.device) -> Any:
    leaves, spec = pytree.tree_flatten(values)
    return pytree.tree_unflatten(move_leaves(leaves, device, grad=False), spec)


class _Run:
    """The state of one step on one stage: pending receives, stashed output gradients."""

    def __init__(self, pipe: DistributedPipeline, micro: list[list[Any]],
                 faces: Sequence[StageInterface], training: bool, stop: int) -> None:
        self.pipe = pipe
        self.micro = micro
        self.faces = faces
        self.training = training
        self.stop = stop
        self.activations: dict[int, Pending] = {}
        self.grads: dict[int, Pending] = {}
        self.output_grads: dict[int, list[torch.Tensor | None]] = {}
        self.targets: list[Any] = []
        self.weights: list[float] = []
        self.loss_fn: Callable[[Any, Any], Any] = lambda out, target: out
        self.loss = 0.0


    def _need(self, action: Action) -> None:
        i, face, links = action.microbatch, self.faces[action.microbatch], self.pipe.links
        if action.phase is Phase.FORWARD and face.inputs is not None and i not in self.activations:
            self.activations[i] = links.recv_activations(i, face.inputs)
        if action.phase is Phase.BACKWARD and face.outputs is not None and i not in self.grads:
            self.grads[i] = links.recv_grads(i, face.outputs)

    def before(self, actions: Sequence[Action], k: int) -> None:
        """Post the receives action ``k`` and the next ones need.

        Receives posted ahead let the data arrive while this stage computes; posting only
        ``LOOKAHEAD`` actions ahead keeps the buffers waiting to O(1), not O(m), which would
        undo 1F1B's bound on memory. Batched links (NCCL) post this action's receive
        together with the previous action's sends instead.
        """
        if self.pipe.links.batched:
            self._need(actions[k])
            self.pipe.links.flush()
            return
        for action in actions[k:k + 1 + LOOKAHEAD]:
            self._need(action)

    def forward(self, i: int) -> None:
        pipe, face = self.pipe, self.faces[i]
        runner = pipe.runner
        if face.inputs is None:
            inputs = _to_device(list(self.micro[i]), runner.device)
        else:
            tensors = self.activations.pop(i).wait()
            if self.training:
                for k, t in zip(face.inputs.tensor_positions, tensors):
                    if k in face.inputs.grad_positions:
                        t.requires_grad_(True)
            inputs = list(face.inputs.assemble(tensors))
        out = runner.forward(i, inputs, grad=self.training, checkpoint=i < self.stop)
        if face.outputs is not None:
            where = f"stage {pipe.stage} (micro-batch {i})"
            pipe.links.send_activations(i, face.outputs, face.outputs.check(out, where))
        else:
            self._loss(i, out)

    def _loss(self, i: int, out: Any) -> None:
        pipe = self.pipe
        leaves, spec = pytree.tree_flatten(out)
        detached = [leaf.detach().requires_grad_(self.training and _differentiable(leaf))
                    if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        with torch.enable_grad() if self.training else torch.no_grad():
            try:
                loss = self.loss_fn(pipe.restructure(pytree.tree_unflatten(detached, spec)),
                                    self.targets[i])
            except Exception as error:
                raise StageExecutionError(
                    f"loss_fn raised on stage {pipe.stage} (micro-batch {i}): "
                    f"{type(error).__name__}: {error}", pipe.stage, i, None) from error
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise LossError(f"loss_fn returned {shape}; return a scalar tensor (reduce "
                                "over the micro-batch with mean or sum)")
            weighted = loss.reshape(()) * self.weights[i]
        self.loss += float(weighted.detach().double().item())
        if not self.training:
            return
        if pipe.grad_scale != 1.0:
            weighted = weighted * pipe.grad_scale
        wanted = [k for k, leaf in enumerate(detached)
                  if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        grads = torch.autograd.grad(weighted, [detached[k] for k in wanted], allow_unused=True)
        per_leaf: list[torch.Tensor | None] = [None] * len(leaves)
        for k, g in zip(wanted, grads):
            per_leaf[k] = g
        self.output_grads[i] = per_leaf

    def backward(self, i: int) -> None:
        pipe, face = self.pipe, self.faces[i]
        if face.outputs is None:
            grad_leaves = self.output_grads.pop(i)
        else:
            tensors = self.grads.pop(i).wait()
            grad_leaves = [None] * len(face.outputs.leaves)
            for k, t in zip(face.outputs.grad_positions, tensors):
                grad_leaves[k] = t
        input_grads = pipe.runner.backward(i, grad_leaves)
        if face.inputs is not None:
            pipe.links.send_grads(i, face.inputs,
                                  [input_grads[k] for k in face.inputs.grad_positions])


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex
