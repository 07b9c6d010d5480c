"""Devices and links: parsing ``devices=``, what each device can do, and clusters.

``devices=`` takes device strings (``"cpu"``, ``"cuda:1"``), ``torch.device`` objects, an int
(that many CUDA devices when CUDA is present, else that many ``"cpu"`` devices), or a
:class:`Cluster`. Each local entry is one pipeline stage's device; repeating ``"cpu"`` gives
several CPU devices, each with its own worker thread, all sharing this machine's cores.

A :class:`DeviceSpec` says how fast and how large a device is: peak FLOP/s per dtype, the
fraction of it large matrix products reach and how that fraction falls for small ones, memory
size and bandwidth, and a fixed cost per operation. A :class:`LinkSpec` is an alpha-beta link
(latency, bandwidth). A :class:`Cluster` is ``nodes x devices_per_node`` devices with a link
inside a node and NICs between nodes, for planning beyond this machine. Presets for V100,
A100-40GB/80GB, H100-SXM, H100-HBM2e-500W and H200 come from public datasheets
(:data:`DEVICES`); the CPU spec is measured by a short calibration
(``partitioner.cost.measure.measure_cpu``).

Example:
    >>> parse_devices(["cpu", "cpu"])
    [device(type='cpu'), device(type='cpu')]
    >>> cluster = Cluster.preset("A100-80GB", nodes=2)
    >>> cluster.size, cluster.node_of(9), cluster.device.flops("bf16") / 1e12
    (16, 1, 312.0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from partitioner.cost.dtypes import dtype_name
from partitioner.cost.links import LINKS, LinkSpec
from partitioner.errors import DeviceError
from partitioner.runtime import device as accelerators

FRESH_RAMP = 8.0
"""Tensors from ``fresh_threshold / FRESH_RAMP`` up are partly faulted in afresh
(:meth:`DeviceSpec.fresh_time`): measured on glibc left to adjust its thresholds, 4 MiB
never, 8 and 16 MiB in part. With them fixed (``partitioner.runtime.host_memory``'s steady
mode) Adam's temporaries of 4-24 MiB weights were reused: a spec's ``fresh_ramp`` is 1."""

__all__ = ["DeviceSpec", "LinkSpec", "Cluster", "DEVICES", "LINKS", "FRESH_RAMP", "parse_devices",
           "interpolate_speedup", "link_bandwidth", "dtype_name", "REFERENCE_CPU"]

@dataclass(frozen=True)
class DeviceSpec:
    """How fast and how large one device is.

    A matrix product of ``f`` FLOPs reaches ``matmul_efficiency * f / (f + matmul_half_flops)``
    of the peak: near ``matmul_efficiency`` for large products, half of it at
    ``matmul_half_flops`` (the work that fills the machine once). Memory-bound operations move
    bytes at ``memory_efficiency * memory_bandwidth``. Every operation also costs
    ``op_overhead`` seconds (kernel launch, framework dispatch). CPU BLAS libraries repack a
    product's weight operand on every call, which costs ``weight bytes / pack_bandwidth``
    whatever the number of rows (0: no repacking, as on GPUs).

    Attributes:
        name: a label (``"A100-80GB"``, ``"cpu (measured)"``).
        peak_flops: dense FLOP/s per dtype name (``"bf16"``, ``"fp32"``, ...); a mapping is
            accepted and stored as sorted pairs.
        memory_bytes: bytes of device memory.
        memory_bandwidth: bytes per second between memory and compute (datasheet peak).
        matmul_efficiency: fraction of peak the largest matrix products reach.
        matmul_half_flops: FLOPs of a product reaching half of ``matmul_efficiency``.
        memory_efficiency: fraction of ``memory_bandwidth`` element-wise kernels reach.
        op_overhead: seconds of fixed cost per operation.
        pack_bandwidth: bytes per second at which a matrix product repacks its weights.
        optimizer_bandwidth: bytes per second the optimizer step's element-wise passes
            reach (0: the achievable memory bandwidth).
        shared_speedup: for devices sharing one host's cores (several ``"cpu"`` devices):
            ``shared_speedup[n - 1]`` is how much faster ``n`` stage workers computing at
            once, with ``1 / n`` of the intra-op threads each (as the runtime gives them),
            get through work than one worker alone with all of them (1.0 first), for the
            calibration's reference work (products of 64 rows by 1024 x 1024 weights). Empty
            for devices with their own compute.
        shared_sizes: the same gain by kind and size of work, as rows ``(flops, s_1, ...,
            s_N)`` (``N = len(shared_speedup)``), ascending in ``flops``: a row with ``flops``
            > 0 is for matrix products of that many FLOPs per call, the row with ``flops`` 0
            for memory-bound ops. Small products gain most from sharing (one product split
            over all the threads synchronises often), large ones least, and memory-bound ops
            can lose. Empty: ``shared_speedup`` for all work.
        fresh_bandwidth: bytes per second at which memory newly mapped for a tensor is first
            written (page faults, the kernel zeroing pages); 0: allocations reuse memory (a
            GPU's caching allocator).
        fresh_threshold: tensors of at least this many bytes get newly mapped memory on
            every allocation (glibc's ``malloc``: above 32 MiB, its largest mmap threshold);
            from ``1 / fresh_ramp`` of it up, a share of them (:meth:`fresh_time`).
        fresh_ramp: how far below ``fresh_threshold`` tensors are faulted in part:
            :data:`FRESH_RAMP` where glibc adjusts its thresholds as the process runs, 1 (none
            below the threshold) where they are fixed.
        action_overhead: seconds the pipeline runtime spends per stage action (one
            micro-batch's forward or backward on one stage: handing it to the stage's
            worker, its stash, autograd bookkeeping), beyond the ops themselves. Measured
            for ``"cpu"`` devices; 0 for the presets.
        thread_latency: seconds per step of a collective between worker threads of one
            process (``"cpu"`` devices' tensor parallelism: a rendezvous, two thread
            wake-ups per rank; ``partitioner.cost.runtime_paths``); the in-process link's
            latency. 0: unmeasured (20 microseconds assumed).
        replica_overhead: seconds one data-parallel replica in one process adds to a
            training step beyond its compute (the split, the hand-offs to and from its
            worker thread, the gradient sum and weight check); 0 for the presets.
        replica_tensor_overhead: seconds each replica beyond the first adds per parameter
            tensor (its weight check and gradient sum: ops and their Python); 0: none.
        fused_linear_overhead: seconds a Linear through ``fused_linear`` (a Python autograd
            function) adds to its forward and backward; 0: none (the presets).
        worker_speed: for devices sharing one host's cores, how fast a stage worker alone
            computes (with its fixed share of the threads, ``runtime/local.py``) against
            one device with all of them; 1.0: as fast (the presets).
        optimizer_tensor_overhead: seconds the optimizer spends per parameter tensor beyond
            the bytes it streams (``torch.optim.Adam``'s loop: kernel calls and Python per
            tensor); 0 for the presets (GPU optimizers run fused or multi-tensor).
        attention_efficiency: fraction of peak a fused attention kernel (FlashAttention-2 in
            torch's SDPA) reaches on its causal FLOPs, forward and backward; 0: as products.
        caller_spin: for devices sharing one host's cores in one process, the seconds at the
            start of a step during which the caller's idle OpenMP helpers, spinning after its
            optimizer step, compete with the step's workers as one more busy worker
            (``benchmarks/caller_spin.py``); 0: none (the presets).

    Raises:
        DeviceError: a value is out of range (every problem listed).
    """

    name: str
    peak_flops: Any
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float = 0.8
    matmul_half_flops: float = 1e9
    memory_efficiency: float = 0.8
    op_overhead: float = 5e-6
    pack_bandwidth: float = 0.0
    optimizer_bandwidth: float = 0.0
    shared_speedup: tuple[float, ...] = field(default=())
    shared_sizes: tuple[tuple[float, ...], ...] = field(default=())
    action_overhead: float = 0.0
    fresh_bandwidth: float = 0.0
    fresh_threshold: float = 0.0
    fresh_ramp: float = FRESH_RAMP
    thread_latency: float = 0.0
    replica_overhead: float = 0.0
    optimizer_tensor_overhead: float = 0.0
    replica_tensor_overhead: float = 0.0
    worker_speed: float = 1.0
    fused_linear_overhead: float = 0.0
    attention_efficiency: float = 0.0
    caller_spin: float = 0.0

    def __post_init__(self) -> None:
        peaks = self.peak_flops
        pairs = tuple(sorted(peaks.items() if isinstance(peaks, Mapping) else
                             (tuple(p) for p in peaks)))
        object.__setattr__(self, "peak_flops", tuple((str(k), float(v)) for k, v in pairs))
        object.__setattr__(self, "shared_speedup", tuple(map(float, self.shared_speedup)))
        object.__setattr__(self, "shared_sizes", tuple(tuple(map(float, row))
                                                       for row in self.shared_sizes))
        problems = [f"peak_flops[{k!r}]={v!r}; it must be > 0" for k, v in self.peak_flops
                    if not v > 0]
        if not self.peak_flops:
            problems.append("peak_flops is empty; give at least {'fp32': FLOP/s}")
        for name in ("memory_bytes", "memory_bandwidth", "matmul_half_flops"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)!r}; it must be > 0")
        if not self.fresh_ramp >= 1:
            problems.append(f"fresh_ramp={self.fresh_ramp!r}; it must be >= 1 (1: no tensor "
                            "below fresh_threshold is faulted in)")
        for name in ("matmul_efficiency", "memory_efficiency", "worker_speed"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"{name}={getattr(self, name)!r}; it must be in (0, 1]")
        for name in ("op_overhead", "pack_bandwidth", "optimizer_bandwidth", "action_overhead",
                     "fresh_bandwidth", "fresh_threshold", "thread_latency",
                     "replica_overhead", "optimizer_tensor_overhead", "attention_efficiency",
                     "replica_tensor_overhead", "fused_linear_overhead", "caller_spin"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name}={getattr(self, name)!r}; it must be >= 0")
        if self.shared_speedup and (self.shared_speedup[0] != 1.0
                                    or any(s <= 0 for s in self.shared_speedup)):
            problems.append(f"shared_speedup={self.shared_speedup}; it starts at 1.0 and "
                            "every entry is > 0")
        problems += _size_problems(self.shared_sizes, len(self.shared_speedup))
        if problems:
            raise DeviceError(f"DeviceSpec {self.name!r}: " + "; ".join(problems))

    def flops(self, dtype: str = "fp32") -> float:
        """Peak FLOP/s for ``dtype`` (fp32's when the dtype has no entry)."""
        table = dict(self.peak_flops)
        return table.get(dtype, table.get("fp32", max(table.values())))

    def matmul_rate(self, flops: float, dtype: str = "fp32") -> float:
        """Achievable FLOP/s of one matrix product of ``flops`` FLOPs."""
        size = max(flops, 1.0)
        return self.flops(dtype) * self.matmul_efficiency * size / (size + self.matmul_half_flops)

    def attention_rate(self, flops: float, dtype: str = "fp32") -> float:
        """Achievable FLOP/s of one fused attention kernel of ``flops`` FLOPs (forward and
        backward alike): :meth:`matmul_rate`'s curve at ``attention_efficiency``.

        Example:
            >>> spec = DEVICES["H100-SXM"]
            >>> round(spec.attention_rate(1e15, "bf16") / spec.matmul_rate(1e15, "bf16"), 3)
            0.437
        """
        efficiency = self.attention_efficiency or self.matmul_efficiency
        return self.matmul_rate(flops, dtype) * efficiency / self.matmul_efficiency

    def fresh_time(self, nbytes: float) -> float:
        """Seconds of first-touching a newly allocated tensor of ``nbytes``: all of it from
        ``fresh_threshold`` up, none below ``fresh_threshold / fresh_ramp`` (the allocator
        reuses memory of that size), a share rising with ``log(nbytes)`` in between.

        glibc's ``malloc`` maps tensors above its mmap threshold (at most 32 MiB) afresh on
        every allocation, and tensors below it come from a heap whose top it returns to the
        system once more than twice the threshold is free there: Adam's step over 16 MiB
        weights faulted in 0.4-1.0 of its two temporaries every step, over 8 MiB weights
        0.2, over 4 MiB ones none (``docs/benchmarks.md``, "Timed in bursts"). A step at
        the threshold predicted a 4-way tensor-parallel split of ``benchmarks/regret.py``'s
        ``wide`` model (16 MiB shards of 64 MiB weights) 3.2x fast.

        Example:
            >>> spec = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, fresh_bandwidth=1e9,
            ...                   fresh_threshold=32 * 2**20)
            >>> [round(spec.fresh_time(m * 2**20) * 1e3, 1) for m in (2, 4, 8, 16, 32, 64)]
            [0.0, 0.0, 2.8, 11.2, 33.6, 67.1]
            >>> steady = replace(spec, fresh_ramp=1.0)
            >>> [round(steady.fresh_time(m * 2**20) * 1e3, 1) for m in (16, 32, 64)]
            [0.0, 33.6, 67.1]
        """
        full = max(self.fresh_threshold, 1.0)
        if not self.fresh_bandwidth or nbytes < full / self.fresh_ramp:
            return 0.0
        if self.fresh_ramp <= 1.0:
            return nbytes / self.fresh_bandwidth
        share = min(1.0, math.log(nbytes * self.fresh_ramp / full) / math.log(self.fresh_ramp))
        return share * nbytes / self.fresh_bandwidth

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes per second element-wise kernels reach."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def optimizer_rate(self) -> float:
        """Bytes per second of the optimizer step's passes."""
        return self.optimizer_bandwidth or self.achievable_bandwidth

    def speedup(self, n: float, flops: float | None = None) -> float:
        """How much faster ``n`` devices sharing this host get through work than one.

        ``n`` may be fractional (devices busy part of the time): linear in between.
        ``flops``: the work is matrix products of that many FLOPs per call (0: memory-bound
        ops; None: the reference work), looked up in ``shared_sizes``, linear in
        ``log(flops)`` between its rows and flat beyond them.

        Example:
            >>> spec = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, shared_speedup=(1, 1.2),
            ...                   shared_sizes=((0, 1, 0.5), (1e7, 1, 1.6), (1e9, 1, 1.0)))
            >>> spec.speedup(2), spec.speedup(2, 1e8), spec.speedup(2, 0), spec.speedup(2, 1e12)
            (1.2, 1.3, 0.5, 1.0)
        """
        if not self.shared_speedup:
            return float(n)
        if flops is None or not self.shared_sizes:
            return interpolate_speedup(self.shared_speedup, n)
        rows = [row for row in self.shared_sizes if (row[0] > 0) == (flops > 0)]
        if not rows:
            return interpolate_speedup(self.shared_speedup, n)
        if flops <= rows[0][0]:
            return interpolate_speedup(rows[0][1:], n)
        for low, high in itertools.pairwise(rows):
            if flops <= high[0]:
                at = math.log(flops / low[0]) / math.log(high[0] / low[0])
                a, b = interpolate_speedup(low[1:], n), interpolate_speedup(high[1:], n)
                return a + at * (b - a)
        return interpolate_speedup(rows[-1][1:], n)

    @property
    def max_speedup(self) -> float:
        """The most any number of devices sharing this host gain over one, for any work."""
        rows = [self.shared_speedup] + [row[1:] for row in self.shared_sizes]
        return max(max(row) for row in rows if row) if self.shared_speedup else math.inf


def interpolate_speedup(table: Sequence[float], n: float) -> float:
    """``table[n - 1]``, linear between whole ``n`` and flat beyond the table's ends."""
    n = min(max(n, 1.0), float(len(table)))
    low = int(n)
    if low == n:
        return float(table[low - 1])
    return table[low - 1] + (n - low) * (table[low] - table[low - 1])


def _size_problems(rows: tuple[tuple[float, ...], ...], width: int) -> list[str]:
    if not rows:
        return []
    if not width:
        return [f"shared_sizes={rows}, but shared_speedup is empty; give both or neither"]
    problems = [f"shared_sizes row {row}: it is (flops >= 0, 1.0, then {width - 1} speedups "
                "> 0)" for row in rows if len(row) != width + 1 or row[0] < 0
                or row[1] != 1.0 or any(x <= 0 for x in row[1:])]
    if [row[0] for row in rows] != sorted({row[0] for row in rows}):
        problems.append(f"shared_sizes={rows}: rows go by strictly ascending flops")
    return problems


_GiB = float(2**30)

# Datasheet figures (dense, no sparsity); every efficiency below is a published measurement
# or says that it is an assumption. None was chosen by comparing with Megatron-LM's table.
# matmul_efficiency: the maximum achievable matmul FLOP/s (MAMF) over peak, from Stas
# Bekman's MAMF finder table (ml-engineering, compute/accelerator, BF16, mean of 100
# iterations after 50 warm-up per shape, as of August 2024): A100 SXM 267.9/312 = 0.859, H100
# SXM 792.1/989 = 0.801 (the table notes "H200 is the same"). It was measured with the GPU
# under continuous matmul load; no clock factor is added (NVIDIA's 1305 MHz A100 HPL clock is
# an FP64 Rpeak convention, and nothing public says how far a long FP16 training run sits
# below MAMF). V100 has no entry: 0.80 is an assumption. matmul_half_flops: the FLOPs the peak
# rate gets through in 5 us (launch, prologue and tail of a kernel), a modelling choice;
# products in large models are far above it. memory_efficiency: read and copy kernels reach
# 0.88-0.90 of HBM bandwidth on A100 (1.80 of 2.04 TB/s, confirmed by Nsight Compute, in
# NVIDIA's developer forum thread "Trouble to reach peak bandwidth of A100", which cites a
# GTC talk's ~90% as the best any kernel reached); 0.85 for the fused element-wise kernels
# of training, a little under that best case. op_overhead: 5 us per kernel, an assumption.
# attention_efficiency: FlashAttention-2 (torch SDPA's bf16 causal kernel) reaches "only 35%
# utilization on the H100 GPU" (FlashAttention-3, Shah et al. 2024, arXiv:2407.08608).
# H100-HBM2e-500W: torchtitan's Grand Teton H100s ("96GB HBM2e with 2.4 TB/sec", "the default
# 500W power limit", benchmarks/llama3_h100_202412_torchtitan.md); their peak "is between SXM
# and NVL, and we don't know its exact value", so SXM's peak and 700 W MAMF: an upper bound.
_HOPPER_FLOPS = {"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12,
                 "fp32": 66.9e12, "fp64": 66.9e12}
_FA2_HOPPER = 0.35
DEVICES: dict[str, DeviceSpec] = {
    "V100": DeviceSpec("V100", {"fp16": 125e12, "bf16": 15.7e12, "fp32": 15.7e12,
                                "fp64": 7.8e12}, 32 * _GiB, 0.9e12, 0.80, 125e12 * 5e-6,
                       0.85, 5e-6),
    "A100-40GB": DeviceSpec("A100-40GB", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12,
                                          "fp32": 19.5e12, "fp64": 19.5e12}, 40 * _GiB,
                            1.555e12, 0.859, 312e12 * 5e-6, 0.85, 5e-6),
    "A100-80GB": DeviceSpec("A100-80GB", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12,
                                          "fp32": 19.5e12, "fp64": 19.5e12}, 80 * _GiB,
                            2.039e12, 0.859, 312e12 * 5e-6, 0.85, 5e-6),
    "H100-SXM": DeviceSpec("H100-SXM", _HOPPER_FLOPS, 80 * _GiB, 3.35e12, 0.801,
                           989e12 * 5e-6, 0.85, 5e-6, attention_efficiency=_FA2_HOPPER),
    "H100-HBM2e-500W": DeviceSpec("H100-HBM2e-500W", _HOPPER_FLOPS, 96 * _GiB, 2.4e12,
                                  0.801, 989e12 * 5e-6, 0.85, 5e-6,
                                  attention_efficiency=_FA2_HOPPER),
    "H200": DeviceSpec("H200", _HOPPER_FLOPS, 141e9, 4.8e12, 0.801, 989e12 * 5e-6, 0.85, 5e-6,
                       attention_efficiency=_FA2_HOPPER),
}
"""Presets from public datasheets, by name."""

REFERENCE_CPU = DeviceSpec(
    "cpu (reference)", {"fp32": 2.0e11, "bf16": 2.0e11, "fp16": 2.0e11, "fp64": 1.0e11},
    24 * _GiB, 2.8e10, 1.0, 2.2e3, 1.0, 5e-6, 1.5e10, 2.4e10,
    shared_speedup=(1.0, 1.2, 1.1, 1.2),
    shared_sizes=((0.0, 1.0, 0.7, 0.6, 0.7), (2.0 * 8 * 2**20, 1.0, 1.6, 1.45, 1.6),
                  (2.0 * 64 * 2**20, 1.0, 1.2, 1.1, 1.2),
                  (2.0 * 256 * 2**20, 1.0, 1.05, 0.95, 1.05),
                  (2.0 * 1024 * 2**20, 1.0, 1.0, 0.9, 1.0)),
    action_overhead=1.5e-4, fresh_bandwidth=3.5e9, fresh_threshold=32 * 2**20,
    thread_latency=6.6e-5, replica_overhead=4.3e-4, optimizer_tensor_overhead=3.6e-5)
"""A fixed 2-core CPU (this project's CI machine, measured with ``measure_cpu`` and the
sharing gains of ``docs/design/003-cost-model.md``): what tests plan with, so plans do not
depend on the machine's timings (``PARTITIONER_CPU_SPEC=reference``)."""


_PRESET_LINKS = {"V100": ("nvlink2", "ib-hdr"), "A100-40GB": ("nvlink3", "ib-hdr"),
                 "A100-80GB": ("nvlink3", "ib-hdr"), "H100-SXM": ("nvlink4", "ib-ndr"),
                 "H100-HBM2e-500W": ("nvlink4", "ib-ndr"), "H200": ("nvlink4", "ib-ndr")}


@dataclass(frozen=True)
class Cluster:
    """``nodes x devices_per_node`` devices with a link inside a node and NICs between nodes.

    Ranks are numbered node by node (rank ``r`` is on node ``r // devices_per_node``). A
    cluster built by :meth:`local` is this machine: ``local`` names its torch devices and
    ``specs`` may give each its own spec.

    Attributes:
        device: the spec of every device (unless ``specs`` overrides it per rank).
        nodes: number of nodes.
        devices_per_node: devices in each node.
        intra_node: the link between two devices of one node.
        inter_node: one NIC's link between nodes (``None`` for a single node).
        nics_per_node: NICs per node (inter-node bandwidth of a node is this many links').
        local: torch device strings, when the cluster is this machine.
        specs: one spec per rank, when the devices differ.
        processes: the local devices are ranks of a torch.distributed world (a process
            each, ``partition_distributed``), not worker threads of one process: their
            replicas all-reduce over the link instead of summing copies in memory, and
            each rank steps its own optimizer at the same time as the others.

    Raises:
        DeviceError: a count is not positive, or a multi-node cluster has no inter-node link.
    """

    device: DeviceSpec
    nodes: int = 1
    devices_per_node: int = 1
    intra_node: LinkSpec = field(default_factory=lambda: LINKS["pcie4"])
    inter_node: LinkSpec | None = None
    nics_per_node: int = 1
    local: tuple[str, ...] = ()
    specs: tuple[DeviceSpec, ...] = ()
    processes: bool = False

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}; it must be an int >= 1"
                    for k in ("nodes", "devices_per_node", "nics_per_node")
                    if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int)
                    or getattr(self, k) < 1]
        if not isinstance(self.processes, bool):
            problems.append(f"processes={self.processes!r}; it must be a bool")
        if not problems and self.nodes > 1 and self.inter_node is None:
            problems.append(f"nodes={self.nodes} but inter_node is None; give the NIC link, "
                            "e.g. LINKS['ib-hdr']")
        if not problems and self.local and len(self.local) != self.size:
            problems.append(f"{len(self.local)} local devices for {self.size} ranks")
        if not problems and self.specs and len(self.specs) != self.size:
            problems.append(f"{len(self.specs)} specs for {self.size} ranks")
        if problems:
            raise DeviceError("bad Cluster: " + "; ".join(problems))

    @classmethod
    def preset(cls, device: str, nodes: int = 1, devices_per_node: int = 8,
               nics_per_node: int | None = None) -> Cluster:
        """A cluster of a preset device with its usual links (NVLink, InfiniBand).

        Args:
            device: a key of :data:`DEVICES`.
            nodes: number of nodes.
            devices_per_node: GPUs per node.
            nics_per_node: InfiniBand NICs per node; one per GPU when omitted.

        Raises:
            DeviceError: for an unknown device name.

        Example:
            >>> Cluster.preset("H100-SXM", nodes=4).inter_node.name
            'InfiniBand NDR 400 Gb/s'
        """
        if device not in DEVICES:
            raise DeviceError(f"no preset device {device!r}; use one of {sorted(DEVICES)} "
                              "or build a DeviceSpec")
        intra, inter = _PRESET_LINKS[device]
        return cls(DEVICES[device], nodes, devices_per_node, LINKS[intra],
                   LINKS[inter] if nodes > 1 else None,
                   nics_per_node if nics_per_node is not None else devices_per_node)

    @classmethod
    def local_devices(cls, devices: Any, specs: Sequence[DeviceSpec]) -> Cluster:
        """This machine's devices as a one-node cluster, with each device's spec.

        ``partitioner.cost.machine.local_cluster`` gives the specs of this machine (a CPU's
        measured once); this only assembles them.

        Example:
            >>> Cluster.local_devices(["cpu", "cpu"], [REFERENCE_CPU] * 2).local
            ('cpu', 'cpu')
        """
        parsed = parse_devices(devices)
        specs = tuple(specs)
        if len(specs) != len(parsed):
            raise DeviceError(f"{len(specs)} specs for {len(parsed)} devices; pass one per "
                              "device")
        kinds = {d.type for d in parsed}
        link = LinkSpec("in process", specs[0].achievable_bandwidth,
                        specs[0].thread_latency or 20e-6) if kinds == {"cpu"} \
            else LINKS["pcie4"]
        return cls(specs[0], 1, len(parsed), link, None, 1, tuple(str(d) for d in parsed),
                   specs if len(set(specs)) > 1 else ())

    @property
    def size(self) -> int:
        """Number of devices (ranks)."""
        return self.nodes * self.devices_per_node

    @property
    def is_local(self) -> bool:
        """Whether the cluster is this machine's devices."""
        return bool(self.local)

    def spec(self, rank: int) -> DeviceSpec:
        """The spec of device ``rank``."""
        return self.specs[rank] if self.specs else self.device

    def node_of(self, rank: int) -> int:
        """The node holding ``rank``."""
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link a point-to-point message from rank ``a`` to rank ``b`` takes.

        Between nodes, every device of a node sends at once (pipeline stages span nodes
        together), so each gets ``nics_per_node / devices_per_node`` of the node's NICs.
        """
        if self.node_of(a) == self.node_of(b) or self.inter_node is None:
            return self.intra_node
        return self._nic_share(1)

    def group_link(self, ranks: Sequence[int]) -> LinkSpec:
        """The per-rank link of a ring collective over ``ranks`` (alpha-beta).

        Inside one node that is the intra-node link. Across nodes, each ring channel crosses
        every node boundary once, so a node's NICs carry ``2 (n - 1) / n * S`` for the
        group whatever ``n``; with ``k`` of the group's ranks per node and every device of
        the node busy in a group shaped alike, the group owns ``k / devices_per_node`` of
        the node's NICs: a per-rank bandwidth of ``nics * nic_bandwidth * k /
        devices_per_node``, never more than the intra-node link.

        Example:
            >>> c = Cluster.preset("A100-80GB", nodes=4)
            >>> c.group_link(range(32)).bandwidth / 1e9, c.group_link([0, 8]).bandwidth / 1e9
            (200.0, 25.0)
        """
        nodes = {self.node_of(r) for r in ranks}
        if len(nodes) <= 1 or self.inter_node is None:
            return self.intra_node
        return self._nic_share(max(1, len(ranks) // len(nodes)))

    def _nic_share(self, ranks_per_node: int) -> LinkSpec:
        assert self.inter_node is not None
        share = self.nics_per_node * self.inter_node.bandwidth * ranks_per_node
        bandwidth = min(share / self.devices_per_node, self.intra_node.bandwidth)
        return replace(self.inter_node, bandwidth=bandwidth)

    def describe(self) -> str:
        """One line: ``"2 x 8 A100-80GB, NVLink 3 inside, 8 x InfiniBand HDR between"``."""
        text = f"{self.nodes} x {self.devices_per_node} {self.device.name}"
        text += f", {self.intra_node.name} inside"
        if self.inter_node is not None and self.nodes > 1:
            text += f", {self.nics_per_node} x {self.inter_node.name} between nodes"
        return text


def parse_devices(
        devices: int | str | torch.device | Cluster | Sequence[str | torch.device]
) -> list[torch.device]:
    """Turn ``devices=`` into a list of ``torch.device``.

    Raises:
        DeviceError: for an empty list, an unknown device string, a CUDA device that this
            machine does not have, or a :class:`Cluster` that is not this machine.
    """
    if isinstance(devices, Cluster):
        if not devices.is_local:
            raise DeviceError(f"devices is a cluster of {devices.describe()}, not this "
                              "machine's devices; plan for it with make_plan(), or run on "
                              "local devices such as ['cpu', 'cpu']")
        devices = list(devices.local)
    if isinstance(devices, bool):
        raise DeviceError(f"devices={devices!r}; pass a list such as ['cpu', 'cpu']")
    if isinstance(devices, int):
        if devices < 1:
            raise DeviceError(f"devices={devices}; pass a positive number of devices")
        if accelerators.available():
            return [accelerators.device(k) for k in range(devices)]
        return [torch.device("cpu")] * devices
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    if not isinstance(devices, Sequence):
        raise DeviceError(f"devices={devices!r} ({type(devices).__name__}); pass a list such "
                          "as ['cpu', 'cpu'], a count such as 2, or a Cluster")
    entries = list(devices)
    if not entries:
        raise DeviceError("devices=[] is empty; pass at least one device, e.g. devices=['cpu']")
    parsed, problems = [], []
    for entry in entries:
        try:
            device = torch.device(entry)
        except (RuntimeError, TypeError) as error:
            problems.append(f"{entry!r} is not a device ({error}); use 'cpu' or 'cuda:N'")
            continue
        if accelerators.is_accelerator(device) and (device.index or 0) >= accelerators.count():
            problems.append(f"{entry!r} is not on this machine ({accelerators.count()} "
                            "CUDA devices); use 'cpu' devices or an existing cuda:N")
        elif device.type not in accelerators.DEVICE_TYPES:
            problems.append(f"{entry!r}: device type {device.type!r} is not supported; use "
                            "'cpu' or 'cuda:N'")
        parsed.append(device)
    if problems:
        raise DeviceError("bad devices: " + "; ".join(problems))
    return parsed


def link_bandwidth(src: torch.device, dst: torch.device) -> float:
    """Bytes per second for a copy from ``src`` to ``dst`` in one process."""
    if src == dst or (src.type == "cpu" and dst.type == "cpu"):
        return math.inf
    return LINKS["pcie4"].effective_bandwidth
