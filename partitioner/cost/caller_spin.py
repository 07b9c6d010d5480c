"""The caller's spinning OpenMP helpers at the start of a step in one process, timed.

In a training loop in one process the caller runs the optimizer step on its own OpenMP team
(torch's intra-op threads) and then hands the next step to the stage or replica workers.
GNU OpenMP's helpers spin-wait for a while after each parallel op (300,000 turns of
``pause`` by default), so for the first milliseconds of the step one of them competes with
the workers for the cores (``benchmarks/caller_spin.py``: two workers of a few milliseconds
each ran one after the other; ``docs/benchmarks.md``, "the caller's spinning OpenMP
helpers").

The calibration times two workers on the same work twice: after the caller sat idle (its
helpers asleep) and right after a parallel op of the caller. The model counts the helpers as
one more busy worker for the first ``window`` seconds of a step (``DeviceSpec.caller_spin``,
``partitioner.planning.simulate``): the workers then progress at ``gain(3) / 3`` of one
alone instead of ``gain(2) / 2``, so the work they lose, and the time it costs, gives the
window: ``(after op - idle) / (1 - (gain(3) / 3) / (gain(2) / 2))``.

Example:
    >>> round(spin_window(0.020, 0.024, 1.4, 1.26), 4)  # 4 ms lost at rates 0.70 / 0.42
    0.01
    >>> spin_window(0.020, 0.019, 1.4, 1.26)  # no loss measured: no window
    0.0
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["SETTLE", "MAX_WINDOW", "spin_timings", "spin_window"]

SETTLE = 0.05
"""Seconds the caller sleeps before a timing that must start with its helpers asleep:
longer than they spin (up to about 15 ms of a core on the 2-core VM)."""
MAX_WINDOW = 0.05
"""The longest window :func:`spin_window` gives (seconds): a measurement that says more
is noise, not a spin."""


def spin_timings(together: Callable[[], None], rounds: int = 4) -> dict[str, float]:
    """The median seconds of ``together`` (work handed to two workers, waited for) started
    after the caller slept (``"spin_idle"``) and right after a parallel op of the caller
    (``"spin_op"``), in alternating rounds."""
    caller = torch.ones(4 * 2**20)  # large enough for a parallel op on the caller's team
    times: dict[str, list[float]] = {"spin_idle": [], "spin_op": []}
    for _ in range(rounds):
        for key in times:
            time.sleep(SETTLE)
            if key == "spin_op":
                caller.mul_(1.0)
            start = time.perf_counter()
            together()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def spin_window(idle: float, after_op: float, gain2: float, gain3: float) -> float:
    """Seconds at the start of a step during which the caller's helpers count as one more
    busy worker, from two workers' time after the caller slept (``idle``) and right after
    its parallel op (``after_op``), and what two and three workers gain over one on the
    work timed (``gain2``, ``gain3``).

    0 where nothing was lost or a third worker costs the two nothing; at most
    :data:`MAX_WINDOW`.
    """
    lost = after_op - idle
    slowed = 1 - (gain3 / 3) / (gain2 / 2) if gain2 > 0 else 0.0
    if lost <= 0 or slowed <= 0:
        return 0.0
    return min(lost / slowed, MAX_WINDOW)
