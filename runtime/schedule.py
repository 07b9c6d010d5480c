"""Pipeline schedules as data: which stage runs which forward or backward, in what order.

Index letters used throughout: ``i`` micro-batch, ``j`` stage, ``k`` clock tick; ``P`` is
the number of stages, ``m`` the number of micro-batches and ``v`` the virtual stages each
stage holds (model chunks of an interleaved schedule; 1 otherwise).

A schedule is a tuple with one entry per stage ``j``: the ordered :class:`Action` s that
stage runs (``partitioner.runtime.action``, re-exported here). An action prints as
``"1F0"`` (stage 1, forward, micro-batch 0); its ``stage`` is the virtual stage it runs,
stage ``j`` holding virtual stages ``j, j + P, ..., j + (v - 1) P`` (Megatron-LM's
placement; with ``v = 1`` the two are one). Schedules are built by pure functions
(``partitioner.runtime.schedule_generators``), found by name in one registry
(``partitioner.runtime.schedule_registry``), checked by :func:`validate` and only *run* by
an executor, so the ordering rules live here and tests check a schedule without a model.

Example:
    >>> from partitioner.runtime.schedule_generators import gpipe
    >>> print(render(gpipe(2, 2), backward_time=1.0))
    0F0 0F1   .   . 0B1 0B0
      . 1F0 1F1 1B1 1B0   .
"""

from __future__ import annotations

import math
from collections import Counter

from partitioner.errors import ScheduleError
from partitioner.runtime.action import Action, Phase, Schedule
from partitioner.runtime.placement import Placement, looped, placement_of, placement_problems

__all__ = [
    "Action",
    "Phase",
    "Schedule",
    "bubble_fraction",
    "check_counts",
    "clock_ticks",
    "held_by_stage",
    "count_problems",
    "in_flight",
    "pipeline_depth",
    "render",
    "validate",
]


def _count_problem(name: str, value: object, fix: str) -> list[str]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return []
    return [f"{name} must be an int >= 1, got {value!r} ({type(value).__name__}); {fix}"]


def count_problems(n_stages: object, n_microbatches: object, virtual: object = 1) -> list[str]:
    """What is wrong with the counts a schedule is built or checked for; empty if nothing.

    Example:
        >>> count_problems(4, 8, virtual=2)
        []
        >>> count_problems(4, 0)[0]
        'n_microbatches must be an int >= 1, got 0 (int); pass the number of micro-batches, e.g. 8'
    """
    return [
        *_count_problem("n_stages", n_stages, "pass the number of pipeline stages, e.g. 4"),
        *_count_problem(
            "n_microbatches", n_microbatches, "pass the number of micro-batches, e.g. 8"
        ),
        *_count_problem("virtual", virtual, "pass the virtual stages per stage, e.g. 2"),
    ]


def pipeline_depth(n_stages: int, virtual: object, holder: str = "device") -> int:
    """``P``, the pipeline's depth, from its ``n_stages = P v`` virtual stages.

    Raises:
        ScheduleError: If ``virtual`` is not an int >= 1 dividing ``n_stages``, naming it
            and the fix (``holder``: what holds ``v`` stages, in the message).

    Example:
        >>> pipeline_depth(8, 2)
        4
    """
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"virtual={virtual!r}; pass the virtual stages per {holder}, an "
                            "int >= 1")
    if n_stages % virtual:
        raise ScheduleError(f"{n_stages} stages do not split into {virtual} virtual stages "
                            f"per {holder}; pass a multiple of {virtual} stages")
    return n_stages // virtual


def check_counts(n_stages: object, n_microbatches: object, virtual: object = 1) -> None:
    """Raises if a count is not an int >= 1.

    Raises:
        ScheduleError: Naming every bad count, its value and a fix.
    """
    problems = count_problems(n_stages, n_microbatches, virtual)
    if problems:
        raise ScheduleError("; ".join(problems))


