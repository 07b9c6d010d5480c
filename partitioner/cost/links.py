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

from dataclasses import dataclass

from partitioner.errors import DeviceError

__all__ = ["LinkSpec", "LINKS"]


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
            scheduled (``partitioner.runtime.distributed.link_probe``); ``None``: ``latency``.
    """

    name: str
    bandwidth: float
    latency: float
    efficiency: float = 1.0
    busy_latency: float | None = None

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
        if problems:
            raise DeviceError(f"LinkSpec {self.name!r}: " + "; ".join(problems))

    @property
    def step_latency(self) -> float:
        """Seconds per step of a collective: ``busy_latency``, else ``latency``."""
        return self.latency if self.busy_latency is None else self.busy_latency

    @property
    def effective_bandwidth(self) -> float:
        """``bandwidth * efficiency``: bytes per second a transfer actually gets."""
        return self.bandwidth * self.efficiency

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
