"""Propagate layouts through a graph: where each value is split, and what it costs.

Given the sharding of each weight, :func:`propagate` walks the graph in order, asks
``tp_ops.decide`` how each node runs, and records the layout of every value and every
*conversion* the plan implies: a split value gathered whole (``S -> R``), a whole value
sliced (``R -> S``), a whole value entering a split computation (``R -> R->``, free forward,
one all-reduce backward). The graph's outputs are always whole.

The walk can start at a given node and stop as soon as no split value is live any more, so
the automatic choice (``tp_match``) can try a layer cheaply on a model of any depth.

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> from partitioner.runtime.tensor_parallel.sharding import Sharding
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = propagate_shapes(gm, (torch.randn(3, 4),))
    >>> result = propagate(gm, {"0.weight": Sharding("colwise", 0, 2),
    ...                         "0.bias": Sharding("colwise", 0, 2),
    ...                         "2.weight": Sharding("rowwise", 1, 2)}, tp=2)
    >>> [str(result.layouts[n]) for n in ("_0", "_1", "_2")]
    ['S(1)', 'S(1)', 'R']
    >>> [str(c) for c in result.conversions]
    ['_0: input_1 R -> R->']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.passes.base import PassError
from partitioner.passes.tensor_parallel.decision import Decision, RuleContext, val
from partitioner.passes.tensor_parallel.layout import EnterRegion, Layout, R, Replicate, Shard
from partitioner.passes.tensor_parallel.ops import decide
from partitioner.passes.tensor_parallel.sites import Site, find_sites
from partitioner.runtime.tensor_parallel.sharding import Sharding

__all__ = ["Conversion", "Propagation", "propagate"]


@dataclass(frozen=True)
class Conversion:
    """A value brought to the layout a node needs.

    Attributes:
        node: the consuming node (``"output"`` for the graph's result).
        value: the value's node.
        have: its layout.
        need: the layout required.
    """

    node: str
    value: str
    have: Layout
    need: Layout

    @property
    def gathers(self) -> bool:
        """Whether it all-gathers a split value (forward communication)."""
        return isinstance(self.have, Shard) and self.have != self.need

    @property
    def slices(self) -> bool:
        """Whether it slices a whole value to a split (all-gather in backward)."""
        return isinstance(self.need, Shard) and self.have != self.need

    def __str__(self) -> str:
        return f"{self.node}: {self.value} {self.have} -> {self.need}"


@dataclass
class Propagation:
    """The result of :func:`propagate`.

    Attributes:
        layouts: layout of every visited value, by node name (tuples for multi-output nodes).
        decisions: how every visited call node runs.
        conversions: every layout change the plan needs, in graph order.
        block_requests: column sites whose output is split into fused parts downstream
            (weight attribute -> part sizes); their shardings should get these ``blocks``.
        problems: sizes that do not divide (the caller raises them together).
    """

    layouts: dict[str, Any] = field(default_factory=dict)
    decisions: dict[str, Decision] = field(default_factory=dict)
    conversions: list[Conversion] = field(default_factory=list)
    block_requests: dict[str, tuple[int, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def split_values(self) -> set[str]:
        """Names of the values held split."""
        return {name for name, layout in self.layouts.items()
                if isinstance(layout, Shard) or (
                    isinstance(layout, tuple) and any(isinstance(x, Shard) for x in layout))}


def propagate(gm: fx.GraphModule, shardings: dict[str, Sharding], tp: int, *,
              sites: list[Site] | None = None, start: str | None = None) -> Propagation:
    """Layouts and conversions of ``gm`` when its weights are split as ``shardings``.

    Args:
        gm: a graph with ``node.meta["val"]`` (shape propagation) on every node.
        shardings: by ``get_attr`` target; weights not named are replicated.
        tp: the tensor-parallel degree.
        sites: the graph's sites, if already found.
        start: begin at this node (everything before it is whole) and stop once no split
            value is live; by default the whole graph, output included.

    Raises:
        PassError: if a call node lacks ``meta["val"]``.
    """
    sites = find_sites(gm) if sites is None else sites
    ctx = RuleContext(gm, tp, {s.node: s for s in sites}, shardings)
    result = Propagation(ctx.layouts, {}, [], ctx.block_requests, ctx.problems)
    split_attrs = {name for name, s in shardings.items() if s.is_split}
    last_split = _last_site(gm, sites, split_attrs)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in split_attrs:
            sharding = shardings[str(node.target)]
            ctx.layouts[node.name] = Shard(int(sharding.dim or 0), sharding.blocks)
    started = start is None
    live = 0
    for index, node in enumerate(gm.graph.nodes):
        started = started or node.name == start
        if not started or not node.op.startswith("call_"):
            if started and node.op == "output":
                _output(node, ctx, result)
            continue
        if "val" not in node.meta:
            raise PassError(f"tensor parallelism needs shapes: node {node.name} has no "
                            "meta['val']; run partitioner.passes.shape_prop.propagate_shapes first")
        live -= sum(1 for n in node.all_input_nodes
                    if n.op != "get_attr" and _is_split(ctx.layouts.get(n.name)))
        decision = decide(node, ctx)
        result.decisions[node.name] = decision
        for name, need in decision.needs.items():
            have = ctx.layouts.get(name, R)
            if _differs(have, need):
                result.conversions.append(Conversion(node.name, name, have, need))
        ctx.layouts[node.name] = decision.out
        if _is_split(decision.out):
            live += len(node.users)
        if start is not None and live <= 0 and index >= last_split:
            break
    return result


def _last_site(gm: fx.GraphModule, sites: list[Site], split_attrs: set[str]) -> int:
    names = {s.node for s in sites if s.weight in split_attrs}
    last = -1
    for index, node in enumerate(gm.graph.nodes):
        if node.name in names:
            last = index
    return last


def _is_split(layout: Any) -> bool:
    if isinstance(layout, tuple):
        return any(isinstance(x, Shard) for x in layout)
    return isinstance(layout, Shard)


def _differs(have: Any, need: Layout) -> bool:
    if isinstance(have, tuple):
        return False
    if isinstance(need, EnterRegion):
        return True  # whole values entering a split computation, or gathered first
    if isinstance(need, Replicate):
        return not isinstance(have, Replicate)
    return bool(have != need)


def _output(node: fx.Node, ctx: RuleContext, result: Propagation) -> None:
    """The graph's results are whole: gather every split tensor in them."""
    for leaf in pytree.tree_leaves(node.args[0]):
        if isinstance(leaf, fx.Node) and isinstance(val(leaf), torch.Tensor):
            have = ctx.layouts.get(leaf.name, R)
            if isinstance(have, Shard):
                result.conversions.append(Conversion("output", leaf.name, have, R))
