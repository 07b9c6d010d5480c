"""Graphviz: a :class:`~partitioner.viz.graph.Diagram` as DOT text, and DOT rendered to images.

DOT text needs nothing installed. Images come from Graphviz's own programs (``dot`` for
graphs, ``neato`` for the timeline, whose boxes are pinned in place); when they are missing,
:func:`render` raises :class:`GraphvizNotFound` saying how to install them (SVG is then drawn
by ``partitioner.viz.svg`` instead; see :func:`graphviz_available`).

Each stage is a DOT cluster filled with its device's colour; arrows between stages are drawn
thick and red, labelled with the tensor shapes and the bytes they carry per micro-batch.

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> from partitioner.viz.graph import diagram
    >>> plan = Plan("balance", ("cpu",), (Stage(0, "cpu", ("fc",)),))
    >>> print(to_dot(diagram(None, plan)).splitlines()[0])
    digraph plan {
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict

from partitioner.errors import GraphvizNotFound, PartitionError
from partitioner.viz.graph import Arrow, Box, Diagram, format_bytes, graph_heading, stage_title

__all__ = ["to_dot", "render", "GraphvizNotFound", "device_color", "quote", "PALETTE",
           "graphviz_available", "graphviz_missing", "INSTALL_GRAPHVIZ"]

#: Fill colours, one per device (stage ``j`` on device ``j`` of the plan), then repeated.
PALETTE = ("#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#ede9fe", "#cffafe", "#fee2e2",
           "#e0e7ff", "#ecfccb", "#ffedd5")
#: Matching stronger tones, for borders and the timeline's bars.
STRONG = ("#3b82f6", "#22c55e", "#f59e0b", "#ec4899", "#8b5cf6", "#06b6d4", "#ef4444",
          "#6366f1", "#84cc16", "#f97316")
CROSS = "#dc2626"
#: How to get Graphviz, for error messages.
INSTALL_GRAPHVIZ = ("install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew "
                    "install graphviz; conda: conda install graphviz; Windows: winget install "
                    "graphviz)")


def graphviz_available(engine: str = "dot") -> bool:
    """Whether Graphviz's ``engine`` program (``dot``, ``neato``) is on the ``PATH``."""
    return shutil.which(engine) is not None


def graphviz_missing(engine: str, fmt: str) -> GraphvizNotFound:
    """The error for ``fmt`` output without Graphviz's ``engine``: what to install, and the
    formats that need nothing."""
    return GraphvizNotFound(
        f"{fmt.upper()} output needs Graphviz's '{engine}' program, which is not on the PATH; "
        f"{INSTALL_GRAPHVIZ}, or write .svg or .html (drawn without Graphviz) or .dot (to "
        "render elsewhere)")


def device_color(j: int, strong: bool = False) -> str:
    """The colour of device ``j`` (light fill, or the strong tone)."""
    return (STRONG if strong else PALETTE)[j % len(PALETTE)]


