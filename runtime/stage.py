"""One pipeline stage on one device: forward and backward of a micro-batch.

A stage keeps, per micro-batch in flight, what its backward needs: the input leaves and
either the outputs with their autograd graph or, when checkpointed, only the generator
state, so the forward can be replayed (same dropout masks) right before the backward.
Gradients of the parameters accumulate into ``.grad`` as in ordinary training; the gradients
of the inputs are returned for the previous stage. A forward run with ``split=True`` has its
backward split in two, as zero-bubble schedules want: :meth:`StageRunner.backward` computes
the input gradients (and those of parameters outside Linear layers) and queues the Linear
layers' weight gradients (``partitioner.runtime.fused_linear``), :meth:`StageRunner.weight`
runs them.

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
from torch import nn

from partitioner.errors import BackwardError, StageExecutionError
from partitioner.runtime.fused_linear import WeightGrads, deferring
from partitioner.runtime.input_hint import input_hint
from partitioner.runtime.precision import autocast
from partitioner.runtime.rng import fork, use_generator, use_shard_generator

CALL_HOOKS_ATTR = "_partitioner_call_hooks"
"""Set (True) on a stage module whose forward must run through ``module(...)`` with its
hooks: FSDP's gather the sharded parameters first (``runtime.distributed.fsdp``)."""

__all__ = ["StageRunner", "locate_node", "CALL_HOOKS_ATTR"]


