"""One pipeline stage on one device: forward and backward of a micro-batch.

A stage keeps, per micro-batch in flight, what its backward needs: the input leaves and
either the outputs with their autograd graph or, when checkpointed, only the generator
state, so the forward can be replayed (same dropout masks) right before the backward.
Gradients of the parameters accumulate into ``.grad`` as in ordinary training; the gradients
of the inputs are returned for the previous stage.

Errors raised by the stage's code are re-raised as :class:`StageExecutionError` naming the
stage, the micro-batch and the graph node that failed.
"""

from __future__ import annotations

import traceback
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.errors import StageExecutionError
from partitioner.runtime.rng import fork, use_generator, use_shard_generator

__all__ = ["StageRunner", "locate_node"]


@dataclass
class _Stash:
    inputs: list[Any]
    outputs: Any | None
    generator_state: torch.Generator | None
    shard_state: torch.Generator | None = None


def locate_node(gm: fx.GraphModule, error: BaseException) -> str | None:
    """The name of the node of ``gm`` executing when ``error`` was raised, if known."""
    filename = type(gm).forward.__code__.co_filename
    line_map = getattr(gm, "_lineno_map", None) or {}
    start = getattr(gm, "_prologue_start", 0)
    nodes = list(gm.graph.nodes)
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename == filename and frame.lineno is not None:
            index = line_map.get(frame.lineno - start)
            if index is not None and index < len(nodes):
                return str(nodes[index].name)
    return None


class StageRunner:
    """Runs one stage's graph on its device.

    Args:
        index: the stage number ``j``.
        graph_module: the stage's graph (already on ``device``).
        device: where it runs.
        shard: this process's tensor-parallel rank when the graph is one rank's slice of a
            split stage: dropout on split values then draws from a generator of the rank's
            own (replicated values keep the stage's generator, seeded alike on every rank).
    """

    def __init__(self, index: int, graph_module: fx.GraphModule, device: torch.device,
                 shard: int | None = None) -> None:
        self.index = index
        self.graph_module = graph_module
        self.device = device
        self.shard = shard
        self.generator = torch.Generator(device=device)
        self.shard_generator = (torch.Generator(device=device) if shard is not None
                                else None)
        self._stash: dict[int, _Stash] = {}

    def reset(self, seed: int) -> None:
        """Forget stashed micro-batches and reseed the stage's generator(s)."""
        self._stash.clear()
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Reseed the stage's generator(s), keeping what a pending backward needs."""
        self.generator.manual_seed(seed)
        if self.shard_generator is not None:
            self.shard_generator.manual_seed((seed + 1 + int(self.shard or 0)) % 2**63)

    def _generators(self, replicated: torch.Generator | None,
                    shard: torch.Generator | None) -> Any:
        if self.shard_generator is None:
            return use_generator(replicated)
        stack = ExitStack()
        stack.enter_context(use_generator(replicated))
        stack.enter_context(use_shard_generator(shard))
        return stack

    def _call(self, i: int, inputs: list[Any]) -> Any:
        try:
            return type(self.graph_module).forward(self.graph_module, *inputs)
        except Exception as error:
            node = locate_node(self.graph_module, error)
            where = f", node {node}" if node else ""
            raise StageExecutionError(
                f"stage {self.index} (micro-batch {i}{where}) raised "
                f"{type(error).__name__}: {error}", self.index, i, node) from error

    def forward(self, i: int, inputs: list[Any], *, grad: bool, checkpoint: bool) -> Any:
        """Run micro-batch ``i``; keep what backward needs when ``grad``."""
        replay = grad and checkpoint
        state = fork(self.generator) if replay else None
        shard_state = (fork(self.shard_generator)
                       if replay and self.shard_generator is not None else None)
        with self._generators(self.generator, self.shard_generator):
            if grad and not checkpoint:
                with torch.enable_grad():
                    outputs = self._call(i, inputs)
                self._stash[i] = _Stash(inputs, outputs, None)
                return outputs
            with torch.no_grad():
                outputs = self._call(i, inputs)
        if grad:
            self._stash[i] = _Stash(inputs, None, state, shard_state)
        return outputs

    def backward(self, i: int, grad_leaves: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Back-propagate micro-batch ``i``; return the gradients of its input leaves.

        ``grad_leaves`` is aligned with ``pytree.tree_leaves`` of the stage's outputs; the
        result is aligned with ``pytree.tree_leaves`` of its inputs.
        """
        stash = self._stash.pop(i)
        outputs = stash.outputs
        if outputs is None:
            with torch.enable_grad(), self._generators(stash.generator_state,
                                                       stash.shard_state):
                outputs = self._call(i, stash.inputs)
        tensors, grads = [], []
        for out, g in zip(pytree.tree_leaves(outputs), grad_leaves):
            if isinstance(out, torch.Tensor) and out.requires_grad and g is not None:
                tensors.append(out)
                grads.append(g)
        if tensors:
            try:
                torch.autograd.backward(tensors, grads)
            except Exception as error:
                raise StageExecutionError(
                    f"stage {self.index} (micro-batch {i}, backward) raised "
                    f"{type(error).__name__}: {error}", self.index, i, None) from error
        return [leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
                for leaf in pytree.tree_leaves(stash.inputs)]

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran and whose backward has not."""
        return len(self._stash)