def validate(
    schedule: Schedule, n_stages: int, n_microbatches: int, virtual: int = 1,
    placement: Placement | None = None,
) -> None:
    """Checks that a schedule runs every action once, in a legal order, without deadlock.

    Every problem found is collected and reported in one error: a wrong number of stage
    lists; an entry that is not an :class:`Action`, or sits in another stage's list; a
    micro-batch index out of range; a forward or backward missing or repeated; a backward
    before its forward; a virtual stage's forwards out of micro-batch order. The deadlock
    check runs each stage's list in order, one action at a time, where ``F(k, i)`` (virtual
    stage ``k``) needs ``F(k-1, i)``, ``B(k, i)`` and ``I(k, i)`` need ``F(k, i)`` and the
    input gradients of stage ``k+1`` (its ``B`` or ``I``), and ``W(k, i)`` needs ``I(k, i)``.
    Each micro-batch runs ``F`` then either ``B`` or ``I`` then ``W`` on each virtual stage.
    It runs only when the other checks pass: a missing or misplaced action, or a backward
    before its forward, would show up again as a stuck stage.

    Args:
        schedule: Per stage, the ordered actions it runs.
        n_stages: Number of stages ``P`` (lists) the schedule must cover.
        n_microbatches: Number of micro-batches ``m`` the schedule must cover.
        virtual: Virtual stages ``v`` per stage; the actions name virtual stages
            ``0 .. P v - 1``.
        placement: Which device's list each virtual stage's actions belong in
            (``partitioner.runtime.placement``); default :func:`looped`, ``k`` on ``k % P``.

    Raises:
        ScheduleError: Listing every problem, if there is any.

    Example:
        >>> from partitioner.runtime.schedule_generators import gpipe
        >>> validate(gpipe(2, 3), 2, 3)
        >>> broken = (tuple(map(Action.parse, ["0F0", "0B0"])), (Action.parse("1F0"),))
        >>> try:
        ...     validate(broken, 2, 1)
        ... except ScheduleError as error:
        ...     print(error)
        schedule for 2 stages and 1 micro-batch has 1 problem:
          - stage 1 never runs 1B0; every stage runs each micro-batch's F and B once
    """
    check_counts(n_stages, n_microbatches, virtual)
    where = looped(n_stages, virtual) if placement is None else tuple(placement)
    bad_map = placement_problems(where, n_stages, virtual)
    if bad_map:
        raise ScheduleError("; ".join(bad_map))
    problems = _placement_problems(schedule, where, n_microbatches, virtual)
    own = _own_actions(schedule, where, n_microbatches)
    problems += _count_problems(own, where, n_microbatches, virtual)
    problems += _order_problems(own)
    if not problems:
        problems = _deadlock_problems(schedule, n_stages * virtual)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        each = f" of {virtual} virtual stages each" if virtual > 1 else ""
        raise ScheduleError(
            f"schedule for {_plural(n_stages, 'stage')}{each} and "
            f"{_plural(n_microbatches, 'micro-batch')} has "
            f"{_plural(len(problems), 'problem')}:\n{listed}"
        )


def _plural(n: int, noun: str) -> str:
    suffix = "" if n == 1 else "es" if noun.endswith("ch") else "s"
    return f"{n} {noun}{suffix}"


def _placement_problems(
    schedule: Schedule, where: Placement, n_microbatches: int, virtual: int
) -> list[str]:
    problems = []
    n_stages = len(where) // virtual
    if len(schedule) != n_stages:
        problems.append(
            f"schedule has {len(schedule)} stage lists but n_stages={n_stages}; "
            "give one list of actions per stage"
        )
    total = n_stages * virtual
    counts = f"n_stages={n_stages}" + (f" and virtual={virtual}" if virtual > 1 else "")
    for j, actions in enumerate(schedule):
        for action in actions:
            if not isinstance(action, Action):
                problems.append(
                    f"stage {j} list holds {action!r}, not an Action; "
                    "build it with Action(...) or Action.parse('1F0')"
                )
            elif action.stage >= total:
                problems.append(
                    f"stage {j} list holds {action}, but {counts}; use stages 0..{total - 1}"
                )
            elif where[action.stage] != j:
                problems.append(
                    f"stage {j} list holds {action}; "
                    f"move it to stage {where[action.stage]}'s list"
                )
            elif action.microbatch >= n_microbatches:
                problems.append(
                    f"{action} names micro-batch {action.microbatch} but "
                    f"n_microbatches={n_microbatches}; use micro-batches 0..{n_microbatches - 1}"
                )
    return problems