@dataclass
class _Stash:
    inputs: list[Any]
    outputs: Any | None
    generator_state: torch.Generator | None
    shard_state: torch.Generator | None = None
    weights: WeightGrads | None = None


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
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"``: every forward, and the replay of a
            checkpointed one, runs under the same autocast (``partitioner.runtime.precision``).
    """

    def __init__(self, index: int, graph_module: fx.GraphModule, device: torch.device,
                 shard: int | None = None, precision: str = "fp32") -> None:
        self.index = index
        self.precision = precision
        self.graph_module = graph_module
        self.device = device
        self.shard = shard
        self.generator = torch.Generator(device=device)
        self.shard_generator = (torch.Generator(device=device) if shard is not None
                                else None)
        self._stash: dict[int, _Stash] = {}
        self._weights: dict[int, WeightGrads] = {}
        self._writes: list[torch.Tensor] | None = None

    def reset(self, seed: int) -> None:
        """Forget stashed micro-batches and reseed the stage's generator(s)."""
        self._stash.clear()
        self._weights.clear()
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
            with autocast(self.precision, self.device.type):
                if getattr(self.graph_module, CALL_HOOKS_ATTR, False):  # FSDP gathers first
                    return self.graph_module(*inputs)
                return type(self.graph_module).forward(self.graph_module, *inputs)
        except Exception as error:
            node = locate_node(self.graph_module, error)
            where = f", node {node}" if node else ""
            raise StageExecutionError(
                f"stage {self.index} (micro-batch {i}{where}) raised "
                f"{type(error).__name__}: {error}{self._dtype_hint(error, inputs)}"
                f"{input_hint(self.graph_module, inputs) if self.index == 0 else ''}",
                self.index, i, node) from error

    def _dtype_hint(self, error: Exception, inputs: list[Any]) -> str:
        """A fix for a dtype clash between floating inputs and the stage's parameters
        (float64 inputs to a model planned and kept in float32), else ``""``."""
        if "dtype" not in str(error) and "scalar type" not in str(error):
            return ""
        params = {p.dtype for p in self.graph_module.parameters() if p.is_floating_point()}
        given = {leaf.dtype for leaf in pytree.tree_leaves(inputs)
                 if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
        if len(params) != 1 or not given - params:
            return ""
        want = str(next(iter(params))).removeprefix("torch.")
        got = ", ".join(sorted(str(d).removeprefix("torch.") for d in given - params))
        return (f"; the inputs are {got} but the model's parameters are {want}: pass {want} "
                f"inputs (x.to(torch.{want})), or convert the model and partition it again")

    def forward(self, i: int, inputs: list[Any], *, grad: bool, checkpoint: bool,
                split: bool = False) -> Any:
        """Run micro-batch ``i``; keep what backward needs when ``grad``.

        ``split``: its backward will be split into :meth:`backward` (input gradients) and
        :meth:`weight` (the Linear layers' weight gradients).
        """
        weights = WeightGrads() if grad and split else None
        replay = grad and checkpoint
        state = fork(self.generator) if replay else None
        shard_state = (fork(self.shard_generator)
                       if replay and self.shard_generator is not None else None)
        with self._generators(self.generator, self.shard_generator):
            if grad and not checkpoint:
                with torch.enable_grad(), deferring(weights):
                    outputs = self._call(i, inputs)
                self._stash[i] = _Stash(inputs, outputs, None, weights=weights)
                return outputs
            with torch.no_grad():
                outputs = self._call(i, inputs)
        if grad:
            self._stash[i] = _Stash(inputs, None, state, shard_state, weights)
        return outputs

    def backward(self, i: int, grad_leaves: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Back-propagate micro-batch ``i``; return the gradients of its input leaves.

        ``grad_leaves`` is aligned with ``pytree.tree_leaves`` of the stage's outputs; the
        result is aligned with ``pytree.tree_leaves`` of its inputs. After a ``split``
        forward the Linear layers' weight gradients wait for :meth:`weight`.

        Raises:
            BackwardError: If micro-batch ``i`` has no forward waiting for its backward.
        """
        stash = self._stash.pop(i, None)
        if stash is None:
            raise BackwardError(f"stage {self.index} has no forward of micro-batch {i} "
                                "waiting for its backward; run each micro-batch's forward, "
                                "then its backward, once")
        outputs = stash.outputs
        writes: list[torch.Tensor] = []
        kept: list[torch.Tensor] = []
        if outputs is None:
            # The replay must not update batch norm statistics or counters a second time:
            # they are put back once its backward (which may read them) has run.
            writes = self._written_buffers()
            kept = [b.detach().clone() for b in writes]
            with torch.enable_grad(), self._generators(stash.generator_state,
                                                       stash.shard_state), \
                    deferring(stash.weights):
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
        # Through ``.data``, which has a version counter of its own: a micro-batch whose
        # forward kept its graph (1F1B runs one before this backward) saved these buffers,
        # and a bumped counter would fail its backward although their values are back.
        for buffer, value in zip(writes, kept):
            buffer.data.copy_(value)
        if stash.weights is not None:
            self._weights[i] = stash.weights
        return [leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
                for leaf in pytree.tree_leaves(stash.inputs)]

    def _written_buffers(self) -> list[torch.Tensor]:
        """The buffers a forward of this stage updates in place: batch norm running
        statistics (modules, or functional calls on attributes) and what in-place ops write."""
        if self._writes is None:
            gm = self.graph_module
            buffers = {id(b) for b in gm.buffers()}
            found: dict[int, torch.Tensor] = {}
            graph = gm.graph if isinstance(gm, fx.GraphModule) else None
            if graph is None:  # a plain module: its own batch norms
                found.update((id(b), b) for m in gm.modules()
                             if isinstance(m, nn.modules.batchnorm._NormBase)
                             for b in m.buffers(recurse=False))
            for node in graph.nodes if graph is not None else ():
                if node.op == "call_module":
                    for m in gm.get_submodule(str(node.target)).modules():
                        if isinstance(m, nn.modules.batchnorm._NormBase):
                            found.update((id(b), b) for b in m.buffers(recurse=False))
                elif _writes_arguments(node):
                    for arg in node.all_input_nodes:
                        if arg.op == "get_attr":
                            value = _attr(gm, str(arg.target))
                            if id(value) in buffers:
                                found[id(value)] = value
            self._writes = list(found.values())
        return self._writes

    def weight(self, i: int) -> None:
        """The weight gradients of micro-batch ``i``, queued by its split backward.

        Raises:
            BackwardError: If micro-batch ``i`` has no split backward waiting.
        """
        weights = self._weights.pop(i, None)
        if weights is None:
            raise BackwardError(f"stage {self.index} has no input-gradient half of "
                                f"micro-batch {i} waiting for its weight gradients; run W "
                                "after I, once, for forwards run with split=True")
        try:
            weights.run()
        except Exception as error:
            raise StageExecutionError(
                f"stage {self.index} (micro-batch {i}, weight gradients) raised "
                f"{type(error).__name__}: {error}", self.index, i, None) from error

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran and whose backward (for a split one: its weight
        gradients) has not."""
        return len(self._stash) + len(self._weights)


def _writes_arguments(node: fx.Node) -> bool:
    """Whether a call may write into its tensor arguments (in-place ops, batch norm)."""
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    # aten ops say so in their schema, except batch norm's composite op (running statistics).
    name = schema.name if schema is not None else getattr(node.target, "__name__", "")
    norm = "batch_norm" in name or "instance_norm" in name
    return norm or (bool(schema.is_mutable) if schema is not None else name.endswith("_"))


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
