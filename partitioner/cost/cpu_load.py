"""How busy other processes keep this machine's cores (Linux ``/proc/stat``).

A timing taken while other processes hold the cores measures them, not the machine: on a
2-core VM one core busy elsewhere stalls every OpenMP barrier of a 2-thread product. The
calibration samples the cores around each run and keeps only quiet ones
(:mod:`partitioner.cost.measure`); the benchmarks report the same share.

Example:
    >>> start = cpu_sample()
    >>> share = foreign_share(start)  # 0.25: others kept a quarter of all cores busy
    >>> share is None or 0.0 <= share
    True
"""

from __future__ import annotations

import os
import time

__all__ = ["Sample", "cpu_sample", "foreign_share"]

Sample = tuple[float, float, float]
"""CPU seconds all processes used, CPU seconds this one used, and the wall clock."""


def cpu_sample() -> Sample | None:
    """A :data:`Sample` of now, or ``None`` where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    own = os.times()  # every thread of this process; not its children
    # Busy: all jiffies but idle (fields[3]) and waiting for I/O (fields[4]).
    return ((sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system, time.perf_counter())


def foreign_share(start: Sample | None, end: Sample | None = None) -> float | None:
    """The share of all cores other processes kept busy between ``start`` and ``end``
    (default: now); ``None`` when unknown (no ``/proc/stat``, or no time passed)."""
    end = end if end is not None else cpu_sample()
    if start is None or end is None:
        return None
    busy, own, wall = (b - a for a, b in zip(start, end))
    if wall <= 0:
        return None
    return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))
