"""Where a training step's gradients flow in a captured graph, as the cost model needs it.

Autograd computes a gradient only for a value that needs one: a product on the model's
batch (which no parameter is upstream of) computes its weight gradient alone, one product
instead of two (``Op.input_grad``). And a schedule that splits its backwards queues only
the Linear layers' weight gradients for its ``W`` action (``passes.fuse_weight_grads``
routes them through ``runtime.fused_linear``); convolutions compute theirs in ``I``
(``Op.queued``).

Example:
    >>> import torch.fx as fx
    >>> from torch import nn
    >>> gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Linear(4, 4), nn.ReLU()))
    >>> sorted(needs_grad(gm))
    ['_1', '_2', 'output']
    >>> nodes = {n.name: n for n in gm.graph.nodes}
    >>> reaches_inputs(nodes["_1"], needs_grad(gm)), reaches_inputs(nodes["_2"], needs_grad(gm))
    (False, True)
    >>> is_linear(gm, nodes["_1"]), is_linear(gm, nodes["_2"])
    (True, False)
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.passes.base import attr_value

__all__ = ["needs_grad", "reaches_inputs", "is_linear"]


def needs_grad(gm: fx.GraphModule) -> set[str]:
    """The nodes whose values autograd tracks in training: an input that requires a
    gradient, a trainable parameter, a module holding one, and whatever any of them reaches."""
    tracked: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            own = any(isinstance(t, torch.Tensor) and t.requires_grad
                      for t in pytree.tree_leaves(node.meta.get("val")))
        elif node.op == "get_attr":
            value = attr_value(gm, str(node.target))
            own = isinstance(value, torch.Tensor) and value.requires_grad
        elif node.op == "call_module":
            own = any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters())
        else:
            own = False
        if own or any(a.name in tracked for a in node.all_input_nodes):
            tracked.add(node.name)
    return tracked


def reaches_inputs(node: fx.Node, tracked: set[str]) -> bool:
    """Whether autograd computes the gradient of one of ``node``'s activation inputs (a
    parameter's, reached through ``get_attr``, is its weight gradient); ``tracked``:
    :func:`needs_grad`."""
    return any(a.name in tracked for a in node.all_input_nodes if a.op != "get_attr")


def is_linear(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is a Linear layer's product (``nn.Linear``, ``F.linear``,
    ``aten.linear``): what ``passes.fuse_weight_grads`` routes through ``fused_linear``."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), torch.nn.Linear)
    return node.op == "call_function" and node.target in (
        torch.nn.functional.linear, torch.ops.aten.linear.default)
