"""The pipeline schedules, each a pure function returning the actions per stage.

Index letters as in ``partitioner.runtime.schedule``: ``i`` micro-batch, ``j`` stage; ``P``
stages, ``m`` micro-batches, ``v`` virtual stages per stage. Each function checks its
counts, returns one tuple of :class:`~partitioner.runtime.action.Action` s per stage, and
knows nothing of models or devices; ``partitioner.runtime.schedule_registry`` names them
and says which runtime executes which. The V's time and memory hooks sit beside its
generator (:func:`v_shape_fill`, :func:`v_shape_peak`: counts of the simulation it is built
by, which the search asks for without needing the lists).

GPipe and 1F1B have the same bubble, ``(P-1)/(m+P-1)`` for equal stages. They differ in
memory: GPipe keeps the activations of all ``m`` micro-batches alive until the drain,
while 1F1B starts each backward as soon as it can, so stage ``j`` holds at most ``P - j``.
Interleaving ``v`` model chunks per stage divides the bubble by ``v``, for more messages
and more micro-batches in flight. Charts are ``render`` output with a backward twice as
long as a forward (a label repeated across ticks is one action; ``.`` is a bubble)::

    gpipe(3, 4): all forwards, then all backwards, last micro-batch first
    0F0 0F1 0F2 0F3   .   .   .   .   .   . 0B3 0B3 0B2 0B2 0B1 0B1 0B0 0B0
      . 1F0 1F1 1F2 1F3   .   .   . 1B3 1B3 1B2 1B2 1B1 1B1 1B0 1B0   .   .
      .   . 2F0 2F1 2F2 2F3 2B3 2B3 2B2 2B2 2B1 2B1 2B0 2B0   .   .   .   .

    one_f_one_b(3, 4): P-j-1 warm-up forwards, then one forward, one backward
    0F0 0F1 0F2   .   .   .   . 0B0 0B0 0F3 0B1 0B1   . 0B2 0B2   . 0B3 0B3
      . 1F0 1F1   .   . 1B0 1B0 1F2 1B1 1B1 1F3 1B2 1B2   . 1B3 1B3   .   .
      .   . 2F0 2B0 2B0 2F1 2B1 2B1 2F2 2B2 2B2 2F3 2B3 2B3   .   .   .   .

    zero_bubble(3, 4): 1F1B with each backward split in I (input gradients, what the
    previous stage waits for) and W (weight gradients, deferred into the bubbles)
    0F0 0F1 0F2   .   . 0I0 0F3 0I1 0W0 0I2 0W1 0I3 0W2 0W3
      . 1F0 1F1   . 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
      .   . 2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 2F3 2I3 2W3

    interleaved(3, 3, 2): stage j holds virtual stages j and j + 3, each half its work
    0F0 0F1 0F2 3F0 3F1 3F2   .   .   .   . 3B0 3B0   . 3B1 3B1   . 3B2 3B2 0B0 0B0 0B1 0B1 0B2 0B2
      . 1F0 1F1 1F2 4F0 4F1 4F2   . 4B0 4B0   . 4B1 4B1   . 4B2 4B2 1B0 1B0 1B1 1B1 1B2 1B2   .   .
      .   . 2F0 2F1 2F2 5F0 5B0 5B0 5F1 5B1 5B1 5F2 5B2 5B2 2B0 2B0 2B1 2B1 2B2 2B2   .   .   .   .

Example:
    >>> from partitioner.runtime.schedule import render
    >>> print(render(one_f_one_b(2, 2), backward_time=1.0))
    0F0 0F1   . 0B0   . 0B1
      . 1F0 1B0 1F1 1B1   .
"""

from __future__ import annotations

from functools import lru_cache

from partitioner.errors import ScheduleError
from partitioner.runtime.action import Action, Phase, Schedule
from partitioner.runtime.placement import Placement, stages_on
from partitioner.runtime.schedule import check_counts

__all__ = ["gpipe", "interleaved", "one_f_one_b", "zero_bubble", "v_shape", "v_shape_fill",
           "v_shape_peak", "zigzag"]


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
    check_counts(n_stages, n_microbatches)
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
    check_counts(n_stages, n_microbatches)
    return tuple(_one_f_one_b_stage(j, n_stages, n_microbatches) for j in range(n_stages))


