"""One self-contained HTML page: the plan table, the graph and the timeline, inline SVG.

Nothing is fetched when the page opens (no scripts, no fonts, no server): the two pictures are
SVG written into the page, so it can be mailed or attached to a ticket as is. Graphviz draws
them when it is installed; without it they are drawn in Python (``partitioner.viz.svg``), so
the report needs nothing beyond the package.
The sections carry ids (``plan-table``, ``memory``, ``graph``, ``timeline``) that tests look
for; the memory figure (bars per device, ``partitioner.viz.memory``) sits beside the table.

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> plan = Plan("balance", ("cpu",), (Stage(0, "cpu", ("fc",)),))
    >>> '<table id="plan-table">' in plan_table_html(plan)
    True
"""

from __future__ import annotations

import html
import re
from typing import Any

from partitioner.plans.plan import Plan
from partitioner.viz.dot import device_color, graphviz_available, render, to_dot
from partitioner.viz.graph import Diagram, diagram, format_bytes
from partitioner.viz.memory import memory_svg
from partitioner.viz.svg import graph_svg, timeline_svg
from partitioner.viz.timeline import Timeline, timeline_dot

__all__ = ["report_html", "plan_table_html", "inline_svg", "graph_picture", "timeline_picture"]

_STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #111827; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #e5e7eb; padding: 4px 10px; text-align: left; }
th { background: #f3f4f6; } td.num { text-align: right; }
figure { margin: 8px 0; padding: 8px; border: 1px solid #e5e7eb; overflow: auto; }
figure svg { max-width: 100%; height: auto; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px;
          vertical-align: middle; margin-right: 6px; border: 1px solid #9ca3af; }
.note { color: #4b5563; font-size: 13px; }
.side { display: flex; gap: 24px; align-items: flex-start; flex-wrap: wrap; }
"""


def report_html(plan: Plan, analysis: Any | None, timeline: Timeline | None,
                detail: str = "auto", title: str | None = None) -> str:
    """The report page as text.

    Args:
        plan: the plan to show.
        analysis: the model's analysis for the graph, or ``None`` to draw the plan alone.
        timeline: the schedule to draw, or ``None`` to leave that section out.
        detail: the graph's level of detail (``partitioner.viz.graph.DETAILS``).
        title: the page heading.

    Raises:
        PartitionError: an unknown ``detail``, or an analysis of another model.
    """
    graph = inline_svg(graph_picture(diagram(analysis, plan, detail)))
    heading = title or f"{plan.strategy} plan: {len(plan.stages)} stages, chunks={plan.chunks}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(heading)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>{html.escape(heading)}</h1>",
             f'<p class="summary">{html.escape(plan.table().splitlines()[0])}</p>',
             '<section id="plan"><h2>Stages</h2><div class="side">', plan_table_html(plan),
             f'<figure id="memory">{memory_svg(plan)}</figure></div>', _details(plan),
             "</section>",
             '<section id="graph"><h2>Graph</h2><p class="note">Boxes grouped by stage and '
             "coloured by device; red arrows cross stages, labelled with the bytes they carry "
             f"per micro-batch.</p><figure>{graph}</figure></section>"]
    if timeline is not None:
        svg = inline_svg(timeline_picture(timeline, plan))
        parts.append('<section id="timeline"><h2>Timeline</h2><p class="note">One row per '
                     "device; F is a forward, B a backward, the number its micro-batch; grey "
                     f"is idle time (the bubble).</p><figure>{svg}</figure></section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def graph_picture(d: Diagram) -> str:
    """The diagram as an SVG document: Graphviz's ``dot`` when installed, else plain SVG."""
    if graphviz_available("dot"):
        return render(to_dot(d), "svg").decode()
    return graph_svg(d)


def timeline_picture(timeline: Any, plan: Plan | None = None) -> str:
    """The timeline as an SVG document: Graphviz's ``neato`` when installed, else plain SVG."""
    if graphviz_available("neato"):
        return render(timeline_dot(timeline, plan), "svg", engine="neato").decode()
    return timeline_svg(timeline, plan)


def plan_table_html(plan: Plan) -> str:
    """The plan's stages as an HTML table (one row per stage)."""
    head = ("stage", "device", "layers", "first .. last", "time / micro-batch", "memory",
            "parameters", "sends / micro-batch")
    rows = ["<table id=\"plan-table\"><thead><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for s in plan.stages:
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        cells = [f'<span class="swatch" style="background:{device_color(s.index)}"></span>'
                 f"{s.index}", html.escape(s.device), str(len(s.layers)), html.escape(span),
                 "-" if s.predicted_time is None else f"{s.predicted_time * 1e3:.2f} ms",
                 _bytes(s.predicted_memory), _bytes(s.param_bytes), _bytes(s.send_bytes)]
        rows.append("<tr>" + "".join(f'<td class="{"num" if k > 1 else ""}">{c}</td>'
                                     for k, c in enumerate(cells)) + "</tr>")
    rows.append("</tbody></table>")
    return "\n".join(rows)


def _details(plan: Plan) -> str:
    facts = []
    if plan.mesh is not None:
        facts.append(f"mesh dp={plan.mesh.dp} pp={plan.mesh.pp} tp={plan.mesh.tp}")
    facts.append(f"{len(plan.shard_specs)} tensor-parallel shard specs")
    if plan.planner is not None and plan.planner.example_inputs:
        facts.append("costed on " + ", ".join(plan.planner.example_inputs))
    if plan.fingerprint is not None:
        facts.append(f"model {plan.fingerprint.model} {plan.fingerprint.digest[:19]}...")
    items = "".join(f"<li>{html.escape(f)}</li>" for f in [*facts, *plan.notes])
    return f'<ul class="note">{items}</ul>'


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def inline_svg(svg: bytes | str) -> str:
    """An SVG file made fit to sit inside an HTML page (no XML prolog, doctype or comments)."""
    text = svg.decode() if isinstance(svg, bytes) else svg
    text = re.sub(r"<\?xml[^>]*\?>", "", text)
    text = re.sub(r"<!DOCTYPE[^>]*>", "", text, flags=re.S)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S).strip()
