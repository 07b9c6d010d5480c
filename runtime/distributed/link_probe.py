"""The link between this world's ranks, measured: what a message costs, not what is assumed.

A pipeline's activations and gradients cross between ranks as point-to-point messages, and
data-parallel gradients as collectives whose every step is one message; the cost model
charges each ``latency + bytes / bandwidth`` (``partitioner.cost.devices.LinkSpec``). On
one CPU host gloo's messages go through the kernel's loopback and wait for the receiving
process to be scheduled: with more ranks than cores a message costs hundreds of
microseconds, ten times the 30 assumed before (measured on the 2-core CI machine: 4 ranks,
a 4-byte message one way 0.6 ms while other processes ran). :func:`probe_link` measures it
in the world that will run the plan: ranks ``2k`` and ``2k + 1`` exchange messages (a lone
last rank waits), first small ones for the latency, then 8 MiB ones for the bandwidth
(medians of round trips), and the slowest pair's figures count, agreed by an all-reduce so
every rank plans with the same link. The latency is measured twice: one pair at a time
(the others wait in a barrier), which is what a pipeline's hand-off pays while the other
stages compute or wait, and every pair at once, which is what a collective pays when every
replica's group reduces together. On the 2-core VM with 4 ranks the two were 65-90 us and
about 2 ms (2026-12-04): planned with the second, a 4-stage pipeline of one micro-batch
was predicted at 22 ms and ran 13-16 ms. It takes about 50 round trips per pair.
Example:
    >>> probe_link  # doctest: +ELLIPSIS
    <function probe_link at 0x...>
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from partitioner.runtime.distributed.comm_failure import communicating

__all__ = ["probe_link", "SMALL_ROUNDS", "LARGE_BYTES"]

SMALL_ROUNDS = 40
"""Round trips of a 4-byte message timed for the latency (after 5 not timed)."""

LARGE_BYTES = 8 << 20
"""The message size timed for the bandwidth (5 round trips)."""


def _round_trips(peer: int, first: bool, tensor: torch.Tensor, rounds: int) -> float:
    """Seconds per one-way message: the median of ``rounds`` round trips with ``peer``
    (a median: one round trip that waited for another process's time slice is not the
    link's figure)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if first:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def probe_link() -> tuple[float, float, float]:
    """``(latency, bandwidth, busy_latency)`` of one message between this world's ranks:
    seconds per message with one pair exchanging at a time, bytes per second, and seconds
    per message with every pair exchanging at once; the slowest pair's (collective: every
    rank calls it).

    Raises:
        CommunicationError: a rank stopped answering (``communicating``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    first = rank % 2 == 0
    small, large = torch.zeros(1), torch.zeros(LARGE_BYTES // 4)
    latency = busy = per_large = 0.0
    with communicating("measuring the link between ranks (send/recv pairs)"):
        dist.barrier()
        for pair in range(world // 2):  # one pair at a time: the others wait
            if rank // 2 == pair and peer < world:
                _round_trips(peer, first, small, 5)
                latency = _round_trips(peer, first, small, SMALL_ROUNDS)
            dist.barrier()
        if peer < world:  # every pair at once
            _round_trips(peer, first, small, 5)
            busy = _round_trips(peer, first, small, SMALL_ROUNDS)
            per_large = _round_trips(peer, first, large, 5)
        agreed = torch.tensor([latency, per_large, busy], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    latency, per_large, busy = (float(v) for v in agreed)
    # The latency's share of a large message: at most half of it, whatever the noise.
    bandwidth = LARGE_BYTES / max(per_large - busy, per_large / 2, 1e-9)
    return latency, bandwidth, max(busy, latency)
