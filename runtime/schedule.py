"""Pipeline schedules as data: which stage runs which forward or backward, in what order.

Index letters used throughout: ``i`` micro-batch, ``j`` stage, ``k`` clock tick; ``P`` is
the number of stages and ``m`` the number of micro-batches.

A schedule is a tuple with one entry per stage ``j``: the ordered :class:`Action` s that
stage runs. An action prints as ``"1F0"`` (stage 1, forward, micro-batch 0). Schedules are
built by pure functions (:func:`gpipe`, :func:`one_f_one_b`), checked by :func:`validate` and
only *run* by the executor, so the ordering rules live here and tests can check a schedule
without a model.

Both schedules below have the same bubble, ``(P-1)/(m+P-1)`` for equal stages. They differ
in memory: GPipe keeps the activations of all ``m`` micro-batches alive until the drain,
while 1F1B starts each backward as soon as it can, so stage ``j`` holds at most ``P - j``.
Charts are :func:`render` output for ``P=3, m=4`` with a backward twice as long as a
forward (a label repeated across ticks is one action; ``.`` is a bubble)::

    gpipe(3, 4): all forwards, then all backwards, last micro-batch first
    0F0 0F1 0F2 0F3   .   .   .   .   .   . 0B3 0B3 0B2 0B2 0B1 0B1 0B0 0B0
      . 1F0 1F1 1F2 1F3   .   .   . 1B3 1B3 1B2 1B2 1B1 1B1 1B0 1B0   .   .
      .   . 2F0 2F1 2F2 2F3 2B3 2B3 2B2 2B2 2B1 2B1 2B0 2B0   .   .   .   .

    one_f_one_b(3, 4): P-j-1 warm-up forwards, then one forward, one backward
    0F0 0F1 0F2   .   .   .   . 0B0 0B0 0F3 0B1 0B1   . 0B2 0B2   . 0B3 0B3
      . 1F0 1F1   .   . 1B0 1B0 1F2 1B1 1B1 1F3 1B2 1B2   . 1B3 1B3   .   .
      .   . 2F0 2B0 2B0 2F1 2B1 2B1 2F2 2B2 2B2 2F3 2B3 2B3   .   .   .   .

Example:
    >>> print(render(gpipe(2, 2), backward_time=1.0))
    0F0 0F1   .   . 0B1 0B0
      . 1F0 1F1 1B1 1B0   .
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from partitioner.errors import ScheduleError

__all__ = [
    "SCHEDULES",
    "Action",
    "Phase",
    "Schedule",
    "bubble_fraction",
    "clock_ticks",
    "gpipe",
    "in_flight",
    "make_schedule",
    "one_f_one_b",
    "render",
    "split_phases",
    "validate",
]


class Phase(str, Enum):
    """Whether an action runs a stage's forward or its backward."""

    FORWARD = "F"
    BACKWARD = "B"


_ACTION_TEXT = re.compile(r"(\d+)([FB])(\d+)")


