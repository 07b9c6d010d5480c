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
stages compute or wait, and every pair at once (what a collective's step was taken to
pay before collectives were timed, below). On the 2-core VM with 4 ranks the two were 65-90 us and
about 2 ms (2026-12-04): planned with the second, a 4-stage pipeline of one micro-batch
was predicted at 22 ms and ran 13-16 ms. It takes about 50 round trips per pair. Then
every rank all-reduces two buffer sizes together (:data:`COLLECTIVE_BYTES`): what a
collective's steps cost is fitted to those, since gloo's ring does not cost what the pairs'
messages suggest; within pairs too (every pair at once); and one number, as the step's
loss is all-reduced.

A rank that waits lets its core idle, and its next compute runs slow: on that VM a 4-rank
pipeline of a small MLP spent 0.2-0.5 ms more on each action than the same work took back
to back, 1.8x its stages' predicted compute. The probe measures that too, per pair: the
receiver times a small forward and backward back to back, then right after waiting while
its peer computes for :data:`WAKE_GAP` (``LinkSpec.wake``: the excess), and what posting
a message costs the sender (``LinkSpec.post_time``: its compute waits for the ``isend``
call, which writes into the socket). Last, what the
ranks' optimizer steps get done at once (``partitioner.runtime.distributed.optimizer_probe``).
Example:
    >>> probe_link  # doctest: +ELLIPSIS
    <function probe_link at 0x...>
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.optimizer_probe import probe_optimizer_gain

__all__ = ["probe_link", "ProbedLink", "SMALL_ROUNDS", "LARGE_BYTES", "WAKE_GAP",
           "WAKE_ROUNDS", "COLLECTIVE_BYTES", "COLLECTIVE_ROUNDS", "STAGGER_GAP",
           "STAGGER_ROUNDS", "STAGGER_AFTER", "POST_BYTES", "POST_ROUNDS", "COMPUTING_BETWEEN",
           "COMPUTING_ROUNDS", "COMPUTING_CYCLES"]

SMALL_ROUNDS = 40
"""Round trips of a 4-byte message timed for the latency (after 5 not timed)."""

LARGE_BYTES = 8 << 20
"""The message size timed for the bandwidth (5 round trips)."""

WAKE_GAP = 5e-3
"""Seconds a rank waits for its peer before its compute is timed for the wake cost; a rank
waiting this long or longer loses all of ``LinkSpec.wake``, a shorter wait its share
(measured on the 2-core CI VM, a small MLP's forward and backward after waits of 0.5, 2 and
5 ms over the same back to back: 0.08-0.30, 0.22-0.59 and 0.50-0.90 ms)."""

WAKE_ROUNDS = 15
"""Rounds timed for the wake cost (about 5.5 ms each)."""

COLLECTIVE_BYTES = (64 << 10, 4 << 20)
"""Buffer sizes of the all-reduces timed over every rank: the ring's step latency and
bandwidth are fitted to them (``partitioner.cost.links.fit_ring_steps``). A ping-pong of
pairs does not predict gloo's collective: on the 2-core CI VM (2026-12-04) a 64 KiB
all-reduce took 0.32 ms on 2 ranks and 4.4 ms on 4, where the pairs' latencies (46 and 74
us) gave 0.11 and 0.48 ms."""

STAGGER_GAP = 1e-3
"""Seconds between the ranks' arrivals at the staggered loss all-reduce
(:func:`_staggered_scalar`): the last rank first, rank 0 last, as a pipeline's stages finish
their backwards."""

STAGGER_ROUNDS = 24
"""Staggered loss all-reduces timed per :data:`STAGGER_AFTER` (after 2 not timed); their
mean counts, the slowest tenth left out (:func:`_trimmed_mean`). Not the median: on the
2-core CI VM with 2 ranks (2026-12-05, 17:55 UTC) the last rank came out 0.2-0.5 ms after
the last one in, median, but 1-5 ms in a quarter to a third of the rounds, means 0.4-1.8
ms over 30; traced in a pipeline (``wide``, ``pp=2``), the first stage's rank came out
1-3 ms after the last one in, where the probe's median of nine had read 0.2-0.3."""

