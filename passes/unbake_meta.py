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

from partitioner.passes.base import PassResult, graph_modules

__all__ = ["unbake_meta", "bake_meta", "holds_meta_device", "replace_device"]

_META = torch.device("meta")
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


def unbake_meta(gm: fx.GraphModule, device: torch.device) -> PassResult:
    """``gm`` with every meta device in its nodes' arguments replaced by ``device``
    (in place).

    Returns:
        A :class:`PassResult`; ``modified`` says whether a node changed.
    """
    device = torch.device(device)
    if device.type == "meta":
        return PassResult(gm, False)
    return replace_device(gm, _META, device)


def bake_meta(gm: fx.GraphModule, device: torch.device) -> PassResult:
    """The reverse of :func:`unbake_meta`: every ``device`` in ``gm``'s nodes' arguments
    becomes the meta device (in place). A meta-built model captured on fake tensors on
    ``device`` (so that its Python code takes that device's branches) gets a graph that,
    like its tensors, is on meta until a stage is placed.

    Returns:
        A :class:`PassResult`; ``modified`` says whether a node changed.
    """
    return replace_device(gm, torch.device(device), _META)


def replace_device(gm: fx.GraphModule, old: torch.device, new: torch.device) -> PassResult:
    """Every ``old`` device in ``gm``'s nodes' arguments becomes ``new`` (in place), in
    ``gm``'s graph and in every graph it holds: the body of a higher-order op
    (``wrap_with_set_grad_enabled`` for a ``torch.no_grad()`` block, ``wrap_with_autocast``)
    is a submodule graph of its own, and a rotary embedding under ``@torch.no_grad()`` keeps
    its ``.to(x.device)`` there. An autocast block's device type follows too
    (:func:`_follow_autocast`)."""
    modified = False
    for graph in graph_modules(gm):
        modified = _replace_in(graph, old, new) or modified
    return PassResult(gm, modified)


def _replace_in(gm: fx.GraphModule, old: torch.device, new: torch.device) -> bool:
    modified = False
    for node in gm.graph.nodes:
        if _follow_autocast(node, old, new):
            modified = True
        if not _holds((node.args, node.kwargs), old):
            continue
        node.args = _replaced(node.args, old, new)
        node.kwargs = _replaced(node.kwargs, old, new)
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return modified


def _follow_autocast(node: fx.Node, old: torch.device, new: torch.device) -> bool:
    """An autocast block's device type (``wrap_with_autocast("cpu", ...)``, a string, from
    ``torch.autocast(x.device.type, enabled=False)``) follows the tensors: left on the
    capture's type it would not turn off the stage's own autocast on a GPU. A meta-built
    model's blocks name the device it was faked on, whatever it was; no block can name
    meta (autocast has no meta type), so baking leaves them."""
    if node.target is not _AUTOCAST or not node.args or not isinstance(node.args[0], str):
        return False
    kind = node.args[0]
    if new.type == "meta" or kind == new.type or (old.type != "meta" and kind != old.type):
        return False
    node.args = (new.type, *node.args[1:])
    return True


def holds_meta_device(value: Any) -> bool:
    """Whether ``value`` (a node argument, possibly nested) names the meta device."""
    return _holds(value, _META)


def _same(value: torch.device, device: torch.device) -> bool:
    return value.type == device.type and (value.index == device.index
                                          or device.type in ("meta", "cpu"))


def _holds(value: Any, device: torch.device) -> bool:
    if isinstance(value, torch.device):
        return _same(value, device)
    if isinstance(value, (tuple, list)):
        return any(_holds(v, device) for v in value)
    if isinstance(value, dict):
        return any(_holds(v, device) for v in value.values())
    return False


def _replaced(value: Any, old: torch.device, new: torch.device) -> Any:
    if isinstance(value, torch.device):
        return new if _same(value, old) else value
    if isinstance(value, tuple):
        return tuple(_replaced(v, old, new) for v in value)
    if isinstance(value, list):
        return [_replaced(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replaced(v, old, new) for k, v in value.items()}
    return value
