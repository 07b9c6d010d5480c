"""Hand values from one stage to the next, across devices.

A stage's outputs are flattened to leaves; tensors travel to the next device (onto CUDA with
``non_blocking`` copies on the receiving worker's stream, after waiting on an event the sender
recorded, so no stream ever waits on the whole device; to the CPU with blocking copies, which
a CPU stage can read at once) and arrive as fresh autograd leaves, which is where the
receiving stage's backward stops and hands gradients back.

Example:
    >>> import torch
    >>> h = send((torch.ones(2, requires_grad=True), 3), torch.device("cpu"))
    >>> leaves, spec = receive(h, torch.device("cpu"))
    >>> leaves[0].is_leaf, leaves[0].requires_grad, leaves[1]
    (True, True, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.runtime.device import is_accelerator, keep_alive, record_event, wait_event

__all__ = ["Handoff", "send", "receive", "move_leaves"]


@dataclass
class Handoff:
    """Values in transit: flat leaves, their structure, and (on CUDA) a ready event."""

    leaves: list[Any]
    spec: pytree.TreeSpec
    event: Any


def send(values: Any, device: torch.device) -> Handoff:
    """Package ``values`` produced on ``device`` (records an event on CUDA)."""
    leaves, spec = pytree.tree_flatten(values)
    return Handoff(leaves, spec, record_event(device))


def receive(handoff: Handoff, device: torch.device, *,
            grad: bool = True) -> tuple[list[Any], pytree.TreeSpec]:
    """Bring a handoff's leaves to ``device`` as new autograd leaves.

    With ``grad``, every floating-point leaf requires grad: a checkpointed sender produced
    its outputs without autograd, yet their gradients are needed once it replays.
    """
    wait_event(device, handoff.event)
    return move_leaves(handoff.leaves, device, grad=grad, floating=True), handoff.spec


def move_leaves(leaves: list[Any], device: torch.device, *, grad: bool = True,
                floating: bool = False) -> list[Any]:
    """Detach tensor leaves onto ``device`` as autograd leaves.

    With ``grad``, a leaf requires grad if its source did, or (with ``floating``) if it holds
    floating-point values.
    """
    moved = []
    # Queued (non-blocking) only onto an accelerator, whose stream orders the copy before
    # its reads. A non-blocking copy from a GPU to the CPU lands in pinned memory and
    # returns at once: the CPU stage would read it before it arrived.
    queued = is_accelerator(device)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            copy = leaf.detach().to(device, non_blocking=queued)
            keep_alive(leaf, device)
            if grad and (leaf.requires_grad or (floating and leaf.is_floating_point())):
                copy.requires_grad_(True)
            moved.append(copy)
        else:
            moved.append(leaf)
    return moved
