"""The plan's step as a timeline: one row per device of the mesh, time across, F/B boxes.

A timeline is any list of ``(action, start, end)``: ``action`` has ``stage``, ``phase``
(``Phase.FORWARD``/``"F"``, ``Phase.BACKWARD``/``"B"``) and ``microbatch``. Three sources
give one:

- a measured run: what the last forward and backward of a partitioned module of any kind
  (pipeline, tensor parallel, replicas) recorded (``partitioner.viz.measured``);
- :func:`predicted_timeline`: the plan's step as ``partitioner.planning.simulate`` plays it
  (:func:`simulated_timeline`), the one predictor the plan's step time comes from, so the
  timeline ends where the plan's header says; a row per device, its gradient all-reduce
  (``R``) and optimizer step (``O``) after its last backward. A plan without cost records
  is laid out in ``partitioner.runtime.schedule``'s clock-tick order instead, each action
  lasting its stage's predicted time (a third forward, two thirds backward) or unit ticks.

Either way :func:`per_device` gives every device of the plan's mesh its row
(``partitioner.viz.mesh``): each replica and each tensor-parallel rank repeats its pipeline
position's bars (the prediction is the same for all of them), named by device.

:func:`timeline_dot` draws it with Graphviz's ``neato`` (boxes pinned at their times): idle
stretches stay grey, so the bubble shows, and the title gives its share.

Example:
    >>> from partitioner.runtime.schedule import Action
    >>> t = Timeline.of([(Action.parse("0F0"), 0.0, 1.0), (Action.parse("1F0"), 1.0, 2.0)])
    >>> t.makespan, t.bubble
    (2.0, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.errors import TimelineError
from partitioner.plans.plan import Plan
from partitioner.runtime.placement import Placement
from partitioner.runtime.schedule import Action, Phase, clock_ticks
from partitioner.runtime.schedule_registry import make_schedule, schedule_kind
from partitioner.viz.dot import device_color, quote
from partitioner.viz.mesh import device_rows, mesh_shape

__all__ = ["Bar", "Timeline", "TimelineError", "predicted_timeline", "simulated_timeline",
           "per_device", "row_name", "COMPUTE_PHASES", "UPDATE_PHASES",
           "timeline_dot", "timeline_heading", "bar_color", "format_span", "nice_step", "darker",
           "bar_tip", "plan_placement"]


COMPUTE_PHASES = "FBIW"
"""Bar phases that are a stage's forward or backward work (what the bubble is measured on)."""
UPDATE_PHASES = {"all-reduce": "R", "optimizer": "O"}
"""Bar phases of what follows a device's last backward, by the simulation's kind."""


@dataclass(frozen=True)
class Bar:
    """One action on the timeline: ``phase`` is ``"F"`` or ``"B"`` (or a simulator's letter:
    ``I``/``W`` halves of a backward, ``R`` gradient all-reduce, ``O`` optimizer step, whose
    ``microbatch`` is -1)."""

    stage: int
    phase: str
    microbatch: int
    start: float
    end: float

    @property
    def label(self) -> str:
        return f"{self.phase}{self.microbatch}" if self.microbatch >= 0 else self.phase