STAGGER_AFTER = (5e-4, 5e-3)
"""Seconds each rank computes once released from the staggered loss all-reduce (its
optimizer step): with more ranks than cores, the ranks released first hold the cores the
others need to come out. Traced on the 2-core CI VM with 4 gloo ranks, the last rank came
out 1.1-1.7 ms after the last one in where the optimizer steps took 0.3-0.4 ms (``mlp``
x4), 2.1-4.3 ms where they took 16 ms (``wide`` x4); the probe read about 1.5 and 3-6 ms
for these two."""

POST_BYTES = 1 << 20
"""The larger message whose posting is timed (the smaller is 4 bytes): what the sending
rank spends in ``isend`` itself (gloo writes what the socket takes in the caller's thread)
before it computes again. On the 2-core CI VM (2026-12-05, 20:15 UTC) a lone pair posted
4 KiB in 0.04 ms, 512 KiB in 0.10 and 2 MiB in 0.39, and the compute after it ran no
slower."""

POST_ROUNDS = 15
"""Messages of each size timed for their posting (after 3 not timed); the median counts."""

COMPUTING_BETWEEN = (1e-3, 4e-3)
"""Seconds each rank computes between the all-reduces of :func:`_computing_all_reduces` (a
tensor-parallel forward's products between its all-reduces). On the 2-core CI VM
(2026-12-06, 01:20 UTC) a 64 KiB all-reduce of 2 gloo ranks took 0.8-1.8 ms between short
computations (what :func:`_all_reduces` times) and 0.5-1.5 ms more between 1-3 ms of
compute; 4 ranks in pairs 0.1-1.9 ms more, all 4 at once 1.8-3.5 ms more."""

COMPUTING_ROUNDS = 20
"""Rounds of :data:`COMPUTING_CYCLES` timed per :data:`COMPUTING_BETWEEN` (after 2 not
timed), with and without the all-reduces; their means count, the slowest tenth left out."""

COMPUTING_CYCLES = 4
"""Cycles of compute and all-reduce per round (the ranks meet at a barrier before each
round, not between its cycles: the first of them enters together, the others from
compute)."""

COLLECTIVE_ROUNDS = 60
"""All-reduces timed per size (after 5 not timed: the first of a size sets gloo's buffers
up, 1.7x the later ones on 2 ranks). Sixty, not twenty: on the 2-core CI VM a 64 KiB
all-reduce of 2 ranks takes about 0.3 or about 3 ms, and the means of twenty in a row
(the slowest two left out) read 0.30-2.34 ms within one world's 300, whose mean was 1.2
and 1.7 ms in two worlds (2026-12-05); the probes of five worlds read 0.47-1.65 ms."""


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


