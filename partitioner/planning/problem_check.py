"""The checks of a :class:`~partitioner.planning.solver.PartitionProblem`'s tables: numbers
converted to floats, shapes and values checked, every problem named in one message.

Devices of one kind share one row object (``PartitionProblem.uniform`` and the planner's
problems replicate one row ``P`` times): each distinct row is converted and checked once,
which keeps validation a small part of a search that builds thousands of problems.

Example:
    >>> shape_problems(((1.0, 2.0),), ((0.0, 0.0, 0.0),), (1.0,), (1.0,))
    ['memory has 1 entries; pass L = 2']
    >>> value_problems(((1.0, -2.0),), ((0.0, 0.0, 0.0),), (1.0, 1.0), (1.0,))
    ['compute[0][1] is -2.0; it must be finite and >= 0 (clamp noisy measurements at 0)']
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence

from partitioner.errors import ProblemError

__all__ = ["to_numbers", "to_table", "shape_problems", "value_problems"]

Table = Sequence[Sequence[float]]
Row = Sequence[float]


def to_numbers(name: str, values: Iterable[object]) -> tuple[float, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise ProblemError(
            f"{name} is {values!r}, not a sequence; pass a tuple of numbers"
        ) from None
    if all(type(item) is float for item in items):  # the planner's own tables: fast path
        return items  # type: ignore[return-value]
    floats = []
    for item in items:
        if not isinstance(item, numbers.Real):
            raise ProblemError(
                f"{name} holds {item!r}, which is not a number; pass floats"
            )
        floats.append(float(item))
    return tuple(floats)


def to_table(
    name: str, rows: Iterable[Iterable[object]]
) -> tuple[tuple[float, ...], ...]:
    try:
        items = tuple(rows)
    except TypeError:
        raise ProblemError(
            f"{name} is {rows!r}, not a sequence; pass one row per stage"
        ) from None
    # Devices of one kind share one row object (PartitionProblem.uniform, the planner's
    # problems): convert and check each distinct row once.
    done: dict[int, tuple[float, ...]] = {}
    out = []
    for j, row in enumerate(items):
        if id(row) not in done:
            done[id(row)] = to_numbers(f"{name}[{j}]", row)
        out.append(done[id(row)])
    return tuple(out)


def shape_problems(compute: Table, transfer: Table, memory: Row, capacity: Row) -> list[str]:
    """What is wrong with the tables' shapes (every problem, or none)."""
    rows = tuple(len(row) for row in compute)
    if not rows:
        return [
            "compute has no rows; pass one row of per-layer times per stage (P >= 1)"
        ]
    if len(set(rows)) != 1 or rows[0] == 0:
        return [
            f"compute rows have lengths {rows}; give every stage a row of the same L >= 1 times"
        ]
    n_stages, n_layers = len(rows), rows[0]
    problems = []
    lengths = tuple(len(row) for row in transfer)
    if lengths != (n_layers + 1,) * n_stages:
        problems.append(
            f"transfer has {len(lengths)} rows of lengths {lengths}; pass P = {n_stages} "
            f"rows of L + 1 = {n_layers + 1} per-boundary times"
        )
    for name, values, want, what in (("memory", memory, n_layers, "L"),
                                     ("capacity", capacity, n_stages, "P")):
        have = len(values)
        if have != want:
            problems.append(f"{name} has {have} entries; pass {what} = {want}")
    return problems


def value_problems(compute: Table, transfer: Table, memory: Row, capacity: Row) -> list[str]:
    """What is wrong with the tables' numbers (the first bad cell of each table), for
    tables of valid shapes."""
    n_layers = len(compute[0])
    if _all_valid(compute, transfer, memory, capacity):  # messages only when something is bad
        return []
    finite = "must be finite and >= 0 (clamp noisy measurements at 0)"
    # Stage 0 never receives, and boundaries 0 and L are never a stage's start.
    tables = [
        _cells("compute", compute, range(n_layers)),
        _cells("transfer", transfer[1:], range(1, n_layers), first_row=1),
        ((f"memory[{i}]", m) for i, m in enumerate(memory)),
    ]
    problems = [
        p for t in tables for p in _first_bad(t, lambda x: 0 <= x < math.inf, finite)
    ]
    limits = ((f"capacity[{j}]", c) for j, c in enumerate(capacity))
    problems += _first_bad(limits, lambda x: x >= 0, "must be >= 0 (math.inf for no limit)")
    return problems


def _all_valid(compute: Table, transfer: Table, memory: Row, capacity: Row) -> bool:
    n_layers = len(compute[0])
    return (all(0 <= x < math.inf for row in _distinct(compute) for x in row[:n_layers])
            and all(0 <= x < math.inf for row in _distinct(transfer[1:])
                    for x in row[1:n_layers])
            and all(0 <= x < math.inf for x in memory)
            and all(x >= 0 for x in capacity))


def _distinct(rows: Sequence[Sequence[float]]) -> list[Sequence[float]]:
    """``rows`` without repeats of one object (shared rows are checked once)."""
    return list({id(row): row for row in rows}.values())


def _cells(
    name: str, table: Sequence[Sequence[float]], columns: range, first_row: int = 0
) -> Iterator[tuple[str, float]]:
    for j, row in enumerate(table, start=first_row):
        for i in columns:
            yield f"{name}[{j}][{i}]", row[i]


def _first_bad(
    cells: Iterable[tuple[str, float]], ok: Callable[[float], bool], rule: str
) -> list[str]:
    bad = [(label, x) for label, x in cells if not ok(x)]
    if not bad:
        return []
    label, value = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return [f"{label} is {value!r}{more}; it {rule}"]
