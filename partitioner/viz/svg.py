"""Plain SVG for the graph and the timeline: the pictures without Graphviz.

Graphviz draws better graphs, but it is a program to install, not a Python package. When it
is missing, :func:`graph_svg` draws a diagram from :func:`~partitioner.viz.layout.layout`'s
positions (stage frames filled with the device's colour, red arrows across stages labelled
with their bytes per micro-batch, as ``partitioner.viz.dot`` asks of Graphviz), and
:func:`timeline_svg` draws the bars where their times put them. The markup follows
Graphviz's where tests and readers look: ``<g class="node">`` with a ``<title>`` for each box
(``bar<k>`` for the timeline's), ``<g class="cluster" id="cluster_stage<j>">`` per stage.

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> from partitioner.viz.graph import diagram
    >>> plan = Plan("balance", ("cpu",), (Stage(0, "cpu", ("fc",)),))
    >>> graph_svg(diagram(None, plan)).startswith("<svg")
    True
"""

from __future__ import annotations

import itertools
from html import escape
from typing import Any

from partitioner.viz.dot import CROSS, device_color
from partitioner.viz.graph import Arrow, Diagram, format_bytes, graph_heading, stage_title
from partitioner.viz.layout import (
    FONT_SIZES,
    TITLE_SIZE,
    Frame,
    Layout,
    Placed,
    layout,
    text_width,
)
from partitioner.viz.timeline import (
    Timeline,
    bar_color,
    bar_tip,
    format_span,
    nice_step,
    row_name,
    timeline_heading,
)

__all__ = ["graph_svg", "timeline_svg"]

_FONT = "font-family=\"Helvetica, Arial, 'DejaVu Sans', sans-serif\""
_GREY = "#555555"
_STYLES = {"io": ('fill="#f3f4f6" stroke="#6b7280"', "#111827"),
           "minor": ('fill="white" stroke="#9ca3af"', "#6b7280"),
           "layer": ('fill="white" stroke="#374151" stroke-width="1.2"', "#111827"),
           "op": ('fill="white" stroke="#374151"', "#111827")}


def graph_svg(d: Diagram, title: str | None = None) -> str:
    """An SVG document of the diagram: frames per stage, boxes, arrows (see the module).

    Args:
        d: the diagram (``partitioner.viz.graph.diagram``).
        title: the heading; by default the plan's strategy, stages, chunks and detail.
    """
    heading = title or graph_heading(d)
    placed = layout(d)
    width = max(placed.width, text_width(heading, 12) + 32)
    parts = [_open(width, placed.height, "plan"), _markers(),
             f'<text x="{width / 2:.1f}" y="26" font-size="12" text-anchor="middle">'
             f"{escape(heading)}</text>"]
    parts += [_frame(d, placed, f) for f in range(len(placed.frames))]
    spots = _spots(d, placed)
    parts += [_edge(e, placed, spots.get((e.source, e.target))) for e in d.edges
              if (e.source, e.target) in placed.routes]
    parts += [_node(p) for p in placed.boxes.values()]
    parts += [_frame_title(d, f) for f in placed.frames]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _open(width: float, height: float, name: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.1f} {height:.1f}" {_FONT}>\n<title>{name}</title>\n'
            f'<rect width="100%" height="100%" fill="white"/>')


def _markers() -> str:
    heads = "".join(
        f'<marker id="partitioner-arrow-{name}" viewBox="0 0 10 10" refX="9" refY="5" '
        f'markerWidth="{size}" markerHeight="{size}" orient="auto">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>'
        for name, color, size in (("plain", _GREY, 6), ("cross", CROSS, 4)))
    return f"<defs>{heads}</defs>"


def _frame(d: Diagram, placed: Layout, k: int) -> str:
    f = placed.frames[k]
    return (f'<g class="cluster" id="cluster_stage{f.stage}"><title>cluster_stage{f.stage}'
            f'</title><rect x="{f.x0:.1f}" y="{f.y0:.1f}" width="{f.x1 - f.x0:.1f}" '
            f'height="{f.y1 - f.y0:.1f}" rx="8" fill="{device_color(f.stage)}" '
            f'stroke="{device_color(f.stage, True)}"/></g>')


def _frame_title(d: Diagram, f: Frame) -> str:
    """A frame's title, drawn last with a halo of its fill: arrows entering pass under it."""
    return (f'<text class="frame-title" x="{f.x0 + 8:.1f}" y="{f.y0 + 15:.1f}" '
            f'font-size="{TITLE_SIZE:g}" stroke="{device_color(f.stage)}" stroke-width="4" '
            f'stroke-linejoin="round" paint-order="stroke">'
            f"{escape(stage_title(d.plan, f.stage))}</text>")


