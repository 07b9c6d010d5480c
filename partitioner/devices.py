"""Devices: parsing ``devices=`` and what each device can do.

``devices=`` takes device strings (``"cpu"``, ``"cuda:1"``), ``torch.device`` objects, or an
int (that many CUDA devices when CUDA is present, else that many ``"cpu"`` devices). Each
entry is one pipeline stage's device; repeating ``"cpu"`` gives several CPU devices, each with
its own worker thread.

A :class:`DeviceSpec` says how fast and how large a device is, for the cost model. The CPU
spec is measured once per process by a short matrix-product calibration.

Example:
    >>> parse_devices(["cpu", "cpu"])
    [device(type='cpu'), device(type='cpu')]
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from partitioner.errors import DeviceError

__all__ = ["DeviceSpec", "parse_devices", "spec_for", "link_bandwidth"]


@dataclass(frozen=True)
class DeviceSpec:
    """How fast and how large a device is.

    Attributes:
        name: a label ("cpu (measured)", "cuda:0 NVIDIA A100").
        flops: achievable dense floating-point operations per second.
        memory_bytes: memory a stage may use.
        memory_bandwidth: bytes per second between memory and compute.
        op_overhead: seconds of fixed cost per operation (dispatch, kernel launch).
    """

    name: str
    flops: float
    memory_bytes: float
    memory_bandwidth: float
    op_overhead: float = 5e-6

    def __post_init__(self) -> None:
        for field in ("flops", "memory_bytes", "memory_bandwidth"):
            if not getattr(self, field) > 0:
                raise DeviceError(f"DeviceSpec.{field}={getattr(self, field)!r}; it must be > 0")
        if self.op_overhead < 0:
            raise DeviceError(f"DeviceSpec.op_overhead={self.op_overhead!r}; it must be >= 0")


def parse_devices(
        devices: int | str | torch.device | Sequence[str | torch.device]) -> list[torch.device]:
    """Turn ``devices=`` into a list of ``torch.device``.

    Raises:
        DeviceError: for an empty list, an unknown device string, or a CUDA device that
            this machine does not have.
    """
    if isinstance(devices, bool):
        raise DeviceError(f"devices={devices!r}; pass a list such as ['cpu', 'cpu']")
    if isinstance(devices, int):
        if devices < 1:
            raise DeviceError(f"devices={devices}; pass a positive number of devices")
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        return [torch.device(kind, k) if kind == "cuda" else torch.device("cpu")
                for k in range(devices)]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
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
        if device.type == "cuda" and (not torch.cuda.is_available()
                                      or (device.index or 0) >= torch.cuda.device_count()):
            problems.append(f"{entry!r} is not on this machine ({torch.cuda.device_count()} "
                            "CUDA devices); use 'cpu' devices or an existing cuda:N")
        elif device.type not in ("cpu", "cuda", "meta"):
            problems.append(f"{entry!r}: device type {device.type!r} is not supported; use "
                            "'cpu' or 'cuda:N'")
        parsed.append(device)
    if problems:
        raise DeviceError("bad devices: " + "; ".join(problems))
    return parsed


@functools.cache
def _cpu_flops() -> float:
    size = 256
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        torch.mm(a, b)
        runs += 1
    return 2 * size**3 * runs / (time.perf_counter() - start)


def _total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


@functools.cache
def spec_for(device: torch.device) -> DeviceSpec:
    """The :class:`DeviceSpec` of a local device (CPU measured, CUDA from its properties)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        # Without a datasheet entry, assume a mid-range accelerator; the cost model of a
        # known part comes from its preset instead.
        return DeviceSpec(f"{device} {props.name}", 50e12, float(props.total_memory), 1e12,
                          op_overhead=8e-6)
    return DeviceSpec("cpu (measured)", _cpu_flops(), _total_memory(), 10e9, op_overhead=8e-6)


def link_bandwidth(src: torch.device, dst: torch.device) -> float:
    """Bytes per second for a copy from ``src`` to ``dst`` in one process."""
    if src == dst or (src.type == "cpu" and dst.type == "cpu"):
        return 10e9
    return 12e9
