"""Tests of partitioner/cost/cpu_load.py: the share of the cores other processes used."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from partitioner.cost.cpu_load import cpu_sample, foreign_share


def test_foreign_share_leaves_out_this_process_s_own_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # 2 s of all cores busy over 1 s of wall clock on 2 cores, 0.5 s of them this process's.
    assert foreign_share((10.0, 1.0, 100.0), (12.0, 1.5, 101.0)) == pytest.approx(0.75)
    assert foreign_share((10.0, 1.0, 100.0), (10.5, 1.5, 101.0)) == 0.0  # all ours


def test_an_unknown_share_is_none() -> None:
    assert foreign_share(None, (1.0, 1.0, 1.0)) is None
    assert foreign_share((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)) is None  # no time passed


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_a_busy_process_is_seen() -> None:
    start = cpu_sample()
    assert start is not None
    spin = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    spin.wait(timeout=60)
    time.sleep(0.05)
    share = foreign_share(start)
    # One spinning process keeps one core busy: at least a fraction of all of them.
    assert share is not None and share > 0.2 / (os.cpu_count() or 1)
