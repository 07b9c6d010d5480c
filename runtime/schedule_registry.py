"""The one registry of pipeline schedules: by name, how each is built and who runs it.

Plans, specs, the predictor, the simulator, the search and the runtimes all look a
schedule up here. Each :class:`ScheduleKind` holds its generator (a pure function of
``partitioner.runtime.schedule_generators``), whether it needs virtual stages, the rules
its counts must keep, the :class:`Runtime` s that execute it, where its virtual stages run
(its placement, ``partitioner.runtime.placement``) and its own time and memory hooks
(``hidden``, ``fill``, ``bound``, ``peak``; ``None``: counted from the schedule itself), so
the predictor and the search never branch on a schedule's name. A schedule no runtime
executes is still simulated and predicted. The one interpreter
(``partitioner.runtime.interpreter``) runs them all; both runtimes execute ``gpipe``,
``1f1b``, ``interleaved`` (``v >= 2`` model chunks per stage), ``zero_bubble`` and
``v_shape`` (its chunks placed in a V), and ``strategy="auto"`` tries them all. What each
runtime runs besides schedules is published here too (:data:`CAPABILITIES`). Adding a
schedule is adding its generator (and placement, if new) to
``partitioner.runtime.schedule_generators`` and one entry to :data:`SCHEDULES`; the tests
then validate it over a grid of sizes and simulate it.

Example:
    >>> [str(a) for a in make_schedule("1f1b", 2, 2)[0]]
    ['0F0', '0F1', '0B0', '0B1']
    >>> schedule_names([Runtime.ONE_PROCESS]) == schedule_names([Runtime.MULTI_PROCESS])
    True
    >>> schedule_kind("v_shape").place(2, 2)  # rank 0 holds the first and the last stage
    (0, 1, 1, 0)
    >>> schedule_kind("interleaved").virtual, schedule_kind("interleaved").runs_on(
    ...     Runtime.MULTI_PROCESS)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache, lru_cache
from types import MappingProxyType

from partitioner.errors import ScheduleError
from partitioner.runtime.action import Phase, Schedule
from partitioner.runtime.placement import Placement, looped
from partitioner.runtime.schedule import clock_ticks, count_problems, held_by_stage, in_flight
from partitioner.runtime.schedule_generators import (
    gpipe,
    interleaved,
    one_f_one_b,
    v_shape,
    v_shape_fill,
    v_shape_peak,
    zero_bubble,
    zigzag,
)

__all__ = [
    "GPIPE",
    "INTERLEAVED",
    "ONE_F_ONE_B",
    "ZERO_BUBBLE",
    "V_SHAPE",
    "Runtime",
    "Capabilities",
    "CAPABILITIES",
    "SCHEDULES",
    "ScheduleKind",
    "check_runtime",
    "make_schedule",
    "name_problem",
    "runtime_problem",
    "schedule_kind",
    "schedule_names",
]

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved"
ZERO_BUBBLE = "zero_bubble"
V_SHAPE = "v_shape"


class Runtime(str, Enum):
    """A runtime that executes schedules."""

    ONE_PROCESS = "one-process"
    MULTI_PROCESS = "multi-process"

    @property
    def label(self) -> str:
        """How messages name it: ``"the one-process runtime (runtime/local.py)"``."""
        where = {Runtime.ONE_PROCESS: "runtime/local.py",
                 Runtime.MULTI_PROCESS: "runtime/distributed/pipeline.py"}[self]
        return f"the {self.value} runtime ({where})"


@dataclass(frozen=True)
class Capabilities:
    """What a runtime executes beyond its schedules (published here, read by the planner).

    Attributes:
        data_parallel: whether it runs ``dp > 1``.
        tensor_parallel: whether it runs ``tp > 1``.
        optimizer_sharding: whether it shards the optimizer state over replicas (ZeRO-1).
        virtual_with_tp: whether schedules with virtual stages run with ``tp > 1``.
    """

    data_parallel: bool = False
    tensor_parallel: bool = False
    optimizer_sharding: bool = False
    virtual_with_tp: bool = False


CAPABILITIES: Mapping[Runtime, Capabilities] = MappingProxyType({
    # Replicas (runtime/replicas.py) and TensorParallelModule, pp groups of tp devices
    # through the one-process pipeline, one whole stage per group.
    Runtime.ONE_PROCESS: Capabilities(data_parallel=True, tensor_parallel=True),
    # Virtual stages hold whole (unsplit) stages: interleaving does not run with tp > 1.
    Runtime.MULTI_PROCESS: Capabilities(data_parallel=True, tensor_parallel=True,
                                        optimizer_sharding=True),
})
"""Each runtime's capabilities; its schedules are those whose entry names it."""


