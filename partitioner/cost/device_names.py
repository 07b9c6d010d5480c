"""Device-name matching: which preset a GPU's name, or a name a user typed, stands for.

The one place names are matched to :data:`~partitioner.cost.devices.DEVICES`: the local
planner (:func:`partitioner.cost.machine.spec_for`), the multi-process planner
(:func:`partitioner.planning.world.world_cluster`) and the CLI's ``--cluster`` all ask here.

A GPU no preset matches is planned as :data:`ASSUMED_GPU`, a mid-range accelerator with the
GPU's own memory, everywhere (never refused): the spec only ranks plans, every plan it picks
runs correctly, and its name says it is assumed so ``plan.explain()`` shows it. Pass
``cluster=`` (a :class:`~partitioner.cost.devices.Cluster` with a measured or datasheet
:class:`~partitioner.cost.devices.DeviceSpec`) to plan with real figures.

Example:
    >>> preset_for("NVIDIA A100-SXM4-80GB", 80 * 2**30), preset_for("Tesla T4", 16e9)
    ('A100-80GB', None)
    >>> gpu_spec("Tesla T4", 16e9).name
    'Tesla T4 (assumed mid-range)'
    >>> preset_key("h100-sxm")
    'H100-SXM'
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.cost.devices import DEVICES, DeviceSpec

__all__ = ["ASSUMED_GPU", "preset_for", "preset_key", "gpu_spec"]

_GiB = float(2**30)

ASSUMED_GPU = DeviceSpec("GPU (assumed mid-range)", {"fp32": 20e12, "bf16": 100e12},
                         16 * _GiB, 1e12)
"""What an unknown GPU is planned as (its name and memory replaced by the real GPU's)."""

# CUDA's device names contain the family; the first match wins (H200 before H100).
_FAMILIES = (("H200", "H200"), ("H100", "H100-SXM"), ("V100", "V100"))


def preset_for(name: str, memory_bytes: float) -> str | None:
    """The key of :data:`~partitioner.cost.devices.DEVICES` for a GPU that CUDA calls
    ``name`` with ``memory_bytes`` of memory, or ``None`` when no preset matches."""
    for family, preset in _FAMILIES:
        if family in name:
            return preset
    if "A100" in name:
        return "A100-80GB" if memory_bytes / _GiB > 48 else "A100-40GB"
    return None


def preset_key(text: str) -> str | None:
    """The preset a user named, case-insensitively (``"a100-80gb"`` -> ``"A100-80GB"``)."""
    return {key.lower(): key for key in DEVICES}.get(text.lower())


def gpu_spec(name: str, memory_bytes: float) -> DeviceSpec:
    """The spec a GPU called ``name`` is planned with: its preset, else :data:`ASSUMED_GPU`,
    either with the GPU's own memory."""
    preset = preset_for(name, memory_bytes)
    if preset is None:
        return replace(ASSUMED_GPU, name=f"{name} (assumed mid-range)",
                       memory_bytes=float(memory_bytes))
    return replace(DEVICES[preset], memory_bytes=float(memory_bytes))
