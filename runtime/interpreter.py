"""The one schedule interpreter: runs a device's action list over its stages.

Every runtime executes schedules the same way. A device (a worker thread in one process, a
rank across processes) holds one or more (virtual) stages, each a
:class:`~partitioner.runtime.stage.StageRunner`, and runs its list of
:class:`~partitioner.runtime.action.Action` s in order:

* ``F(k, i)``: take the inputs of virtual stage ``k`` for micro-batch ``i`` from the
  transport (stage 0: the micro-batch itself), run the forward, hand the outputs on (the
  last stage of a training step gives them to its :class:`~partitioner.runtime.loss_head.
  LossHead` instead, which starts the backward from the loss);
* ``B(k, i)`` / ``I(k, i)``: take the gradients of the outputs, back-propagate, hand the
  input gradients back (``I`` leaves the Linear layers' weight gradients queued);
* ``W(k, i)``: run the queued weight gradients.

Where data comes from and goes to is the :class:`Transport`'s business: futures between
threads (``partitioner.runtime.thread_transport``) or torch.distributed point-to-point
messages (``partitioner.runtime.distributed.pipeline``). The interpreter knows neither,
and the schedules know nothing of either: one registry of action lists
(``partitioner.runtime.schedule_registry``), one executor, two transports.

Example:
    >>> import torch
    >>> from partitioner.runtime.schedule_generators import one_f_one_b
    >>> from partitioner.runtime.stage import StageRunner
    >>> class Here:  # a transport for one device holding the only stage
    ...     def __init__(self, x): self.x, self.grads = x, None
    ...     def inputs(self, k, i): return [self.x]
    ...     def send_outputs(self, k, i, out): pass
    ...     def output_grads(self, k, i): raise AssertionError("the head gives them")
    ...     def send_input_grads(self, k, i, grads): self.grads = grads
    ...     def prefetch(self, actions, position): pass
    ...     def failed(self, action, error): raise error
    >>> layer = torch.nn.Linear(2, 1)
    >>> x = torch.randn(3, 2, requires_grad=True)
    >>> runner = StageRunner(0, layer, torch.device("cpu"))
    >>> head = LossHead(lambda out, _: out.sum(), [None], [1.0])
    >>> Interpreter({0: runner}, 1, Here(x), head=head).run(one_f_one_b(1, 1)[0])
    >>> layer.weight.grad.shape
    torch.Size([1, 2])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from partitioner.runtime.action import Action, Phase
from partitioner.runtime.loss_head import LossHead
from partitioner.runtime.stage import StageRunner

__all__ = ["Interpreter", "LossHead", "Transport", "splits_backward"]


class Transport(Protocol):
    """Moves what crosses stage boundaries for one device.

    Virtual stage ``k`` receives its inputs from ``k - 1`` and sends its outputs to
    ``k + 1``; gradients go the other way. Stage 0's inputs are the micro-batch, and the
    last stage's outputs (when no loss head takes them) and stage 0's input gradients leave
    the pipeline: the transport decides where to.
    """

    def inputs(self, stage: int, microbatch: int) -> list[Any]:
        """Virtual stage ``stage``'s inputs for ``microbatch`` (blocking until they came)."""

    def send_outputs(self, stage: int, microbatch: int, outputs: Any) -> None:
        """Hand ``outputs`` of ``stage`` on to the next stage (or out of the pipeline)."""

    def output_grads(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        """The gradients of ``stage``'s output leaves for ``microbatch`` (blocking)."""

    def send_input_grads(self, stage: int, microbatch: int,
                         grads: list[torch.Tensor | None]) -> None:
        """Hand the gradients of ``stage``'s input leaves back."""

    def prefetch(self, actions: Sequence[Action], position: int) -> None:
        """Post the receives the action at ``position`` and those just after it need."""

    def failed(self, action: Action, error: BaseException) -> None:
        """``action`` raised ``error``: re-raise to stop, or record it and return to go on
        (the transport then fails what the action would have sent, so no peer waits)."""


def splits_backward(actions: Sequence[Action]) -> bool:
    """Whether a list of actions splits its backwards into ``I`` and ``W``."""
    return any(a.phase is Phase.INPUT for a in actions)


class Interpreter:
    """Runs one device's actions over its virtual stages.

    Args:
        runners: the device's stages by virtual stage index.
        n_stages: the number of virtual stages in the whole pipeline (``P v``).
        transport: where inputs and gradients come from and go to.
        head: computes the loss of each micro-batch on the last stage (a training step);
            ``None``: the last stage's outputs go to the transport and its output
            gradients come from it (``pm(x)`` then ``loss.backward()``).
        training: whether forwards record what backwards need.
        replay_below: micro-batches ``i < replay_below`` run checkpointed (their forward
            is replayed in the backward).
        on_action: called before each action (e.g. to set intra-op threads).
        record: called with ``(action, start, end)`` (``time.perf_counter`` seconds) after
            each action that ran.
        arm: called right before the device's last action of a training step (data
            parallelism starts reducing gradients from there).
    """

    def __init__(self, runners: Mapping[int, StageRunner], n_stages: int,
                 transport: Transport, *, head: LossHead | None = None,
                 training: bool = True, replay_below: int = 0,
                 on_action: Callable[[Action], None] | None = None,
                 record: Callable[[Action, float, float], None] | None = None,
                 arm: Callable[[], None] | None = None) -> None:
        self.runners = dict(runners)
        self.n_stages = n_stages
        self.transport = transport
        self.head = head
        self.training = training
        self.replay_below = replay_below
        self.on_action = on_action
        self.record = record
        self.arm = arm
        self._head_grads: dict[int, list[torch.Tensor | None]] = {}
        #: The most micro-batches any of this device's stages held activations for at once.
        self.peak_in_flight = 0

    def run(self, actions: Sequence[Action]) -> None:
        """Run ``actions`` in order (each errors goes to ``transport.failed``)."""
        split = splits_backward(actions)
        last = len(actions) - 1
        for position, action in enumerate(actions):
            try:
                self.transport.prefetch(actions, position)
                if self.on_action is not None:
                    self.on_action(action)
                if position == last and self.training and self.arm is not None:
                    self.arm()
                self._run(action, split)
            except BaseException as error:  # the transport decides: go on or stop
                self.transport.failed(action, error)

    def _run(self, action: Action, split: bool) -> None:
        k, i = action.stage, action.microbatch
        runner = self.runners[k]
        if action.phase is Phase.FORWARD:
            inputs = self.transport.inputs(k, i)
            start = time.perf_counter()
            out = runner.forward(i, list(inputs), grad=self.training,
                                 checkpoint=i < self.replay_below, split=split)
            end = time.perf_counter()
            self.peak_in_flight = max(self.peak_in_flight,
                                      sum(r.in_flight for r in self.runners.values()))
            if k == self.n_stages - 1 and self.head is not None:
                self._head_grads[i] = self.head(i, out, stage=k)
            else:
                self.transport.send_outputs(k, i, out)
        elif action.phase is Phase.WEIGHT:
            start = time.perf_counter()
            runner.weight(i)
            end = time.perf_counter()
        else:
            if k == self.n_stages - 1 and self.head is not None:
                grads = self._head_grads.pop(i)
            else:
                grads = self.transport.output_grads(k, i)
            start = time.perf_counter()
            input_grads = runner.backward(i, grads)
            end = time.perf_counter()
            if action.phase is Phase.BACKWARD and split:
                # A B in a list that splits others: its weight gradients now, too.
                runner.weight(i)
                end = time.perf_counter()
            self.transport.send_input_grads(k, i, input_grads)
        if self.record is not None:
            self.record(action, start, end)
