"""One of several processes of a host that need the CPU calibration at once (as torchrun's
ranks do), with the measurement replaced by a fast fake that logs each call.

Usage: ``python calibration_rank.py LOG BARRIER_DIR PROCESSES``. Waits until all the
processes have started (a file each in BARRIER_DIR), then asks for the CPU spec the way
planning does (``partitioner.cost.machine.cpu_spec``) and prints its ``repr``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import partitioner.cost.calibration_cache as cache
import partitioner.cost.measure as measure
from partitioner.cost.machine import cpu_spec


def fake_timings(progress: object) -> dict[str, float]:
    with open(sys.argv[1], "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough for the others to reach the lock
    timings = dict.fromkeys(measure.TIMING_KEYS, 1e-3)
    # Each process its own figures: had several measured, their specs would differ.
    timings.update(few=1e-4, some=8e-4, many=3.2e-3, fresh=2e-3, add=1e-3 * (1 + os.getpid() % 97))
    return timings


def main() -> None:
    measure._timings = fake_timings
    cache.foreign_share = lambda start, end=None: 0.0  # the test machine's load is not ours
    barrier, processes = Path(sys.argv[2]), int(sys.argv[3])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(barrier.iterdir())) < processes and time.monotonic() < deadline:
        time.sleep(0.01)
    print(repr(cpu_spec()))


if __name__ == "__main__":
    main()