InFlight = Callable[[int, int, int, int], int]
"""``(P, m, j, v)`` to the peak (chunk-)micro-batches stage ``j`` holds activations of."""

Hidden = Callable[[Sequence[float], float], float]
"""``(backward, input_share)``, seconds of each virtual stage's backward of one micro-batch
and the share of a backward that computes input gradients, to how much of the first
micro-batch's path through the pipeline (every forward, then every backward) the schedule
hides from the fill and drain."""

Bound = Callable[[int, int, int, Sequence[float], Sequence[float], float], float]
"""``(P, m, v, forward, backward, input_share)`` (times per layer or stage of one
micro-batch) to a lower bound on a step's pipeline time: what the search prunes with."""

Fill = Callable[[int, int, int], float]
"""``(P, m, v)`` to the fill and drain of a schedule with virtual stages: how many times a
virtual stage's forward and backward of one micro-batch a step takes beyond the ``m v`` of
each device's own work (equal stages)."""


def looped_fill(p: int, m: int, v: int) -> float:
    """Megatron's interleaving: ``P - 1`` chunk times, ``1 / v`` of 1F1B's fill and drain."""
    return float(p - 1)


def nothing_hidden(backward: Sequence[float], share: float) -> float:
    """Whole backwards: the first micro-batch's forwards and backwards run in a chain."""
    return 0.0


def weight_halves_hidden(backward: Sequence[float], share: float) -> float:
    """A split backward: the input halves (``I``) run in a chain, the weight halves (``W``)
    wait in the bubbles, but for the last one, on the first stage."""
    return (1 - share) * (sum(backward) - (backward[0] if backward else 0.0))


def fill_drain_bound(p: int, m: int, v: int, forward: Sequence[float],
                     backward: Sequence[float], share: float) -> float:
    """``m`` micro-batches plus the ``(P - 1) / v`` fill and drain of a 1F1B-like order,
    over ``P`` devices."""
    return (m + (p - 1) / v) * sum(f + b for f, b in zip(forward, backward)) / p


def split_bound(p: int, m: int, v: int, forward: Sequence[float],
                backward: Sequence[float], share: float) -> float:
    """The weight halves fill the bubbles, the input halves do not: the first micro-batch's
    chain of forwards and input halves, then the other ``m - 1`` at the busiest device's
    pace (at least an even share of the work). This is the predictor's own fill and drain
    with :func:`weight_halves_hidden` (less the first stage's weight half, which ends the
    step), so it never exceeds a prediction and is as tight as the closed form allows."""
    work = sum(f + b for f, b in zip(forward, backward))
    chain = sum(f + share * b for f, b in zip(forward, backward))
    return chain + (m - 1) * work / p if p > 1 else m * work


def critical_path_bound(p: int, m: int, v: int, forward: Sequence[float],
                        backward: Sequence[float], share: float) -> float:
    """What any order needs: each device's share of the work, and one micro-batch's path."""
    work = sum(f + b for f, b in zip(forward, backward))
    return max(m * work / p, work)


def v_bound(p: int, m: int, v: int, forward: Sequence[float], backward: Sequence[float],
            share: float) -> float:
    """The predictor's own pipeline time for the V over stages as even as the work allows,
    ``(fill + m v)`` chunk times of ``1 / (P v)`` of the work each, with the fill at its
    least: device ``P - 1`` waits ``P - 1`` forwards for its first input, and after its
    last backward the gradients still go down ``P - 1`` stages (``P - 1`` chunk times at
    ``B = 2F``, the predictor's), and one micro-batch's path is every chunk in turn
    (``v (P - m)`` when ``m < P``). The counted fill is never less and the predictor's
    busiest device is no less busy than the average, so this never exceeds a prediction;
    it costs no simulation (the search bounds every configuration before it predicts any).
    """
    work = sum(f + b for f, b in zip(forward, backward))
    return (max(p - 1, v * (p - m)) + m * v) * work / (p * v)


