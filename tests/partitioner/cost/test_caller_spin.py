"""Tests of partitioner/cost/caller_spin.py: the caller's spinning OpenMP helpers, timed."""

from __future__ import annotations

import doctest
import time

import pytest
import torch

import partitioner.cost.caller_spin
import partitioner.cost.measure
from partitioner.cost.calibration_cache import Run
from partitioner.cost.caller_spin import MAX_WINDOW, spin_timings, spin_window
from partitioner.cost.measure import TIMING_KEYS, median_spec


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.caller_spin).failed == 0


def test_the_window_is_the_lost_time_over_what_a_third_worker_slows_two() -> None:
    # Two workers at gain 2.0 (rate 1.0 each), three at gain 2.0 (rate 2/3): a window of w
    # seconds loses w / 3 of each worker's work, so 1 ms lost is a 3 ms window.
    assert spin_window(0.010, 0.011, 2.0, 2.0) == pytest.approx(0.003)
    assert spin_window(0.010, 0.010, 2.0, 2.0) == 0.0  # nothing lost
    assert spin_window(0.010, 0.009, 2.0, 2.0) == 0.0  # faster after the op: noise
    assert spin_window(0.010, 0.011, 1.0, 1.5) == 0.0  # a third worker costs nothing
    assert spin_window(0.010, 0.500, 2.0, 2.0) == MAX_WINDOW


def test_the_timings_start_the_work_after_a_sleep_and_after_a_parallel_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(partitioner.cost.caller_spin, "SETTLE", 0.0)
    order: list[str] = []
    real_mul = torch.Tensor.mul_

    def mul_(self: torch.Tensor, *args: object) -> torch.Tensor:
        order.append("op")
        return real_mul(self, *args)
    monkeypatch.setattr(torch.Tensor, "mul_", mul_)

    def together() -> None:
        order.append("work")
        time.sleep(0.001)
    timings = spin_timings(together, rounds=2)
    assert sorted(timings) == ["spin_idle", "spin_op"]
    assert all(0.001 <= t < 0.1 for t in timings.values())
    assert order == ["work", "op", "work"] * 2  # idle first, then right after the op


def test_the_calibrated_spec_carries_the_window_of_its_run() -> None:
    # The reference work's gains come from "alone", "two" and "three" (here 1.6 and 1.5):
    # rates 0.8 and 0.5, so a 1 ms loss is a window of 1 / (1 - 0.5 / 0.8) = 2.67 ms.
    timings = {**dict.fromkeys(TIMING_KEYS, 1e-3), "alone": 1e-2, "two": 1.25e-2,
               "three": 2e-2, "spin_idle": 2e-2, "spin_op": 2.1e-2}
    spec = median_spec([Run(timings, 0.0, 0.0)])
    assert spec.speedup(2) == pytest.approx(1.6) and spec.speedup(3) == pytest.approx(1.5)
    assert spec.caller_spin == pytest.approx(0.001 / 0.375)
    quiet = median_spec([Run({**timings, "spin_op": 2e-2}, 0.0, 0.0)])
    assert quiet.caller_spin == 0.0


def test_a_measured_run_times_the_spin() -> None:
    # The real thing, on this machine: a window within its bounds, from two timings.
    with partitioner.cost.measure._together(lambda: torch.ones(2**16).add_(1), 2) as two:
        timings = spin_timings(two, rounds=1)
    assert set(timings) == {"spin_idle", "spin_op"} and min(timings.values()) > 0
    assert 0.0 <= spin_window(timings["spin_idle"], timings["spin_op"], 1.4, 1.3) <= MAX_WINDOW
