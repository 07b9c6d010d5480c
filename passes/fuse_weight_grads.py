"""Route Linear layers through ``partitioner.runtime.fused_linear``: weight gradients added in
place.

Rewrites every ``nn.Linear`` call (``call_module`` of an exact ``nn.Linear`` without
module hooks: a hooked module must stay a module call so its hooks run), every
``F.linear`` call and every ``aten.linear`` node (what ``torch.export`` produces) into a
call of ``partitioner.runtime.fused_linear.linear_module`` / ``linear``, which compute the same
values
and the same gradients, but add each weight gradient into ``.grad`` with one in-place
product instead of a fresh tensor plus an accumulation (see that module).

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

__all__ = ["fuse_weight_grads"]

_FUNCTIONS = {F.linear, torch.ops.aten.linear.default}


def fuse_weight_grads(gm: fx.GraphModule) -> PassResult:
    """Rewrite the Linear calls of ``gm`` in place (see the module doc).

    Returns:
        ``PassResult(gm, modified)``.

    Raises:
        PassError: if an ``nn.Linear`` call survives (postcondition).
    """
    modified = False
    for node in list(gm.graph.nodes):
        if _fusable_module(gm, node):
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(str(node.target))
            node.op, node.target = "call_function", fused_linear.linear_module
            node.args, node.kwargs = (node.args[0], module), {}
            modified = True
        elif node.op == "call_function" and node.target in _FUNCTIONS:
            node.target = fused_linear.linear
            modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    left = [n.name for n in gm.graph.nodes if _fusable_module(gm, n)]
    if left:
        raise PassError(f"fuse_weight_grads left nn.Linear calls {left}")
    return PassResult(gm, modified)


def _is_linear_module(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and type(gm.get_submodule(str(node.target))) is nn.Linear


def _fusable_module(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An exact ``nn.Linear`` whose call runs no hooks (calling it must stay a module call)."""
    if not _is_linear_module(gm, node):
        return False
    module = gm.get_submodule(str(node.target))
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
             module._backward_pre_hooks, _module._global_forward_hooks,
             _module._global_forward_pre_hooks, _module._global_backward_hooks,
             _module._global_backward_pre_hooks)
    return not any(hooks)