def _one_f_one_b_stage(j: int, n_stages: int, n_microbatches: int) -> tuple[Action, ...]:
    warmup = min(n_stages - j - 1, n_microbatches)
    actions = [Action(j, Phase.FORWARD, i) for i in range(warmup)]
    for i in range(warmup, n_microbatches):
        actions += [Action(j, Phase.FORWARD, i), Action(j, Phase.BACKWARD, i - warmup)]
    cooldown = range(n_microbatches - warmup, n_microbatches)
    actions += [Action(j, Phase.BACKWARD, i) for i in cooldown]
    return tuple(actions)


def interleaved(n_stages: int, n_microbatches: int, virtual: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: per stage, its actions over its ``v`` model chunks.

    Stage ``j`` holds virtual stages ``j, j + P, ..., j + (v - 1) P``. It runs
    ``min(2 (P - j - 1) + (v - 1) P, m v)`` warm-up forwards, then alternates one forward
    and one backward, then drains; forwards walk the chunks in order over groups of ``P``
    micro-batches, backwards in reverse chunk order, so ``m`` must be a multiple of ``P``.
    Stage ``j`` holds at most ``min(2 (P - j - 1) + (v - 1) P + 1, m v)`` chunk-micro-batches.

    Args:
        n_stages: Number of stages ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, a multiple of ``P``.
        virtual: Virtual stages (model chunks) per stage ``v``, at least 2.

    Returns:
        The schedule, one tuple of actions per stage; actions name virtual stages.

    Raises:
        ScheduleError: If a count is not an int >= 1, ``v < 2`` or ``m`` is not a
            multiple of ``P``.

    Example:
        >>> [" ".join(map(str, actions)) for actions in interleaved(2, 2, 2)]
        ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']
    """
    check_counts(n_stages, n_microbatches, virtual)
    p, m, v = n_stages, n_microbatches, virtual
    problems = []
    if v < 2:
        problems.append(f"virtual={v}; interleaving needs 2 or more model chunks per stage "
                        "(use one_f_one_b for one)")
    if m % p:
        problems.append(f"n_microbatches={m} is not a multiple of n_stages={p}; micro-batches "
                        f"go through in groups of {p}, so use {p}, {2 * p}, ...")
    if problems:
        raise ScheduleError("interleaved: " + "; ".join(problems))
    return tuple(_interleaved_stage(j, p, m, v) for j in range(p))


def _interleaved_stage(j: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    total = m * v

    def action(k: int, phase: Phase) -> Action:
        # The k-th forward (or backward) of stage j: chunk by position in a group of p * v,
        # backwards walking the chunks from the last.
        chunk = (k % (p * v)) // p
        if phase is Phase.BACKWARD:
            chunk = v - chunk - 1
        return Action(chunk * p + j, phase, (k // (p * v)) * p + k % p)

    warmup = min(2 * (p - j - 1) + (v - 1) * p, total)
    actions = [action(k, Phase.FORWARD) for k in range(warmup)]
    for r in range(total - warmup):
        actions += [action(warmup + r, Phase.FORWARD), action(r, Phase.BACKWARD)]
    actions += [action(k, Phase.BACKWARD) for k in range(total - warmup, total)]
    return tuple(actions)


def zero_bubble(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1, the zero-bubble schedule of Qi et al. (2023) that keeps 1F1B's memory.

    Each backward is split into ``I`` (the gradients of the stage's inputs, which the
    previous stage waits for) and ``W`` (the gradients of its weights, which nobody waits
    for). Stages run like 1F1B, ``I`` first whenever its gradients have arrived, then a
    forward if the stage holds fewer than ``min(P - j, m)`` micro-batches (1F1B's bound,
    counting a micro-batch until its ``W``), else a pending ``W``; in the drain the ``W`` s
    fill the time 1F1B leaves idle while the gradients travel back. The order is built by
    simulating unit-time ``F``, ``I`` and ``W``, so it is deterministic; it never holds
    more micro-batches than 1F1B and its bubble is at most 1F1B's.

    Args:
        n_stages: Number of stages ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, at least 1.

    Returns:
        The schedule, one tuple of actions per stage, with ``I`` and ``W`` for each
        micro-batch instead of ``B``.

    Raises:
        ScheduleError: If a count is not an int >= 1.

    Example:
        >>> [" ".join(map(str, actions)) for actions in zero_bubble(2, 2)]
        ['0F0 0F1 0I0 0W0 0I1 0W1', '1F0 1I0 1W0 1F1 1I1 1W1']
    """
    check_counts(n_stages, n_microbatches)
    p, m = n_stages, n_microbatches
    bound = [min(p - j, m) for j in range(p)]
    forward_done = [[-1] * m for _ in range(p)]   # tick each F finished, -1: not yet
    input_done = [[-1] * m for _ in range(p)]
    counts = [[0, 0, 0] for _ in range(p)]         # F, I, W run so far per stage
    actions: list[list[Action]] = [[] for _ in range(p)]
    busy = [0] * p
    tick = 0
    while any(c[2] < m for c in counts):
        for j in range(p):
            if busy[j] > tick:
                continue
            chosen = _zero_bubble_choice(j, tick, p, m, bound[j], counts[j],
                                         forward_done, input_done)
            if chosen is None:
                continue
            phase, i = chosen
            actions[j].append(Action(j, phase, i))
            busy[j] = tick + 1
            if phase is Phase.FORWARD:
                forward_done[j][i] = tick + 1
                counts[j][0] += 1
            elif phase is Phase.INPUT:
                input_done[j][i] = tick + 1
                counts[j][1] += 1
            else:
                counts[j][2] += 1
        tick += 1
    return tuple(tuple(stage) for stage in actions)


def _zero_bubble_choice(j: int, tick: int, p: int, m: int, bound: int, count: list[int],
                        forward_done: list[list[int]], input_done: list[list[int]]
                        ) -> tuple[Phase, int] | None:
    """What stage ``j`` starts at ``tick``: a ready ``I``, else a ``F`` within the bound,
    else a pending ``W``; ``None``: it waits."""
    f, i_run, w = count

    def finished(at: int) -> bool:
        return 0 <= at <= tick

    if i_run < f and finished(forward_done[j][i_run]) and (
            j == p - 1 or finished(input_done[j + 1][i_run])):
        return Phase.INPUT, i_run
    if f < m and f - w < bound and (j == 0 or finished(forward_done[j - 1][f])):
        return Phase.FORWARD, f
    if w < i_run:
        return Phase.WEIGHT, w
    return None


def zigzag(n_stages: int, virtual: int) -> Placement:
    """The V placement: chunk ``c`` of the model runs down the devices when ``c`` is even
    and back up when it is odd, so stage ``k`` of ``P v`` is on ``k % P`` or
    ``P - 1 - k % P`` (torch's ``ScheduleZBVZeroBubble`` places its two chunks so). The
    turn costs no message: stages ``P - 1`` and ``P`` share device ``P - 1``.

    Example:
        >>> zigzag(3, 2)
        (0, 1, 2, 2, 1, 0)
    """
    p = n_stages
    return tuple(k % p if (k // p) % 2 == 0 else p - 1 - k % p for k in range(p * virtual))


def v_shape(n_stages: int, n_microbatches: int, virtual: int) -> Schedule:
    """1F1B over the V placement of :func:`zigzag`: ``v >= 2`` chunks per device.

    Built by simulating unit-time forwards and two-unit backwards: a device runs a ready
    forward of a deeper chunk (it carries a micro-batch on towards its backward), else lets
    a new micro-batch in while it holds fewer than ``min(2 P, m)``, else a ready backward,
    deepest stage first. A micro-batch enters a device at its first chunk and leaves at that
    chunk's backward, so a device holds at most ``min(2 P, m)`` micro-batches of ``v``
    chunks of ``1 / v`` of its layers each. No tuning beyond that: for ``P = 4, m = 16`` its
    bubble (``bubble_fraction``, ``B = 2 F``) is 0.12 against 1F1B's 0.16 and interleaving's
    0.09 at ``v = 2``, for twice 1F1B's activation memory on the first device.

    Args:
        n_stages: Number of devices ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, at least 1.
        virtual: Chunks per device ``v``, at least 2.

    Raises:
        ScheduleError: If a count is not an int >= 1 or ``v < 2``.

    Example:
        >>> [" ".join(map(str, actions)) for actions in v_shape(2, 2, 2)]
        ['0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1', '1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1']
    """
    check_counts(n_stages, n_microbatches, virtual)
    if virtual < 2:
        raise ScheduleError(f"v_shape: virtual={virtual}; a V needs 2 or more chunks per "
                            "device (use one_f_one_b for one)")
    return _VShape(n_stages, n_microbatches, virtual).run()


@lru_cache(maxsize=4096)
def _v_counts(p: int, m: int, v: int) -> tuple[float, tuple[int, ...]]:
    simulation = _VShape(p, m, v)
    simulation.run(record=False)  # the counts only: no lists of actions to build
    return simulation.ticks / 3 - m * v, tuple(simulation.peak)


def v_shape_fill(n_stages: int, n_microbatches: int, virtual: int) -> float:
    """The V's fill and drain (its registry time hook): chunk times, a forward and a
    backward of one virtual stage, that :func:`v_shape` takes beyond each device's ``m v``
    of work, at the unit times it is built with (one simulation, cached: what
    ``clock_ticks`` would count, without building and replaying the lists twice).

    Example:
        >>> v_shape_fill(4, 1, 2), v_shape_fill(4, 8, 2)  # one micro-batch: the whole path
        (6.0, 3.0)
    """
    check_counts(n_stages, n_microbatches, virtual)
    return _v_counts(n_stages, n_microbatches, virtual)[0]


def v_shape_peak(n_stages: int, n_microbatches: int, stage: int, virtual: int) -> int:
    """The chunk-micro-batches device ``j`` of :func:`v_shape` holds at most (its registry
    memory hook, ``partitioner.runtime.schedule.in_flight`` of one cached simulation).

    Example:
        >>> [v_shape_peak(4, 8, j, 2) for j in range(4)]  # the last device holds the most
        [13, 14, 15, 16]
    """
    check_counts(n_stages, n_microbatches, virtual)
    return _v_counts(n_stages, n_microbatches, virtual)[1][stage]


class _VShape:
    """The unit-time simulation :func:`v_shape` builds its order from."""

    def __init__(self, p: int, m: int, v: int) -> None:
        self.p, self.m, self.total = p, m, p * v
        self.where = zigzag(p, v)
        self.held = [stages_on(self.where, j) for j in range(p)]
        self.next = {Phase.FORWARD: [0] * self.total, Phase.BACKWARD: [0] * self.total}
        self.end = {phase: [[-1] * m for _ in range(self.total)] for phase in self.next}
        self.actions: list[list[Action]] = [[] for _ in range(p)]
        #: Per device, the most chunk-micro-batches in flight (``in_flight`` of the lists).
        self.peak = [0] * p

    def run(self, record: bool = True) -> Schedule:
        busy, tick, live = [0] * self.p, 0, [0] * self.p
        while any(n < self.m for n in self.next[Phase.BACKWARD]):
            for j in range(self.p):
                chosen = self.choice(j, tick) if busy[j] <= tick else None
                if chosen is not None:
                    k, phase = chosen
                    i = self.next[phase][k]
                    if record:
                        self.actions[j].append(Action(k, phase, i))
                    live[j] += 1 if phase is Phase.FORWARD else -1
                    self.peak[j] = max(self.peak[j], live[j])
                    busy[j] = self.end[phase][k][i] = tick + (1 if phase is Phase.FORWARD else 2)
                    self.next[phase][k] += 1
            # What a device may start changes only when an action ends: skip to the next end.
            tick = min((b for b in busy if b > tick), default=tick + 1)
        #: The makespan in ticks (a forward 1, a backward 2), what ``clock_ticks`` replays.
        self.ticks = max(busy)
        return tuple(tuple(actions) for actions in self.actions)

    def done(self, phase: Phase, k: int, i: int, tick: int) -> bool:
        return 0 <= self.end[phase][k][i] <= tick

    def choice(self, j: int, tick: int) -> tuple[int, Phase] | None:
        """Device ``j``'s next action at ``tick``: (stage, phase), or ``None`` to wait."""
        forward, backward = self.next[Phase.FORWARD], self.next[Phase.BACKWARD]
        first = self.held[j][0]
        for k in reversed(self.held[j][1:]):
            if forward[k] < self.m and self.done(Phase.FORWARD, k - 1, forward[k], tick):
                return k, Phase.FORWARD
        i = forward[first]
        if i < self.m and i - backward[first] < min(2 * self.p, self.m) and (
                first == 0 or self.done(Phase.FORWARD, first - 1, i, tick)):
            return first, Phase.FORWARD
        for k in reversed(self.held[j]):
            i = backward[k]
            if i < forward[k] and self.done(Phase.FORWARD, k, i, tick) and (
                    k == self.total - 1 or self.done(Phase.BACKWARD, k + 1, i, tick)):
                return k, Phase.BACKWARD
        return None
