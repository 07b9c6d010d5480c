"""Seeing a plan: its graph, its schedule as a timeline, and both in one HTML report.

``visualize(pm_or_plan, path)`` writes by the path's suffix:

- ``.dot``: Graphviz source (needs nothing installed);
- ``.svg``: the graph drawn by Graphviz's ``dot`` when it is installed, else as plain SVG
  laid out in Python (``partitioner.viz.svg``);
- ``.png``, ``.pdf``: drawn by Graphviz (an error says how to install it when it is missing);
- ``.html``: one self-contained page with the plan table, the graph and the timeline (inline
  SVG, by Graphviz or in Python as above).

``visualize_timeline(pm_or_plan, path)`` draws the plan's step, a row per device of its mesh
(``.dot``/``.svg``/``.png``/``.pdf``): measured when a partitioned module (pipeline, tensor
parallel or replicas) has run, else predicted from the plan;
or pass ``timeline=`` (a simulator's list of ``(action, start, end)``). The ``write_*``
functions do the same from a plan and its analysis (the command line's way in).

A partitioned module carries its captured graph (``pm.analysis``), so it is drawn node by
node (or layer by layer for big models); a bare plan is drawn layer by layer from its names.

Example:
    >>> import torch
    >>> from partitioner import partition
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(torch.randn(6, 4),),
    ...                chunks=2)
    >>> "subgraph cluster_stage1" in to_dot(diagram(pm.analysis, pm.plan))
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partitioner.errors import PartitionError, SuffixError
from partitioner.plans.plan import Plan
from partitioner.viz.dot import (
    GraphvizNotFound,
    graphviz_available,
    graphviz_missing,
    render,
    to_dot,
)
from partitioner.viz.graph import DETAILS, Diagram, diagram
from partitioner.viz.measured import measured_timeline
from partitioner.viz.report import graph_picture, report_html, timeline_picture
from partitioner.viz.timeline import Timeline, predicted_timeline, timeline_dot

__all__ = ["visualize", "visualize_timeline", "diagram", "to_dot", "render", "timeline_dot",
           "report_html", "Timeline", "Diagram", "predicted_timeline", "measured_timeline",
           "GraphvizNotFound", "DETAILS", "unpack", "check_output", "write_graph",
           "write_timeline", "write_report", "default_timeline", "SUFFIXES"]

#: The suffixes each kind of picture may be written as.
SUFFIXES = {"graph": (".dot", ".svg", ".png", ".pdf", ".html"),
            "timeline": (".dot", ".svg", ".png", ".pdf"), "report": (".html",)}
#: The Graphviz program each kind of picture is drawn with.
_ENGINES = {"graph": "dot", "timeline": "neato"}


def visualize(source: Any, path: str | Path, *, detail: str = "auto",
              timeline: Any | None = None) -> Path:
    """Draw a partitioned module or a plan to ``path`` (format from the suffix).

    Args:
        source: a ``PartitionedModule`` (drawn from its captured graph) or a :class:`Plan`.
        path: ``.dot``, ``.svg``, ``.png``, ``.pdf`` or ``.html``.
        detail: ``"auto"``, ``"nodes"``, ``"layers"`` or ``"blocks"`` (see ``viz.graph``).
        timeline: for ``.html``, the schedule to show (a list of ``(action, start, end)``);
            by default the module's last measured run, else the plan's predicted timeline.

    Returns:
        The path written.

    Raises:
        GraphvizNotFound: ``.png`` or ``.pdf`` was asked for and Graphviz is not installed.
        PartitionError: an unknown suffix or ``detail``.

    Example:
        >>> visualize(pm, "plan.svg")  # doctest: +SKIP
    """
    plan, analysis = unpack(source)
    path = Path(path)
    check_output(path, "graph")
    if path.suffix.lower() == ".html":
        chosen = Timeline.of(timeline) if timeline is not None else default_timeline(source)
        return write_report(path, plan, analysis, chosen, detail)
    return write_graph(path, plan, analysis, detail)


def visualize_timeline(source: Any, path: str | Path, *, timeline: Any | None = None) -> Path:
    """Draw the pipeline schedule of a module or plan to ``.dot``, ``.svg``, ``.png``, ``.pdf``.

    Args:
        source: a ``PartitionedModule`` or a :class:`Plan` (names the rows' devices).
        path: where to write; the suffix picks the format.
        timeline: the events to draw; by default as in :func:`visualize`.

    Returns:
        The path written.
    """
    plan, _ = unpack(source)
    check_output(path, "timeline")
    chosen = Timeline.of(timeline) if timeline is not None else default_timeline(source)
    return write_timeline(path, chosen, plan)


def check_output(path: str | Path, kind: str) -> None:
    """Refuse, before any work, a file that cannot be drawn: an unknown suffix for ``kind``
    (``"graph"``, ``"timeline"`` or ``"report"``), or an image Graphviz would draw when it
    is not installed.

    Raises:
        SuffixError: the suffix is not one of ``SUFFIXES[kind]``.
        GraphvizNotFound: ``.png`` or ``.pdf`` without Graphviz.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES[kind]:
        raise SuffixError(f"cannot write {path.name} as a {kind}: use "
                          f"{', '.join(SUFFIXES[kind])}")
    if suffix in (".png", ".pdf") and not graphviz_available(_ENGINES[kind]):
        raise graphviz_missing(_ENGINES[kind], suffix[1:])


def write_graph(path: str | Path, plan: Plan, analysis: Any | None = None,
                detail: str = "auto") -> Path:
    """Draw the graph of ``plan`` (from ``analysis`` when given) to ``path``, by suffix:
    ``.dot``, ``.svg``, ``.png``, ``.pdf``, or ``.html`` (a report with the predicted
    timeline)."""
    path = Path(path)
    check_output(path, "graph")
    suffix = path.suffix.lower()
    if suffix == ".html":
        return write_report(path, plan, analysis, predicted_timeline(plan), detail)
    d = diagram(analysis, plan, detail)
    if suffix == ".dot":
        path.write_text(to_dot(d))
    elif suffix == ".svg":
        path.write_text(graph_picture(d))
    else:
        path.write_bytes(render(to_dot(d), suffix[1:]))
    return path


def write_timeline(path: str | Path, timeline: Any, plan: Plan | None = None) -> Path:
    """Draw ``timeline`` (rows named by ``plan``'s devices) to ``.dot``, ``.svg``, ``.png``
    or ``.pdf``."""
    path = Path(path)
    check_output(path, "timeline")
    suffix = path.suffix.lower()
    if suffix == ".dot":
        path.write_text(timeline_dot(timeline, plan))
    elif suffix == ".svg":
        path.write_text(timeline_picture(timeline, plan))
    else:
        path.write_bytes(render(timeline_dot(timeline, plan), suffix[1:], engine="neato"))
    return path


def write_report(path: str | Path, plan: Plan, analysis: Any | None, timeline: Any | None,
                 detail: str = "auto") -> Path:
    """Write the HTML report (``partitioner.viz.report``) to ``path``."""
    path = Path(path)
    path.write_text(report_html(plan, analysis, timeline, detail))
    return path


def unpack(source: Any) -> tuple[Plan, Any | None]:
    """The plan and, when there is one, the captured model's analysis of ``source``."""
    if isinstance(source, Plan):
        return source, None
    plan = getattr(source, "plan", None)
    if not isinstance(plan, Plan):
        raise PartitionError(f"cannot draw a {type(source).__name__}; pass a partitioned "
                             "module (from partition()) or a Plan")
    return plan, getattr(source, "analysis", None)


def default_timeline(source: Any) -> Timeline:
    """The measured timeline of a module that has run, else the plan's predicted one."""
    plan, _ = unpack(source)
    if not isinstance(source, Plan) and (hasattr(source, "pipeline")
                                         or hasattr(source, "replicas")):
        try:
            return measured_timeline(source)
        except PartitionError:
            pass
    return predicted_timeline(plan)
