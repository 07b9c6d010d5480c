"""Where each box of a diagram goes, computed in Python, for drawing without Graphviz.

A layered layout, the same idea as Graphviz's ``dot`` in a few steps:

1. ranks: every box sits at least one row below the boxes it uses (longest path over the
   DAG, with networkx's topological order); an arrow that skips rows gets a point in each,
   which the next steps place like a narrow box, so it runs in a lane of its own;
2. bands: the model's inputs come first, then each stage in turn, then the output; a stage
   starts below every row of the stage before, so its frame (a rectangle around its boxes,
   like Graphviz's cluster) never overlaps another's;
3. order within a row: each box is placed under the mean x of the boxes it uses
   (barycentres), then pushed aside until none overlap.

Sizes are in SVG pixels and estimated from the label text (no font metrics are at hand).

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> from partitioner.viz.graph import diagram
    >>> plan = Plan("balance", ("cpu", "cpu"), (Stage(0, "cpu", ("a",)), Stage(1, "cpu", ("b",))))
    >>> placed = layout(diagram(None, plan))
    >>> [placed.boxes[i].row for i in ("input", "L0", "L1", "output")]
    [0, 1, 2, 3]
    >>> [f.stage for f in placed.frames]
    [0, 1]
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import networkx as nx

from partitioner.viz.graph import Box, Diagram, stage_title

__all__ = ["Placed", "Frame", "Layout", "layout", "text_width", "FONT_SIZES", "TITLE_SIZE",
           "TITLE_ROOM"]

#: Font size in pixels of each kind of box, and of a frame's title.
FONT_SIZES = {"op": 10.0, "layer": 10.0, "io": 10.0, "minor": 8.0}
TITLE_SIZE = 11.0
_GAP_X = 18.0  # between boxes of a row
_GAP_Y = 34.0  # between rows (room for an edge's label)
_BAND_GAP = 46.0  # extra, where a stage begins (room for its title and a label above)
_PAD = 10.0  # inside a frame, around its boxes
TITLE_ROOM = 18.0  # a frame's title line
_LANE = 12.0  # the room a passing arrow takes in a row
_MARGIN = 16.0
_HEADING = 34.0  # the diagram's heading above everything


@dataclass(frozen=True)
class Placed:
    """A box with its centre ``(x, y)``, size, and the row it sits in."""

    box: Box
    x: float
    y: float
    width: float
    height: float
    row: int


@dataclass(frozen=True)
class Frame:
    """The rectangle around one stage's boxes (top-left ``x0, y0``, bottom-right ``x1, y1``)."""

    stage: int
    x0: float
    y0: float
    x1: float
    y1: float


@dataclass(frozen=True)
class Layout:
    """Every box placed, the stages' frames, each arrow's route and the drawing's size.

    ``routes[(source, target)]`` runs from the bottom of the source box through a point in
    every row between to the top of the target box.
    """

    boxes: dict[str, Placed]
    frames: list[Frame]
    routes: dict[tuple[str, str], list[tuple[float, float]]]
    width: float
    height: float


def text_width(text: str, size: float) -> float:
    """About how wide ``text`` is in a sans-serif font of ``size`` pixels."""
    return 0.58 * size * max((len(line) for line in text.split("\n")), default=0)


def _box_size(box: Box) -> tuple[float, float]:
    size = FONT_SIZES.get(box.kind, 10.0)
    lines = box.label.count("\n") + 1
    return max(text_width(box.label, size) + 16, 40.0), lines * size * 1.25 + 10


