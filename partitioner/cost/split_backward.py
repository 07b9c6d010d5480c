"""What a schedule that splits its backwards (``I`` and ``W``: zero-bubble, V-shape) adds
to a stage's actions: every Linear with a weight gradient runs through ``fused_linear`` (a
Python autograd function, ``runtime/fused_linear.py``) whose cost the forward and the
backward share, and the ``W`` action is one more action.

Example:
    >>> from partitioner.cost.cost import LayerCost, Op
    >>> from partitioner.cost.devices import DeviceSpec
    >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, fused_linear_overhead=1e-5)
    >>> layers = [LayerCost("fc", (Op("matmul", flops=1e3, weight_grad=64),))]
    >>> round(split_forward_overhead(layers, cpu) * 1e6, 2)
    6.5
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.cost.cost import LayerCost
from partitioner.cost.devices import DeviceSpec

__all__ = ["FUSED_FORWARD_SHARE", "split_forward_overhead", "split_backward_overhead"]


FUSED_FORWARD_SHARE = 0.65
"""The share of ``DeviceSpec.fused_linear_overhead`` a Linear's forward pays (the autograd
function's ``apply``): 5.0 of 8.2 us for 16 8 x 8 layers and 0.11 of 0.16 ms for `mlp`'s 14
``Linear(128)`` (one thread, 2026-12-05); `mlp` on 2 gloo ranks ran each stage's forward
0.10 ms slower under ``zero_bubble`` than ``1f1b``, where all was charged to ``W``."""


def _fused_products(layers: Sequence[LayerCost]) -> float:
    """Products with a weight gradient, routed through ``fused_linear`` by a split backward
    (convolutions count too: the costs do not tell them apart)."""
    return sum(op.count for layer in layers for op in layer.ops
               if op.kind == "matmul" and op.weight_grad > 0)


def split_forward_overhead(layers: Sequence[LayerCost], spec: DeviceSpec) -> float:
    """Seconds a schedule that splits its backwards adds to a stage's forward of one
    micro-batch: its share (:data:`FUSED_FORWARD_SHARE`) of every product run through
    ``fused_linear``."""
    return FUSED_FORWARD_SHARE * _fused_products(layers) * spec.fused_linear_overhead


def split_backward_overhead(layers: Sequence[LayerCost], spec: DeviceSpec) -> float:
    """Seconds a schedule that splits its backwards (``I`` and ``W``) adds to a stage's
    backward of one micro-batch: the ``W`` action's own runtime cost, and the backward's
    share of every product with a weight gradient run through ``fused_linear`` (whose
    queue the ``W`` action runs; the forward pays the rest, :func:`split_forward_overhead`)."""
    return spec.action_overhead + (1 - FUSED_FORWARD_SHARE) * _fused_products(layers) \
        * spec.fused_linear_overhead
