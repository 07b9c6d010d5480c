"""A plan's graph as a diagram: nodes grouped by stage, edges labelled with what crosses them.

:func:`diagram` builds a :class:`Diagram` (plain data: boxes, arrows, stage groups) at one of
three levels of detail, from the captured graph when there is one and from the plan alone
otherwise:

- ``"nodes"``: every graph node, grouped by layer within each stage, each edge labelled with
  the tensor's shape;
- ``"layers"``: one box per layer, an arrow wherever one layer uses another's value;
- ``"blocks"``: runs of numbered layers within a stage (``h.2 .. h.8``) folded into one box,
  which keeps a 48-block GPT-2-xl on 8 devices to a page.

``"auto"`` picks the most detailed level that stays readable. Arrows between stages are
marked ``cross`` and carry the bytes they move per micro-batch; every arrow's shapes are a
micro-batch's (the example batch split over the replicas and ``chunks``). Each stage's title
names its devices (``partitioner.viz.mesh``: a tensor-parallel stage's ranks, each replica's
device), and with tensor parallelism each box says how its modules are split (column, row,
vocab) or that every rank holds all of it. ``partitioner.viz.dot`` turns a diagram into
Graphviz.

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> stages = (Stage(0, "cpu", ("a", "b")), Stage(1, "cpu", ("c",)))
    >>> plan = Plan("balance", ("cpu", "cpu"), stages)
    >>> d = diagram(None, plan)
    >>> [(e.source, e.target, e.cross) for e in d.edges]
    [('input', 'L0', False), ('L0', 'L1', False), ('L1', 'L2', True), ('L2', 'output', False)]
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.errors import VizError
from partitioner.plans.plan import Plan
from partitioner.viz.mesh import (
    layer_splits,
    mesh_shape,
    short_splits,
    split_modules,
    stage_devices,
)

__all__ = ["Box", "Arrow", "Diagram", "diagram", "DETAILS", "format_bytes", "format_shape",
           "stage_title", "graph_heading"]

DETAILS = ("auto", "nodes", "layers", "blocks")
#: "auto" draws every node up to this many, every layer up to _MAX_LAYERS, else blocks.
_MAX_NODES = 120
_MAX_LAYERS = 40


@dataclass(frozen=True)
class Box:
    """One node of the diagram: ``stage`` is ``None`` for the model's inputs and output."""

    id: str
    label: str
    stage: int | None
    group: str | None = None  # the layer a graph node belongs to, for "nodes" detail
    kind: str = "op"  # "op", "layer", "io", "minor" (a shape or index computation)


@dataclass(frozen=True)
class Arrow:
    """One edge: ``label`` names what flows; ``cross`` when it leaves one stage for another."""

    source: str
    target: str
    label: str = ""
    cross: bool = False
    bytes_per_microbatch: int | None = None


@dataclass
class Diagram:
    """Boxes, arrows and the plan they belong to."""

    plan: Plan
    detail: str
    boxes: list[Box] = field(default_factory=list)
    edges: list[Arrow] = field(default_factory=list)


def diagram(analysis: Any | None, plan: Plan, detail: str = "auto") -> Diagram:
    """The diagram of ``plan`` at ``detail`` (see the module docstring).

    Args:
        analysis: the ``partitioner.api.Analysis`` of the model (captured graph, layers,
            shapes when example inputs were given), or ``None`` to draw from the plan alone.
        plan: which layers run in which stage.
        detail: ``"auto"``, ``"nodes"``, ``"layers"`` or ``"blocks"``.

    Raises:
        PartitionError: an unknown ``detail``, ``"nodes"`` without an analysis, or an
            analysis whose layers are not the plan's.
    """
    if detail not in DETAILS:
        raise VizError(f"detail={detail!r}; use one of {DETAILS}")
    if analysis is not None and [la.name for la in analysis.layers] != list(plan.layers):
        raise VizError("the analysis' layers are not the plan's; draw the plan alone or "
                        "analyse the model the plan was made for")
    if detail == "auto":
        detail = _auto(analysis, plan)
    if detail == "nodes":
        if analysis is None:
            raise VizError("detail='nodes' needs the model's graph; pass a partitioned module "
                            "(or the model with the plan) instead of a bare plan")
        return _node_splits(_node_diagram(analysis, plan), analysis)
    layers = _layer_splits(_layer_diagram(analysis, plan))
    return _fold_blocks(layers) if detail == "blocks" else layers


def graph_heading(d: Diagram) -> str:
    """``"auto: mesh dp=2 x pp=2 x tp=1: 4 devices, chunks=2, nodes view; shapes per
    micro-batch"``: a diagram's title."""
    dp, pp, tp = mesh_shape(d.plan)
    return (f"{d.plan.strategy}: {len(d.plan.stages)} stages on mesh dp={dp} x pp={pp} x "
            f"tp={tp} ({dp * pp * tp} devices), chunks={d.plan.chunks}, {d.detail} view; "
            "shapes per micro-batch")


