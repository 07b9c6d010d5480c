"""Memory per device as bars: what each device of the plan's mesh is predicted to hold.

A device holds the stages on its pipeline position (with the interleaved schedule, several
virtual stages); every replica and tensor-parallel rank of that position holds the same
(a stage's predicted memory is per device). :func:`device_memory` sums it per device and
:func:`memory_svg` draws one horizontal bar per device, longest = the fullest device,
labelled with the bytes, for the HTML report to show beside the plan table.

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> plan = Plan("balance", ("cpu", "cpu"), (Stage(0, "cpu", ("a",), predicted_memory=2000),
    ...                                          Stage(1, "cpu", ("b",), predicted_memory=1000)))
    >>> device_memory(plan)
    [('device 0: cpu (stage 0)', 2000), ('device 1: cpu (stage 1)', 1000)]
    >>> memory_svg(plan).count('class="memory-bar"')
    2
"""

from __future__ import annotations

from html import escape

from partitioner.plans.plan import Plan
from partitioner.viz.dot import device_color
from partitioner.viz.graph import format_bytes
from partitioner.viz.layout import text_width
from partitioner.viz.mesh import device_rows, mesh_shape

__all__ = ["device_memory", "memory_svg"]


def device_memory(plan: Plan) -> list[tuple[str, int | None]]:
    """Per device of the mesh, its name and predicted bytes (``None`` if not costed)."""
    pp = mesh_shape(plan)[1]
    out: list[tuple[str, int | None]] = []
    for row in device_rows(plan):
        held = [s.predicted_memory for k, s in enumerate(plan.stages) if k % pp == row.stage]
        out.append((row.name, None if None in held else sum(m for m in held if m)))
    return out


def memory_svg(plan: Plan, width: float = 220.0) -> str:
    """An SVG bar chart of :func:`device_memory` (a bar per device, its stage's colour)."""
    rows = device_memory(plan)
    left = max(text_width(name, 10) for name, _ in rows) + 12
    most = max((m or 0 for _, m in rows), default=0) or 1
    height = 28 + 20 * len(rows)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 70:.0f}" '
             f'height="{height}" font-family="Helvetica, Arial, sans-serif">',
             '<text x="4" y="14" font-size="11">predicted memory per device</text>']
    pp = mesh_shape(plan)[1]
    for k, (name, held) in enumerate(rows):
        y = 24 + 20 * k
        length = width * (held or 0) / most
        parts.append(f'<g class="memory-bar"><title>{escape(name)}</title>'
                     f'<text x="{left - 6:.1f}" y="{y + 11}" font-size="10" '
                     f'text-anchor="end">{escape(name)}</text>'
                     f'<rect x="{left:.1f}" y="{y}" width="{max(length, 0.5):.1f}" height="14" '
                     f'fill="{device_color(device_rows(plan)[k].stage % pp, True)}"/>'
                     f'<text x="{left + length + 4:.1f}" y="{y + 11}" font-size="10">'
                     f'{"-" if held is None else format_bytes(held)}</text></g>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
