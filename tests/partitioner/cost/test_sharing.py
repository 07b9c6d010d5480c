"""Tests of partitioner/cost/sharing.py: what a lone worker and two workers at once make of
a layer's work on a shared host, from the part of each op the intra-op threads divide."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.cost.cost import LayerCost, Op
from partitioner.cost.devices import REFERENCE_CPU, DeviceSpec
from partitioner.cost.sharing import (
    GRAIN_SIZE,
    lone_work,
    pair_gain,
    shared_work,
    thread_parts,
)

# A host whose lone worker has half the threads' speed; 3 and 4 workers get 0.9 and 1.0 of
# what 2 do on the reference products; element-wise streams gain 0.9.
CPU = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, 1.0, 1e3, 1.0, 1e-6, pack_bandwidth=1e9,
                 shared_speedup=(1.0, 1.2, 1.08, 1.2),
                 shared_sizes=((0.0, 1.0, 0.9, 0.8, 0.9), (1e8, 1.0, 1.2, 1.08, 1.2)),
                 worker_speed=0.5)


def _product(rows: int, weight: int) -> LayerCost:
    """A Linear's product on ``rows`` rows (samples) with a ``weight`` x ``weight`` matrix."""
    return LayerCost("fc", (Op("matmul", flops=2.0 * weight**2, bytes=8.0 * weight,
                               weight_read=4.0 * weight**2),))


def test_a_product_at_the_full_rate_is_all_the_threads_work_and_gains_nothing() -> None:
    layer = _product(4096, 256)
    seconds, fixed, parallel = thread_parts(layer, layer.ops[0], CPU, 4096)
    assert parallel / (seconds - fixed) > 0.95
    alone, two, three, four = shared_work(layer, CPU, 4096)
    assert alone / two == pytest.approx(1.0, abs=0.06)  # 2 x worker_speed
    assert alone / lone_work(layer, CPU, 4096) == pytest.approx(0.5, abs=0.03)
    # 3 and 4 workers: what the reference products lose against 2, never more than 2 gain.
    assert (alone / three) / (alone / two) == pytest.approx(0.9, rel=1e-3)
    assert (alone / four) / (alone / two) == pytest.approx(1.0, rel=1e-3)
    more = replace(CPU, shared_speedup=(1.0, 1.2, 1.08, 1.5))  # the reference gains at 4
    assert shared_work(layer, more, 4096)[3] == pytest.approx(two, rel=1e-6)


def test_a_product_mostly_repacking_its_weights_gains_from_a_second_worker() -> None:
    # 8 rows of a 1024 x 1024 weight: repacking 4 MiB twice (8.4 ms) against three passes
    # reading it from memory (1.3 ms, which the threads divide) and 17 MFLOP.
    layer = _product(8, 1024)
    seconds, fixed, parallel = thread_parts(layer, layer.ops[0], CPU, 8)
    assert parallel / (seconds - fixed) == pytest.approx(3 * 4.2e-4 / 9.67e-3, rel=0.05)
    alone, two, *_ = shared_work(layer, CPU, 8)
    assert alone / two > 1.7
    assert alone / lone_work(layer, CPU, 8) > 0.85


def test_the_repacking_stays_whole_scaled_like_the_rest() -> None:
    # What the threads do not shorten (repacking the weights, the size curve's loss) is
    # scaled by the calibration as the rest: so is what they divide.
    small = _product(8, 1024)
    slow = replace(small, time_scale=1.6)
    seconds, fixed, parallel = thread_parts(slow, slow.ops[0], CPU, 8)
    assert parallel == pytest.approx(1.6 * thread_parts(small, small.ops[0], CPU, 8)[2])
    assert seconds - fixed > 5 * parallel


def test_pair_gain_is_what_two_workers_at_their_share_get_done() -> None:
    # 1 s of work, 0.6 s of it divided by the threads: a worker takes 1.2 + 0.4 = 1.6 s.
    assert pair_gain(1.0, 0.6, CPU) == pytest.approx(2 / 1.6)
    assert pair_gain(1.0, 0.0, CPU) == 2.0 and pair_gain(1.0, 1.0, CPU) == 1.0


def test_small_element_wise_ops_run_on_one_thread_large_ones_on_all() -> None:
    # torch splits an element-wise kernel from GRAIN_SIZE elements of output on.
    small = LayerCost("relu", (Op("memory", bytes=8.0, out_bytes=4.0),))
    below, above = GRAIN_SIZE // 2, GRAIN_SIZE * 4
    assert thread_parts(small, small.ops[0], CPU, below)[2] == 0.0
    seconds, fixed, parallel = thread_parts(small, small.ops[0], CPU, above)
    assert parallel == pytest.approx(seconds - fixed)
    # One thread each: two workers get twice the work done (less the launches, which they
    # take in turn); a lone worker loses nothing.
    alone, two, *_ = shared_work(small, CPU, below)
    seconds, fixed, _ = thread_parts(small, small.ops[0], CPU, below)
    assert two == pytest.approx((seconds - fixed) / 2 + fixed)
    assert lone_work(small, CPU, below) == pytest.approx(alone)
    # All the threads: the element-wise streams' gain, and the lone worker's share.
    alone, two, *_ = shared_work(small, CPU, above)
    seconds, fixed, _ = thread_parts(small, small.ops[0], CPU, above)
    assert two == pytest.approx((seconds - fixed) / 0.9 + fixed)
    assert lone_work(small, CPU, above) == pytest.approx((seconds - fixed) / 0.5 + fixed)


def test_time_a_layer_measured_beyond_its_flops_is_divided_by_the_threads() -> None:
    # A layer timed in context at 3x its modelled time (time_scale): what a call costs
    # whatever its rows is the calibration's call_seconds, apart; the scaled rest is the
    # rows' work, which the threads divide as they divide the FLOPs (counted as not divided,
    # it had two workers gain 1.46x on GPT-2's LM head, measured 1.04; docs/benchmarks.md).
    layer = _product(4096, 256)
    slow = replace(layer, time_scale=3.0)
    _, _, parallel = thread_parts(layer, layer.ops[0], CPU, 4096)
    seconds, fixed, scaled = thread_parts(slow, slow.ops[0], CPU, 4096)
    assert scaled == pytest.approx(3.0 * parallel)
    assert scaled > 0.95 * (seconds - fixed)
    alone = shared_work(slow, CPU, 4096)[0]
    assert alone / lone_work(slow, CPU, 4096) == pytest.approx(0.5, abs=0.03)


def test_a_spec_without_a_lone_workers_speed_keeps_its_table_by_size() -> None:
    # The presets (worker_speed 1): products gain what shared_sizes says for their FLOPs.
    layer = _product(4096, 256)
    alone, two, *_ = shared_work(layer, REFERENCE_CPU, 4096)
    seconds, fixed, _ = thread_parts(layer, layer.ops[0], REFERENCE_CPU, 4096)
    gain = REFERENCE_CPU.speedup(2, 2.0 * 256**2 * 4096)
    assert two == pytest.approx((seconds - fixed) / gain + fixed)
    assert lone_work(layer, REFERENCE_CPU, 4096) == pytest.approx(alone)


def test_devices_with_their_own_compute_share_nothing() -> None:
    assert shared_work(_product(64, 64), replace(CPU, shared_speedup=(), shared_sizes=()),
                       64) == ()