@dataclass(frozen=True)
class Timeline:
    """Bars with their time unit (``"s"`` or ``"tick"``) and where they came from.

    A bar's ``stage`` is its row. ``row_names`` names the rows when they are devices (by
    :func:`per_device`); ``row_colors`` gives each row's colour (its pipeline position's,
    as the graph colours stages).
    """

    bars: tuple[Bar, ...]
    unit: str = "s"
    source: str = "measured"
    row_names: tuple[str, ...] = ()
    row_colors: tuple[int, ...] = ()

    @classmethod
    def of(cls, events: Any, unit: str = "s", source: str = "measured") -> Timeline:
        """Read a timeline from a list of ``(action, start, end)`` (or objects with
        ``action``, ``start`` and ``end``, or a result with a ``timeline`` attribute; a
        simulation's result is read by :func:`simulated_timeline`).

        Raises:
            PartitionError: an entry without stage, phase and micro-batch.
        """
        if isinstance(events, Timeline):
            return events
        if getattr(events, "updates", None) is not None:
            return simulated_timeline(events, source="simulated" if source == "measured"
                                      else source)
        events = getattr(events, "timeline", events)
        bars = []
        for item in events:
            action, start, end = (item if isinstance(item, (tuple, list)) else
                                  (getattr(item, "action", item), item.start, item.end))
            try:
                phase = getattr(action.phase, "value", action.phase)
                bars.append(Bar(int(action.stage), str(phase)[:1].upper(),
                                int(action.microbatch), float(start), float(end)))
            except (AttributeError, TypeError, ValueError) as error:
                raise TimelineError(f"timeline entry {item!r} is not (action, start, end) "
                                     f"with action.stage/.phase/.microbatch: {error}") from error
        if not bars:
            raise TimelineError("the timeline is empty; run a forward and backward first, or "
                                 "draw predicted_timeline(plan)")
        origin = min(b.start for b in bars)
        shifted = tuple(Bar(b.stage, b.phase, b.microbatch, b.start - origin, b.end - origin)
                        for b in sorted(bars, key=lambda b: (b.start, b.stage)))
        return cls(shifted, unit, source)

    @property
    def makespan(self) -> float:
        return max(b.end for b in self.bars)

    @property
    def stages(self) -> list[int]:
        return sorted({b.stage for b in self.bars})

    @property
    def bubble(self) -> float:
        """Idle share of the rows from the first forward to the last backward (what a
        plan's predicted bubble measures; the all-reduces and optimizer steps after it do
        not count)."""
        work = [b for b in self.bars if b.phase in COMPUTE_PHASES] or list(self.bars)
        span = max(b.end for b in work)
        busy = sum(b.end - b.start for b in work)
        return 1 - busy / (len(self.stages) * span) if span else 0.0


def predicted_timeline(plan: Plan) -> Timeline:
    """The plan's step laid out in time, ending at its predicted step time.

    A plan made by the planner carries its chosen candidate's stage costs: its step is
    simulated (``partitioner.planning.simulate.simulate``, the predictor its step time came
    from) and drawn by :func:`simulated_timeline`. Otherwise the order of actions is
    ``partitioner.runtime.schedule.clock_ticks``'s; each then starts as soon as its stage is
    free and its inputs are done (``F(j, i)`` after ``F(j-1, i)``, ``B(j, i)`` after
    ``B(j+1, i)``), lasting a third (forward) or two thirds (backward) of its stage's
    predicted time; without predictions every stage takes unit ticks, F = 1 and B = 2.
    """
    if plan.candidates and "stages" in plan.candidates[0]:
        from partitioner.planning.simulate import simulate

        return per_device(simulated_timeline(simulate(plan), len(plan.devices),
                                             source="predicted", placement=plan_placement(plan)),
                          plan)
    return per_device(_ticked_timeline(plan), plan)


def _ticked_timeline(plan: Plan) -> Timeline:
    """The clock-tick model of :func:`predicted_timeline`: a row per pipeline device
    (virtual stage ``k`` on the device the schedule's placement names)."""
    p, n, m = len(plan.devices), len(plan.stages), plan.chunks
    where = plan_placement(plan)
    schedule = make_schedule(plan.schedule, p, m, plan.virtual_stages)
    order = list(dict.fromkeys(a for tick in clock_ticks(schedule) for a in tick if a))
    costed = all(s.predicted_time for s in plan.stages)
    per_stage = [s.predicted_time if costed and s.predicted_time else 3.0 for s in plan.stages]
    free, finish = [0.0] * p, dict[Action, float]()
    events = []
    for a in order:
        forward = a.phase is Phase.FORWARD
        needs = ([Action(a.stage - 1, a.phase, a.microbatch)] if forward and a.stage else
                 [Action(a.stage + 1, a.phase, a.microbatch)] if not forward
                 and a.stage + 1 < n else [])
        start = max([free[where[a.stage]], *(finish.get(d, 0.0) for d in needs)])
        finish[a] = free[where[a.stage]] = start + per_stage[a.stage] * (1 if forward else 2) / 3
        events.append((Action(where[a.stage], a.phase, a.microbatch), start, finish[a]))
    return Timeline.of(events, "s" if costed else "tick", "predicted")


