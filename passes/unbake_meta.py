"""Take the meta device out of a graph captured from a model built on it.

A model built under ``torch.device("meta")`` is captured on the meta device, and
``torch.export`` records the device of every tensor ``forward`` creates or checks:
``arange(n, device=meta)`` for positions, ``_assert_tensor_metadata(inv_freq, device=meta)``
and ``inv_freq.to(meta, float32)`` in a rotary embedding, ``to(..., device=meta)`` of
masks. Once a stage's tensors are real on a CPU or GPU those constants are wrong: the
assertions fail ("Tensor device mismatch! Expected: meta, Got: cpu") and the created
tensors hold no data. Every meta device constant becomes the stage's device; no other
device is touched (a ``.to("cpu")`` the model wrote stays).

Example:
    >>> import torch
    >>> class Positions(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.scale = torch.nn.Parameter(torch.ones(3))
    ...     def forward(self, x):
    ...         return x * self.scale + torch.arange(3, device=self.scale.device)
    >>> with torch.device("meta"):
    ...     model = Positions()
    >>> program = torch.export.export(model, (torch.ones(2, 3, device="meta"),), strict=False)
    >>> gm = program.module()
    >>> unbake_meta(gm, torch.device("cpu")).modified
    True
    >>> any("meta" in str(n.kwargs) for n in gm.graph.nodes)
    False
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from partitioner.passes.base import PassResult

__all__ = ["unbake_meta", "holds_meta_device"]

_META = torch.device("meta")


def unbake_meta(gm: fx.GraphModule, device: torch.device) -> PassResult:
    """``gm`` with every meta device in its nodes' arguments replaced by ``device``
    (in place).

    Returns:
        A :class:`PassResult`; ``modified`` says whether a node changed.
    """
    device = torch.device(device)
    if device.type == "meta":
        return PassResult(gm, False)
    modified = False
    for node in gm.graph.nodes:
        if not holds_meta_device((node.args, node.kwargs)):
            continue
        node.args = _replaced(node.args, device)
        node.kwargs = _replaced(node.kwargs, device)
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def holds_meta_device(value: Any) -> bool:
    """Whether ``value`` (a node argument, possibly nested) names the meta device."""
    if isinstance(value, torch.device):
        return value.type == "meta"
    if isinstance(value, (tuple, list)):
        return any(holds_meta_device(v) for v in value)
    if isinstance(value, dict):
        return any(holds_meta_device(v) for v in value.values())
    return False


def _replaced(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device):
        return device if value.type == "meta" else value
    if isinstance(value, tuple):
        return tuple(_replaced(v, device) for v in value)
    if isinstance(value, list):
        return [_replaced(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _replaced(v, device) for k, v in value.items()}
    return value
