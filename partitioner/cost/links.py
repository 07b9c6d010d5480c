"""Links between devices: the alpha-beta :class:`LinkSpec` and the presets (:data:`LINKS`).

A message of ``S`` bytes over a link takes ``latency + S / (bandwidth x efficiency)``
(``partitioner.cost.comm`` builds collectives from it). A link measured between the ranks of
one CPU host (``partitioner.runtime.distributed.link_probe``) has two latencies: a lone
pair's, which a pipeline's hand-off pays, and ``busy_latency``, which each step of a
collective pays when every group of the host reduces at once. ``partitioner.cost.devices``
re-exports both names.

Example:
    >>> round(LINKS["nvlink3"].effective_bandwidth / 1e9)
    230
    >>> LinkSpec("loopback", 2e9, 1e-4, busy_latency=2e-3).step_latency
    0.002
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.errors import DeviceError
from partitioner.runtime.distributed.link_probe import WAKE_GAP

__all__ = ["LinkSpec", "LINKS", "WAKE_GAP", "WAKE_FLOOR", "fit_ring_steps"]

WAKE_FLOOR = 0.25
"""The share of :attr:`LinkSpec.wake` any wait costs: on the 2-core CI VM a small MLP's
forward and backward after waits of 0.5, 2 and 5 ms for a gloo message ran 0.08-0.30,
0.22-0.59 and 0.50-0.90 ms over the same back to back (about ``0.15 ms + 0.1 x the wait``):
a quarter of the 5 ms figure, and the rest in proportion to the wait."""



@dataclass(frozen=True)
class LinkSpec:
    """An alpha-beta link: a message of ``S`` bytes takes ``latency + S / bandwidth``.

    Attributes:
        name: a label.
        bandwidth: bytes per second in one direction (datasheet).
        latency: seconds per message (a pipeline's hand-off; a step of a collective unless
            ``busy_latency`` is given).
        efficiency: fraction of ``bandwidth`` reached by collectives in practice.
        busy_latency: seconds per step of a collective that every group of the host runs
            at once (all replicas' gradient all-reduce, every tensor-parallel group's),
            where ranks outnumber the cores and each message waits for its receiver to be
            scheduled (``partitioner.runtime.distributed.link_probe``), where no ``rings``
            were timed; ``None``: ``latency``.
        rings: per group size ``n`` timed in the world, ``(n, step latency, step
            bandwidth)`` of an all-reduce among ``n`` ranks while every group of the host
            reduces at once, fitted to all-reduces the link probe timed
            (:func:`fit_ring_steps`). On the 2-core CI VM with 4 ranks a 64 KiB all-reduce
            took 3.8-4.7 ms over all four and 0.32-0.41 ms within pairs; gloo's ring moves
            bytes at a third of a message's bandwidth. A size not timed takes the next
            larger one timed (the largest past them); none: ``busy_latency`` and
            ``bandwidth x efficiency`` (:meth:`ring_step`).
        scalar_all_reduce: seconds of an all-reduce of one number over the world's ranks
            (the step's loss), measured by the link probe; ``None``: a ring of ``latency``
            hand-offs (with more ranks than cores, 0.5-1.2 ms on 4 ranks of the 2-core CI VM
            against 0.25 ms for six hand-offs).
        staggered_all_reduce: ``(seconds computed once released, seconds)`` pairs, in
            increasing order of the first: from the last rank's arrival at that all-reduce
            to the last rank's release when the ranks arrive one after another, as a
            pipeline's stages do (the first stage's backward ends last), and then compute
            for that long (their optimizer steps: ranks released first hold the cores the
            others need to come out), measured by the link probe; empty:
            ``scalar_all_reduce`` (:meth:`staggered_time`). Traced on 4 gloo ranks of the
            2-core CI VM, the last rank came out 1.1-1.7 ms after the last one in where
            the optimizer steps took 0.3-0.4 ms, 2.1-4.3 ms where they took 16 ms, and
            ranks entering together took 1.0-1.7 ms.
        wake: seconds a rank's compute loses when it starts right after waiting
            ``WAKE_GAP`` or longer for a message (a process that blocked lets its core idle
            or run another process: on the 2-core CI VM the next forward and backward of a
            small MLP ran 0.5-0.9 ms slower after 5 ms); a shorter wait loses less
            (:meth:`wake_time`).
            Measured by the link probe between the ranks of one CPU host; 0: none (the
            presets, and GPU ranks, whose host only launches).
        optimizer_gain: for the ranks of one CPU host, how many ranks' optimizer steps all
            of them stepping at once get done in the time of one rank's step alone
            (``partitioner.runtime.distributed.optimizer_probe``: 4 one-thread ranks of the
            2-core CI VM, 1.7-2.9 where the calibration's element-wise row said 1.02); 0:
            unmeasured (``partitioner.cost.optimizer_steps`` takes that row).
        post_latency: seconds a rank spends posting one message before it computes again
            (the ``isend`` call: gloo writes into the socket in the caller's thread),
            measured by the link probe; 0: none (the presets, NCCL's queued sends).
        post_bandwidth: bytes per second of that posting beyond ``post_latency``; 0: none.
        computing_all_reduce: ``(group size n, seconds computed before, seconds)``, in
            increasing order of the first two: what an all-reduce among ``n`` ranks costs
            beyond its ring's figure (:func:`~partitioner.cost.comm.all_reduce_time` with
            :attr:`rings`) when each rank computes that long between all-reduces, as a
            tensor-parallel forward does (products, all-reduce, products, all-reduce),
            measured by the link probe with every group of the host at once; empty: none
            (the presets; one process's threads). On the 2-core CI VM (2026-12-06) a 64
            KiB all-reduce of 2 gloo ranks cost 0.5-1.5 ms more between 1-3 ms of compute
            than the probe's all-reduces between short ones (:meth:`computing_excess`).
    """

    name: str
    bandwidth: float
    latency: float
    efficiency: float = 1.0
    busy_latency: float | None = None
    wake: float = 0.0
    rings: tuple[tuple[int, float, float], ...] = ()
    scalar_all_reduce: float | None = None
    optimizer_gain: float = 0.0
    staggered_all_reduce: tuple[tuple[float, float], ...] = ()
    post_latency: float = 0.0
    post_bandwidth: float = 0.0
    computing_all_reduce: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if not self.bandwidth > 0:
            problems.append(f"bandwidth={self.bandwidth!r}; it must be > 0")
        if not self.latency >= 0:
            problems.append(f"latency={self.latency!r}; it must be >= 0")
        if not 0 < self.efficiency <= 1:
            problems.append(f"efficiency={self.efficiency!r}; it must be in (0, 1]")
        if self.busy_latency is not None and not self.busy_latency >= 0:
            problems.append(f"busy_latency={self.busy_latency!r}; it must be >= 0 or None")
        bad = [r for r in self.rings if len(r) != 3 or not (int(r[0]) == r[0] >= 2
                                                             and r[1] >= 0 and r[2] > 0)]
        if bad:
            problems.append(f"rings={self.rings!r}; each must be (group size >= 2, step "
                            "latency >= 0, step bandwidth > 0)")
        if self.scalar_all_reduce is not None and not self.scalar_all_reduce >= 0:
            problems.append(f"scalar_all_reduce={self.scalar_all_reduce!r}; it must be >= 0 "
                            "or None")
        points = self.staggered_all_reduce
        if any(len(p) != 2 or not (p[0] >= 0 and p[1] >= 0) for p in points) or any(
                a[0] >= b[0] for a, b in itertools.pairwise(points)):
            problems.append(f"staggered_all_reduce={points!r}; it must be (seconds after "
                            ">= 0, seconds >= 0) pairs in increasing order of the first")
        rows = self.computing_all_reduce
        if any(len(r) != 3 or not (int(r[0]) == r[0] >= 2 and r[1] >= 0 and r[2] >= 0)
               for r in rows) or any(a[:2] >= b[:2] for a, b in itertools.pairwise(rows)):
            problems.append(f"computing_all_reduce={rows!r}; it must be (group size >= 2, "
                            "seconds computed >= 0, seconds >= 0) rows in increasing order "
                            "of the first two")
        if not self.wake >= 0:
            problems.append(f"wake={self.wake!r}; it must be >= 0")
        if not (self.post_latency >= 0 and self.post_bandwidth >= 0):
            problems.append(f"post_latency={self.post_latency!r}, post_bandwidth="
                            f"{self.post_bandwidth!r}; each must be >= 0 (0: none)")
        if not self.optimizer_gain >= 0:
            problems.append(f"optimizer_gain={self.optimizer_gain!r}; it must be >= 0 "
                            "(0: unmeasured)")
        if problems:
            raise DeviceError(f"LinkSpec {self.name!r}: " + "; ".join(problems))

    def staggered_time(self, after: float) -> float | None:
        """Seconds from the last rank's arrival at the loss all-reduce to the last one's
        release when the ranks then compute ``after`` seconds each: interpolated between
        the probe's :attr:`staggered_all_reduce` points, the nearest one outside them;
        ``None`` where none was measured.

        Example:
            >>> link = LinkSpec("l", 3e9, 4e-5, staggered_all_reduce=((1e-3, 1e-3),
            ...                                                      (5e-3, 3e-3)))
            >>> [round(link.staggered_time(a) * 1e3, 2) for a in (0.0, 3e-3, 0.1)]
            [1.0, 2.0, 3.0]
        """
        points = self.staggered_all_reduce
        return _interpolated(points, after) if points else None

    def computing_excess(self, n: int, between: float) -> float:
        """Seconds an all-reduce among ``n`` ranks costs beyond its ring's figure when the
        ranks compute ``between`` seconds before it (:attr:`computing_all_reduce`): the rows
        of the timed group size ``n``, else the next larger one timed, else the largest;
        interpolated in ``between``, the nearest row outside them; 0 where none were timed.

        Example:
            >>> link = LinkSpec("l", 3e9, 4e-5, computing_all_reduce=(
            ...     (2, 1e-3, 5e-4), (2, 4e-3, 1.1e-3), (4, 1e-3, 2e-3)))
            >>> [round(link.computing_excess(2, b) * 1e3, 2) for b in (0.0, 2e-3, 9e-3)]
            [0.5, 0.7, 1.1]
            >>> link.computing_excess(3, 1e-3), LinkSpec("l", 3e9, 4e-5).computing_excess(2, 1)
            (0.002, 0.0)
        """
        if not self.computing_all_reduce:
            return 0.0
        sizes = sorted({r[0] for r in self.computing_all_reduce})
        size = next((s for s in sizes if s >= n), sizes[-1])
        points = [(a, t) for s, a, t in self.computing_all_reduce if s == size]
        return _interpolated(points, between)

    @property
    def step_latency(self) -> float:
        """Seconds per step of a collective: ``busy_latency``, else ``latency``."""
        return self.latency if self.busy_latency is None else self.busy_latency

    @property
    def effective_bandwidth(self) -> float:
        """``bandwidth * efficiency``: bytes per second a transfer actually gets."""
        return self.bandwidth * self.efficiency

    def ring_step(self, n: int) -> tuple[float, float]:
        """``(seconds, bytes per second)`` of one step of a ring collective among ``n``
        ranks: the timed group size ``n`` of :attr:`rings`, else the next larger one timed,
        else the largest; without rings ``step_latency`` and ``effective_bandwidth``.

        Example:
            >>> link = LinkSpec("l", 3e9, 4e-5, rings=((2, 1e-4, 1e9), (4, 7e-4, 2e9)))
            >>> [link.ring_step(n)[0] for n in (2, 3, 4, 8)]
            [0.0001, 0.0007, 0.0007, 0.0007]
        """
        if not self.rings:
            return self.step_latency, self.effective_bandwidth
        timed = sorted(self.rings)
        _, alpha, beta = next((r for r in timed if r[0] >= n), timed[-1])
        return alpha, beta

    def wake_time(self, waited: float) -> float:
        """Seconds a rank's next action loses after waiting ``waited`` seconds for a
        message: :data:`WAKE_FLOOR` of ``wake`` for any wait (the process blocked and its
        core ran another), rising in proportion to all of it at ``WAKE_GAP``; nothing when
        the message was there (``waited`` 0).

        Example:
            >>> link = LinkSpec("loopback", 2e9, 1e-4, wake=4e-4)
            >>> [round(link.wake_time(w) * 1e6) for w in (0.0, 1e-5, 2e-3, 5e-3, 1e-2)]
            [0, 101, 220, 400, 400]
        """
        if waited <= 0:
            return 0.0
        return self.wake * (WAKE_FLOOR + (1 - WAKE_FLOOR) * min(waited / WAKE_GAP, 1.0))

    def post_time(self, nbytes: float) -> float:
        """Seconds the sending rank spends posting a message of ``nbytes`` (its compute
        waits for it): ``post_latency + nbytes / post_bandwidth``.

        Example:
            >>> link = LinkSpec("loopback", 2e9, 1e-4, post_latency=4e-5, post_bandwidth=5e9)
            >>> round(link.post_time(1 << 20) * 1e6), LinkSpec("l", 2e9, 1e-4).post_time(8)
            (250, 0.0)
        """
        per_byte = 1 / self.post_bandwidth if self.post_bandwidth > 0 else 0.0
        return self.post_latency + nbytes * per_byte

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over this link."""
        return self.latency + nbytes / self.effective_bandwidth if nbytes > 0 else 0.0


# NVLink: 25 GB/s per link and direction (V100 6 links, A100 12, H100 18). NCCL's kernels
# copy with 128-byte payloads, about 20 of a link's 25 GB/s (0.8), and on A100 other limits
# hold the 12 links to about 230 of 300 GB/s (0.77): NCCL's maintainer in NVIDIA/nccl-tests
# issue #149 (2023). InfiniBand, per NIC: nccl-tests issue #119 measured an all-reduce bus
# bandwidth of 96 GB/s at the largest sizes (84.8 averaged over sizes down to 8 bytes) over
# 4 HDR NICs rated 100 GB/s together: 0.9. PCIe 0.8 and every latency are assumptions.
LINKS: dict[str, LinkSpec] = {
    "nvlink2": LinkSpec("NVLink 2", 150e9, 5e-6, 0.8),
    "nvlink3": LinkSpec("NVLink 3", 300e9, 5e-6, 230 / 300),
    "nvlink4": LinkSpec("NVLink 4", 450e9, 5e-6, 0.8),
    "pcie4": LinkSpec("PCIe 4.0 x16", 32e9, 10e-6, 0.8),
    "ib-hdr": LinkSpec("InfiniBand HDR 200 Gb/s", 25e9, 10e-6, 0.9),
    "ib-ndr": LinkSpec("InfiniBand NDR 400 Gb/s", 50e9, 10e-6, 0.9),
    # CPU worlds (assumptions; pass cluster= to plan with another link): gloo between the
    # ranks of one node goes through the kernel's loopback, and nodes meet over Ethernet.
    "loopback": LinkSpec("gloo over loopback (assumed)", 5e9, 30e-6),
    "ethernet-10g": LinkSpec("Ethernet 10 Gb/s (assumed)", 1.25e9, 50e-6, 0.9),
}
"""Link presets, by name: the one place links are defined."""


def _interpolated(points: Sequence[tuple[float, float]], x: float) -> float:
    """``points``' ``(x, y)`` line at ``x`` (``x`` increasing), the nearest ``y`` outside."""
    if x <= points[0][0]:
        return points[0][1]
    for (a, t), (b, u) in itertools.pairwise(points):
        if x <= b:
            return t + (u - t) * (x - a) / (b - a)
    return points[-1][1]


def fit_ring_steps(ranks: int, sizes: tuple[float, float], seconds: tuple[float, float],
                   floor: LinkSpec) -> tuple[float, float]:
    """``(step latency, step bandwidth)`` of a ring all-reduce over ``ranks`` that took
    ``seconds`` for buffers of ``sizes`` bytes (the ring's ``2 (n - 1)`` steps each move
    ``S / n``: ``t = 2 (n - 1) (alpha + S / (n beta))``, two sizes, two unknowns). Noise
    that would make either figure better than ``floor``'s point-to-point one keeps that.

    Example:
        >>> floor = LinkSpec("loopback", 3e9, 4e-5)
        >>> alpha, beta = fit_ring_steps(2, (65536, 4 << 20), (316e-6, 3681e-6), floor)
        >>> round(alpha * 1e6), round(beta / 1e9, 2)  # the 2-rank CI VM, 2026-12-04
        (131, 1.23)
    """
    (small, large), (t_small, t_large) = sizes, seconds
    steps = 2 * (ranks - 1)
    per_byte = max((t_large - t_small) / (large - small), 0.0)  # seconds per buffer byte
    beta = min(floor.effective_bandwidth,
               steps / (ranks * per_byte) if per_byte > 0 else floor.effective_bandwidth)
    alpha = max((t_small - steps * small / (ranks * beta)) / steps, floor.latency)
    return alpha, beta
