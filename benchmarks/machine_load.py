"""How busy other processes kept the machine while a benchmark measured (Linux /proc).

On this 2-core VM one core busy elsewhere stalls every OpenMP barrier of a 2-thread step, so
the benchmarks report (or discard) what ran while other processes were busy::

    start = cpu_sample()
    ...                                   # timed work
    share = foreign_share(start)          # 0.25: others kept a quarter of all cores busy
"""

from __future__ import annotations

import os
import time

Sample = tuple[float, float, float]


def cpu_sample() -> Sample | None:
    """(CPU seconds all processes used, CPU seconds this one used, wall clock), if readable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    own = os.times()
    return ((sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system, time.perf_counter())


def foreign_share(start: Sample | None) -> float | None:
    """Share of all cores other processes kept busy since ``start`` (``None``: unknown)."""
    end = cpu_sample()
    if start is None or end is None:
        return None
    busy, own, wall = (b - a for a, b in zip(start, end))
    return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))