def _posting(peer: int, first: bool, tensor: torch.Tensor, rounds: int) -> float:
    """Seconds the first rank of a pair spends posting ``tensor`` to ``peer`` (the
    ``isend`` call, not the transfer), the median of ``rounds``; the peer receives it and
    answers with one number, so each message finds the link idle. 0 on the peer."""
    ack = torch.zeros(1)
    times = []
    for _ in range(rounds):
        if first:
            start = time.perf_counter()
            work = dist.isend(tensor, peer)
            times.append(time.perf_counter() - start)
            assert work is not None, "isend in a group this rank belongs to"
            work.wait()
            dist.recv(ack, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(ack, peer)
    return statistics.median(times) if times else 0.0


def _wake(peer: int, first: bool, tensor: torch.Tensor, rounds: int) -> float:
    """Seconds a rank's compute loses right after waiting for a message: the receiver
    times a small forward and backward back to back (the steady figure the cost model's
    compute times are), then, each round, waits while its peer computes for
    :data:`WAKE_GAP` and times it once; the median of those over the steady one (0 on the
    peer, which computes without waiting)."""
    work = _reference_work()
    steady = 0.0
    if not first:
        for _ in range(10):
            work()
        times = []
        for _ in range(30):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        steady = statistics.median(times)
    colds = []
    for _ in range(rounds):
        if first:
            end = time.perf_counter() + WAKE_GAP
            while time.perf_counter() < end:  # the peer computes: this rank's core is busy
                work()
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            start = time.perf_counter()
            work()
            colds.append(time.perf_counter() - start)
            dist.send(tensor, peer)
    return max(statistics.median(colds) - steady, 0.0) if colds else 0.0


def _reference_work() -> Callable[[], None]:
    """A forward and backward of a small MLP (about 0.2 ms on one core of the CI VM)."""
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(128, 256, generator=generator, requires_grad=True)
    w2 = torch.randn(256, 128, generator=generator, requires_grad=True)
    x = torch.randn(64, 128, generator=generator)

    def work() -> None:
        w1.grad = w2.grad = None
        (torch.relu(x @ w1) @ w2).sum().backward()
    return work


@dataclass(frozen=True)
class ProbedLink:
    """What :func:`probe_link` measured, agreed by every rank (the slowest pair's).

    Attributes:
        latency: seconds per message with one pair exchanging at a time.
        bandwidth: bytes per second of one large message.
        busy_latency: seconds per message with every pair exchanging at once.
        wake: seconds a rank's compute loses after waiting :data:`WAKE_GAP` for a message.
        collective: seconds of an all-reduce over every rank of each of
            :data:`COLLECTIVE_BYTES` (``(0, 0)`` in a world of one).
        scalar: seconds of an all-reduce of one float64 over every rank, the step's loss
            all-reduce (``DistributedPipeline._reduce_loss``; 0 in a world of one).
        pairs: as ``collective`` within pairs of ranks, every pair at once (the groups of
            two that tensor parallelism and replicas reduce in); ``None`` in worlds of 2 or
            fewer.
        optimizer_gain: the ranks' optimizer steps at once against one alone
            (:func:`~partitioner.runtime.distributed.optimizer_probe.probe_optimizer_gain`);
            1.0 in a world of one.
        staggered: per :data:`STAGGER_AFTER` (the compute that follows), seconds from the
            last rank's arrival at the one-number all-reduce to the last rank's release,
            the ranks arriving one after another (:func:`_staggered_scalar`; 0 in a world
            of one).
        posting: seconds a rank spends posting a message of 4 bytes and of
            :data:`POST_BYTES` to its peer, one pair at a time (:func:`_posting`; 0 in a
            world of one).
        computing: ``(group size, seconds computed between, seconds)`` per group size
            timed (pairs, and the whole world of more than 2) and per
            :data:`COMPUTING_BETWEEN`: an all-reduce of ``COLLECTIVE_BYTES[0]`` between
            computations of that length, every group at once
            (:func:`_computing_all_reduces`; empty in a world of one).
    """

    latency: float
    bandwidth: float
    busy_latency: float
    wake: float
    collective: tuple[float, float]
    scalar: float = 0.0
    pairs: tuple[float, float] | None = None
    optimizer_gain: float = 1.0
    staggered: tuple[float, ...] = ()
    posting: tuple[float, float] = (0.0, 0.0)
    computing: tuple[tuple[int, float, float], ...] = ()


def probe_link() -> ProbedLink:
    """The link between this world's ranks (collective: every rank calls it).

    Raises:
        CommunicationError: a rank stopped answering (``communicating``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    first = rank % 2 == 0
    small, large = torch.zeros(1), torch.zeros(LARGE_BYTES // 4)
    posted = torch.zeros(POST_BYTES // 4)
    latency = busy = per_large = wake = post_small = post_large = 0.0
    with communicating("measuring the link between ranks (send/recv pairs)"):
        dist.barrier()
        for pair in range(world // 2):  # one pair at a time: the others wait
            if rank // 2 == pair and peer < world:
                _round_trips(peer, first, small, 5)
                latency = _round_trips(peer, first, small, SMALL_ROUNDS)
                wake = _wake(peer, first, small, WAKE_ROUNDS)
                _posting(peer, first, posted, 3)
                post_small = _posting(peer, first, small, POST_ROUNDS)
                post_large = _posting(peer, first, posted, POST_ROUNDS)
            dist.barrier()
        if peer < world:  # every pair at once
            _round_trips(peer, first, small, 5)
            busy = _round_trips(peer, first, small, SMALL_ROUNDS)
            per_large = _round_trips(peer, first, large, 5)
        buffers = [torch.zeros(n // 4) for n in COLLECTIVE_BYTES]
        scalar = torch.zeros(1, dtype=torch.float64)
        reduced = ([_all_reduces(scalar), *(_all_reduces(b) for b in buffers)] if world > 1
                   else [0.0, 0.0, 0.0])
        paired = _pair_all_reduces(buffers) if world > 2 else [0.0, 0.0]
        computing = _computing_rows(buffers[0]) if world > 1 else []
        staggered = [_staggered_scalar(scalar, STAGGER_ROUNDS, after) if world > 1 else 0.0
                     for after in STAGGER_AFTER]
        agreed = torch.tensor([latency, per_large, busy, wake, *reduced, *paired, post_small,
                               post_large, *staggered], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    latency, per_large, busy, wake, one, mid, big, pair_mid, pair_big, post_small, \
        post_large = (float(v) for v in agreed[:11])
    rows = []
    if computing:
        got = torch.tensor([v for _, between, took in computing for v in (between, took)],
                           dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)  # the slowest group's, as above
        rows = [(n, float(got[2 * i]), float(got[2 * i + 1]))
                for i, (n, _, _) in enumerate(computing)]
    # The latency's share of a large message: a lone pair's message, at most half of it.
    # Not the busy pairs' median: it reads about 50 us or 2 ms by the probe on 4 ranks of 2
    # cores, which took 2 ms off 8 MiB round trips of about 3 ms and doubled the bandwidth.
    bandwidth = LARGE_BYTES / max(per_large - latency, per_large / 2, 1e-9)
    return ProbedLink(latency, bandwidth, max(busy, latency), wake, (mid, big), one,
                      (pair_mid, pair_big) if world > 2 else None, probe_optimizer_gain(),
                      tuple(float(v) for v in agreed[11:]), (post_small, post_large),
                      tuple(rows))


def _staggered_scalar(tensor: torch.Tensor, rounds: int, after: float) -> float:
    """Seconds from the last rank's arrival at an all-reduce of ``tensor`` (one number) to
    the last rank's release, as a pipeline's ranks reach the step's loss all-reduce: rank
    ``r`` computes ``(world - 1 - r)`` :data:`STAGGER_GAP` before it (the last stage
    finishes its backward first, the first stage last) and ``after`` seconds once released
    (its optimizer step). The mean of ``rounds``, the slowest tenth left out, on the host's
    one clock (``perf_counter`` is the host's monotonic clock in every process: the probe
    runs in one-host worlds).

    Traced on the 2-core CI VM, 4 gloo ranks of ``mlp([1024, 4096, 1024, 4096, 1024])``
    as ``pp=4``: rank 0, the last to arrive, was released 0.6 ms later and the others
    2.1-4.3 ms later, where the same all-reduce entered together took 1.0-1.7 ms.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    work = _reference_work()
    marks = torch.zeros(rounds + 2, world, 2, dtype=torch.float64)
    for k in range(rounds + 2):
        dist.barrier()
        end = time.perf_counter() + (world - 1 - rank) * STAGGER_GAP
        while time.perf_counter() < end:
            work()
        arrived = time.perf_counter()
        dist.all_reduce(tensor)
        released = time.perf_counter()
        marks[k, rank] = torch.tensor([arrived, released], dtype=torch.float64)
        end = released + after
        while time.perf_counter() < end:
            work()
    dist.all_reduce(marks)  # each rank filled its own row
    spans = [float(m[:, 1].max() - m[:, 0].max()) for m in marks[2:]]
    return max(_trimmed_mean(spans), 0.0)


def _trimmed_mean(times: list[float]) -> float:
    """The mean of ``times`` with the slowest tenth left out: a step pays the slow calls as
    well as the fast ones, but not one that waited for another process's time slice."""
    kept = sorted(times)[:max(1, len(times) - len(times) // 10)]
    return sum(kept) / len(kept)


def _all_reduces(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Seconds of one all-reduce of ``tensor`` over ``group`` (every rank) between short
    computations, as tensor parallelism and bucketed gradients call it: the mean of
    :data:`COLLECTIVE_ROUNDS` after 5 not timed, the slowest tenth left out. A mean, not a
    median: on the 2-core CI VM a 32 KiB all-reduce of 2 ranks took about 0.3 ms or about
    3 ms, the slow ones 20-50% of the calls (2026-12-04), and a step pays their sum."""
    work = _reference_work()
    times = []
    for k in range(COLLECTIVE_ROUNDS + 5):
        work()
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if k >= 5:
            times.append(time.perf_counter() - start)
    return _trimmed_mean(times)


def _pair_all_reduces(buffers: list[torch.Tensor]) -> list[float]:
    """Seconds of an all-reduce of each buffer within this rank's pair (``2k``,
    ``2k + 1``), every pair at once; a lone last rank times nothing (0)."""
    return _in_pairs(lambda mine: [_all_reduces(b, mine) for b in buffers],
                     [0.0] * len(buffers))


def _in_pairs(timed: Callable[[dist.ProcessGroup], list[float]],
              alone: list[float]) -> list[float]:
    """``timed`` of this rank's pair's group (``2k``, ``2k + 1``), every pair at once;
    ``alone`` on a lone last rank. Every rank creates every pair's group, as
    ``new_group`` requires."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]
    mine = groups[rank // 2] if rank // 2 < len(groups) else None
    dist.barrier()
    times = timed(mine) if mine is not None else alone
    dist.barrier()
    if mine is not None:
        dist.destroy_process_group(mine)
    return times


def _computing_rows(tensor: torch.Tensor) -> list[tuple[int, float, float]]:
    """``(group size, seconds computed between, seconds)`` of :func:`_computing_all_reduces`
    per :data:`COMPUTING_BETWEEN`: within pairs (every pair at once), and over the whole
    world where it has more than two ranks (collective)."""
    world = dist.get_world_size()
    rows = []
    if world > 2:
        got = _in_pairs(lambda mine: [v for between in COMPUTING_BETWEEN for v in
                                      _computing_all_reduces(tensor, between, mine)],
                        [0.0] * 2 * len(COMPUTING_BETWEEN))
        rows += [(2, got[2 * i], got[2 * i + 1]) for i in range(len(COMPUTING_BETWEEN))]
    rows += [(world, *_computing_all_reduces(tensor, between)) for between in
             COMPUTING_BETWEEN]
    return rows


def _computing_all_reduces(tensor: torch.Tensor, between: float,
                           group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """``(seconds computed between, seconds)`` of an all-reduce of ``tensor`` over
    ``group`` (every rank) that each rank enters from about ``between`` seconds of compute
    and leaves into the next, as a tensor-parallel forward's products and all-reduces
    alternate: :data:`COMPUTING_CYCLES` cycles a round timed with the all-reduces and
    without (every rank computing at once), their difference a cycle; the means of
    :data:`COMPUTING_ROUNDS`, the slowest tenth left out.

    On the 2-core CI VM (2026-12-06) with 2 ranks and 3 ms between, the cycle took 2.1 ms
    more than its compute where the same all-reduce between short computations took 1.1-1.3
    ms: a rank released first computes, and its peer, still in the all-reduce, waits for a
    core (:data:`COMPUTING_BETWEEN`).
    """
    work = _reference_work()
    for _ in range(5):
        work()
    start = time.perf_counter()
    for _ in range(10):
        work()
    each = torch.tensor([(time.perf_counter() - start) / 10], dtype=torch.float64)
    dist.all_reduce(each, group=group)  # every rank of the group computes as many
    count = max(1, round(between * dist.get_world_size(group) / float(each)))
    alone: list[float] = []
    cycles: list[float] = []
    for with_all_reduce, into in ((False, alone), (True, cycles)):
        for k in range(COMPUTING_ROUNDS + 2):
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(COMPUTING_CYCLES):
                for _ in range(count):
                    work()
                if with_all_reduce:
                    dist.all_reduce(tensor, group=group)
            if k >= 2:
                into.append((time.perf_counter() - start) / COMPUTING_CYCLES)
    computed = _trimmed_mean(alone)
    return computed, max(_trimmed_mean(cycles) - computed, 0.0)
