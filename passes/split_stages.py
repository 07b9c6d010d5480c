"""Split a graph into one ``GraphModule`` per pipeline stage.

Stage ``j`` receives, as placeholders, every value live across boundary ``j`` (computed
before stage ``j`` and used at or after it) and returns, as a tuple, every value live across
boundary ``j + 1``, whether it computed that value or only passes it on. So a skip connection
from stage 0 to stage 3 is relayed by stages 1 and 2, and each stage talks only to its
neighbours, which is what point-to-point pipelines across processes need. Stage 0 takes the
model's own placeholders; the last stage returns the model's output structure. Attributes
(``get_attr``) are fetched by every stage that uses them, never handed across.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    >>> calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    >>> split = split_stages(gm, {calls[0]: 0, calls[1]: 1}, 2)
    >>> [s.inputs for s in split.stages]
    [('input_1',), ('_0',)]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.fx as fx

from partitioner.passes.base import PassError, PassResult
from partitioner.passes.dead_code import has_side_effect
from partitioner.passes.liveness import live_values
from partitioner.passes.non_persistent import keep_non_persistent, non_persistent_names

__all__ = ["StageGraph", "StageSplit", "split_stages"]


@dataclass(frozen=True)
class StageGraph:
    """One stage's graph and its interface.

    Attributes:
        graph_module: the stage's code; its attributes are the model's own tensors.
        inputs: names of the values it receives, in placeholder order.
        outputs: names of the values it hands on (empty for the last stage).
        is_last: whether it returns the model's output.
    """

    graph_module: fx.GraphModule = field(repr=False)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    is_last: bool


@dataclass(frozen=True)
class StageSplit(PassResult):
    """The result of :func:`split_stages`."""

    stages: tuple[StageGraph, ...] = ()


def split_stages(gm: fx.GraphModule, stage_of: dict[fx.Node, int], n_stages: int) -> StageSplit:
    """Split ``gm`` into ``n_stages`` stage graphs.

    Args:
        gm: the whole graph.
        stage_of: the stage of every call node; must not decrease along the graph order.
        n_stages: the number of stages; every stage must own at least one call node.

    Returns:
        A :class:`StageSplit` (``modified=True``; ``gm`` itself is left untouched).

    Raises:
        PassError: if a call node has no stage, the stages go backwards, or one is empty.
    """
    _check_assignment(gm, stage_of, n_stages)
    live = live_values(gm, stage_of, n_stages)
    stages = []
    for j in range(n_stages):
        received = [n for n in gm.graph.nodes if n.op == "placeholder"] if j == 0 else live[j - 1]
        sent = live[j] if j < n_stages - 1 else None
        stages.append(_build_stage(gm, stage_of, j, received, sent))
    _check_interfaces(stages)
    return StageSplit(gm, True, tuple(stages))


def _check_assignment(gm: fx.GraphModule, stage_of: dict[fx.Node, int], n_stages: int) -> None:
    problems = []
    previous = 0
    used = set()
    for node in gm.graph.nodes:
        if not node.op.startswith("call_"):
            continue
        if node not in stage_of:
            problems.append(f"node {node.name} has no stage")
            continue
        j = stage_of[node]
        if not 0 <= j < n_stages:
            problems.append(f"node {node.name} is given stage {j} outside 0..{n_stages - 1}")
        if j < previous:
            problems.append(f"node {node.name} is in stage {j} after a node of stage {previous}")
        previous = max(previous, j)
        used.add(j)
    empty = sorted(set(range(n_stages)) - used)
    if empty:
        problems.append(f"stages {empty} own no operation")
    if problems:
        raise PassError("split_stages: " + "; ".join(problems))


def _build_stage(gm: fx.GraphModule, stage_of: dict[fx.Node, int], j: int,
                 received: list[fx.Node], sent: list[fx.Node] | None) -> StageGraph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in received:
        if node.op == "placeholder" and j == 0:
            new = graph.node_copy(node)
        else:
            # Later stages get every value passed: a default (forward's ``scale=2.0``) would
            # only make the signature invalid once a value without one follows it.
            new = graph.placeholder(node.name, type_expr=node.type)
        new.meta = dict(node.meta)
        env[node] = new

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise PassError(f"split_stages: stage {j} uses {node.name}, "
                                "which is neither computed in it nor received")
            env[node] = graph.node_copy(node)
        return env[node]

    for node in gm.graph.nodes:
        if node.op.startswith("call_") and stage_of[node] == j:
            env[node] = graph.node_copy(node, lookup)
        elif node.op == "output" and sent is None:
            graph.output(fx.map_arg(node.args[0], lookup))
    if sent is not None:
        graph.output(tuple(lookup(n) for n in sent))
    module = fx.GraphModule(gm, graph, class_name=f"Stage{j}")
    keep_non_persistent(module, non_persistent_names(gm))
    module.graph.eliminate_dead_code(lambda node: has_side_effect(module, node))
    module.graph.lint()
    module.recompile()
    return StageGraph(module, tuple(n.name for n in received),
                      tuple(n.name for n in sent or ()), sent is None)


def _check_interfaces(stages: list[StageGraph]) -> None:
    for before, after in itertools.pairwise(stages):
        if before.outputs != after.inputs:
            raise PassError(f"split_stages: a stage sends {before.outputs} but the next "
                            f"receives {after.inputs}")