def _node(p: Placed) -> str:
    shape, ink = _STYLES.get(p.box.kind, _STYLES["op"])
    x0, y0 = p.x - p.width / 2, p.y - p.height / 2
    radius = p.height / 2 if p.box.kind == "io" else 6
    size = FONT_SIZES.get(p.box.kind, 10.0)
    tip = p.box.id if p.box.group is None else f"{p.box.id} (in {p.box.group})"
    return (f'<g class="node" id="node_{escape(p.box.id)}"><title>{escape(tip)}</title>'
            f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{p.width:.1f}" height="{p.height:.1f}" '
            f'rx="{radius:.1f}" {shape}/>'
            + _text(p.box.label, p.x, p.y, size, ink) + "</g>")


def _text(label: str, x: float, y: float, size: float, ink: str, anchor: str = "middle") -> str:
    """Text of one or more lines, centred on ``y``."""
    lines = label.split("\n")
    first = y - (len(lines) - 1) * size * 0.625 + size * 0.35
    spans = "".join(f'<tspan x="{x:.1f}" y="{first + k * size * 1.25:.1f}">{escape(line)}'
                    "</tspan>" for k, line in enumerate(lines))
    return f'<text font-size="{size:g}" fill="{ink}" text-anchor="{anchor}">{spans}</text>'


def _edge(e: Arrow, placed: Layout, spot: tuple[float, float, str] | None) -> str:
    points = placed.routes[(e.source, e.target)]
    path = f"M{points[0][0]:.1f},{points[0][1]:.1f}" + "".join(
        f" C{x0:.1f},{(y0 + y1) / 2:.1f} {x1:.1f},{(y0 + y1) / 2:.1f} {x1:.1f},{y1:.1f}"
        for (x0, y0), (x1, y1) in itertools.pairwise(points))
    color, width, head = (CROSS, 2.2, "cross") if e.cross else (_GREY, 1.0, "plain")
    text = (_text(_label(e), spot[0], spot[1], _label_size(e), color, spot[2])
            if spot is not None else "")
    return (f'<g class="edge"><title>{escape(e.source)}&#45;&gt;{escape(e.target)}</title>'
            f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{width}" '
            f'marker-end="url(#partitioner-arrow-{head})"/>{text}</g>')


def _label(e: Arrow) -> str:
    if not e.cross:
        return e.label
    moved = (f"{format_bytes(e.bytes_per_microbatch)}/micro-batch"
             if e.bytes_per_microbatch is not None else "crosses stages")
    return f"{e.label}\n{moved}" if e.label else moved


def _label_size(e: Arrow) -> float:
    return 9.0 if e.cross else 8.0


_Rect = tuple[float, float, float, float]  # x0, y0, x1, y1


def _spots(d: Diagram, placed: Layout) -> dict[tuple[str, str], tuple[float, float, str]]:
    """Where each arrow's label goes (x, y of its middle, text-anchor): beside the arrow,
    clear of the boxes, the frames' titles and the labels placed before it when possible."""
    taken: list[_Rect] = [(p.x - p.width / 2, p.y - p.height / 2, p.x + p.width / 2,
                           p.y + p.height / 2) for p in placed.boxes.values()]
    taken += [(f.x0, f.y0, f.x0 + text_width(stage_title(d.plan, f.stage), TITLE_SIZE) + 16,
               f.y0 + 20) for f in placed.frames]
    spots, said = {}, set()
    for e in d.edges:
        label = _label(e)
        if not label or (e.source, e.target) not in placed.routes or (e.source, label) in said:
            continue
        if d.detail == "nodes":  # a node is one value: where it fans out, label it once
            said.add((e.source, label))
        w = text_width(label, _label_size(e))
        h = (label.count("\n") + 1) * _label_size(e) * 1.25
        options = []
        for x, y in _candidates(placed.routes[(e.source, e.target)], placed, e.cross):
            options += [(x + 4, y, "start", (x + 4, y - h / 2, x + 4 + w, y + h / 2)),
                        (x - 4, y, "end", (x - 4 - w, y - h / 2, x - 4, y + h / 2))]
        # The first option clear of everything, else the one overlapping least.
        x, y, anchor, rect = min(options, key=lambda o: sum(_overlap(o[3], r) for r in taken))
        taken.append(rect)
        spots[(e.source, e.target)] = (x, y, anchor)
    return spots