@dataclass(frozen=True)
class ScheduleKind:
    """One registered schedule.

    Attributes:
        name: What plans, specs and configurations call it.
        generate: The pure function building it, called ``generate(P, m)``, or
            ``generate(P, m, v)`` when ``virtual``; returns the actions per stage.
        virtual: Whether it needs ``v >= 2`` virtual stages per stage (else exactly 1).
        runtimes: The runtimes that execute it; empty: simulated and predicted only.
        grouped: Whether micro-batches go through in groups of ``P`` (``m`` a multiple of
            ``P``).
        last_backward_first: Whether each stage's first backward is the last micro-batch's
            (fill-drain), so the one micro-batch ``except_last`` keeps whole is freed
            before any checkpointed one is replayed.
        peak: The in-flight peak in closed form; ``None``: counted from the schedule (the
            schedule's memory hook).
        placement: ``(P, v)`` to the stage-to-device map (``partitioner.runtime.placement``)
            its generator's lists follow; everything that places a stage reads it.
        hidden: How much of its fill and drain it hides (the time hook of the predictor,
            one virtual stage per device).
        fill: Its fill and drain with virtual stages (the time hook of the predictor);
            ``None``: counted from the schedule in unit times (:meth:`fill_drain`).
        bound: Its lower bound on a step (the time hook of the search).
        searched: Whether ``strategy="auto"`` tries it (else only when asked for).
    """

    name: str
    generate: Callable[..., Schedule]
    virtual: bool = False
    runtimes: frozenset[Runtime] = frozenset()
    grouped: bool = False
    last_backward_first: bool = False
    peak: InFlight | None = None
    placement: Callable[[int, int], Placement] = looped
    hidden: Hidden = nothing_hidden
    fill: Fill | None = looped_fill
    bound: Bound = fill_drain_bound
    searched: bool = True

    def problems(self, n_stages: int, n_microbatches: int, virtual: int = 1) -> list[str]:
        """What keeps this schedule from being built for these counts; empty if nothing."""
        found = count_problems(n_stages, n_microbatches, virtual)
        if found:
            return found
        if self.virtual and virtual < 2:
            found.append(f"schedule {self.name!r} needs virtual >= 2 (model chunks per stage), "
                         f"got virtual={virtual}; pass 2 or more, or use one of "
                         f"{_listed(schedule_names(virtual=False))}")
        elif not self.virtual and virtual != 1:
            found.append(f"schedule {self.name!r} runs one virtual stage per stage, got "
                         f"virtual={virtual}; pass virtual=1, or use one of "
                         f"{_listed(schedule_names(virtual=True))}")
        if self.grouped and n_microbatches % n_stages:
            found.append(f"schedule {self.name!r} runs micro-batches in groups of the "
                         f"{n_stages} stages, got {n_microbatches} micro-batches; use a "
                         f"multiple of {n_stages}")
        return found

    def build(self, n_stages: int, n_microbatches: int, virtual: int = 1) -> Schedule:
        """The schedule for ``P`` stages, ``m`` micro-batches and ``v`` virtual stages.

        Raises:
            ScheduleError: Listing :meth:`problems`, if there are any.
        """
        found = self.problems(n_stages, n_microbatches, virtual)
        if found:
            raise ScheduleError("; ".join(found))
        if self.virtual:
            return self.generate(n_stages, n_microbatches, virtual)
        return self.generate(n_stages, n_microbatches)

    def in_flight(self, n_stages: int, n_microbatches: int, stage: int, virtual: int = 1
                  ) -> int:
        """Peak micro-batches (chunk-micro-batches with virtual stages) stage ``j`` holds
        activations of, as ``partitioner.runtime.schedule.in_flight`` counts them."""
        if self.peak is not None:
            return self.peak(n_stages, n_microbatches, stage, virtual)
        return _counted_peaks(self, n_stages, n_microbatches, virtual)[stage]

    def held_by_stage(self, n_stages: int, n_microbatches: int, stage: int, virtual: int = 1
                      ) -> tuple[tuple[int, ...], ...]:
        """Stage ``j``'s micro-batches in flight per virtual stage it holds, at each moment
        that can be its activation peak (``partitioner.runtime.schedule.held_by_stage``);
        one stage per device: its :meth:`in_flight`."""
        if virtual == 1:
            return ((self.in_flight(n_stages, n_microbatches, stage, virtual),),)
        return _counted_held(self, n_stages, n_microbatches, virtual)[stage]

    def fill_drain(self, n_stages: int, n_microbatches: int, virtual: int) -> float:
        """Chunk times (one virtual stage's forward and backward of one micro-batch) a step
        of ``P`` devices, ``m`` micro-batches and ``v`` virtual stages each takes beyond
        the ``m v`` of a device's own work, for equal stages.

        Example:
            >>> schedule_kind("v_shape").fill_drain(4, 8, 2), schedule_kind(
            ...     "interleaved").fill_drain(4, 8, 2)
            (3.0, 3.0)
        """
        if self.fill is not None:
            return self.fill(n_stages, n_microbatches, virtual)
        return _counted_fill(self, n_stages, n_microbatches, virtual)

    def place(self, n_stages: int, virtual: int = 1) -> Placement:
        """Per virtual stage, the pipeline device that runs it."""
        return self.placement(n_stages, virtual)

    def runs_on(self, runtime: Runtime) -> bool:
        """Whether ``runtime`` executes this schedule."""
        return runtime in self.runtimes

    @property
    def splits_backward(self) -> bool:
        """Whether its backwards are split into input (``I``) and weight (``W``) halves
        (what needs Linear weight gradients queued rather than run: ``fused_linear``)."""
        return _splits(self)


