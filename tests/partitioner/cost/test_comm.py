"""Tests of partitioner/cost/comm.py: the alpha-beta costs of point-to-point and collectives."""

from __future__ import annotations

import doctest

import pytest

import partitioner.cost.comm
from partitioner.cost.comm import (
    CommError,
    all_gather_time,
    all_reduce_time,
    collective_time,
    p2p_time,
    reduce_scatter_time,
)
from partitioner.cost.devices import Cluster, LinkSpec
from partitioner.cost.links import fit_ring_steps
from partitioner.errors import DeviceError

LINK = LinkSpec("test", bandwidth=50e9, latency=2e-6)


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_ring_all_reduce_formula(n: int) -> None:
    size = 3e8
    expected = 2 * (n - 1) * (2e-6 + size / (n * 50e9))
    assert all_reduce_time(size, n, LINK) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_all_gather_and_reduce_scatter_are_half_an_all_reduce(n: int) -> None:
    size = 1e9
    half = (n - 1) * (2e-6 + size / (n * 50e9))
    assert all_gather_time(size, n, LINK) == pytest.approx(half)
    assert reduce_scatter_time(size, n, LINK) == pytest.approx(half)
    assert all_reduce_time(size, n, LINK) == pytest.approx(
        reduce_scatter_time(size, n, LINK) + all_gather_time(size, n, LINK))


def test_bandwidth_term_tends_to_twice_the_buffer_over_beta() -> None:
    size = 1e10
    assert all_reduce_time(size, 4096, LinkSpec("l", 1e9, 0.0)) == pytest.approx(
        2 * size / 1e9, rel=1e-3)


def test_single_rank_and_empty_messages_cost_nothing() -> None:
    assert all_reduce_time(1e9, 1, LINK) == 0.0
    assert all_gather_time(0.0, 8, LINK) == 0.0
    assert p2p_time(0.0, LINK) == 0.0
    assert p2p_time(1e6, LINK) == pytest.approx(2e-6 + 1e6 / 50e9)


def test_effective_bandwidth_is_used() -> None:
    slow = LinkSpec("l", 100e9, 0.0, efficiency=0.5)
    assert p2p_time(1e9, slow) == pytest.approx(0.02)


def test_collective_steps_pay_the_busy_latency_and_hand_offs_the_lone_one() -> None:
    # Ranks outnumbering the cores: a message while every pair exchanges waits for its
    # receiver to be scheduled (2 ms), one pair alone does not (0.1 ms).
    busy = LinkSpec("loopback", 2e9, 1e-4, busy_latency=2e-3)
    assert busy.step_latency == 2e-3 and LINK.step_latency == LINK.latency
    assert p2p_time(1e6, busy) == pytest.approx(1e-4 + 1e6 / 2e9)
    assert all_reduce_time(1e6, 2, busy) == pytest.approx(2 * (2e-3 + 1e6 / (2 * 2e9)))
    assert all_gather_time(1e6, 4, busy) == pytest.approx(3 * (2e-3 + 1e6 / (4 * 2e9)))
    with pytest.raises(DeviceError, match="busy_latency=-1.0"):
        LinkSpec("bad", 1e9, 0.0, busy_latency=-1.0)


def test_ring_steps_are_the_timed_group_sizes_and_messages_are_not() -> None:
    # gloo's ring reduces as it receives, and a ring over every rank of an oversubscribed
    # host waits at each step: the steps cost what was timed for the group's size.
    ring = LinkSpec("loopback", 3e9, 4e-5, busy_latency=9e-5,
                    rings=((2, 1.3e-4, 1.2e9), (4, 7e-4, 2e9)))
    assert p2p_time(1e6, ring) == pytest.approx(4e-5 + 1e6 / 3e9)
    assert all_reduce_time(1e6, 2, ring) == pytest.approx(2 * (1.3e-4 + 1e6 / (2 * 1.2e9)))
    assert all_reduce_time(1e6, 4, ring) == pytest.approx(6 * (7e-4 + 1e6 / (4 * 2e9)))
    assert all_gather_time(1e6, 3, ring) == pytest.approx(2 * (7e-4 + 1e6 / (3 * 2e9)))
    assert LINK.ring_step(4) == (LINK.step_latency, LINK.effective_bandwidth)
    for bad in (((1, 1e-4, 1e9),), ((2, -1.0, 1e9),), ((2, 1e-4, 0.0),), ((2, 1e-4),)):
        with pytest.raises(DeviceError, match="rings="):
            LinkSpec("bad", 1e9, 0.0, rings=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_ring_fitted_to_two_timed_all_reduces_gives_them_back(ranks: int) -> None:
    alpha, beta = 7e-4, 0.9e9
    floor = LinkSpec("pairs", 3e9, 5e-5)
    link = LinkSpec("ring", 3e9, 5e-5, rings=((ranks, alpha, beta),))
    sizes = (64 << 10, 4 << 20)
    seconds = (all_reduce_time(sizes[0], ranks, link), all_reduce_time(sizes[1], ranks, link))
    fitted = fit_ring_steps(ranks, sizes, seconds, floor)
    assert fitted == pytest.approx((alpha, beta), rel=1e-9)
    # Noise that would make the ring faster than the pairs keeps the pairs' figures.
    fast = fit_ring_steps(ranks, sizes, (1e-6, 2e-6), floor)
    assert fast == (floor.latency, floor.effective_bandwidth)
    # A larger buffer timed faster than the smaller one: the bandwidth is the pairs'.
    assert fit_ring_steps(ranks, sizes, (5e-3, 4e-3), floor)[1] == floor.effective_bandwidth


def test_bad_arguments_are_reported_together() -> None:
    with pytest.raises(CommError, match="nbytes=-1.*n=0") as info:
        all_reduce_time(-1, 0, LINK)
    assert isinstance(info.value, ValueError)
    with pytest.raises(CommError, match="n=True"):
        all_gather_time(1.0, True, LINK)


def test_collectives_take_the_group_s_link() -> None:
    cluster = Cluster.preset("A100-80GB", nodes=2)
    inside = collective_time("all_reduce", 1e9, range(8), cluster)
    across = collective_time("all_reduce", 1e9, [0, 8], cluster)
    assert inside == pytest.approx(all_reduce_time(1e9, 8, cluster.intra_node))
    assert across == pytest.approx(all_reduce_time(1e9, 2, cluster.group_link([0, 8])))
    assert across > inside
    with pytest.raises(CommError, match="collective 'broadcast' is unknown"):
        collective_time("broadcast", 1.0, [0], cluster)
    with pytest.raises(CommError, match="ranks is empty"):
        collective_time("all_gather", 1.0, [], cluster)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.comm).failed == 0