def per_device(t: Timeline, plan: Plan) -> Timeline:
    """``t`` (a row per pipeline position ``j``) with a row per device of ``plan``'s mesh:
    each device repeats its position's bars, and rows are named by device
    (``partitioner.viz.mesh.device_rows``). A timeline whose rows are devices already (as
    many as the mesh has, e.g. a measured run of replicas) is only named."""
    rows = device_rows(plan)
    names = tuple(r.name for r in rows)
    colors = tuple(r.stage for r in rows)
    dp, pp, tp = mesh_shape(plan)
    if dp * tp == 1 or max(t.stages) >= pp:
        return Timeline(t.bars, t.unit, t.source, names, colors)
    bars = [Bar(r.index, b.phase, b.microbatch, b.start, b.end)
            for b in t.bars for r in rows if r.stage == b.stage]
    return Timeline(tuple(sorted(bars, key=lambda b: (b.start, b.stage))), t.unit, t.source,
                    names, colors)


def row_name(t: Timeline, j: int, plan: Plan | None = None) -> str:
    """The label of row ``j``: its device (:func:`per_device`), else ``"stage j - cpu"``."""
    if j < len(t.row_names):
        return t.row_names[j]
    device = plan.devices[j] if plan is not None and j < len(plan.devices) else None
    return f"stage {j}" + (f" - {device}" if device else "")


def plan_placement(plan: Plan) -> Placement:
    """Per virtual stage of ``plan``, its pipeline device: the schedule's placement."""
    return schedule_kind(plan.schedule).place(len(plan.devices), plan.virtual_stages)


def simulated_timeline(result: Any, devices: int | None = None, source: str = "simulated",
                       placement: Sequence[int] | None = None) -> Timeline:
    """A simulated step (``partitioner.planning.simulate.SimulationResult``) as a timeline:
    a row per pipeline device (``devices``, by default one per entry of
    ``result.peak_memory``; virtual stage ``k`` on row ``placement[k]``, by default
    ``k % devices``: :func:`plan_placement` gives a plan's), then each device's
    gradient all-reduce (the part after its last backward) and optimizer step, so the
    timeline ends at ``result.step_time``.

    Example:
        >>> from types import SimpleNamespace
        >>> from partitioner.runtime.schedule import Action
        >>> done = SimpleNamespace(peak_memory=[0.0],
        ...     timeline=[(Action.parse("0F0"), 0.0, 1.0), (Action.parse("0B0"), 1.0, 3.0)],
        ...     updates=[(0, "all-reduce", 2.0, 3.5), (0, "optimizer", 3.5, 4.0)])
        >>> [b.label for b in simulated_timeline(done).bars]
        ['F0', 'B0', 'R', 'O']
    """
    devices = devices or len(result.peak_memory)
    bars, last = [], [0.0] * devices
    for action, start, end in result.timeline:
        j = placement[action.stage] if placement is not None else action.stage % devices
        bars.append(Bar(j, getattr(action.phase, "value", str(action.phase)), action.microbatch,
                        start, end))
        last[j] = max(last[j], end)
    for j, kind, start, end in result.updates:
        start = max(start, last[j]) if kind == "all-reduce" else start
        if end > start or kind == "optimizer":
            bars.append(Bar(j, UPDATE_PHASES[kind], -1, start, end))
    if not bars:
        raise TimelineError("the simulation ran no actions")
    return Timeline(tuple(sorted(bars, key=lambda b: (b.start, b.stage))), "s", source)