def _layer_splits(d: Diagram) -> Diagram:
    """Each layer box with how tensor parallelism splits it (a line under its name)."""
    splits = layer_splits(d.plan)
    if splits:
        d.boxes = [replace(b, label=f"{b.label}\n{short_splits(splits[b.label])}")
                   if b.kind == "layer" and b.label in splits else b for b in d.boxes]
    return d


def _node_splits(d: Diagram, analysis: Any) -> Diagram:
    """Each call of a split module with its split kind; the layer group of a layer with no
    split module says that every rank holds it."""
    if mesh_shape(d.plan)[2] == 1:
        return d
    modules = split_modules(d.plan)
    held = {name for name, summary in layer_splits(d.plan).items() if summary == "replicated"}
    boxes = []
    for b in d.boxes:
        target = b.label.split("\n")[0]
        if b.kind == "op" and target in modules:
            b = replace(b, label=f"{b.label}\n{modules[target]} split")
        if b.group in held:
            b = replace(b, group=f"{b.group} (replicated)")
        boxes.append(b)
    d.boxes = boxes
    return d


def _auto(analysis: Any | None, plan: Plan) -> str:
    if analysis is not None:
        nodes = [n for n in analysis.captured.graph_module.graph.nodes if n.op != "get_attr"]
        if len(nodes) <= _MAX_NODES:
            return "nodes"
    return "layers" if len(plan.layers) <= _MAX_LAYERS else "blocks"


