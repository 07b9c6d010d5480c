"""Decisions: how one node of a tensor-parallel graph runs on a rank, and what rules read.

A rule (``tp_ops``, ``tp_shape_ops``) looks at one node, the layouts of its inputs and the
whole (unsplit) shapes shape propagation recorded, and returns a :class:`Decision`: the
layout each tensor input must have, the layout of the output, and an action saying how the
node is rewritten for one rank (``tp_rewrite`` carries it out). :class:`RuleContext` is
what rules read and where they report problems.

Example:
    >>> print(Decision({"x": Shard(1)}, Shard(1)).out)
    S(1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from partitioner.passes.tensor_parallel.layout import Layout, R, Shard
from partitioner.passes.tensor_parallel.sites import Site
from partitioner.runtime.tensor_parallel.sharding import Sharding

__all__ = ["Decision", "RuleContext", "Action", "Keep", "Resize", "SizeQuery",
           "ShardedDropout", "ColumnSite", "RowSite", "VocabSite", "AttentionSite", "ArgPath",
           "val", "is_tensor", "tensor_inputs", "sharded_inputs", "replicated", "arg",
           "is_method", "is_function"]

aten = torch.ops.aten

#: Where an argument sits: ("args", i, ...) or ("kwargs", name, ...), then indices inside.
ArgPath = tuple[Any, ...]


@dataclass(frozen=True)
class Keep:
    """Copy the node as it is."""


@dataclass(frozen=True)
class Resize:
    """Copy the node, dividing the whole sizes at ``paths`` by ``tp`` (``(path, entry)``:
    ``entry`` indexes into a shape-valued argument, else ``None``)."""

    paths: tuple[tuple[ArgPath, int | None], ...]


@dataclass(frozen=True)
class SizeQuery:
    """Answer a size query on a split tensor with the whole size (``what``: shape, size,
    numel)."""

    what: str
    dim: int


@dataclass(frozen=True)
class ShardedDropout:
    """Dropout on a split tensor: draw from the rank's own generator."""


@dataclass(frozen=True)
class ColumnSite:
    """A column-parallel Linear (or column-split Embedding): local weight, split output."""

    site: Site


@dataclass(frozen=True)
class RowSite:
    """A row-parallel Linear: local product, all-reduce, then the bias."""

    site: Site


@dataclass(frozen=True)
class VocabSite:
    """A vocabulary-parallel Embedding: masked local lookup, then all-reduce."""

    site: Site


@dataclass(frozen=True)
class AttentionSite:
    """An ``nn.MultiheadAttention`` split by heads: the rank's heads, then all-reduces
    (``reduces``: one for the output, one more for head-averaged weights)."""

    site: Site
    reduces: int = 1


Action = (Keep | Resize | SizeQuery | ShardedDropout | ColumnSite | RowSite | VocabSite
          | AttentionSite)


@dataclass(frozen=True)
class Decision:
    """How one node runs on a rank.

    Attributes:
        needs: the layout each tensor input must have, by input node name.
        out: the output's layout (a tuple for nodes returning several tensors).
        action: how the node is rewritten.
    """

    needs: dict[str, Layout]
    out: Layout | tuple[Layout, ...]
    action: Action = field(default_factory=Keep)


@dataclass
class RuleContext:
    """What rules read: the graph, the degree, the sites and shardings, and layouts so far.

    ``problems`` collects sizes that do not divide (raised together by the caller);
    ``block_requests`` maps a column site's weight to the fused parts its output is split
    into downstream.
    """

    gm: fx.GraphModule
    tp: int
    sites: dict[str, Site]
    shardings: dict[str, Sharding]
    layouts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    block_requests: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def layout(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return R
        return self.layouts.get(node.name, R)

    def where(self, node: fx.Node) -> str:
        stack = node.meta.get("nn_module_stack") or {}
        paths = [e[0] for e in stack.values() if isinstance(e, tuple) and e[0]]
        return f"node {node.name}" + (f" (in {paths[-1]})" if paths else "")


def val(node: Any) -> Any:
    """The value shape propagation recorded for ``node`` (or ``node`` itself if constant)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(val(node), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if is_tensor(n)]


def sharded_inputs(node: fx.Node, ctx: RuleContext) -> list[tuple[fx.Node, Shard]]:
    return [(n, layout) for n in tensor_inputs(node)
            if isinstance(layout := ctx.layout(n), Shard)]


def replicated(node: fx.Node) -> Decision:
    """Run the node on whole inputs: every split input is gathered first."""
    out = val(node)
    layout: Any = tuple(R for _ in out) if isinstance(out, (tuple, list)) else R
    return Decision({n.name: R for n in tensor_inputs(node)}, layout)


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def is_function(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and any(node.target is t for t in targets)


