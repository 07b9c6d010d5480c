"""Processes of one host that need the CPU calibration at once measure it once and share it
(partitioner/cost/calibration_cache.py's lock, as torchrun's ranks of a host do)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RANK = Path(__file__).with_name("calibration_rank.py")


@pytest.mark.slow  # several processes
def test_ranks_of_one_host_measure_once_and_share_the_spec(tmp_path: Path) -> None:
    log, barrier = tmp_path / "measured.log", tmp_path / "barrier"
    barrier.mkdir()
    processes = 3
    env = {**os.environ, "PARTITIONER_CPU_SPEC": "", "PARTITIONER_CACHE_DIR": str(tmp_path),
           "PARTITIONER_CALIBRATION_CACHE": "1", "LOCAL_WORLD_SIZE": str(processes)}
    ranks = [subprocess.Popen([sys.executable, str(RANK), str(log), str(barrier),
                               str(processes)], env={**env, "LOCAL_RANK": str(k)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(processes)]
    results = [rank.communicate(timeout=240) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in results]
    assert len(log.read_text().splitlines()) == 1  # one process measured
    specs = {out.strip().splitlines()[-1] for out, _ in results}
    assert len(specs) == 1 and "cpu (measured)" in specs.pop()
    waited = [err for _, err in results if "waiting for its result" in err]
    assert len(waited) <= processes - 1