def quote(text: str) -> str:
    """A DOT double-quoted string (newlines become line breaks)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(d: Diagram, title: str | None = None) -> str:
    """DOT text for a diagram: one cluster per stage, arrows across stages in red."""
    heading = title or graph_heading(d)
    lines = ["digraph plan {",
             f"  graph [rankdir=TB, fontname=Helvetica, fontsize=12, labelloc=t, "
             f"label={quote(heading)}, nodesep=0.25, ranksep=0.35, newrank=true];",
             "  node [shape=box, style=\"rounded,filled\", fillcolor=white, fontname=Helvetica, "
             "fontsize=10, height=0.3];",
             "  edge [fontname=Helvetica, fontsize=8, color=\"#555555\", arrowsize=0.6];"]
    by_stage: dict[int | None, list[Box]] = defaultdict(list)
    for box in d.boxes:
        by_stage[box.stage].append(box)
    lines += [f"  {_node(b)}" for b in by_stage.pop(None, [])]
    for j, boxes in sorted(by_stage.items(), key=lambda item: item[0] or 0):
        lines += _cluster(d, int(j or 0), boxes)
    lines += [f"  {_edge(e)}" for e in d.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster(d: Diagram, j: int, boxes: list[Box]) -> list[str]:
    title = stage_title(d.plan, j)
    lines = [f"  subgraph cluster_stage{j} {{",
             f"    label={quote(title)}; style=\"rounded,filled\"; "
             f"fillcolor={quote(device_color(j))}; color={quote(device_color(j, True))}; "
             "fontsize=11; labeljust=l;"]
    lines += _title_room(d, j, boxes, title)
    groups: dict[str | None, list[Box]] = defaultdict(list)
    for box in boxes:
        groups[box.group].append(box)
    for k, (group, members) in enumerate(groups.items()):
        if group is None or d.detail != "nodes":
            lines += [f"    {_node(b)}" for b in members]
            continue
        lines += [f"    subgraph cluster_stage{j}_layer{k} {{",
                  f"      label={quote(group)}; style=\"rounded,dashed\"; color=\"#888888\"; "
                  "fontsize=9;"]
        lines += [f"      {_node(b)}" for b in members]
        lines.append("    }")
    lines.append("  }")
    return lines


def _title_room(d: Diagram, j: int, boxes: list[Box], title: str) -> list[str]:
    """An invisible box as wide as the stage's title, left of its first box on the same
    rank: the title (left-justified above it) then ends before the arrows that enter the
    stage, instead of under them."""
    ids = {b.id for b in boxes}
    first = next((b for b in boxes if not any(e.target == b.id and e.source in ids
                                              for e in d.edges)), None)
    if first is None:
        return []
    room = f"room_stage{j}"
    width = 6.2 * len(title) / 72  # inches, at the title's 11 points
    return [f"    {quote(room)} [label=\"\", style=invis, width={width:.2f}, height=0.01];",
            f"    {{rank=same; {quote(room)} -> {quote(first.id)} [style=invis];}}"]


def _node(box: Box) -> str:
    style = {"io": "shape=ellipse, style=filled, fillcolor=\"#f3f4f6\"",
             "minor": "fontsize=8, fontcolor=\"#6b7280\", color=\"#9ca3af\", height=0.2",
             # One group: dot keeps the chain of layers straight, so stages stack.
             "layer": "penwidth=1.2, group=layers"}.get(box.kind, "")
    return f"{quote(box.id)} [label={quote(box.label)}{', ' + style if style else ''}];"


def _edge(edge: Arrow) -> str:
    attrs = []
    label = edge.label
    if edge.cross:
        moved = (f"{format_bytes(edge.bytes_per_microbatch)}/micro-batch"
                 if edge.bytes_per_microbatch is not None else "crosses stages")
        label = f"{label}\n{moved}" if label else moved
        # minlen=2 leaves a rank between the stages for the next one's title, so stages
        # stack instead of stepping sideways past each other's titles.
        attrs += [f"color={quote(CROSS)}", "penwidth=2.2", f"fontcolor={quote(CROSS)}",
                  "fontsize=9", "minlen=2"]
    if label:
        attrs.append(f"label={quote(label)}")
    return f"{quote(edge.source)} -> {quote(edge.target)} [{', '.join(attrs)}];"


def render(source: str, fmt: str, engine: str = "dot") -> bytes:
    """Run Graphviz on DOT text.

    Args:
        source: DOT text.
        fmt: an output format Graphviz knows (``"svg"``, ``"png"``, ``"pdf"``).
        engine: ``"dot"`` for layered graphs, ``"neato"`` for pinned positions.

    Raises:
        GraphvizNotFound: the program is not installed (the message says how to get it).
        PartitionError: Graphviz failed on the input (its message is included).
    """
    program = shutil.which(engine)
    if program is None:
        raise graphviz_missing(engine, fmt)
    args = [program, f"-T{fmt}"] + (["-n2"] if engine == "neato" else [])
    done = subprocess.run(args, input=source.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise PartitionError(f"Graphviz '{engine} -T{fmt}' failed: "
                             f"{done.stderr.decode(errors='replace').strip()}")
    return done.stdout