def layout(d: Diagram) -> Layout:
    """Place the boxes of ``d`` and route its arrows (see the module docstring)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(b.id for b in d.boxes)
    graph.add_edges_from((e.source, e.target) for e in d.edges
                         if e.source != e.target and e.source in graph and e.target in graph)
    rank, bands = _ranks(d, graph)
    routed, lanes = _lanes(graph, rank)
    rows: dict[int, list[str]] = defaultdict(list)
    for i in routed.nodes:  # boxes in topological order, then the lanes' points
        rows[rank[i]].append(i)
    sizes = {b.id: _box_size(b) for b in d.boxes} | {i: (_LANE, 0.0) for i in rank
                                                     if i not in graph}
    xs = _columns([rows[r] for r in sorted(rows)], routed, sizes)
    ys, y, previous = {}, _MARGIN + _HEADING, None
    for r in sorted(rows):
        band = next((bands[i] for i in rows[r] if i in bands), previous)
        if previous is not None and band != previous:
            y += _BAND_GAP
        height = max(sizes[i][1] for i in rows[r])
        ys.update(dict.fromkeys(rows[r], y + height / 2))
        y += height + _GAP_Y
        previous = band
    shift = _MARGIN - min(xs[i] - sizes[i][0] / 2 for i in xs)
    placed = {b.id: Placed(b, xs[b.id] + shift, ys[b.id], *sizes[b.id], rank[b.id])
              for b in d.boxes}
    frames = _frames(d, placed)
    routes = {}
    for u, v in graph.edges:
        a, b = placed[u], placed[v]
        routes[(u, v)] = [(a.x, a.y + a.height / 2),
                          *((xs[i] + shift, ys[i]) for i in lanes.get((u, v), [])),
                          (b.x, b.y - b.height / 2)]
    right = max([p.x + p.width / 2 for p in placed.values()] + [f.x1 for f in frames]
                + [x for points in routes.values() for x, _ in points])
    bottom = max([p.y + p.height / 2 for p in placed.values()] + [f.y1 for f in frames])
    return Layout(placed, frames, routes, right + _MARGIN, bottom + _MARGIN)


def _band(box: Box, graph: nx.DiGraph, stages: int) -> int:
    """-1 for the model's inputs, the stage for a stage's box, ``stages`` for the output."""
    if box.stage is not None:
        return box.stage
    return -1 if graph.in_degree(box.id) == 0 else stages


def _ranks(d: Diagram, graph: nx.DiGraph) -> tuple[dict[str, int], dict[str, int]]:
    """The row of every box (in topological order) and its band."""
    index = {b.id: k for k, b in enumerate(d.boxes)}
    order = (list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))
             if nx.is_directed_acyclic_graph(graph) else [b.id for b in d.boxes])
    topo = {i: k for k, i in enumerate(order)}
    bands = {b.id: _band(b, graph, len(d.plan.stages)) for b in d.boxes}
    rank: dict[str, int] = {}
    floor, deepest, current = 0, -1, None
    for i in sorted(order, key=lambda i: (bands[i], topo[i])):
        if bands[i] != current:
            # A band starts below every row of the bands above it.
            floor, current = deepest + 1, bands[i]
        used = [rank[u] + 1 for u in graph.predecessors(i) if u in rank]
        rank[i] = max([floor, *used])
        deepest = max(deepest, rank[i])
    return {i: rank[i] for i in order}, bands


def _lanes(graph: nx.DiGraph, rank: dict[str, int]
           ) -> tuple[nx.DiGraph, dict[tuple[str, str], list[str]]]:
    """The graph with a point in every row that an arrow passes (so a long arrow gets a lane
    of its own instead of running through the boxes between), and each arrow's points.

    ``rank`` gains the points' rows.
    """
    routed = nx.DiGraph()
    routed.add_nodes_from(rank)
    lanes: dict[tuple[str, str], list[str]] = {}
    for u, v in list(graph.edges):
        points = [f"\0{u}\0{v}\0{r}" for r in range(rank[u] + 1, rank[v])]
        rank.update({p: r for p, r in zip(points, range(rank[u] + 1, rank[v]))})
        routed.add_nodes_from(points)
        nx.add_path(routed, [u, *points, v])
        if points:
            lanes[(u, v)] = points
    return routed, lanes


def _columns(rows: list[list[str]], graph: nx.DiGraph,
             sizes: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The x of each box's centre: under the mean x of what it uses, without overlaps."""
    xs: dict[str, float] = {}
    for row in rows:
        wanted = {}
        for k, i in enumerate(row):
            used = [xs[u] for u in graph.predecessors(i) if u in xs]
            wanted[i] = sum(used) / len(used) if used else float(k)
        # Ties keep the row's order: boxes before the lanes of arrows passing by.
        ordered = sorted(row, key=lambda i: (wanted[i], row.index(i)))
        if all(not any(u in xs for u in graph.predecessors(i)) for i in row):
            wanted = dict.fromkeys(row, 0.0)  # the inputs, side by side
        placed: list[float] = []
        for k, i in enumerate(ordered):
            x = wanted[i]
            if k:
                before = ordered[k - 1]
                x = max(x, placed[-1] + (sizes[before][0] + sizes[i][0]) / 2 + _GAP_X)
            placed.append(x)
        # Pushing aside moved the row right; centre its boxes back on where they wanted to
        # be (lanes give way, so a chain of boxes stays straight).
        boxes = [k for k, i in enumerate(ordered) if sizes[i][1] > 0] or list(range(len(row)))
        drift = sum(placed[k] - wanted[ordered[k]] for k in boxes) / len(boxes)
        xs.update({i: x - drift for i, x in zip(ordered, placed)})
    return xs


def _frames(d: Diagram, placed: dict[str, Placed]) -> list[Frame]:
    members: dict[int, list[Placed]] = defaultdict(list)
    for p in placed.values():
        if p.box.stage is not None:
            members[p.box.stage].append(p)
    frames = []
    for j in sorted(members):
        ps = members[j]
        x0 = min(p.x - p.width / 2 for p in ps) - _PAD
        # Wide enough for its title, which is often wider than one box.
        x1 = max([p.x + p.width / 2 + _PAD for p in ps]
                 + [x0 + text_width(stage_title(d.plan, j), TITLE_SIZE) + 2 * _PAD])
        frames.append(Frame(j, x0, min(p.y - p.height / 2 for p in ps) - _PAD - TITLE_ROOM, x1,
                            max(p.y + p.height / 2 for p in ps) + _PAD))
    return frames
