"""Route Linear layers through ``partitioner.runtime.fused_linear``: weight gradients added in
place.

Rewrites every ``nn.Linear`` call (``call_module`` of an exact ``nn.Linear`` without
module hooks: a hooked module must stay a module call so its hooks run), every
``F.linear`` call and every ``aten.linear`` node (what ``torch.export`` produces) into a
call of ``partitioner.runtime.fused_linear.linear_module`` / ``linear``, which compute the same
values
and the same gradients, but add each weight gradient into ``.grad`` with one in-place
product instead of a fresh tensor plus an accumulation (see that module).

The fusion is a Python autograd function: each call costs tens of microseconds more than
``F.linear`` (80 us a forward and backward on the 2-core CI VM), and it saves the fresh
weight-gradient tensor and its addition only when gradients accumulate over several
micro-batches of a step. :func:`fusion_threshold` says, for a stage run a given way, which
Linear layers gain: none with one micro-batch a step (the first gradient is taken, not
added: a replica, a pipeline of ``chunks=1``), those whose weight has at least
:data:`CPU_MIN_WEIGHT` elements on a CPU with several (measured crossover: a Linear(256,
256) of 8-row micro-batches loses 30%, a Linear(512, 512) gains 35%), and all of them
whenever the schedule splits its backwards (its ``W`` actions are the queued products).

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> fuse_weight_grads(gm).modified
    True
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from partitioner.passes.base import PassError, PassResult
from partitioner.runtime import fused_linear
from partitioner.runtime.schedule_registry import schedule_kind

__all__ = ["fuse_weight_grads", "fusion_threshold", "CPU_MIN_WEIGHT"]

CPU_MIN_WEIGHT = 1 << 17
"""Elements of the smallest Linear weight the fusion pays for on a CPU (see the module doc)."""

_FUNCTIONS = {F.linear, torch.ops.aten.linear.default}


def fusion_threshold(chunks: int, schedule: str, device_type: str) -> int | None:
    """The fewest weight elements a Linear of a stage needs to be fused, for a stage run
    with ``chunks`` micro-batches a step under ``schedule`` on ``device_type``; ``None``:
    fuse none (see the module doc).

    Example:
        >>> fusion_threshold(1, "1f1b", "cpu") is None, fusion_threshold(1, "zero_bubble", "cpu")
        (True, 0)
        >>> fusion_threshold(4, "gpipe", "cpu") == CPU_MIN_WEIGHT
        True
        >>> fusion_threshold(4, "gpipe", "cuda")
        0
    """
    if schedule_kind(schedule).splits_backward:
        return 0
    if chunks <= 1:
        return None
    return CPU_MIN_WEIGHT if device_type == "cpu" else 0


def fuse_weight_grads(gm: fx.GraphModule, min_weight: int | None = 0) -> PassResult:
    """Rewrite the Linear calls of ``gm`` in place (see the module doc): the ``nn.Linear``
    modules whose weight has at least ``min_weight`` elements, and every ``F.linear`` /
    ``aten.linear`` call (whose weight the graph does not know) when ``min_weight`` is 0.
    ``min_weight=None`` rewrites nothing (:func:`fusion_threshold`'s "fuse none").

    Returns:
        ``PassResult(gm, modified)``.

    Raises:
        PassError: if an ``nn.Linear`` call of that size survives (postcondition).
    """
    if min_weight is None:
        return PassResult(gm, False)
    modified = False
    for node in list(gm.graph.nodes):
        if _fusable_module(gm, node, min_weight):
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(str(node.target))
            node.op, node.target = "call_function", fused_linear.linear_module
            node.args, node.kwargs = (node.args[0], module), {}
            modified = True
        elif node.op == "call_function" and node.target in _FUNCTIONS and not min_weight:
            node.target = fused_linear.linear
            modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    left = [n.name for n in gm.graph.nodes if _fusable_module(gm, n, min_weight)]
    if left:
        raise PassError(f"fuse_weight_grads left nn.Linear calls {left}")
    return PassResult(gm, modified)


def _is_linear_module(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and type(gm.get_submodule(str(node.target))) is nn.Linear


def _fusable_module(gm: fx.GraphModule, node: fx.Node, min_weight: int = 0) -> bool:
    """An exact ``nn.Linear`` of at least ``min_weight`` weight elements whose call runs no
    hooks (calling it must stay a module call)."""
    if not _is_linear_module(gm, node):
        return False
    module = gm.get_submodule(str(node.target))
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.numel() < min_weight:
        return False
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
             module._backward_pre_hooks, _module._global_forward_hooks,
             _module._global_forward_pre_hooks, _module._global_backward_hooks,
             _module._global_backward_pre_hooks)
    return not any(hooks)