def _own_actions(
    schedule: Schedule, where: Placement, n_microbatches: int
) -> list[list[Action]]:
    # Misplaced entries are reported once, by _placement_problems, and skipped here.
    return [
        [
            a
            for a in actions
            if isinstance(a, Action)
            and a.stage < len(where)
            and where[a.stage] == j
            and a.microbatch < n_microbatches
        ]
        for j, actions in enumerate(schedule[:max(where, default=-1) + 1])
    ]


def _count_problems(
    own: list[list[Action]], where: Placement, n_microbatches: int, virtual: int
) -> list[str]:
    problems = []
    each = " per virtual stage" if virtual > 1 else ""
    for j, actions in enumerate(own):
        counts = Counter(actions)
        missing = []
        for k in (k for k, at in enumerate(where) if at == j):
            for i in range(n_microbatches):
                def has(phase: Phase, k: int = k, i: int = i,
                        counts: Counter[Action] = counts) -> bool:
                    return counts[Action(k, phase, i)] > 0
                if not has(Phase.FORWARD):
                    missing.append(f"{k}F{i}")
                split = has(Phase.INPUT) or has(Phase.WEIGHT)
                if has(Phase.BACKWARD) and split:
                    problems.append(
                        f"stage {j} runs both {k}B{i} and its halves "
                        f"{k}I{i}/{k}W{i}; run either B or I then W"
                    )
                elif split:
                    missing += [f"{k}{p.value}{i}" for p in (Phase.INPUT, Phase.WEIGHT)
                                if not has(p)]
                elif not has(Phase.BACKWARD):
                    missing.append(f"{k}B{i}")
        if missing:
            halves = " (or I then W)" if any(a.phase is Phase.INPUT for a in actions) else ""
            problems.append(
                f"stage {j} never runs {', '.join(missing)}; "
                f"every stage runs each micro-batch's F and B{halves} once{each}"
            )
        problems += [
            f"stage {j} runs {a} {n} times; run it once"
            for a, n in sorted(counts.items())
            if n > 1
        ]
    return problems


def _order_problems(own: list[list[Action]]) -> list[str]:
    problems = []
    for j, actions in enumerate(own):
        first_forward: dict[tuple[int, int], int] = {}
        for k, a in enumerate(actions):
            if a.phase is Phase.FORWARD:
                first_forward.setdefault((a.stage, a.microbatch), k)
        first_input: dict[tuple[int, int], int] = {}
        for k, a in enumerate(actions):
            if a.phase is Phase.INPUT:
                first_input.setdefault((a.stage, a.microbatch), k)
        problems += [
            f"stage {j} runs {a} before {a.stage}F{a.microbatch}; "
            "a backward needs its forward's activations, so move it after"
            for k, a in enumerate(actions)
            if a.phase in (Phase.BACKWARD, Phase.INPUT)
            and first_forward.get((a.stage, a.microbatch), -1) > k
        ]
        problems += [
            f"stage {j} runs {a} before {a.stage}I{a.microbatch}; "
            "a weight gradient needs the gradients its input-gradient half computed, "
            "so move it after"
            for k, a in enumerate(actions)
            if a.phase is Phase.WEIGHT and first_input.get((a.stage, a.microbatch), -1) > k
        ]
        for stage in sorted({a.stage for a in actions}):
            order = [a.microbatch for a in actions if a.phase is Phase.FORWARD and a.stage == stage]
            whose = "" if stage == j else f" of virtual stage {stage}"
            if order != sorted(order):
                problems.append(
                    f"stage {j} runs forwards{whose} in micro-batch order {order}; "
                    f"run them as {sorted(order)}, since micro-batches flow through in order"
                )
    return problems


