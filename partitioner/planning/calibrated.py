"""The workload scaled to this machine: layers and optimizer step timed before planning.

The cost model builds each layer's time from the CPU's calibration (products, bandwidth, a
fixed cost per op). On this 2-core VM it predicted the unpartitioned models of
``benchmarks/regret.py`` 1.2-2.2x faster than they trained: what a layer pays beyond its
products and bytes (autograd's bookkeeping, allocations, convolution kernels slower than
the calibrated products) is not in the spec, and Adam's step was off both ways (0.6-2x).
So when the devices are this machine's CPU, :func:`calibrated` times the model itself, a
few training passes of the captured graph on the example batch
(:func:`partitioner.cost.measure.calibrate`), and scales every layer's cost and the
optimizer's to what it measured; the plan's other terms (pipeline actions, replicas,
collectives between threads, stages sharing the cores) stay the model's, measured by the
CPU's calibration.

A tensor-parallel plan is built on layers merged so that no stage boundary cuts a
column/row pair (``partitioner.planning.compile.split_layers``), costed again on the
capture; :func:`carried` gives them what their layers measured, so the plan built is
predicted with the calibration the search ranked it by.

``calibrate=None`` (``partition``'s default) calibrates only where it can and should: the
devices are this machine's CPU planned with its *measured* spec (a pinned spec or
``PARTITIONER_CPU_SPEC=reference`` is a request for plans that do not depend on this
machine's timings), the weights are real, and a training step is predicted cheap
(:data:`BUDGET`) and small next to the host's memory. ``True`` calibrates whatever the
spec; ``False`` never.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from partitioner.analysis import Analysis
from partitioner.cost.cost import Workload, phase_times
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.cost.machine import local_cluster, measured_cpu_spec
from partitioner.cost.measure import calibrate
from partitioner.errors import PartitionError
from partitioner.planning.predict import Config, predict
from partitioner.request import PlanRequest

__all__ = ["calibrated", "carried", "BUDGET", "should_calibrate"]

BUDGET = 1.0
"""Seconds a training step of the whole model may be predicted to take for
``calibrate=None`` to time it (about ten passes: a few seconds at most)."""

MIN_SECONDS = 0.5
"""Timed passes continue until they last this long (at most 64): a VM's bursts of slowness
span a few passes of a small model, and the median of three read one 1.4x apart from one
plan to the next."""

MEMORY_SHARE = 0.5
"""The share of the host's memory the timed passes may be predicted to need."""


def should_calibrate(analysis: Analysis, request: PlanRequest, cluster: Cluster,
                     workload: Workload) -> bool:
    """Whether to time the model before planning (see the module docstring)."""
    if request.calibrate is not None:
        return request.calibrate
    if not cluster.is_local or any(torch.device(d).type != "cpu" for d in cluster.local):
        return False
    if not measured_cpu_spec() or analysis.inputs is None:
        return False
    gm = analysis.captured.graph_module
    if any(p.is_meta for p in gm.parameters()) or not any(
            p.requires_grad for p in gm.parameters()):
        return False
    spec = cluster.spec(0)
    step = sum(sum(phase_times(layer, spec, workload.batch)) for layer in workload.layers)
    if step > BUDGET:
        return False
    try:
        alone = predict(workload, local_cluster([cluster.local[0]]), Config())
    except PartitionError:
        return False
    return alone.peak_memory <= MEMORY_SHARE * spec.memory_bytes


def calibrated(analysis: Analysis, request: PlanRequest, cluster: Cluster,
               workload: Workload) -> Workload:
    """``workload`` with its layers and optimizer step scaled to this machine's times, when
    :func:`should_calibrate`; else ``workload`` itself."""
    if not should_calibrate(analysis, request, cluster, workload):
        return workload
    layers, step = calibrate(analysis.captured.graph_module, analysis.layers,
                             workload.layers, analysis.inputs or [], cluster.spec(0),
                             workload.batch, progress=request.calibrate is True,
                             optimizer=True, min_seconds=MIN_SECONDS)
    scaled = replace(workload, layers=tuple(layers))
    if not step:
        return scaled
    one = local_cluster([cluster.local[0]])
    predicted = predict(scaled, one, Config()).optimizer_times[0]
    return replace(scaled, optimizer_scale=step / predicted) if predicted > 0 else scaled


def carried(scaled: Workload, merged: Workload, names: Sequence[Sequence[str]],
            spec: DeviceSpec) -> Workload:
    """``merged`` (layers merged from those of ``scaled``, ``names`` listing each one's, and
    costed again) taking the time its layers took in ``scaled`` (their ``call_seconds``
    summed), and its optimizer step's scale; ``merged`` itself when ``scaled`` was not
    calibrated.

    Example:
        >>> from partitioner.cost.cost import LayerCost, Op
        >>> from partitioner.cost.devices import REFERENCE_CPU
        >>> fc = Op("matmul", flops=1e6)
        >>> a, b = (LayerCost(n, (fc,), 0, time_scale=t) for n, t in (("a", 2.0), ("b", 4.0)))
        >>> both = LayerCost("a", (fc, fc), 0)
        >>> out = carried(Workload((a, b), (0.0,) * 3, batch=4, optimizer_scale=1.5),
        ...               Workload((both,), (0.0,) * 2, batch=4), [["a", "b"]], REFERENCE_CPU)
        >>> round(out.layers[0].time_scale, 6), out.optimizer_scale
        (3.0, 1.5)
    """
    if scaled.optimizer_scale == 1.0 and all(c.time_scale == 1.0 and not any(c.call_seconds)
                                             for c in scaled.layers):
        return merged
    by_name = {c.name: c for c in scaled.layers}
    layers = []
    for layer, members in zip(merged.layers, names, strict=True):
        # The members' calls add up; the rest of their time scales the merged layer's ops.
        calls = (sum(by_name[n].call_seconds[0] for n in members),
                 sum(by_name[n].call_seconds[1] for n in members))
        took = sum(sum(phase_times(by_name[n], spec, merged.batch)) for n in members)
        bare = replace(layer, time_scale=1.0, call_seconds=(0.0, 0.0))
        costed = sum(phase_times(bare, spec, merged.batch))
        layers.append(replace(layer, time_scale=max((took - sum(calls)) / costed, 1e-3),
                              call_seconds=calls) if costed > 0 else layer)
    return replace(merged, layers=tuple(layers), optimizer_scale=scaled.optimizer_scale)
