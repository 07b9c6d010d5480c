"""Graphviz: a :class:`~partitioner.viz.graph.Diagram` as DOT text, and DOT rendered to images.

DOT text needs nothing installed. SVG and PNG come from Graphviz's own programs (``dot`` for
graphs, ``neato`` for the timeline, whose boxes are pinned in place); when they are missing,
:func:`render` raises :class:`GraphvizNotFound` saying how to install them.

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
from partitioner.viz.graph import Arrow, Box, Diagram, format_bytes

__all__ = ["to_dot", "render", "GraphvizNotFound", "device_color", "quote", "PALETTE"]

#: Fill colours, one per device (stage ``j`` on device ``j`` of the plan), then repeated.
PALETTE = ("#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#ede9fe", "#cffafe", "#fee2e2",
           "#e0e7ff", "#ecfccb", "#ffedd5")
#: Matching stronger tones, for borders and the timeline's bars.
STRONG = ("#3b82f6", "#22c55e", "#f59e0b", "#ec4899", "#8b5cf6", "#06b6d4", "#ef4444",
          "#6366f1", "#84cc16", "#f97316")
CROSS = "#dc2626"


def device_color(j: int, strong: bool = False) -> str:
    """The colour of device ``j`` (light fill, or the strong tone)."""
    return (STRONG if strong else PALETTE)[j % len(PALETTE)]


def quote(text: str) -> str:
    """A DOT double-quoted string (newlines become line breaks)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(d: Diagram, title: str | None = None) -> str:
    """DOT text for a diagram: one cluster per stage, arrows across stages in red."""
    plan = d.plan
    heading = title or (f"{plan.strategy}: {len(plan.stages)} stages, chunks={plan.chunks}, "
                        f"{d.detail} view")
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
    stage = d.plan.stages[j]
    facts = [f"stage {j} on {stage.device}"]
    if stage.predicted_time is not None:
        facts.append(f"{stage.predicted_time * 1e3:.2f} ms/mb")
    if stage.predicted_memory is not None:
        facts.append(format_bytes(stage.predicted_memory))
    lines = [f"  subgraph cluster_stage{j} {{",
             f"    label={quote(' - '.join(facts))}; style=\"rounded,filled\"; "
             f"fillcolor={quote(device_color(j))}; color={quote(device_color(j, True))}; "
             "fontsize=11; labeljust=l;"]
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


def _node(box: Box) -> str:
    style = {"io": "shape=ellipse, style=filled, fillcolor=\"#f3f4f6\"",
             "minor": "fontsize=8, fontcolor=\"#6b7280\", color=\"#9ca3af\", height=0.2",
             "layer": "penwidth=1.2"}.get(box.kind, "")
    return f"{quote(box.id)} [label={quote(box.label)}{', ' + style if style else ''}];"


def _edge(edge: Arrow) -> str:
    attrs = []
    label = edge.label
    if edge.cross:
        moved = (f"{format_bytes(edge.bytes_per_microbatch)}/micro-batch"
                 if edge.bytes_per_microbatch is not None else "crosses stages")
        label = f"{label}\n{moved}" if label else moved
        attrs += [f"color={quote(CROSS)}", "penwidth=2.2", f"fontcolor={quote(CROSS)}",
                  "fontsize=9"]
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
        raise GraphvizNotFound(
            f"Graphviz's '{engine}' program is not installed, and {fmt.upper()} output needs "
            "it. Install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew "
            "install graphviz; conda: conda install graphviz), or write a .dot file, which "
            "needs nothing, and render it elsewhere")
    args = [program, f"-T{fmt}"] + (["-n2"] if engine == "neato" else [])
    done = subprocess.run(args, input=source.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise PartitionError(f"Graphviz '{engine} -T{fmt}' failed: "
                             f"{done.stderr.decode(errors='replace').strip()}")
    return done.stdout
