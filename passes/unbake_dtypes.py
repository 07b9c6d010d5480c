"""Loosen what an fp32 ``torch.export`` capture baked in about dtypes, for autocast.

A model captured in fp32 and run under ``precision="bf16"``/``"fp16"`` computes in the
low-precision dtype, but its graph still holds two fp32 facts:

* ``aten._assert_tensor_metadata(x, dtype=torch.float32)``, which export records for each
  ``x.to(...)`` (Mixtral's router): under autocast ``x`` is bf16 and the assertion fails. The
  dtype check is dropped (shape, device and layout checks stay).
* ``torch.finfo(x.dtype).min`` evaluated at capture: ``masked_fill(mask, -3.4e38)``
  (DeBERTa-v2's attention) overflows a bf16 tensor. A ``masked_fill`` or ``where`` filling
  with an fp32 extreme fills with the running tensor's extreme instead
  (:func:`~partitioner.runtime.precision.saturate`); in fp32 that is the same value.

Example:
    >>> import torch
    >>> class Mask(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.masked_fill(x < 0, torch.finfo(x.dtype).min)
    >>> program = torch.export.export(Mask(), (torch.randn(2, 3),), strict=False)
    >>> gm = unbake_dtypes(program.module()).graph_module
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     gm(-torch.ones(2, 3, dtype=torch.bfloat16)).isfinite().all().item()
    True
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from partitioner.passes.base import PassResult, graph_modules
from partitioner.runtime.precision import masked_fill_saturated, where_saturated

__all__ = ["unbake_dtypes"]

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default

# op -> (the saturating function calling it, the position of its scalar fill value)
_FILLS = {
    torch.ops.aten.masked_fill.Scalar: (masked_fill_saturated, 2),
    torch.ops.aten.where.ScalarOther: (where_saturated, 2),
}

_FP32_MAX = torch.finfo(torch.float32).max


def unbake_dtypes(gm: fx.GraphModule) -> PassResult:
    """``gm`` with its dtype assertions and fp32-extreme fills made dtype-neutral (in place).

    Returns:
        A :class:`PassResult`; ``modified`` says whether a node changed.
    """
    modified = False
    for graph in graph_modules(gm):  # a no_grad block's body too
        modified = _unbake(graph) or modified
    return PassResult(gm, modified)


def _unbake(gm: fx.GraphModule) -> bool:
    modified = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _ASSERT_METADATA:
            modified = _drop_dtype(node) or modified
        elif node.target in _FILLS:
            function, slot = _FILLS[node.target]
            value = node.args[slot] if len(node.args) > slot else None
            if isinstance(value, float) and math.isfinite(value) and abs(value) >= _FP32_MAX:
                node.target = function
                modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return modified


def _drop_dtype(node: fx.Node) -> bool:
    """Drop the ``dtype`` of an ``_assert_tensor_metadata`` node (positional or keyword)."""
    if len(node.args) > 3 and node.args[3] is not None:
        node.args = (*node.args[:3], None, *node.args[4:])
        return True
    if node.kwargs.get("dtype") is not None:
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
        return True
    return False
