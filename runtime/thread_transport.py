"""The one-process transport: stages on worker threads hand values over through futures.

Each (virtual stage ``k``, micro-batch ``i``) has one future for ``k``'s outputs and one for
the gradients of ``k``'s inputs. A receiver blocks on its future and moves the values to its
own device (``partitioner.runtime.transfer``); an action that raised sets its outgoing future
to the error instead, so the neighbour waiting for it fails too rather than hanging, and
the pipeline reports the root cause (:func:`first_stage_error`).

Stage 0 reads the micro-batches themselves. Without a loss head the last stage's outputs
are collected for the caller and its output gradients come from the caller (``pm(x)`` then
``loss.backward()``); stage 0's input gradients are collected likewise.

Example:
    >>> import torch
    >>> t = ThreadTransport([[torch.ones(2)]], [torch.device("cpu")], training=False)
    >>> t.inputs(0, 0)[0].tolist()
    [1.0, 1.0]
    >>> t.send_outputs(0, 0, (torch.zeros(1),)); t.outputs()[0][0].tolist()
    [0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.errors import StageExecutionError
from partitioner.runtime.action import Action, Phase
from partitioner.runtime.transfer import Handoff, move_leaves, receive, send

__all__ = ["ThreadTransport", "first_stage_error"]


class ThreadTransport:
    """Futures between the worker threads of one process.

    Args:
        micro: the micro-batches of stage 0's inputs (one list of values each).
        devices: the device of each virtual stage.
        training: whether received activations require grad.
        last_grads: per micro-batch, the gradients of the last stage's output leaves
            (``None``: a loss head supplies them, or there is no backward).
    """

    def __init__(self, micro: Sequence[Sequence[Any]], devices: Sequence[torch.device], *,
                 training: bool, last_grads: Sequence[list[Any]] | None = None) -> None:
        self.micro = micro
        self.devices = list(devices)
        self.training = training
        self.last_grads = last_grads
        n, m = len(self.devices), len(micro)
        self._acts: list[list[Future[Handoff]]] = [[Future() for _ in range(m)]
                                                   for _ in range(n)]
        self._grads: list[list[Future[Handoff]]] = [[Future() for _ in range(m)]
                                                    for _ in range(n)]
        self.errors: list[BaseException] = []

    def inputs(self, stage: int, microbatch: int) -> list[Any]:
        device = self.devices[stage]
        if stage == 0:
            leaves, spec = pytree.tree_flatten(list(self.micro[microbatch]))
            return list(pytree.tree_unflatten(
                move_leaves(leaves, device, grad=self.training), spec))
        handoff = self._acts[stage - 1][microbatch].result()
        leaves, spec = receive(handoff, device, grad=self.training)
        return list(pytree.tree_unflatten(leaves, spec))

    def send_outputs(self, stage: int, microbatch: int, outputs: Any) -> None:
        self._acts[stage][microbatch].set_result(send(outputs, self.devices[stage]))

    def output_grads(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        device = self.devices[stage]
        if stage == len(self.devices) - 1:
            if self.last_grads is None:
                raise RuntimeError("the last stage's output gradients were not given")
            return move_leaves(self.last_grads[microbatch], device, grad=False)
        leaves, _ = receive(self._grads[stage + 1][microbatch].result(), device, grad=False)
        return leaves

    def send_input_grads(self, stage: int, microbatch: int,
                         grads: list[torch.Tensor | None]) -> None:
        self._grads[stage][microbatch].set_result(send(grads, self.devices[stage]))

    def prefetch(self, actions: Sequence[Action], position: int) -> None:
        """Nothing to post ahead: a future is filled as soon as its sender is done."""

    def failed(self, action: Action, error: BaseException) -> None:
        """Record ``error`` and fail what ``action`` would have sent; the device goes on."""
        self.errors.append(error)
        row = self._acts if action.phase is Phase.FORWARD else \
            self._grads if action.phase.gives_input_grad else None
        if row is not None:
            slot = row[action.stage][action.microbatch]
            if not slot.done():
                slot.set_exception(error)

    def outputs(self) -> list[Any]:
        """The last stage's outputs, one per micro-batch (raises the first error)."""
        self.raise_first()
        return [pytree.tree_unflatten(h.leaves, h.spec)
                for h in (f.result() for f in self._acts[-1])]

    def input_grads(self) -> list[list[Any]]:
        """The gradients of stage 0's input leaves, one list per micro-batch."""
        self.raise_first()
        return [f.result().leaves for f in self._grads[0]]

    def raise_first(self) -> None:
        """Raise the root cause, if any action failed."""
        if self.errors:
            raise first_stage_error(self.errors)


def first_stage_error(errors: list[BaseException]) -> BaseException:
    """The root cause: a stage's own error rather than a neighbour's echo of it."""
    own = [e for e in errors if isinstance(e, StageExecutionError)]
    own.sort(key=lambda e: (e.microbatch, e.stage))
    return own[0] if own else errors[0]