def format_shape(value: Any, batch: int | None = None, parts: int = 1) -> str:
    """``"4x16x32"`` for a tensor, joined by ``", "`` for a pytree of them; ``""`` else.
    A tensor whose dim 0 is ``batch`` is shown split ``parts`` ways (a micro-batch's)."""
    shapes = ["x".join(str(-(-d // parts) if k == 0 and leaf.dim() and d == batch else d)
                       for k, d in enumerate(leaf.shape)) or "scalar"
              for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return ", ".join(shapes[:3]) + (" ..." if len(shapes) > 3 else "")


def format_bytes(n: float) -> str:
    """``"4.1 KB"``: bytes in decimal units."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def stage_title(plan: Plan, j: int) -> str:
    """``"stage 1 on cpu - 1.20 ms/mb - 4.1 MB"``: the heading of stage ``j``'s frame
    (``"on devices 0+1 (cpu; tp=2)"`` on a mesh of several devices per stage)."""
    stage = plan.stages[j]
    facts = [f"stage {j} on {stage_devices(plan, j)}"]
    if stage.predicted_time is not None:
        facts.append(f"{stage.predicted_time * 1e3:.2f} ms/mb")
    if stage.predicted_memory is not None:
        facts.append(format_bytes(stage.predicted_memory))
    return " - ".join(facts)


class _Sizer:
    """Bytes and shapes per micro-batch of a value: batch-dimension tensors are split
    ``parts`` ways (the replicas times ``chunks``)."""

    def __init__(self, gm: fx.GraphModule, parts: int) -> None:
        self.chunks = parts
        first = next((n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"
                      and isinstance(n.meta.get("val"), torch.Tensor)), None)
        self.batch = first.shape[0] if first is not None and first.dim() else None

    def __call__(self, value: Any) -> int:
        total = 0
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                size = leaf.numel() * leaf.element_size()
                split = leaf.dim() and self.batch is not None and leaf.shape[0] == self.batch
                total += -(-size // self.chunks) if split else size
        return total

    def shape(self, value: Any) -> str:
        return format_shape(value, self.batch, self.chunks)


def _parts(plan: Plan) -> int:
    """How many micro-batches the example batch is cut into: replicas times chunks."""
    return mesh_shape(plan)[0] * plan.chunks


def _stage_of_layers(plan: Plan) -> list[int]:
    return [stage.index for stage in plan.stages for _ in stage.layers]


def _node_stage(node: fx.Node, layer_stage: list[int], last: int) -> int:
    if node.op == "output":
        return last
    layer = node.meta.get("layer")
    return layer_stage[layer] if layer is not None else 0


def _node_label(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str]:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return f"{node.target}\n{type(module).__name__}", "op"
    if node.op in ("call_function", "call_method"):
        name = getattr(node.target, "__name__", str(node.target))
        minor = name in ("getattr", "getitem", "size", "dim") or not isinstance(
            node.meta.get("val"), torch.Tensor)
        return name, "minor" if minor else "op"
    return node.name, "io"


def _node_diagram(analysis: Any, plan: Plan) -> Diagram:
    gm = analysis.captured.graph_module
    layer_stage, last = _stage_of_layers(plan), len(plan.stages) - 1
    sizer = _Sizer(gm, _parts(plan))
    result = Diagram(plan, "nodes")
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        label, kind = _node_label(gm, node)
        layer = node.meta.get("layer")
        io = node.op in ("placeholder", "output")
        result.boxes.append(Box(node.name, label, None if io else
                                _node_stage(node, layer_stage, last),
                                None if layer is None else plan.layers[layer], kind))
        for used in node.all_input_nodes:
            if used.op == "get_attr":
                continue
            a, b = (_node_stage(x, layer_stage, last) for x in (used, node))
            value = used.meta.get("val")
            cross = a != b
            result.edges.append(Arrow(used.name, node.name, sizer.shape(value), cross,
                                      sizer(value) if cross else None))
    return result


def _layer_diagram(analysis: Any | None, plan: Plan) -> Diagram:
    names = list(plan.layers)
    layer_stage = _stage_of_layers(plan)
    result = Diagram(plan, "layers")
    result.boxes.append(Box("input", "input", None, kind="io"))
    result.boxes += [Box(f"L{k}", name, layer_stage[k], kind="layer")
                     for k, name in enumerate(names)]
    result.boxes.append(Box("output", "output", None, kind="io"))
    if analysis is None:
        result.edges = _chain_edges(plan)
        return result
    # Per pair of layers, the values flowing between them (a value used twice counts once).
    flows: dict[tuple[str, str], dict[fx.Node, Any]] = defaultdict(dict)
    gm = analysis.captured.graph_module
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        for user in node.users:
            a, b = _layer_end(node, "input"), _layer_end(user, "output")
            if a != b:
                flows[(a, b)][node] = node.meta.get("val")
    sizer = _Sizer(gm, _parts(plan))
    last = len(plan.stages) - 1

    def stage(box: str) -> int:
        return 0 if box == "input" else last if box == "output" else layer_stage[int(box[1:])]

    for (a, b), by_node in flows.items():
        values = list(by_node.values())
        cross = stage(a) != stage(b)
        label = ", ".join(dict.fromkeys(s for s in map(sizer.shape, values) if s))
        result.edges.append(Arrow(a, b, label, cross, sizer(values) if cross else None))
    return result


def _layer_end(node: fx.Node, io: str) -> str:
    layer = node.meta.get("layer")
    return io if layer is None or node.op in ("placeholder", "output") else f"L{layer}"


def _chain_edges(plan: Plan) -> list[Arrow]:
    ids = ["input", *(f"L{k}" for k in range(len(plan.layers))), "output"]
    ends = {sum(len(s.layers) for s in plan.stages[:j + 1]): s for j, s in
            enumerate(plan.stages[:-1])}
    edges = []
    for k, (a, b) in enumerate(itertools.pairwise(ids)):
        stage = ends.get(k)
        edges.append(Arrow(a, b, "", stage is not None,
                           stage.send_bytes if stage is not None else None))
    return edges


_NUMBERED = re.compile(r"(.*?)(\d+)")


def _fold_blocks(layers: Diagram) -> Diagram:
    """Fold runs of consecutive numbered layers (``h.2 .. h.8``) of one stage into one box."""
    boxes = [b for b in layers.boxes if b.kind == "layer"]
    runs: list[list[Box]] = []
    for box in boxes:
        if runs and _continues(runs[-1][-1], box):
            runs[-1].append(box)
        else:
            runs.append([box])
    folded: dict[str, str] = {}
    result = Diagram(layers.plan, "blocks", [b for b in layers.boxes if b.kind == "io"][:1])
    for run in runs:
        label = run[0].label if len(run) == 1 else _run_label(run)
        result.boxes.append(Box(run[0].id, label, run[0].stage, kind="layer"))
        folded.update({b.id: run[0].id for b in run})
    result.boxes.append(layers.boxes[-1])
    merged: dict[tuple[str, str], Arrow] = {}
    for edge in layers.edges:
        a, b = folded.get(edge.source, edge.source), folded.get(edge.target, edge.target)
        old = merged.get((a, b))
        if a == b:
            continue
        if old is None:
            merged[(a, b)] = replace(edge, source=a, target=b)
        else:
            label = old.label if edge.label in ("", old.label) else f"{old.label}, {edge.label}"
            merged[(a, b)] = replace(old, label=label, bytes_per_microbatch=_add(
                old.bytes_per_microbatch, edge.bytes_per_microbatch))
    result.edges = list(merged.values())
    return result


def _run_label(run: list[Box]) -> str:
    """``"h.2 .. h.8\n(7 layers)"``, then the layers' split line when they share one."""
    first, last = (run[k].label.partition("\n") for k in (0, -1))
    same = all(b.label.partition("\n")[2] == first[2] for b in run)
    extra = f"\n{first[2]}" if same and first[2] else ""
    return f"{first[0]} .. {last[0]}\n({len(run)} layers){extra}"


def _continues(previous: Box, box: Box) -> bool:
    a, b = (_NUMBERED.fullmatch(x.label.split("\n")[0]) for x in (previous, box))
    return (previous.stage == box.stage and a is not None and b is not None
            and a.group(1) == b.group(1) and int(b.group(2)) == int(a.group(2)) + 1)


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)
