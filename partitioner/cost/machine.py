"""This machine's devices: a GPU's spec from its name, a CPU's pinned, cached or measured once.

Planning for ``"cpu"`` devices needs the CPU's spec. Where it comes from, first match wins:

1. a spec pinned in this process (:func:`pin_cpu_spec`);
2. ``PARTITIONER_CPU_SPEC=reference``: the fixed
   :data:`~partitioner.cost.devices.REFERENCE_CPU` (tests, and anyone who wants plans that
   do not depend on this machine's timings); ``=measure``: measure in this process;
3. the calibration cache of this machine (``~/.cache/partitioner``, keyed by the CPU model,
   core count, torch version and thread count; see
   :func:`partitioner.cost.measure.measure_cpu`): the median of the runs kept there;
4. otherwise measure now (about 3 s), saying so on stderr, and keep the run in the cache.

Example:
    >>> with pinned_cpu_spec(REFERENCE_CPU):
    ...     local_cluster(["cpu", "cpu"]).device.name
    'cpu (reference)'
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from partitioner.cost.device_names import gpu_spec, preset_for
from partitioner.cost.devices import REFERENCE_CPU, Cluster, DeviceSpec, parse_devices
from partitioner.cost.measure import cache_file, cached_cpu_spec, measure_cpu
from partitioner.errors import DeviceError
from partitioner.runtime import device as accelerators
from partitioner.runtime.host_memory import steady_host_memory

__all__ = ["cpu_spec", "measured_cpu_spec", "pin_cpu_spec", "pinned_cpu_spec", "spec_for",
           "local_cluster", "as_cluster", "preset_for"]

_PINNED: list[DeviceSpec] = []
_SOURCES = ("reference", "measure")


def pin_cpu_spec(spec: DeviceSpec | None) -> None:
    """Plan every ``"cpu"`` device of this process with ``spec`` (``None`` unpins)."""
    _PINNED.clear()
    if spec is not None:
        _PINNED.append(spec)


@contextmanager
def pinned_cpu_spec(spec: DeviceSpec) -> Iterator[DeviceSpec]:
    """:func:`pin_cpu_spec` for the duration of a ``with`` block."""
    before = list(_PINNED)
    pin_cpu_spec(spec)
    try:
        yield spec
    finally:
        _PINNED[:] = before


def measured_cpu_spec() -> bool:
    """Whether ``"cpu"`` devices are planned with this machine's measured spec (the cache
    or a measurement: neither pinned nor ``PARTITIONER_CPU_SPEC=reference``)."""
    return not _PINNED and os.environ.get("PARTITIONER_CPU_SPEC", "") != "reference"


def cpu_spec() -> DeviceSpec:
    """The spec ``"cpu"`` devices are planned with (see the module docstring).

    Raises:
        DeviceError: ``PARTITIONER_CPU_SPEC`` names no known source.
    """
    if _PINNED:
        return _PINNED[0]
    source = os.environ.get("PARTITIONER_CPU_SPEC", "")
    if source == "reference":
        return REFERENCE_CPU
    if source not in ("", *_SOURCES):
        raise DeviceError(f"PARTITIONER_CPU_SPEC={source!r}; set it to one of {_SOURCES} "
                          "or unset it (the cached calibration of this machine)")
    if source == "":
        cached = cached_cpu_spec()
        if cached is not None:
            return cached
    return _measure_announced()


@functools.cache
def _measure_announced() -> DeviceSpec:
    where = cache_file()
    sys.stderr.write("partitioner: measuring this machine's CPU for the cost model (about "
                     "3 s, once per machine"
                     + (f"; kept in {where}" if where is not None else "") + ")\n")
    sys.stderr.flush()
    start = time.perf_counter()
    spec = measure_cpu(progress=True)
    sys.stderr.write(f"partitioner: CPU measured in {time.perf_counter() - start:.1f} s\n")
    return spec


def spec_for(device: torch.device) -> DeviceSpec:
    """The :class:`DeviceSpec` of a local device (a CPU's from :func:`cpu_spec`, a GPU's
    from its name: :func:`~partitioner.cost.device_names.gpu_spec`, which assumes a
    mid-range accelerator for a GPU no preset matches). A CPU's makes this process's
    allocator steady first (``partitioner.runtime.host_memory.steady_host_memory``): the
    spec holds under it, and the plan then runs under it."""
    if not accelerators.is_accelerator(device):
        steady_host_memory()
        return cpu_spec()
    name, memory = accelerators.properties(device)
    spec = gpu_spec(name, memory)
    return replace(spec, name=f"{device} {spec.name}" if "assumed" in spec.name
                   else f"{device} {name}")


def local_cluster(devices: Any) -> Cluster:
    """This machine's ``devices`` as a one-node :class:`Cluster`, each with its spec."""
    parsed = parse_devices(devices)
    return Cluster.local_devices(parsed, [spec_for(d) for d in parsed])


def as_cluster(devices: Any) -> Cluster:
    """``devices=`` as a :class:`Cluster` (a cluster as given, else this machine's)."""
    return devices if isinstance(devices, Cluster) else local_cluster(devices)