@lru_cache(maxsize=256)
@cache
def _splits(kind: ScheduleKind) -> bool:
    virtual = 2 if kind.virtual else 1
    return any(action.phase is Phase.INPUT for actions in kind.build(2, 2, virtual)
               for action in actions)


def _counted_peaks(kind: ScheduleKind, n_stages: int, n_microbatches: int, virtual: int
                   ) -> tuple[int, ...]:
    return in_flight(kind.build(n_stages, n_microbatches, virtual))


@lru_cache(maxsize=256)
def _counted_held(kind: ScheduleKind, n_stages: int, n_microbatches: int, virtual: int
                  ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return held_by_stage(kind.build(n_stages, n_microbatches, virtual),
                         kind.place(n_stages, virtual))


@lru_cache(maxsize=256)
def _counted_fill(kind: ScheduleKind, n_stages: int, n_microbatches: int, virtual: int
                  ) -> float:
    # A backward twice a forward, as the cost model's layers mostly are; 3 ticks a chunk.
    ticks = len(clock_ticks(kind.build(n_stages, n_microbatches, virtual), 1.0, 2.0))
    return ticks / 3 - n_microbatches * virtual


_BOTH = frozenset({Runtime.ONE_PROCESS, Runtime.MULTI_PROCESS})

SCHEDULES: Mapping[str, ScheduleKind] = MappingProxyType({kind.name: kind for kind in (
    ScheduleKind(GPIPE, gpipe, runtimes=_BOTH,
                 last_backward_first=True, peak=lambda p, m, j, v: m),
    ScheduleKind(ONE_F_ONE_B, one_f_one_b, runtimes=_BOTH,
                 peak=lambda p, m, j, v: min(p - j, m)),
    ScheduleKind(INTERLEAVED, interleaved, virtual=True, grouped=True, runtimes=_BOTH,
                 peak=lambda p, m, j, v: min(2 * (p - j - 1) + (v - 1) * p + 1, m * v)),
    ScheduleKind(ZERO_BUBBLE, zero_bubble, runtimes=_BOTH,
                 peak=lambda p, m, j, v: min(p - j, m), hidden=weight_halves_hidden,
                 bound=split_bound),
    ScheduleKind(V_SHAPE, v_shape, virtual=True, runtimes=_BOTH,
                 placement=zigzag, peak=v_shape_peak, fill=v_shape_fill, bound=v_bound),
)})
"""Every schedule by name, in the order messages list them."""


def _listed(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def schedule_names(runtimes: Iterable[Runtime] | None = None, *, virtual: bool | None = None,
                   searched: bool | None = None) -> tuple[str, ...]:
    """Registered names, optionally only those some of ``runtimes`` execute, only those
    that need (``virtual=True``) or refuse (``False``) virtual stages, or only those
    ``strategy="auto"`` tries (``searched=True``).

    Example:
        >>> schedule_names(), schedule_names(virtual=True)
        (('gpipe', '1f1b', 'interleaved', 'zero_bubble', 'v_shape'), ('interleaved', 'v_shape'))
    """
    wanted = None if runtimes is None else frozenset(runtimes)
    return tuple(name for name, kind in SCHEDULES.items()
                 if (wanted is None or kind.runtimes & wanted)
                 and (virtual is None or kind.virtual == virtual)
                 and (searched is None or kind.searched == searched))


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a registered schedule, or ``None`` if it is.

    Example:
        >>> print(name_problem("zb"))  # doctest: +NORMALIZE_WHITESPACE
        schedule='zb' is not a registered schedule;
        use one of 'gpipe', '1f1b', 'interleaved', 'zero_bubble', 'v_shape'
    """
    return None if _lookup(name) else _unknown(name)


def _lookup(name: object) -> ScheduleKind | None:
    return SCHEDULES.get(name) if isinstance(name, str) else None


def _unknown(name: object) -> str:
    return f"schedule={name!r} is not a registered schedule; use one of {_listed(SCHEDULES)}"


def schedule_kind(name: object) -> ScheduleKind:
    """The registered schedule called ``name``.

    Raises:
        ScheduleError: If no schedule has that name, naming it and the registered ones.
    """
    kind = _lookup(name)
    if kind is None:
        raise ScheduleError(_unknown(name))
    return kind


def make_schedule(name: str, n_stages: int, n_microbatches: int, virtual: int = 1) -> Schedule:
    """Builds a schedule by its name in :data:`SCHEDULES`.

    Args:
        name: A registered name, such as ``"gpipe"`` or ``"1f1b"``.
        n_stages: Number of stages ``P``, at least 1.
        n_microbatches: Number of micro-batches ``m``, at least 1.
        virtual: Virtual stages per stage ``v``: 1, or 2 or more for ``"interleaved"``.

    Returns:
        The schedule, one tuple of actions per stage.

    Raises:
        ScheduleError: If the name is unknown or the counts do not suit the schedule.

    Example:
        >>> from partitioner.runtime.schedule_generators import one_f_one_b
        >>> make_schedule("1f1b", 2, 2) == one_f_one_b(2, 2)
        True
    """
    return schedule_kind(name).build(n_stages, n_microbatches, virtual)


def runtime_problem(name: object, runtime: Runtime) -> str | None:
    """Why ``runtime`` cannot execute the schedule ``name``, or ``None`` if it can.

    Example:
        >>> print(runtime_problem("zb", Runtime.MULTI_PROCESS))  # doctest: +NORMALIZE_WHITESPACE
        schedule='zb' is not a registered schedule;
        use one of 'gpipe', '1f1b', 'interleaved', 'zero_bubble', 'v_shape'
    """
    kind = _lookup(name)
    if kind is None:
        return _unknown(name)
    if kind.runs_on(runtime):
        return None
    where = " and ".join(f"the {r.value} runtime" for r in Runtime if kind.runs_on(r))
    return (f"schedule={name!r} is not executed by {runtime.label}; use one of "
            f"{_listed(schedule_names([runtime]))} ({name!r} "
            + (f"runs in {where})" if where else "is simulated and predicted only)"))


def check_runtime(name: object, runtime: Runtime) -> ScheduleKind:
    """The schedule ``name``, if ``runtime`` executes it.

    Raises:
        ScheduleError: If the name is unknown or ``runtime`` does not execute it.
    """
    problem = runtime_problem(name, runtime)
    if problem is not None:
        raise ScheduleError(problem)
    return schedule_kind(name)