@dataclass(frozen=True, order=True)
class Action:
    """One stage running one phase of one micro-batch.

    Args:
        stage: Index ``j`` of the stage, from 0.
        phase: :attr:`Phase.FORWARD` or :attr:`Phase.BACKWARD`.
        microbatch: Index ``i`` of the micro-batch, from 0.

    Raises:
        ScheduleError: If an index is not an int >= 0 or ``phase`` is not a :class:`Phase`.

    Example:
        >>> a = Action(1, Phase.FORWARD, 0)
        >>> str(a), Action.parse("1F0") == a
        ('1F0', True)
    """

    stage: int
    phase: Phase
    microbatch: int

    def __post_init__(self) -> None:
        problems = [
            *_index_problem("stage", self.stage, "number stages from 0"),
            *_index_problem("microbatch", self.microbatch, "number micro-batches from 0"),
        ]
        if not isinstance(self.phase, Phase):
            problems.append(
                f"Action phase must be a Phase, got {self.phase!r}; "
                "pass Phase.FORWARD or Phase.BACKWARD (Phase('F') converts a letter)"
            )
        if problems:
            raise ScheduleError("; ".join(problems))

    def __str__(self) -> str:
        return f"{self.stage}{self.phase.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads an action written as ``str(action)`` does, such as ``"1F0"``.

        Args:
            text: Stage, phase letter (``F`` or ``B``) and micro-batch; outer spaces are ignored.

        Returns:
            The action.

        Raises:
            ScheduleError: If ``text`` is not of that form.

        Example:
            >>> Action.parse("2B3")
            Action(stage=2, phase=<Phase.BACKWARD: 'B'>, microbatch=3)
        """
        found = _ACTION_TEXT.fullmatch(text.strip()) if isinstance(text, str) else None
        if found is None:
            raise ScheduleError(
                f"cannot read {text!r} as an action; write stage, phase and micro-batch "
                "like '1F0' (phase F for forward, B for backward)"
            )
        stage, letter, microbatch = found.groups()
        return cls(int(stage), Phase(letter), int(microbatch))


Schedule = tuple[tuple[Action, ...], ...]
"""Per stage ``j``, the ordered actions that stage runs."""


def _index_problem(name: str, value: object, fix: str) -> list[str]:
    # bool is an int to Python but never a meaningful index.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return []
    return [f"Action {name} must be an int >= 0, got {value!r}; {fix}"]


def _count_problem(name: str, value: object, fix: str) -> list[str]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return []
    return [f"{name} must be an int >= 1, got {value!r} ({type(value).__name__}); {fix}"]


def _check_counts(n_stages: object, n_microbatches: object) -> None:
    problems = [
        *_count_problem("n_stages", n_stages, "pass the number of pipeline stages, e.g. 4"),
        *_count_problem(
            "n_microbatches", n_microbatches, "pass the number of micro-batches, e.g. 8"
        ),
    ]
    if problems:
        raise ScheduleError("; ".join(problems))


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """The fill-drain schedule of GPipe.

    Every stage runs all forwards in micro-batch order, then all backwards in *reverse*
    micro-batch order, as torchgpipe's autograd does: the last micro-batch's forward is
    the freshest, so its backward can start on the last stage without waiting.

    Args:
        n_stages: Number of stages ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, at least 1.

    Returns:
        The schedule, one tuple of actions per stage.

    Raises:
        ScheduleError: If a count is not an int >= 1.

    Example:
        >>> [" ".join(map(str, actions)) for actions in gpipe(2, 2)]
        ['0F0 0F1 0B1 0B0', '1F0 1F1 1B1 1B0']
    """
    _check_counts(n_stages, n_microbatches)
    return tuple(
        tuple(Action(j, Phase.FORWARD, i) for i in range(n_microbatches))
        + tuple(Action(j, Phase.BACKWARD, i) for i in reversed(range(n_microbatches)))
        for j in range(n_stages)
    )


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """The 1F1B schedule (PipeDream-flush, Megatron's non-interleaved schedule).

    Stage ``j`` runs ``min(P - j - 1, m)`` warm-up forwards, then alternates one forward
    and one backward, then runs the remaining cool-down backwards. Backwards go in
    micro-batch order, so stage ``j`` never holds more than ``min(P - j, m)`` micro-batches'
    activations, against ``m`` for :func:`gpipe`, at the same bubble.

    Args:
        n_stages: Number of stages ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, at least 1.

    Returns:
        The schedule, one tuple of actions per stage.

    Raises:
        ScheduleError: If a count is not an int >= 1.

    Example:
        >>> [" ".join(map(str, actions)) for actions in one_f_one_b(2, 3)]
        ['0F0 0F1 0B0 0F2 0B1 0B2', '1F0 1B0 1F1 1B1 1F2 1B2']
    """
    _check_counts(n_stages, n_microbatches)
    return tuple(_one_f_one_b_stage(j, n_stages, n_microbatches) for j in range(n_stages))


def _one_f_one_b_stage(j: int, n_stages: int, n_microbatches: int) -> tuple[Action, ...]:
    warmup = min(n_stages - j - 1, n_microbatches)
    actions = [Action(j, Phase.FORWARD, i) for i in range(warmup)]
    for i in range(warmup, n_microbatches):
        actions += [Action(j, Phase.FORWARD, i), Action(j, Phase.BACKWARD, i - warmup)]
    cooldown = range(n_microbatches - warmup, n_microbatches)
    actions += [Action(j, Phase.BACKWARD, i) for i in cooldown]
    return tuple(actions)


def validate(schedule: Schedule, n_stages: int, n_microbatches: int) -> None:
    """Checks that a schedule runs every action once, in a legal order, without deadlock.

    Every problem found is collected and reported in one error: a wrong number of stage
    lists; an entry that is not an :class:`Action`; an action in another stage's list; a
    micro-batch index out of range; a forward or backward missing or repeated; a backward
    before its forward on the same stage; forwards out of micro-batch order. The deadlock
    check runs each stage's list in order, one action at a time, where ``F(j, i)`` needs
    ``F(j-1, i)`` and ``B(j, i)`` needs ``F(j, i)`` and ``B(j+1, i)``. It runs only when
    the other checks pass: a missing or misplaced action, or a backward before its forward,
    would show up again as a stuck stage.

    Args:
        schedule: Per stage, the ordered actions it runs.
        n_stages: Number of stages ``P`` the schedule must cover.
        n_microbatches: Number of micro-batches ``m`` the schedule must cover.

    Raises:
        ScheduleError: Listing every problem, if there is any.

    Example:
        >>> validate(gpipe(2, 3), 2, 3)
        >>> broken = (tuple(map(Action.parse, ["0F0", "0B0"])), (Action.parse("1F0"),))
        >>> try:
        ...     validate(broken, 2, 1)
        ... except ScheduleError as error:
        ...     print(error)
        schedule for 2 stages and 1 micro-batch has 1 problem:
          - stage 1 never runs 1B0; every stage runs each micro-batch's F and B once
    """
    _check_counts(n_stages, n_microbatches)
    problems = _placement_problems(schedule, n_stages, n_microbatches)
    own = _own_actions(schedule, n_stages, n_microbatches)
    problems += _count_problems(own, n_microbatches) + _order_problems(own)
    if not problems:
        problems = _deadlock_problems(schedule)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ScheduleError(
            f"schedule for {_plural(n_stages, 'stage')} and "
            f"{_plural(n_microbatches, 'micro-batch')} has "
            f"{_plural(len(problems), 'problem')}:\n{listed}"
        )


def _plural(n: int, noun: str) -> str:
    suffix = "" if n == 1 else "es" if noun.endswith("ch") else "s"
    return f"{n} {noun}{suffix}"


def _placement_problems(schedule: Schedule, n_stages: int, n_microbatches: int) -> list[str]:
    problems = []
    if len(schedule) != n_stages:
        problems.append(
            f"schedule has {len(schedule)} stage lists but n_stages={n_stages}; "
            "give one list of actions per stage"
        )
    for j, actions in enumerate(schedule):
        for action in actions:
            if not isinstance(action, Action):
                problems.append(
                    f"stage {j} list holds {action!r}, not an Action; "
                    "build it with Action(...) or Action.parse('1F0')"
                )
            elif action.stage >= n_stages:
                problems.append(
                    f"stage {j} list holds {action}, but n_stages={n_stages}; "
                    f"use stages 0..{n_stages - 1}"
                )
            elif action.stage != j:
                problems.append(
                    f"stage {j} list holds {action}; move it to stage {action.stage}'s list"
                )
            elif action.microbatch >= n_microbatches:
                problems.append(
                    f"{action} names micro-batch {action.microbatch} but "
                    f"n_microbatches={n_microbatches}; use micro-batches 0..{n_microbatches - 1}"
                )
    return problems


def _own_actions(schedule: Schedule, n_stages: int, n_microbatches: int) -> list[list[Action]]:
    # Misplaced entries are reported once, by _placement_problems, and skipped here.
    return [
        [
            a
            for a in actions
            if isinstance(a, Action) and a.stage == j and a.microbatch < n_microbatches
        ]
        for j, actions in enumerate(schedule[:n_stages])
    ]


def _count_problems(own: list[list[Action]], n_microbatches: int) -> list[str]:
    problems = []
    for j, actions in enumerate(own):
        counts = Counter(actions)
        expected = [Action(j, p, i) for p in Phase for i in range(n_microbatches)]
        missing = [str(a) for a in expected if counts[a] == 0]
        if missing:
            problems.append(
                f"stage {j} never runs {', '.join(missing)}; "
                "every stage runs each micro-batch's F and B once"
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
        first_forward: dict[int, int] = {}
        for k, a in enumerate(actions):
            if a.phase is Phase.FORWARD:
                first_forward.setdefault(a.microbatch, k)
        problems += [
            f"stage {j} runs {a} before {j}F{a.microbatch}; "
            "a backward needs its forward's activations, so move it after"
            for k, a in enumerate(actions)
            if a.phase is Phase.BACKWARD and first_forward.get(a.microbatch, -1) > k
        ]
        order = [a.microbatch for a in actions if a.phase is Phase.FORWARD]
        if order != sorted(order):
            problems.append(
                f"stage {j} runs forwards in micro-batch order {order}; "
                f"run them as {sorted(order)}, since micro-batches flow through in order"
            )
    return problems


def _needs(action: Action, n_stages: int) -> tuple[Action, ...]:
    j, i = action.stage, action.microbatch
    if action.phase is Phase.FORWARD:
        return (Action(j - 1, Phase.FORWARD, i),) if j > 0 else ()
    after = (Action(j + 1, Phase.BACKWARD, i),) if j + 1 < n_stages else ()
    return (Action(j, Phase.FORWARD, i), *after)


def _execute(schedule: Schedule) -> tuple[list[Action], list[int]]:
    """Runs each stage's list in order; returns the actions in a feasible order and,
    per stage, how many of its actions ran (fewer than its list means it is stuck)."""
    n_stages, done, order = len(schedule), set[Action](), list[Action]()
    ran = [0] * n_stages
    progressed = True
    while progressed:
        progressed = False
        for j, actions in enumerate(schedule):
            while ran[j] < len(actions) and done.issuperset(_needs(actions[ran[j]], n_stages)):
                done.add(actions[ran[j]])
                order.append(actions[ran[j]])
                ran[j] += 1
                progressed = True
    return order, ran


def _deadlock_problems(schedule: Schedule) -> list[str]:
    order, ran = _execute(schedule)
    done = set(order)
    waits = [
        f"stage {j} waits on {a} which needs "
        + ", ".join(str(d) for d in _needs(a, len(schedule)) if d not in done)
        for j, actions in enumerate(schedule)
        if ran[j] < len(actions)
        for a in [actions[ran[j]]]
    ]
    if not waits:
        return []
    return [f"deadlock: {'; '.join(waits)}; reorder so each action's inputs run before it"]


def _ticks_per_phase(forward_time: float, backward_time: float) -> dict[Phase, int]:
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
    return {Phase.FORWARD: 1, Phase.BACKWARD: round(ratio)}


def clock_ticks(
    schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0
) -> list[list[Action | None]]:
    """Simulates a schedule in unit clock ticks, each action starting as soon as it can.

    A forward takes one tick, a backward ``backward_time / forward_time`` ticks (a whole
    number). Transfers between stages are free. The schedule is validated first, with
    ``P`` its number of lists and ``m`` one more than its largest micro-batch index.

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
        >>> [[str(a) if a else "." for a in tick] for tick in clock_ticks(gpipe(2, 1))]
        [['0F0', '.'], ['.', '1F0'], ['.', '1B0'], ['.', '1B0'], ['0B0', '.'], ['0B0', '.']]
    """
    ticks = _ticks_per_phase(forward_time, backward_time)
    n_stages = len(schedule)
    n_microbatches = 1 + max(
        (a.microbatch for actions in schedule for a in actions if isinstance(a, Action)),
        default=-1,
    )
    validate(schedule, n_stages, n_microbatches)
    free, start, finish = [0] * n_stages, dict[Action, int](), dict[Action, int]()
    for a in _execute(schedule)[0]:
        start[a] = max([free[a.stage], *(finish[d] for d in _needs(a, n_stages))])
        finish[a] = free[a.stage] = start[a] + ticks[a.phase]
    grid: list[list[Action | None]] = [[None] * n_stages for _ in range(max(finish.values()))]
    for a, k0 in start.items():
        for k in range(k0, finish[a]):
            grid[k][a.stage] = a
    return grid


def in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the peak number of micro-batches whose forward ran but backward has not.

    This is how many micro-batches' activations the stage must hold at once: ``m`` on
    every stage for :func:`gpipe`, ``min(P - j, m)`` for :func:`one_f_one_b`.

    Args:
        schedule: Per stage, the ordered actions it runs.

    Returns:
        The peak per stage.

    Example:
        >>> in_flight(gpipe(3, 4)), in_flight(one_f_one_b(3, 4))
        ((4, 4, 4), (3, 2, 1))
    """
    peaks = []
    for actions in schedule:
        live = peak = 0
        for a in actions:
            live += 1 if a.phase is Phase.FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def bubble_fraction(
    schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0
) -> float:
    """The share of stage-ticks left idle, ``idle / (P * makespan)``, per :func:`clock_ticks`.

    For equal stages both :func:`gpipe` and :func:`one_f_one_b` give ``(P-1)/(m+P-1)``,
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


def split_phases(schedule: Schedule) -> tuple[Schedule, Schedule]:
    """Splits a fill-drain schedule into its forward pass and its backward pass.

    For runtimes that run forward and backward in separate calls (``loss =
    model(x)`` then ``loss.backward()``), which only works if no stage runs a forward
    after any of its backwards.

    Args:
        schedule: Per stage, the ordered actions it runs.

    Returns:
        ``(forwards, backwards)``: per stage, its forward actions and its backward actions,
        each in the schedule's order.

    Raises:
        ScheduleError: Naming every stage that runs a forward after a backward.

    Example:
        >>> forwards, backwards = split_phases(gpipe(2, 2))
        >>> [str(a) for a in forwards[0]], [str(a) for a in backwards[0]]
        (['0F0', '0F1'], ['0B1', '0B0'])
    """
    problems = []
    for j, actions in enumerate(schedule):
        first_b = next((a for a in actions if a.phase is Phase.BACKWARD), None)
        if first_b is None:
            continue
        late = [a for a in actions[actions.index(first_b) :] if a.phase is Phase.FORWARD]
        if late:
            problems.append(f"stage {j} runs {late[0]} after {first_b}")
    if problems:
        raise ScheduleError(
            f"cannot split into a forward pass then a backward pass: {'; '.join(problems)}; "
            "run such schedules action by action, or use a fill-drain schedule such as 'gpipe'"
        )
    return _phase_only(schedule, Phase.FORWARD), _phase_only(schedule, Phase.BACKWARD)


def _phase_only(schedule: Schedule, phase: Phase) -> Schedule:
    return tuple(tuple(a for a in actions if a.phase is phase) for actions in schedule)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""The schedules :func:`make_schedule` knows, by name."""


def make_schedule(name: str, n_stages: int, n_microbatches: int) -> Schedule:
    """Builds a schedule by its name in :data:`SCHEDULES`.

    Args:
        name: ``"gpipe"`` or ``"1f1b"``.
        n_stages: Number of stages ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, at least 1.

    Returns:
        The schedule, one tuple of actions per stage.

    Raises:
        ScheduleError: If the name is unknown or a count is not an int >= 1.

    Example:
        >>> make_schedule("1f1b", 2, 2) == one_f_one_b(2, 2)
        True
    """
    if name not in SCHEDULES:
        known = ", ".join(repr(n) for n in sorted(SCHEDULES))
        raise ScheduleError(f"unknown schedule {name!r}; use one of {known}")
    return SCHEDULES[name](n_stages, n_microbatches)