def _overlap(a: _Rect, b: _Rect) -> float:
    """The area two rectangles share."""
    return max(min(a[2], b[2]) - max(a[0], b[0]), 0) * max(min(a[3], b[3]) - max(a[1], b[1]), 0)


def _candidates(points: list[tuple[float, float]], placed: Layout,
                cross: bool) -> list[tuple[float, float]]:
    """Points on the arrow for its label, best first: half way down its first leg or, for
    an arrow across stages, in the gap above the first frame it enters; then up and down
    that leg from there."""
    legs = list(itertools.pairwise(points))
    leg, y = legs[0], (legs[0][0][1] + legs[0][1][1]) / 2
    for a, b in legs if cross else ():
        tops = [f.y0 for f in placed.frames if a[1] < f.y0 < b[1]]
        if tops:
            bottoms = [f.y1 for f in placed.frames if a[1] < f.y1 < min(tops)]
            leg, y = (a, b), (max(bottoms, default=a[1]) + min(tops)) / 2
            break
    (x0, y0), (x1, y1) = leg
    found = []
    for dy in (0, -8, 8, -16, 16, -24, 24, -32, 32):
        at = min(max(y + dy, min(y0, y1)), max(y0, y1))
        # A leg is a cubic with upright ends: x follows smoothstep of the height fraction.
        f = (at - y0) / (y1 - y0) if y1 != y0 else 0.5
        found.append((x0 + (x1 - x0) * (3 * f * f - 2 * f ** 3), at))
    return found


def timeline_svg(timeline: Any, plan: Any | None = None, title: str | None = None,
                 width: float = 760.0) -> str:
    """An SVG document of the timeline: a row per device, a bar per action, idle time grey.

    Args:
        timeline: a :class:`~partitioner.viz.timeline.Timeline` or what ``Timeline.of`` reads.
        plan: names each row's device when given.
        title: the heading; by default the source, stages, micro-batches and bubble share.
        width: pixels of drawing for the whole makespan.
    """
    t = Timeline.of(timeline)
    heading = title or timeline_heading(t)
    names = {j: row_name(t, j, plan) for j in t.stages}
    left = max(130.0, max(text_width(n, 10) for n in names.values()) + 20)
    top, row_height, bar_height = 48.0, 34.0, 26.0
    scale = width / t.makespan
    rows = {j: top + k * row_height for k, j in enumerate(t.stages)}
    axis_y = top + len(rows) * row_height + 4
    total = max(left + width + 40, text_width(heading, 13) + 32)
    parts = [_open(total, axis_y + 34, "timeline"),
             f'<text x="{total / 2:.1f}" y="24" font-size="13" text-anchor="middle">'
             f"{escape(heading)}</text>"]
    for j, y in rows.items():
        name = names[j]
        parts.append(f'<g class="row"><text x="{left - 10:.1f}" y="{y + bar_height / 2 + 4:.1f}" '
                     f'font-size="10" text-anchor="end">{escape(name)}</text>'
                     f'<rect x="{left:.1f}" y="{y:.1f}" width="{width:.1f}" '
                     f'height="{bar_height:.1f}" fill="#e5e7eb" stroke="#d1d5db"/></g>')
    for k, b in enumerate(t.bars):
        x0, x1, y = left + b.start * scale, left + b.end * scale, rows[b.stage]
        text = (_text(b.label, (x0 + x1) / 2, y + bar_height / 2, 9, "white")
                if x1 - x0 >= 16 else "")
        parts.append(f'<g class="node" id="bar{k}"><title>bar{k}: {escape(bar_tip(b, t.unit))}'
                     f'</title><rect x="{x0:.2f}" y="{y:.1f}" width="{max(x1 - x0, 0.5):.2f}" '
                     f'height="{bar_height:.1f}" fill="{bar_color(b, t)}" stroke="white" '
                     f'stroke-width="0.6"/>{text}</g>')
    parts += _axis(t, left, axis_y, scale, width)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _axis(t: Timeline, left: float, y: float, scale: float, width: float) -> list[str]:
    step = nice_step(t.makespan)
    parts = [f'<line x1="{left:.1f}" y1="{y:.1f}" x2="{left + width:.1f}" y2="{y:.1f}" '
             'stroke="#6b7280"/>']
    k, value = 0, 0.0
    while value <= t.makespan * 1.0001:
        x = left + value * scale
        parts.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 4:.1f}" '
                     f'stroke="#6b7280"/><text x="{x:.1f}" y="{y + 16:.1f}" font-size="8" '
                     f'text-anchor="middle">{escape(format_span(value, t.unit))}</text>')
        k, value = k + 1, (k + 1) * step
    return parts
