"""Group nodes into layers: the units between which a stage boundary may fall.

A layer is a maximal run of consecutive call nodes owned by one layer unit (see
``flatten_sequential.assign_layer_paths``). Nodes that no unit owns, such as the residual
``add`` in a block's own ``forward`` or a ``flatten`` between body and head, join the layer
before them (or the first layer when none precedes them). A unit called twice (a reused
module) yields two layers, the second named ``name#2``.

Example:
    >>> import torch
    >>> from partitioner.passes.flatten_sequential import assign_layer_paths
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = assign_layer_paths(gm, model, {})
    >>> [layer.name for layer in group_layers(gm).layers]
    ['0', '1']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx

from partitioner.passes.base import PassError, PassResult, require_meta

__all__ = ["Layer", "LayerGrouping", "group_layers", "compute_nodes"]


@dataclass(frozen=True)
class Layer:
    """One layer: a contiguous run of graph nodes.

    Attributes:
        name: unique name (the owning module's qualified name, ``#k`` on reuse).
        path: the owning module's qualified name.
        nodes: names of the graph nodes, in order.
    """

    name: str
    path: str
    nodes: tuple[str, ...] = field(repr=False)


@dataclass(frozen=True)
class LayerGrouping(PassResult):
    """The result of :func:`group_layers`: the graph and its layers in order."""

    layers: tuple[Layer, ...] = ()


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The call nodes of ``gm`` in graph order."""
    return [n for n in gm.graph.nodes if n.op.startswith("call_")]


def group_layers(gm: fx.GraphModule) -> LayerGrouping:
    """Group ``gm``'s call nodes into layers and write ``node.meta["layer"]``.

    Args:
        gm: a graph whose call nodes carry ``meta["layer_path"]``.

    Returns:
        A :class:`LayerGrouping` (``modified=False``: only metadata is written).

    Raises:
        PassError: if ``layer_path`` is missing or the graph has no call node.
    """
    require_meta(gm, "layer_path", "group_layers")
    nodes = compute_nodes(gm)
    if not nodes:
        raise PassError("group_layers: the graph has no operations to partition")
    runs: list[tuple[str, list[fx.Node]]] = []
    for node in nodes:
        path = node.meta["layer_path"]
        # A leaf unit's every call_module node is a call of its own (self.a(self.a(x))).
        recalled = node.op == "call_module" and node.target == path
        if runs and (path == "" or (path == runs[-1][0] and not recalled)):
            runs[-1][1].append(node)
        elif path == "" and not runs:
            runs.append(("", [node]))
        elif runs and runs[-1][0] == "":
            runs[-1] = (path, runs[-1][1] + [node])
        else:
            runs.append((path, [node]))
    seen: Counter[str] = Counter()
    layers = []
    for index, (path, run) in enumerate(runs):
        seen[path] += 1
        name = (path or "<root>") + (f"#{seen[path]}" if seen[path] > 1 else "")
        layers.append(Layer(name, path, tuple(n.name for n in run)))
        for node in run:
            node.meta["layer"] = index
    return LayerGrouping(gm, False, tuple(layers))
