"""The multi-process transport of the one interpreter: point-to-point messages between ranks.

A rank holds the virtual stages the schedule's placement puts on it (``v`` per rank:
``k = j, j + P, ...`` looped, ``j`` and ``2 P - 1 - j`` in a V). Virtual stage ``k``
receives its inputs from ``k - 1`` on the rank the placement puts that on, and sends its
outputs to ``k + 1``; gradients go the other way. With one virtual stage per rank the links
form a line; looped with ``v >= 2`` the last rank sends to rank 0 for the next chunk, a
ring; a V goes down the ranks and back up, and its turn (stages ``P - 1`` and ``P``, both
on the last rank) is handed over in memory by the links. Every message is tagged with the
boundary it crosses (``k`` to ``k + 1``), so messages of different chunks between the same
two ranks never match each other.

What crosses each boundary comes from shape prediction (:class:`StageInterface` per virtual
stage and micro-batch); receives are posted before they are needed (:meth:`P2PTransport.
prefetch`): on gloo those of the next ``LOOKAHEAD`` actions, so transfers overlap compute
while buffers stay few; on NCCL the running action's receives are batched with the previous
action's sends (``partitioner.runtime.distributed.p2p``).

Example:
    >>> from partitioner.runtime.action import Action, Phase
    >>> t = P2PTransport(links, faces, micro, n_stages=4, device=cpu)  # doctest: +SKIP
    >>> t.prefetch([Action(1, Phase.FORWARD, 0)], 0)  # posts 1F0's receives  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partitioner.runtime.action import Action, Phase
from partitioner.runtime.distributed.p2p import Boundary, Pending, PipeLinks
from partitioner.runtime.loss_head import to_device

__all__ = ["LOOKAHEAD", "P2PTransport", "StageInterface"]

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


class P2PTransport:
    """Moves one rank's activations and gradients for one step, by P2P messages.

    Args:
        links: the rank's links to the ranks of its replica's other virtual stages.
        faces: per micro-batch, each of this rank's virtual stages' interface.
        micro: the micro-batches of stage 0's inputs.
        n_stages: virtual stages in the whole pipeline (``P v``).
        device: where this rank computes.
        training: whether received activations require grad.
    """

    def __init__(self, links: PipeLinks, faces: Sequence[Mapping[int, StageInterface]],
                 micro: Sequence[Sequence[Any]], *, n_stages: int, device: torch.device,
                 training: bool = True) -> None:
        self.links = links
        self.faces = faces
        self.micro = micro
        self.n_stages = n_stages
        self.device = device
        self.training = training
        self._activations: dict[tuple[int, int], Pending] = {}
        self._grads: dict[tuple[int, int], Pending] = {}

    def _face(self, stage: int, microbatch: int) -> StageInterface:
        return self.faces[microbatch][stage]

    def _need(self, action: Action) -> None:
        """Post the receives ``action`` needs, unless they are posted already."""
        k, i = action.stage, action.microbatch
        face = self._face(k, i)
        if action.phase is Phase.FORWARD and face.inputs is not None \
                and (k, i) not in self._activations:
            self._activations[(k, i)] = self.links.recv_activations(k - 1, i, face.inputs)
        if action.phase.gives_input_grad and face.outputs is not None \
                and (k, i) not in self._grads:
            self._grads[(k, i)] = self.links.recv_grads(k, i, face.outputs)

    def prefetch(self, actions: Sequence[Action], position: int) -> None:
        """Post the receives of the action at ``position`` and the next ones.

        Receives posted ahead let the data arrive while this rank computes; posting only
        ``LOOKAHEAD`` actions ahead keeps the buffers waiting to O(1), not O(m), which would
        undo 1F1B's bound on memory. Batched links (NCCL) post this action's receives
        together with the previous action's sends instead.
        """
        if self.links.batched:
            self._need(actions[position])
            self.links.flush()
            return
        for action in actions[position:position + 1 + LOOKAHEAD]:
            self._need(action)

    def inputs(self, stage: int, microbatch: int) -> list[Any]:
        face = self._face(stage, microbatch)
        if face.inputs is None:
            return list(to_device(list(self.micro[microbatch]), self.device))
        pending = self._activations.pop((stage, microbatch), None)
        if pending is None:
            pending = self.links.recv_activations(stage - 1, microbatch, face.inputs)
        tensors = pending.wait()
        if self.training:
            for k, t in zip(face.inputs.tensor_positions, tensors):
                if k in face.inputs.grad_positions:
                    t.requires_grad_(True)
        return list(face.inputs.assemble(tensors))

    def send_outputs(self, stage: int, microbatch: int, outputs: Any) -> None:
        face = self._face(stage, microbatch)
        if face.outputs is None:
            raise RuntimeError(f"virtual stage {stage} is the last: its outputs go to the "
                               "loss head, not to another rank")
        where = f"stage {stage} (micro-batch {microbatch})"
        self.links.send_activations(stage, microbatch, face.outputs,
                                    face.outputs.check(outputs, where))

    def output_grads(self, stage: int, microbatch: int) -> list[torch.Tensor | None]:
        face = self._face(stage, microbatch)
        if face.outputs is None:
            raise RuntimeError(f"virtual stage {stage} is the last: its output gradients "
                               "come from the loss head")
        pending = self._grads.pop((stage, microbatch), None)
        if pending is None:
            pending = self.links.recv_grads(stage, microbatch, face.outputs)
        tensors = pending.wait()
        grads: list[torch.Tensor | None] = [None] * len(face.outputs.leaves)
        for k, t in zip(face.outputs.grad_positions, tensors):
            grads[k] = t
        return grads

    def send_input_grads(self, stage: int, microbatch: int,
                         grads: list[torch.Tensor | None]) -> None:
        face = self._face(stage, microbatch)
        if face.inputs is None:
            return  # stage 0's input gradients stay here (the batch needs none)
        self.links.send_grads(stage - 1, microbatch, face.inputs,
                              [grads[k] for k in face.inputs.grad_positions])

    def failed(self, action: Action, error: BaseException) -> None:
        """Stop the rank: its neighbours learn of it from the failure watchdog."""
        raise error
