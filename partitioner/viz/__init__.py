"""Seeing a plan: its graph, its schedule as a timeline, and both in one HTML report.

``visualize(pm_or_plan, path)`` writes by the path's suffix:

- ``.dot``: Graphviz source (needs nothing installed);
- ``.svg``, ``.png``, ``.pdf``: the graph drawn by Graphviz's ``dot``;
- ``.html``: one self-contained page with the plan table, the graph and the timeline.

``visualize_timeline(pm_or_plan, path)`` draws the pipeline schedule (``.dot``/``.svg``/
``.png``): measured when a partitioned module has run, else predicted from the plan; or pass
``timeline=`` (a simulator's list of ``(action, start, end)``).

A partitioned module carries its captured graph (``pm.analysis``), so it is drawn node by
node (or layer by layer for big models); a bare plan is drawn layer by layer from its names.

Example:
    >>> import torch
    >>> from partitioner import partition
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> pm = partition(model, ["cpu", "cpu"], example_inputs=(torch.randn(6, 4),), chunks=2)
    >>> "subgraph cluster_stage1" in to_dot(diagram(pm.analysis, pm.plan))
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partitioner.errors import PartitionError, SuffixError
from partitioner.plans.plan import Plan
from partitioner.viz.dot import GraphvizNotFound, render, to_dot
from partitioner.viz.graph import DETAILS, Diagram, diagram
from partitioner.viz.report import report_html
from partitioner.viz.timeline import (
    Timeline,
    measured_timeline,
    predicted_timeline,
    timeline_dot,
)

__all__ = ["visualize", "visualize_timeline", "diagram", "to_dot", "render", "timeline_dot",
           "report_html", "Timeline", "Diagram", "predicted_timeline", "measured_timeline",
           "GraphvizNotFound", "DETAILS", "unpack"]

_IMAGES = (".svg", ".png", ".pdf")


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
        GraphvizNotFound: an image or report was asked for and Graphviz is not installed.
        PartitionError: an unknown suffix or ``detail``.

    Example:
        >>> visualize(pm, "plan.svg")  # doctest: +SKIP
    """
    plan, analysis = unpack(source)
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".html":
        chosen = Timeline.of(timeline) if timeline is not None else default_timeline(source)
        path.write_text(report_html(plan, analysis, chosen, detail))
        return path
    dot = to_dot(diagram(analysis, plan, detail))
    if suffix == ".dot":
        path.write_text(dot)
    elif suffix in _IMAGES:
        path.write_bytes(render(dot, suffix[1:]))
    else:
        raise SuffixError(f"cannot write {path.name}: use .dot, .svg, .png, .pdf or .html")
    return path


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
    chosen = Timeline.of(timeline) if timeline is not None else default_timeline(source)
    dot = timeline_dot(chosen, plan)
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".dot":
        path.write_text(dot)
    elif suffix in _IMAGES:
        path.write_bytes(render(dot, suffix[1:], engine="neato"))
    else:
        raise SuffixError(f"cannot write {path.name}: use .dot, .svg, .png or .pdf")
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
    if not isinstance(source, Plan) and hasattr(source, "pipeline"):
        try:
            return measured_timeline(source)
        except PartitionError:
            pass
    return predicted_timeline(plan)
