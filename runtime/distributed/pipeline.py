"""Run one rank's stages of a pipeline across processes: the one interpreter over P2P.

Every rank holds ``v`` virtual stages of one pipeline replica, those the schedule's
placement puts on it (``k = j, j + P, ...`` looped; ``j`` and ``2 P - 1 - j`` in a V; one
stage ``j`` without virtual stages) and runs its list of any registered schedule
(``partitioner.runtime.schedule_registry``: GPipe, 1F1B, interleaved 1F1B, zero-bubble,
the V) through the same :class:`~partitioner.runtime.interpreter.Interpreter` as the
one-process runtime, with point-to-point messages as the transport
(``partitioner.runtime.distributed.transport``)::

    1f1b, P=2, m=4      rank of stage 0:  0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
                        rank of stage 1:  1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    F: receive inputs (stage > 0), forward, send outputs (stage < P v - 1)
    B / I: receive output gradients, backward, send input gradients (stage > 0)
    W: the deferred weight gradients (zero-bubble), local

The loss is computed on the rank of the last virtual stage (rank 0 in a V), per
micro-batch, as soon as that micro-batch's output exists
(:class:`~partitioner.runtime.loss_head.LossHead`: the loss runs where the output lives, so
outputs never travel back to one device). Each micro-batch's loss is
weighted by its share of the batch, ``n_i / N`` for a mean-reduced loss, so the accumulated
gradients equal full-batch training, and with data parallelism the replicas' gradients are
then averaged (``partitioner.runtime.distributed.data_parallel``; the interpreter arms the
reducer before the rank's last action). The step's loss is summed over micro-batches,
averaged over replicas, and returned on every rank.

Example:
    >>> pipe = DistributedPipeline({0: runner}, n_stages=2, links=links,
    ...                            interfaces=predict, schedule="1f1b", chunks=4)  # doctest: +SKIP
    >>> loss = pipe.step([x], y, torch.nn.functional.cross_entropy, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import ChunksError, LossError, ScheduleError, StrategyError
from partitioner.runtime.checkpointing import checkpoint_problem, checkpoint_stop
from partitioner.runtime.device import batches_sends
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.data_parallel import GradReducer, TiedGradients
from partitioner.runtime.distributed.fsdp import FsdpGradients
from partitioner.runtime.distributed.p2p import PipeLinks
from partitioner.runtime.distributed.transport import P2PTransport, StageInterface
from partitioner.runtime.distributed.zero import ShardedGradients
from partitioner.runtime.interpreter import Interpreter
from partitioner.runtime.loss_head import (
    LOSS_REDUCTIONS,
    LossHead,
    loss_reduction_problem,
    loss_weights,
    split_targets,
    to_device,
)
from partitioner.runtime.microbatch import batch_size, scatter
from partitioner.runtime.placement import Placement, stages_on
from partitioner.runtime.schedule import Action, Phase, pipeline_depth, validate
from partitioner.runtime.schedule_registry import Runtime, runtime_problem, schedule_kind
from partitioner.runtime.stage import StageRunner

__all__ = ["DistributedPipeline", "StageInterface", "LossError", "LOSS_REDUCTIONS"]

InterfaceFn = Callable[[list[list[Any]]], Sequence[Mapping[int, StageInterface]]]
"""Given the micro-batches of stage 0's inputs, per micro-batch each of this rank's virtual
stages' interface."""


