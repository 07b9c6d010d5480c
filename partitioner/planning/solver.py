"""Exact optimal contiguous partition of a chain of layers into pipeline stages.

Pure: lists of numbers in, boundaries out (no torch). The cost model measures layers and
links; this module only decides where to cut. Stage ``j`` runs on device ``j`` and holds
layers ``[boundaries[j], boundaries[j + 1])``; devices may differ in speed and memory.

The objective is lexicographic: first the smallest *bottleneck* (the slowest stage bounds a
pipeline's throughput), then, among partitions within a hair of that bottleneck, the smallest
*total* stage time (less work and fewer transfers for the same throughput), then the
lexicographically smallest boundaries (a deterministic answer).

Why two dynamic programs rather than one over ``(max, sum)`` pairs: that pair order has no
optimal substructure. A prefix with costs ``(5, 10)`` beats one with ``(4, 12)`` once the rest
of the chain has a stage of time 6, since both totals then have max 6 and the first has the
smaller sum; yet a DP keeping the lexicographically best prefix keeps ``(4, 12)``. Fixing the
bottleneck ``B*`` first turns the second objective into "minimize a sum subject to every
stage time <= B*", which does decompose. Both programs are ``O(P * L**2)``.

Example:
    >>> problem = PartitionProblem.uniform([1.0, 2.0, 3.0, 4.0], n_stages=2)
    >>> solution = solve(problem)
    >>> solution.balance, solution.bottleneck
    ((3, 1), 6.0)
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from partitioner.errors import BalanceError, InfeasibleError, ProblemError
from partitioner.planning.problem_check import (
    shape_problems,
    to_numbers,
    to_table,
    value_problems,
)

__all__ = [
    "InfeasibleError",
    "PartitionProblem",
    "PartitionSolution",
    "ProblemError",
    "balanced_cuts",
    "evaluate",
    "lower_bound",
    "solve",
    "stage_time",
]

# Stage times within this relative distance of the optimum count as ties. Prefix sums and
# plain sums of the same floats differ in the last bits; a tie must not hinge on that.
_REL_TOL = 1e-12
_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


@dataclass(frozen=True)
class PartitionProblem:
    """Costs of every layer on every stage's device, and the memory each stage may use.

    ``P`` is the number of stages, ``L`` the number of layers. Lists are accepted and stored
    as tuples of floats.

    Attributes:
        compute: ``P x L``; ``compute[j][l]`` is layer ``l``'s time on stage ``j``'s device.
        transfer: ``P x (L + 1)``; ``transfer[j][b]`` is the time stage ``j`` spends
            receiving the values live at boundary ``b`` when its first layer is ``b``.
            Entries of stage 0 and of ``b`` in ``{0, L}`` are never used nor checked.
        memory: ``L`` bytes, what layer ``l`` needs on its device (parameters, gradients,
            optimizer state and activations, summed by the caller).
        capacity: ``P`` bytes available on stage ``j``'s device; ``math.inf`` for no limit.

    Raises:
        ProblemError: A shape is wrong or a number is negative or not finite (every problem
            is listed in one message).

    Example:
        >>> PartitionProblem(compute=((1, 2), (3, 4)), transfer=((0, 0, 0), (0, 1, 0)),
        ...                  memory=(1, 1), capacity=(2, 2)).n_stages
        2
    """

    compute: tuple[tuple[float, ...], ...]
    transfer: tuple[tuple[float, ...], ...]
    memory: tuple[float, ...]
    capacity: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("compute", "transfer"):
            object.__setattr__(self, name, to_table(name, getattr(self, name)))
        for name in ("memory", "capacity"):
            object.__setattr__(self, name, to_numbers(name, getattr(self, name)))
        tables = (self.compute, self.transfer, self.memory, self.capacity)
        problems = shape_problems(*tables)
        if not problems:
            problems = value_problems(*tables)
        if problems:
            raise ProblemError("invalid PartitionProblem: " + "; ".join(problems))

    @property
    def n_stages(self) -> int:
        """``P``, the number of stages (and devices)."""
        return len(self.compute)

    @property
    def n_layers(self) -> int:
        """``L``, the number of layers in the chain."""
        return len(self.compute[0])

    @classmethod
    def uniform(
        cls,
        compute: Sequence[float],
        n_stages: int,
        transfer: Sequence[float] | None = None,
        memory: Sequence[float] | None = None,
        capacity: float | Sequence[float] = math.inf,
    ) -> PartitionProblem:
        """Builds a problem whose devices all run at the same speed.

        Args:
            compute: ``L`` per-layer times, the same on every device.
            n_stages: ``P``, the number of stages.
            transfer: ``L + 1`` per-boundary receive times (index ``b`` for a stage that
                starts at layer ``b``); zeros when omitted.
            memory: ``L`` per-layer bytes; zeros when omitted.
            capacity: Bytes per device, one number for all or ``P`` numbers.

        Returns:
            The :class:`PartitionProblem` with every row replicated ``n_stages`` times.

        Raises:
            ProblemError: ``n_stages < 1`` or the lists have the wrong lengths.

        Example:
            >>> PartitionProblem.uniform([1, 2, 3], n_stages=2).compute
            ((1.0, 2.0, 3.0), (1.0, 2.0, 3.0))
        """
        if n_stages < 1:
            raise ProblemError(f"n_stages is {n_stages}; pass n_stages >= 1")
        n_layers = len(compute)
        row_transfer = (
            tuple(transfer) if transfer is not None else (0.0,) * (n_layers + 1)
        )
        caps = (
            tuple(capacity)
            if isinstance(capacity, Sequence)
            else (capacity,) * n_stages
        )
        return cls(
            compute=(tuple(compute),) * n_stages,
            transfer=(row_transfer,) * n_stages,
            memory=tuple(memory) if memory is not None else (0.0,) * n_layers,
            capacity=caps,
        )


@dataclass(frozen=True)
class PartitionSolution:
    """Where to cut, and what each stage then costs.

    Attributes:
        boundaries: ``P + 1`` strictly increasing cut positions from 0 to ``L``; stage ``j``
            holds layers ``[boundaries[j], boundaries[j + 1])``.
        stage_times: ``P`` stage times, compute plus the receiving transfer.
        stage_memory: ``P`` stage byte counts.
        bottleneck: ``max(stage_times)``.

    Raises:
        BalanceError: The boundaries are not increasing from 0, or the lengths disagree.

    Example:
        >>> PartitionSolution((0, 2, 5), (3.0, 4.0), (0.0, 0.0), 4.0).balance
        (2, 3)
    """

    boundaries: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    bottleneck: float

    def __post_init__(self) -> None:
        cuts = self.boundaries
        problems = _boundary_problems(
            cuts, cuts[-1] if cuts else 0, max(len(cuts) - 1, 1)
        )
        n_stages = len(cuts) - 1
        if len(self.stage_times) != n_stages or len(self.stage_memory) != n_stages:
            problems.append(
                f"{n_stages} stages but {len(self.stage_times)} stage_times and "
                f"{len(self.stage_memory)} stage_memory; give one of each per stage"
            )
        elif self.stage_times and self.bottleneck != max(self.stage_times):
            problems.append(
                f"bottleneck {self.bottleneck!r} is not max(stage_times) "
                f"{max(self.stage_times)!r}; pass the maximum"
            )
        if problems:
            raise BalanceError("invalid PartitionSolution: " + "; ".join(problems))

    @property
    def balance(self) -> tuple[int, ...]:
        """Layers per stage (torchgpipe's ``balance``)."""
        return tuple(b - a for a, b in pairwise(self.boundaries))

    @property
    def total_time(self) -> float:
        """Sum of the stage times: the work done, transfers included."""
        return math.fsum(self.stage_times)


def stage_time(problem: PartitionProblem, j: int, a: int, b: int) -> float:
    """Time of stage ``j`` holding layers ``[a, b)``: compute plus receiving layer ``a``'s input.

    Args:
        problem: The costs.
        j: Stage index, ``0 <= j < P``.
        a: First layer of the stage.
        b: One past its last layer, ``a < b <= L``.

    Returns:
        ``sum(compute[j][a:b])``, plus ``transfer[j][a]`` when ``j > 0``.

    Raises:
        BalanceError: The indices are out of range or the stage is empty.

    Example:
        >>> p = PartitionProblem.uniform([1, 2, 3], n_stages=2, transfer=[0, 5, 7, 0])
        >>> stage_time(p, 0, 0, 1), stage_time(p, 1, 1, 3)
        (1.0, 10.0)
    """
    if not (0 <= j < problem.n_stages and 0 <= a < b <= problem.n_layers):
        raise BalanceError(
            f"stage_time(j={j}, a={a}, b={b}) is out of range; need 0 <= j < "
            f"{problem.n_stages} and 0 <= a < b <= {problem.n_layers}"
        )
    arrival = problem.transfer[j][a] if j > 0 and a > 0 else 0.0
    return math.fsum(problem.compute[j][a:b]) + arrival


def evaluate(problem: PartitionProblem, boundaries: Sequence[int]) -> PartitionSolution:
    """Costs a given partition, whether or not it is optimal or fits memory.

    Compare ``stage_memory`` with ``problem.capacity`` to check the fit.

    Args:
        problem: The costs.
        boundaries: ``P + 1`` strictly increasing cut positions from 0 to ``L``.

    Returns:
        The partition's :class:`PartitionSolution`.

    Raises:
        BalanceError: The boundaries do not describe ``P`` non-empty stages over ``L`` layers.

    Example:
        >>> p = PartitionProblem.uniform([1, 2, 3, 4], n_stages=2)
        >>> evaluate(p, [0, 2, 4]).stage_times
        (3.0, 7.0)
    """
    cuts = tuple(boundaries)
    problems = _boundary_problems(cuts, problem.n_layers, problem.n_stages)
    if problems:
        raise BalanceError(
            f"boundaries {cuts} do not describe {problem.n_stages} non-empty stages over "
            f"{problem.n_layers} layers: " + "; ".join(problems) + f"; pass "
            f"{problem.n_stages + 1} strictly increasing cut positions from 0 to "
            f"{problem.n_layers}"
        )
    spans = list(pairwise(cuts))
    times = tuple(stage_time(problem, j, a, b) for j, (a, b) in enumerate(spans))
    memory = tuple(math.fsum(problem.memory[a:b]) for a, b in spans)
    return PartitionSolution(cuts, times, memory, max(times))


def solve(problem: PartitionProblem) -> PartitionSolution:
    """Finds the partition with the smallest bottleneck that fits every device's memory.

    Ties within a relative ``1e-12`` of the optimum go to the smallest total stage time,
    and remaining ties to the lexicographically smallest boundaries (see the module
    docstring for why this takes two dynamic programs).

    Args:
        problem: The costs.

    Returns:
        The optimal :class:`PartitionSolution`.

    Raises:
        InfeasibleError: ``P > L``, or no partition fits the memory limits; its
            ``min_devices`` says how many of the largest devices would do.

    Example:
        >>> p = PartitionProblem.uniform([4, 1, 1, 1, 1], n_stages=2)
        >>> solve(p).boundaries
        (0, 1, 5)
    """
    if problem.n_stages > problem.n_layers:
        raise _too_many_stages(problem)
    costs = _Costs(problem)
    bottleneck = _suffix_table(costs, max, math.inf)[0][0]
    if math.isinf(bottleneck):
        raise _out_of_memory(problem)
    limit = bottleneck + _slack(bottleneck)
    totals = _suffix_table(costs, operator.add, limit)
    return evaluate(problem, _first_boundaries(costs, limit, totals))


def lower_bound(problem: PartitionProblem) -> float:
    """A bottleneck no partition can beat, for reporting optimality gaps.

    The larger of: the slowest layer on its fastest device, and the total of every layer's
    fastest time spread evenly over the ``P`` stages. Transfers are left out.

    Args:
        problem: The costs.

    Returns:
        A number ``<= solve(problem).bottleneck``.

    Example:
        >>> lower_bound(PartitionProblem.uniform([1, 1, 1, 5], n_stages=2))
        5.0
    """
    fastest: list[float] = [min(column) for column in zip(*problem.compute)]
    return max(max(fastest), math.fsum(fastest) / problem.n_stages)


class _Costs:
    """Stage times and memory fit in O(1) from per-stage prefix sums (solve's inner loop)."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.n_stages = problem.n_stages
        self.n_layers = problem.n_layers
        sums: dict[int, list[float]] = {}  # one per distinct row object (devices of a kind)
        for row in problem.compute:
            if id(row) not in sums:
                sums[id(row)] = list(accumulate(row, initial=0.0))
        self.prefix = [sums[id(row)] for row in problem.compute]
        self.memory_prefix = list(accumulate(problem.memory, initial=0.0))
        self.transfer = problem.transfer
        self.capacity = problem.capacity

    def options(self, j: int, a: int, limit: float) -> Iterator[tuple[int, float]]:
        """Yields ``(b, time)`` for each end ``b`` of stage ``j`` from layer ``a`` that fits.

        Fits means: memory within the device, time within ``limit``, and enough layers left
        for the later stages. Both memory and time grow with ``b``, so the scan stops early.
        """
        prefix, memory = self.prefix[j], self.memory_prefix
        arrival = self.transfer[j][a] if j > 0 and a > 0 else 0.0
        last = self.n_layers - (self.n_stages - 1 - j)
        for b in range(a + 1, last + 1):
            time = prefix[b] - prefix[a] + arrival
            if memory[b] - memory[a] > self.capacity[j] or time > limit:
                return
            yield b, time


def _suffix_table(
    costs: _Costs, combine: Callable[[float, float], float], limit: float
) -> list[list[float]]:
    """``best[j][a]``: best cost of stages ``j..P-1`` over layers ``[a, L)``, or ``inf``.

    ``combine`` folds one stage's time into the rest's cost: ``max`` for the bottleneck,
    ``+`` for the total.
    """
    n_stages, n_layers = costs.n_stages, costs.n_layers
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_layers] = 0.0
    bottleneck = combine is max
    memory = costs.memory_prefix
    for j in reversed(range(n_stages)):
        rest, row = best[j + 1], best[j]
        prefix, capacity = costs.prefix[j], costs.capacity[j]
        last = n_layers - (n_stages - 1 - j)
        for a in range(j, n_layers - (n_stages - j) + 1):
            # costs.options(j, a, limit), inlined (the search's hottest loop); a stage time
            # at or above the best so far cannot improve it (the rest adds, or maxes, >= 0),
            # and stage times grow with b: stop there too.
            arrival = costs.transfer[j][a] if j > 0 and a > 0 else 0.0
            value = math.inf
            for b in range(a + 1, last + 1):
                time = prefix[b] - prefix[a] + arrival
                if memory[b] - memory[a] > capacity or time > limit or time >= value:
                    break
                after = rest[b]
                cost = (time if time > after else after) if bottleneck else time + after
                if cost < value:
                    value = cost
            row[a] = value
    return best


def _first_boundaries(
    costs: _Costs, limit: float, totals: list[list[float]]
) -> tuple[int, ...]:
    """Walks forward taking the smallest cut that still allows a near-minimal total."""
    target = totals[0][0] + _slack(totals[0][0])
    cuts, spent = [0], 0.0
    for j in range(costs.n_stages):
        # The optimal path itself passes this test, so a candidate always exists.
        b, time = next(
            (b, time)
            for b, time in costs.options(j, cuts[-1], limit)
            if spent + time + totals[j + 1][b] <= target
        )
        cuts.append(b)
        spent += time
    return tuple(cuts)


def _slack(value: float) -> float:
    return _REL_TOL * max(1.0, abs(value))


def _min_devices(memory: Sequence[float], capacity: float) -> int | None:
    """Fewest contiguous stages of ``capacity`` bytes holding ``memory``; greedy is optimal."""
    if any(m > capacity for m in memory):
        return None
    count, load = 1, 0.0
    for m in memory:
        if load + m > capacity:
            count, load = count + 1, 0.0
        load += m
    return count


def _too_many_stages(problem: PartitionProblem) -> InfeasibleError:
    return InfeasibleError(
        f"cannot split {problem.n_layers} layers into {problem.n_stages} non-empty stages; "
        f"pass at most {problem.n_layers} stages",
        _min_devices(problem.memory, max(problem.capacity)),
    )


def _out_of_memory(problem: PartitionProblem) -> InfeasibleError:
    largest = max(problem.capacity)
    need = _min_devices(problem.memory, largest)
    head = (
        f"no partition of {problem.n_layers} layers into {problem.n_stages} stages fits: "
        f"{_describe_limits(problem.capacity)}; "
    )
    if need is None:
        layer = max(range(problem.n_layers), key=problem.memory.__getitem__)
        tail = (
            f"layer {layer} alone needs {_format_bytes(problem.memory[layer])}, more than "
            "any device; reduce its memory (activation checkpointing, smaller micro-batches) "
            "or use larger devices"
        )
    elif len(set(problem.capacity)) == 1:
        tail = (
            f"{need} devices of that size would fit; use at least {need} stages or reduce "
            "per-layer memory (activation checkpointing, smaller micro-batches)"
        )
    else:
        tail = (
            f"{need} device{'s' if need > 1 else ''} of the largest size "
            f"({_format_bytes(largest)}) would fit; "
            + (
                "give the stages with small limits larger devices, or reorder the devices"
                if need <= problem.n_stages
                else "use more or larger devices, or reduce per-layer memory"
            )
        )
    return InfeasibleError(head + tail, need)


def _describe_limits(capacity: Sequence[float]) -> str:
    if len(set(capacity)) == 1:
        return f"stage memory limit {_format_bytes(capacity[0])}"
    return "stage memory limits " + ", ".join(_format_bytes(c) for c in capacity)


def _format_bytes(n: float) -> str:
    """Decimal units: ``1e9`` bytes is ``"1.0 GB"``."""
    if math.isinf(n):
        return "unlimited"
    power = 0
    while n >= 1000 and power < len(_BYTE_UNITS) - 1:
        n /= 1000
        power += 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {_BYTE_UNITS[power]}"


def _boundary_problems(cuts: Sequence[int], n_layers: int, n_stages: int) -> list[str]:
    if not all(isinstance(c, numbers.Integral) for c in cuts):
        return [f"{cuts} holds a non-integer; cut positions are layer indices"]
    problems = []
    if len(cuts) != n_stages + 1:
        problems.append(f"they are {len(cuts)} positions, not P + 1 = {n_stages + 1}")
    if cuts and cuts[0] != 0:
        problems.append(f"the first is {cuts[0]}, not 0")
    if cuts and cuts[-1] != n_layers:
        problems.append(f"the last is {cuts[-1]}, not L = {n_layers}")
    steps = [j for j, (a, b) in enumerate(pairwise(cuts)) if not a < b]
    if steps:
        problems.append(
            f"stage {steps[0]} is empty or reversed ({cuts[steps[0]]} to {cuts[steps[0] + 1]})"
        )
    return problems


def balanced_cuts(problem: PartitionProblem, limit: float) -> tuple[int, ...]:
    """Cuts with every stage time within ``limit`` that minimise the sum of squared stage times.

    For the interleaved schedule a device's load is the sum of its chunks, and the solver's
    optimum only bounds the largest chunk (its ties leave the first chunks nearly empty);
    spreading the layers evenly over all chunks balances the devices too.
    """
    n, layers = problem.n_stages, problem.n_layers
    limit *= 1 + 1e-9
    prefix = [0.0]
    for t in problem.compute[0]:
        prefix.append(prefix[-1] + t)
    mem = [0.0]
    for b in problem.memory:
        mem.append(mem[-1] + b)
    best = [[math.inf] * (layers + 1) for _ in range(n + 1)]
    choice = [[0] * (layers + 1) for _ in range(n + 1)]
    best[n][layers] = 0.0
    for k in reversed(range(n)):
        for a in range(k, layers - (n - k) + 1):
            arrival = problem.transfer[k][a] if k and a else 0.0
            for b in range(a + 1, layers - (n - k - 1) + 1):
                time = prefix[b] - prefix[a] + arrival
                if time > limit or mem[b] - mem[a] > problem.capacity[k]:
                    break
                cost = time * time + best[k + 1][b]
                if cost < best[k][a]:
                    best[k][a], choice[k][a] = cost, b
    if math.isinf(best[0][0]):
        return solve(problem).boundaries
    cuts = [0]
    for k in range(n):
        cuts.append(choice[k][cuts[-1]])
    return tuple(cuts)