def timeline_dot(timeline: Any, plan: Plan | None = None, title: str | None = None,
                 width: float = 760.0) -> str:
    """DOT text (for ``neato -n2``) drawing the timeline: rows per stage, boxes per action.

    Args:
        timeline: a :class:`Timeline` or anything :meth:`Timeline.of` reads.
        plan: names each row's device when given.
        title: the heading; by default the source, schedule and bubble share.
        width: points of drawing for the whole makespan.
    """
    t = Timeline.of(timeline)
    scale = width / t.makespan
    rows = t.stages
    row_y = {j: 40 + 34 * (len(rows) - 1 - k) for k, j in enumerate(rows)}
    heading = title or timeline_heading(t)
    lines = ["digraph timeline {",
             f"  graph [label={quote(heading)}, labelloc=t, fontname=Helvetica, fontsize=13, "
             "pad=0.25, splines=false, bgcolor=white];",
             "  node [shape=box, style=filled, fixedsize=true, fontname=Helvetica, fontsize=9, "
             "penwidth=0.6, margin=0, label=\"\"];"]
    for j in rows:
        name = row_name(t, j, plan)
        # Right-aligned against the bars: the label's box ends 8 points left of time 0.
        room = 5.6 * len(name) + 8
        lines.append(f"  row{j} [pos=\"{-room / 2 - 8:.1f},{row_y[j]}!\", label={quote(name)}, "
                     f"shape=plaintext, style=\"\", width={room / 72:.3f}, height=0.3, "
                     "fontsize=10];")
        lines.append(f"  idle{j} [pos=\"{width / 2:.1f},{row_y[j]}!\", width={width / 72:.3f}, "
                     "height=0.36, fillcolor=\"#e5e7eb\", color=\"#d1d5db\"];")
    for k, b in enumerate(t.bars):
        x0, x1 = b.start * scale, b.end * scale
        inches = max((x1 - x0) / 72, 0.01)
        fill = bar_color(b, t)
        text = b.label if x1 - x0 >= 16 else ""
        tip = bar_tip(b, t.unit)
        lines.append(f"  bar{k} [pos=\"{(x0 + x1) / 2:.2f},{row_y[b.stage]}!\", "
                     f"width={inches:.4f}, height=0.36, fillcolor={quote(fill)}, "
                     f"color=white, fontcolor=white, label={quote(text)}, "
                     f"tooltip={quote(tip)}];")
    lines += _axis(t, scale, width)
    lines.append("}")
    return "\n".join(lines) + "\n"


def timeline_heading(t: Timeline) -> str:
    """``"measured timeline: 3 stages, 4 micro-batches, 12.1 ms; bubble (grey) 38%"``
    (``"4 devices"`` when the rows are devices)."""
    rows = f"{len(t.stages)} {'devices' if t.row_names else 'stages'}"
    return (f"{t.source} timeline: {rows}, "
            f"{len({b.microbatch for b in t.bars if b.microbatch >= 0})} micro-batches, "
            f"{format_span(t.makespan, t.unit)}; bubble (grey) {t.bubble:.0%}")


def bar_color(bar: Bar, t: Timeline | None = None) -> str:
    """A bar's fill: its row's colour (``t.row_colors``, else its stage's), darker for
    anything but a forward."""
    colors = t.row_colors if t is not None else ()
    fill = device_color(colors[bar.stage] if bar.stage < len(colors) else bar.stage,
                        strong=True)
    return fill if bar.phase == "F" else darker(fill)


def bar_tip(bar: Bar, unit: str) -> str:
    """``"1F0: 2 ms .. 3 ms"``: a bar's tooltip, its action and when it ran."""
    return f"{bar.stage}{bar.label}: {format_span(bar.start, unit)} .. {format_span(bar.end, unit)}"


def _axis(t: Timeline, scale: float, width: float) -> list[str]:
    step = nice_step(t.makespan)
    lines = ["  axis0 [pos=\"0,14!\", shape=point, width=0.01, style=invis];",
             f"  axis1 [pos=\"{width:.1f},14!\", shape=point, width=0.01, style=invis];",
             "  axis0 -> axis1 [arrowhead=none, color=\"#6b7280\"];"]
    k, value = 0, 0.0
    while value <= t.makespan * 1.0001:
        lines.append(f"  tick{k} [pos=\"{value * scale:.1f},4!\", shape=plaintext, style=\"\", "
                     f"width=0.8, height=0.2, fontsize=8, "
                     f"label={quote(format_span(value, t.unit))}];")
        k, value = k + 1, (k + 1) * step
    return lines


def nice_step(span: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving about 8 ticks over ``span``."""
    raw = span / 8
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(f * power for f in (1, 2, 5, 10) if f * power >= raw)


def format_span(value: float, unit: str) -> str:
    """``"1.5 ms"``, ``"3 ticks"``: a time (seconds, or clock ticks) for people."""
    if value == 0:
        return "0"
    if unit == "tick":
        return f"{value:g} ticks" if value != 1 else "1 tick"
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def darker(color: str) -> str:
    """``color`` (``#rrggbb``) at 62% brightness."""
    r, g, b = (int(color[k:k + 2], 16) for k in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(int(c * 0.62) for c in (r, g, b)))