# What an action waits for, and what it makes available, as (virtual stage, micro-batch,
# event): "F" its forward ran, "G" the gradients of its inputs exist (B or I ran).
_Event = tuple[int, int, str]


def _needs(action: Action, n_total: int) -> tuple[_Event, ...]:
    k, i = action.stage, action.microbatch
    if action.phase is Phase.FORWARD:
        return ((k - 1, i, "F"),) if k > 0 else ()
    if action.phase is Phase.WEIGHT:
        return ((k, i, "G"),)
    after = ((k + 1, i, "G"),) if k + 1 < n_total else ()
    return ((k, i, "F"), *after)


def _gives(action: Action) -> tuple[_Event, ...]:
    k, i = action.stage, action.microbatch
    if action.phase is Phase.FORWARD:
        return ((k, i, "F"),)
    return ((k, i, "G"),) if action.phase.gives_input_grad else ()


def _event_text(event: _Event, split: bool) -> str:
    k, i, what = event
    if what == "F":
        return f"{k}F{i}"
    return f"{k}B{i} (or {k}I{i})" if split else f"{k}B{i}"


def _execute(schedule: Schedule, n_total: int) -> tuple[list[Action], list[int]]:
    """Runs each stage's list in order; returns the actions in a feasible order and,
    per stage, how many of its actions ran (fewer than its list means it is stuck)."""
    done, order = set[_Event](), list[Action]()
    ran = [0] * len(schedule)
    progressed = True
    while progressed:
        progressed = False
        for j, actions in enumerate(schedule):
            while ran[j] < len(actions) and done.issuperset(_needs(actions[ran[j]], n_total)):
                done.update(_gives(actions[ran[j]]))
                order.append(actions[ran[j]])
                ran[j] += 1
                progressed = True
    return order, ran


def _deadlock_problems(schedule: Schedule, n_total: int) -> list[str]:
    order, ran = _execute(schedule, n_total)
    done = {event for a in order for event in _gives(a)}
    split = any(a.phase is Phase.INPUT for actions in schedule for a in actions)
    waits = [
        f"stage {j} waits on {a} which needs "
        + ", ".join(_event_text(d, split) for d in _needs(a, n_total) if d not in done)
        for j, actions in enumerate(schedule)
        if ran[j] < len(actions)
        for a in [actions[ran[j]]]
    ]
    if not waits:
        return []
    return [f"deadlock: {'; '.join(waits)}; reorder so each action's inputs run before it"]


