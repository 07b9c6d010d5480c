"""The link between a CPU world's ranks is measured (``link_probe``), not assumed; under
the reference CPU spec (tests) planning uses the reference link, so it stays deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_harness import launch, results

from partitioner.cost.devices import REFERENCE_CPU
from partitioner.planning.world import LOOPBACK, REFERENCE_LOOPBACK, world_cluster
from partitioner.planning.world_agreement import cpu_world_link, post_figures
from partitioner.runtime.distributed.link_probe import COLLECTIVE_BYTES, COMPUTING_BETWEEN

WORKER = Path(__file__).with_name("link_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_agrees_on_the_measured_link(world: int) -> None:
    """Pairs of ranks exchange messages (a lone last rank of 3 waits), one pair at a time
    and all at once; every rank gets the slowest pair's latencies and bandwidth, positive
    and finite, the latency with every pair at once never below the one of a lone pair, the
    compute a rank loses after waiting for its peer (``wake``) finite and not negative, and
    the all-reduces every rank times together the same on every rank, the loss all-reduce
    as a pipeline's ranks reach it one by one, and what the ranks' optimizer steps get done
    at once (never more than one step per rank, never less than
    one rank's alone shared by all), and what posting a message costs its sender."""
    per_rank = results(launch(WORKER, world, [], timeout=120))
    figures = {(r[0]["latency"], r[0]["bandwidth"], r[0]["busy"], r[0]["wake"],
                tuple(r[0]["collective"]), r[0]["scalar"],
                tuple(r[0]["pairs"]) if r[0]["pairs"] is not None else None,
                r[0]["optimizer_gain"], tuple(r[0]["staggered"]), tuple(r[0]["posting"]),
                tuple(tuple(row) for row in r[0]["computing"]))
               for r in per_rank}
    assert len(figures) == 1, figures
    (latency, bandwidth, busy, wake, (mid, big), scalar, pairs, gain, staggered,
     posting, computing) = figures.pop()
    assert 1 / world <= gain <= world
    assert 0 < latency <= busy < 1.0 and 1e6 < bandwidth < 1e13
    assert 0 <= wake < 0.1
    # Every rank's all-reduces of 64 KiB and 4 MiB (the collective's fit): the larger
    # buffer never costs less than a ring's bytes over the pairs' bandwidth.
    assert 0 < mid < 1.0 and 0 < big < 10.0
    assert 0 < scalar < 1.0  # one number, as the step's loss is all-reduced
    # The same, the ranks arriving one by one (a pipeline's): the last rank out after the
    # last in, on the host's one clock; at least a message's way back.
    assert len(staggered) == 2 and all(latency / 2 < t < 1.0 for t in staggered)
    # Within pairs (every pair at once): timed where the world has more than one pair's
    # ranks (a lone last rank of 3 times nothing; the slowest pair counts).
    assert (pairs is None) == (world == 2)
    if pairs is not None:
        assert 0 < pairs[0] < 1.0 and 0 < pairs[1] < 10.0
    assert big >= 2 * (world - 1) / world * COLLECTIVE_BYTES[1] / bandwidth * 0.5
    # Posting a message (the isend call on the sender), 4 bytes and 1 MiB: positive, under a
    # second; the link built from them charges no negative time.
    assert all(0 < t < 1.0 for t in posting), posting
    figures = post_figures(posting)
    assert figures["post_latency"] == posting[0] and figures["post_bandwidth"] >= 0
    # An all-reduce between computations (a tensor-parallel forward's), per group size
    # (pairs, and the whole world of more than 2) and per compute length: the compute
    # about as long as asked, the all-reduce's cycle cost not negative, under a second.
    sizes = [2, world] if world > 2 else [2]
    assert [n for n, _, _ in computing] == [n for n in sizes for _ in COMPUTING_BETWEEN]
    for (_, between, took), asked in zip(computing, COMPUTING_BETWEEN * len(sizes)):
        assert asked / 4 < between < asked * 8 and 0 <= took < 1.0, computing


def test_reference_spec_plans_with_the_reference_link() -> None:
    # No world needed: one host under the reference spec takes the pinned link.
    assert cpu_world_link(["host", "host"]) is REFERENCE_LOOPBACK
    assert cpu_world_link(["a", "b"]) is None  # across hosts: the assumed presets
    assert cpu_world_link(["host"]) is None  # one rank sends nothing


def test_world_cluster_plans_with_the_given_link() -> None:
    cluster = world_cluster(["h", "h"], "cpu", cpu=REFERENCE_CPU, link=REFERENCE_LOOPBACK)
    assert cluster.intra_node is REFERENCE_LOOPBACK
    assert world_cluster(["h", "h"], "cpu", cpu=REFERENCE_CPU).intra_node == LOOPBACK


def test_the_ring_steps_are_fitted_above_a_lone_pairs_message_not_the_busy_pairs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The busy pairs' median round trip reads about 50 us or 2 ms by the probe on 4 ranks
    of 2 cores: as the floor of the ring's fit it decided every tensor-parallel
    all-reduce's step. The all-reduces timed decide; a lone pair's message is the floor."""
    import partitioner.planning.world_agreement as agreement
    from partitioner.cost.devices import DeviceSpec
    from partitioner.cost.links import LinkSpec, fit_ring_steps
    from partitioner.runtime.distributed.link_probe import ProbedLink

    probed = ProbedLink(latency=5e-5, bandwidth=3e9, busy_latency=2e-3, wake=1e-4,
                        collective=(5e-3, 8e-3), scalar=1e-3, pairs=(1e-3, 4.5e-3),
                        optimizer_gain=1.8)
    monkeypatch.setattr(agreement, "probe_link", lambda: probed)
    monkeypatch.setattr(agreement, "cpu_spec",
                        lambda: DeviceSpec("cpu (measured)", {"fp32": 1e11}, 2**34, 6e10))
    monkeypatch.setattr(agreement.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(agreement, "_MEASURED_LINKS", {})
    link = agreement.cpu_world_link(["host"] * 4)
    assert link is not None and link.busy_latency == 2e-3
    lone = LinkSpec("pairs", 3e9, 5e-5)
    (two, *pair_fit), (four, *ring_fit) = link.rings
    assert (two, four) == (2, 4)
    assert tuple(pair_fit) == fit_ring_steps(2, COLLECTIVE_BYTES, probed.pairs, lone)
    assert tuple(ring_fit) == fit_ring_steps(4, COLLECTIVE_BYTES, probed.collective, lone)
    assert pair_fit[0] < 1e-3 < probed.busy_latency  # the 64 KiB pair took 1 ms in 2 steps