class DistributedPipeline:
    """One rank's part of a multi-process pipeline: its virtual stages, run by the one
    interpreter over point-to-point links.

    Args:
        runners: this rank's virtual stages by index (those the schedule's placement puts
            on it); one :class:`StageRunner` is the rank's only stage.
        n_stages: virtual stages in the whole pipeline, ``P v``.
        links: P2P links to the ranks of this replica's other virtual stages (each
            boundary's peer from the placement: a ring when looped, a V goes down the
            ranks and back up, its turn on one rank handed over in memory).
        interfaces: predicts the boundaries of each micro-batch from stage 0's inputs.
        schedule: any schedule the multi-process runtime executes
            (``Runtime.MULTI_PROCESS`` in ``partitioner.runtime.schedule_registry``).
        chunks: micro-batches per step.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        restructure: turns the last stage's output into what the model returns.
        reducer: averages gradients over replicas (None without data parallelism), or cuts
            them over the replicas for a sharded optimizer.
        tied: sums the gradients of weights this rank shares with others (None if none).
        dp_size: replicas per stage (the returned loss is averaged over them).
        loss_rank: whether this rank contributes its loss to the returned value (the last
            stage, one shard per replica).
        loss_reduction: how ``loss_fn`` reduces over a micro-batch's samples, ``"mean"``
            (micro-batch losses weighted by their share of the batch) or ``"sum"``.
        grad_scale: a factor on the gradients only (not the returned loss): ``1 / dp``
            lets a ``GradReducer(predivided=True)`` sum instead of average, saving a pass.
        virtual: virtual stages per rank ``v`` (``"interleaved"``, ``"v_shape"``: 2 or more).

    Raises:
        StrategyError: If the runtime does not execute ``schedule``, or the checkpoint mode
            or loss reduction is unknown.
        ScheduleError: If the stages, ``virtual`` and ``chunks`` do not suit the schedule.
    """

    def __init__(self, runners: StageRunner | Mapping[int, StageRunner], *, n_stages: int,
                 links: PipeLinks, interfaces: InterfaceFn, schedule: str = "1f1b",
                 chunks: int = 1, checkpoint: str = "never",
                 restructure: Callable[[Any], Any] = lambda o: o,
                 reducer: GradReducer | ShardedGradients | FsdpGradients | None = None,
                 tied: TiedGradients | None = None,
                 dp_size: int = 1, loss_rank: bool | None = None, loss_reduction: str = "mean",
                 grad_scale: float = 1.0, virtual: int = 1) -> None:
        problems = [p for p in (runtime_problem(schedule, Runtime.MULTI_PROCESS),
                                checkpoint_problem(checkpoint),
                                loss_reduction_problem(loss_reduction)) if p is not None]
        if problems:
            raise StrategyError("; ".join(problems))
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ChunksError(f"chunks={chunks!r}; pass a positive int")
        self.runners = ({runners.index: runners} if isinstance(runners, StageRunner)
                        else dict(sorted(runners.items())))
        self.virtual = virtual
        self.pipeline_stages = _pipeline_stages(n_stages, virtual)
        self.stage = min(self.runners)
        self.schedule_kind = schedule_kind(schedule)
        #: Per virtual stage, the pipeline rank that runs it (the schedule's placement).
        self.placement = self.schedule_kind.place(self.pipeline_stages, virtual)
        _check_held(self.runners, self.stage, self.placement)
        found = self.schedule_kind.problems(self.pipeline_stages, chunks, virtual)
        if found:
            raise ScheduleError("; ".join(found))
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
        self.is_last = n_stages - 1 in self.runners
        self.loss_rank = self.is_last if loss_rank is None else loss_rank
        self.loss_reduction = loss_reduction
        self.grad_scale = grad_scale
        #: The most micro-batches (of all this rank's virtual stages together) whose
        #: activations this rank held at once, last step.
        self.peak_in_flight = 0
        self._actions: dict[int, tuple[Action, ...]] = {}

    @property
    def runner(self) -> StageRunner:
        """This rank's first virtual stage (its only one without virtual stages)."""
        return self.runners[self.stage]

    @property
    def device(self) -> torch.device:
        """Where this rank computes."""
        return self.runner.device

    def actions(self, n_microbatches: int) -> tuple[Action, ...]:
        """This rank's actions for ``n_microbatches`` (the schedule is validated once).

        Raises:
            ScheduleError: If the schedule cannot be built for ``n_microbatches`` (a batch
                too small for the chunks an interleaved schedule groups by ``P``).
        """
        if n_microbatches not in self._actions:
            p, v = self.pipeline_stages, self.virtual
            schedule = self.schedule_kind.build(p, n_microbatches, v)
            validate(schedule, p, n_microbatches, v, self.placement)
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
        else:  # every chunk's forwards in turn: no cycle of waits, whatever v
            actions = tuple(Action(k, Phase.FORWARD, i) for k in self.runners for i in range(m))
        head = None
        if self.is_last:
            head = LossHead(loss_fn, [to_device(t, self.device) for t in
                                      split_targets(targets, m, batch_size(values))],
                            loss_weights(micro, values, self.loss_reduction), self.restructure,
                            training=training, grad_scale=self.grad_scale,
                            upcast=self.runner.precision != "fp32")
        transport = P2PTransport(self.links, self.interfaces(micro), micro,
                                 n_stages=self.n_stages, device=self.device, training=training)
        for chunk, runner in enumerate(self.runners.values()):
            # One virtual stage per rank keeps the seed as it was; chunks get their own.
            runner.reset(seed + chunk)
        arm = self.reducer.arm if training and self.reducer is not None else None
        interpreter = Interpreter(self.runners, self.n_stages, transport, head=head,
                                  training=training, arm=arm,
                                  replay_below=checkpoint_stop(self.checkpoint, m)
                                  if training else 0)
        interpreter.run(actions)
        self.peak_in_flight = interpreter.peak_in_flight
        self.links.finish()
        if training and self.reducer is not None:
            self.reducer.finish()
        if training and self.tied is not None:
            self.tied.reduce()
        return self._reduce_loss(head.loss if head is not None else 0.0)

    def _reduce_loss(self, local: float) -> float:
        """The step's loss on every rank: the last stages' losses summed over the world.

        Raises:
            CommunicationError: if the all-reduce fails (a rank died), like any exchange.
        """
        if not dist.is_initialized():  # a world of one process
            return local / self.dp_size
        device = (self.runner.device if batches_sends(str(dist.get_backend()))
                  else torch.device("cpu"))
        value = torch.tensor([local if self.loss_rank else 0.0], dtype=torch.float64,
                             device=device)
        with communicating(f"the loss all-reduce over every rank (stage {self.stage})"):
            dist.all_reduce(value)
        return float(value.item()) / self.dp_size


def _pipeline_stages(n_stages: int, virtual: int) -> int:
    """``P``, from ``P v`` virtual stages (``partitioner.runtime.schedule.pipeline_depth``)."""
    return pipeline_depth(n_stages, virtual, "rank")


def _check_held(runners: Mapping[int, StageRunner], j: int, placement: Placement) -> None:
    """A rank holds exactly the virtual stages the schedule's placement puts on it.

    Raises:
        ScheduleError: Naming the stages held and those expected.
    """
    expected = list(stages_on(placement, j))
    if list(runners) != expected:
        raise ScheduleError(f"a rank holds virtual stages {list(runners)}, but the schedule "
                            f"places virtual stage k on pipeline rank {placement}[k]: pass "
                            f"stages {expected}")