def _ticks_per_phase(forward_time: float, backward_time: float, split: bool = False
                     ) -> dict[Phase, int]:
    if not (forward_time > 0 and backward_time > 0):
        raise ScheduleError(
            f"forward_time and backward_time must be > 0, got {forward_time!r} and "
            f"{backward_time!r}; pass positive durations"
        )
    ratio = backward_time / forward_time
    if not math.isclose(ratio, round(ratio), rel_tol=1e-9):
        raise ScheduleError(
            f"backward_time / forward_time is {ratio:g} ({backward_time!r} / {forward_time!r}) "
            "but clock ticks need a whole number >= 1; pick times whose ratio is 1, 2, 3, ..."
        )
    b = round(ratio)
    if split and b % 2:
        raise ScheduleError(
            f"backward_time / forward_time is {b} but this schedule splits backwards into "
            "input- and weight-gradient halves of equal length; pick an even ratio (2, 4, ...)"
        )
    return {Phase.FORWARD: 1, Phase.BACKWARD: b, Phase.INPUT: b // 2, Phase.WEIGHT: b // 2}


def clock_ticks(
    schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0
) -> list[list[Action | None]]:
    """Simulates a schedule in unit clock ticks, each action starting as soon as it can.

    A forward takes one tick, a backward ``backward_time / forward_time`` ticks (a whole
    number), and each half of a split backward (``I``, ``W``) half of that. Transfers
    between stages are free. The schedule is validated first, with ``P`` its number of
    lists, ``m`` one more than its largest micro-batch index and ``v`` enough virtual
    stages per stage to hold its largest stage index.

    Args:
        schedule: Per stage, the ordered actions it runs.
        forward_time: Duration of one forward, in any unit.
        backward_time: Duration of one backward, in the same unit.

    Returns:
        Per tick ``k``, per stage ``j``, the action running then or ``None`` (a bubble).
        An action lasting several ticks appears in each of them.

    Raises:
        ScheduleError: If the schedule is invalid or the time ratio is not a whole number.

    Example:
        >>> from partitioner.runtime.schedule_generators import gpipe
        >>> [[str(a) if a else "." for a in tick] for tick in clock_ticks(gpipe(2, 1))]
        [['0F0', '.'], ['.', '1F0'], ['.', '1B0'], ['.', '1B0'], ['0B0', '.'], ['0B0', '.']]
    """
    n_stages = len(schedule)
    actions = [a for stage in schedule for a in stage if isinstance(a, Action)]
    split = any(a.phase in (Phase.INPUT, Phase.WEIGHT) for a in actions)
    ticks = _ticks_per_phase(forward_time, backward_time, split)
    n_microbatches = 1 + max((a.microbatch for a in actions), default=-1)
    highest = 1 + max((a.stage for a in actions), default=0)
    virtual = max(1, -(-highest // n_stages)) if n_stages else 1
    where = _read_placement(schedule, n_stages, virtual)
    validate(schedule, n_stages, n_microbatches, virtual, where)
    free, start, finish = [0] * n_stages, dict[Action, int](), dict[Action, int]()
    ready: dict[_Event, int] = {}
    for a in _execute(schedule, n_stages * virtual)[0]:
        j = where[a.stage]
        start[a] = max([free[j], *(ready[d] for d in _needs(a, n_stages * virtual))])
        finish[a] = free[j] = start[a] + ticks[a.phase]
        ready.update((event, finish[a]) for event in _gives(a))
    grid: list[list[Action | None]] = [[None] * n_stages for _ in range(max(finish.values()))]
    for a, k0 in start.items():
        for k in range(k0, finish[a]):
            grid[k][where[a.stage]] = a
    return grid


def _read_placement(schedule: Schedule, n_stages: int, virtual: int) -> Placement:
    """The placement the lists spell out, or (for lists that spell none, which
    :func:`validate` then explains) the looped one."""
    try:
        where = placement_of(schedule)
    except ScheduleError:
        return looped(n_stages, virtual)
    return where if len(where) == n_stages * virtual else looped(n_stages, virtual)


def in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the peak number of micro-batches whose forward ran but backward has not
    (for a split backward: whose ``W`` has not).

    This is how many micro-batches' activations the stage must hold at once: ``m`` on
    every stage for GPipe, ``min(P - j, m)`` for 1F1B. With virtual stages a micro-batch
    counts once per virtual stage it is in flight on.

    Args:
        schedule: Per stage, the ordered actions it runs.

    Returns:
        The peak per stage.

    Example:
        >>> from partitioner.runtime.schedule_generators import gpipe, one_f_one_b
        >>> in_flight(gpipe(3, 4)), in_flight(one_f_one_b(3, 4))
        ((4, 4, 4), (3, 2, 1))
    """
    peaks = []
    for actions in schedule:
        live = peak = 0
        for a in actions:
            live += 1 if a.phase is Phase.FORWARD else -1 if a.phase.frees else 0
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def held_by_stage(schedule: Schedule, placement: Placement) -> tuple[tuple[tuple[int, ...],
                                                                          ...], ...]:
    """Per device, the micro-batches in flight on each of its virtual stages at the moments
    that can be its activation peak.

    :func:`in_flight` counts a device's micro-batches as if every virtual stage held as many
    activations; where the stages differ (an interleaved device whose last chunk holds the
    head and its logits), the peak is the largest ``sum_k count_k * bytes_k`` over the
    moments after a forward. This gives those moments' counts, one entry per virtual stage
    of the device in stage order (``stages_on``), keeping only counts no other moment's
    exceed in every entry.

    Args:
        schedule: Per device, the ordered actions it runs.
        placement: Per virtual stage, the device that runs it.

    Example:
        >>> from partitioner.runtime.placement import looped
        >>> from partitioner.runtime.schedule_generators import interleaved
        >>> held_by_stage(interleaved(2, 2, 2), looped(2, 2))
        (((2, 2),), ((2, 1),))
        >>> held_by_stage(interleaved(2, 4, 2), looped(2, 2))[1]  # either can be the peak
        ((2, 1), (3, 0))
    """
    found = []
    for j, actions in enumerate(schedule):
        mine = [k for k, device in enumerate(placement) if device == j]
        where = {k: n for n, k in enumerate(mine)}
        live = [0] * len(mine)
        moments: set[tuple[int, ...]] = set()
        for a in actions:
            if a.phase is Phase.FORWARD:
                live[where[a.stage]] += 1
                moments.add(tuple(live))
            elif a.phase.frees:
                live[where[a.stage]] -= 1
        # Largest first: whatever exceeds a moment in every entry has a larger sum, so it
        # (or one exceeding it) is kept before the moment is looked at.
        kept: list[tuple[int, ...]] = []
        for c in sorted(moments, key=sum, reverse=True):
            if not any(all(x >= y for x, y in zip(o, c)) for o in kept):
                kept.append(c)
        found.append(tuple(sorted(kept)))
    return tuple(found)


def bubble_fraction(
    schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0
) -> float:
    """The share of stage-ticks left idle, ``idle / (P * makespan)``, per :func:`clock_ticks`.

    For equal stages both GPipe and 1F1B give ``(P-1)/(m+P-1)``,
    whatever the backward's length: fill and drain each cost ``P-1`` forwards and
    backwards.

    Args:
        schedule: Per stage, the ordered actions it runs.
        forward_time: Duration of one forward.
        backward_time: Duration of one backward, a whole multiple of ``forward_time``.

    Returns:
        The idle fraction, from 0 (no bubble) towards 1.

    Raises:
        ScheduleError: As :func:`clock_ticks` does.

    Example:
        >>> from partitioner.runtime.schedule_generators import gpipe
        >>> bubble_fraction(gpipe(4, 8))
        0.2727272727272727
    """
    grid = clock_ticks(schedule, forward_time, backward_time)
    idle = sum(a is None for tick in grid for a in tick)
    return idle / (len(schedule) * len(grid))


def render(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0) -> str:
    """Draws a schedule as ASCII: one row per stage, one column per clock tick.

    Args:
        schedule: Per stage, the ordered actions it runs.
        forward_time: Duration of one forward.
        backward_time: Duration of one backward, a whole multiple of ``forward_time``.

    Returns:
        Rows joined by newlines; a label repeated across ticks is one action lasting that
        long, and ``.`` marks a bubble.

    Raises:
        ScheduleError: As :func:`clock_ticks` does.

    Example:
        >>> from partitioner.runtime.schedule_generators import one_f_one_b
        >>> print(render(one_f_one_b(2, 2), backward_time=1.0))
        0F0 0F1   . 0B0   . 0B1
          . 1F0 1B0 1F1 1B1   .
    """
    grid = clock_ticks(schedule, forward_time, backward_time)
    width = max(len(str(a)) for actions in schedule for a in actions)
    return "\n".join(
        " ".join(str(tick[j] or ".").rjust(width) for tick in grid)
        for j in range(len(schedule))
    )
