"""Route dropout through the stage's own generator.

Stages of a pipeline run on several threads; dropout drawing from torch's global generator
would make masks depend on thread timing, and a checkpointed stage could not replay them.
This pass rewrites every dropout in a stage graph (``nn.Dropout`` modules, ``F.dropout``,
``torch.dropout`` and the ``aten`` dropout ops ``torch.export`` produces, in the graph and in
every graph it holds: an autocast or ``no_grad`` block's) into a call of
``partitioner.runtime.rng.dropout``, which draws from the generator the stage's worker installs;
and every other random op (``torch.randn_like``, ``Tensor.normal_``, an ATen op tagged
``nondeterministic_seeded``) into ``partitioner.runtime.rng.seeded_op``, seeded from it.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Dropout(0.5)))
    >>> route_dropout(gm).modified
    True
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from partitioner.passes.base import PassError, PassResult, graph_modules
from partitioner.runtime import rng

__all__ = ["route_dropout", "route_module_randomness"]

_FUNCTIONS = {torch.nn.functional.dropout, torch.dropout}
_ATEN = {torch.ops.aten.dropout.default}


def route_dropout(gm: fx.GraphModule) -> PassResult:
    """Rewrite dropout nodes of ``gm`` in place to draw from the stage generator.

    Only element-wise dropout is rewritten (channel-wise ``Dropout2d``/``3d`` masks have
    another shape and keep the global generator; see the README's restrictions).

    Returns:
        ``PassResult(gm, modified)``.

    Raises:
        PassError: if a rewritten dropout survives (postcondition).
    """
    modified = False
    for graph in graph_modules(gm):  # a dropout in an autocast or no_grad block's graph too
        modified = _route(graph) or modified
    left = [n.name for n in gm.graph.nodes if _is_module_dropout(gm, n)]
    if left:
        raise PassError(f"route_dropout left dropout modules {left}")
    return PassResult(gm, modified)


def _route(gm: fx.GraphModule) -> bool:
    modified = False
    for node in list(gm.graph.nodes):
        if _is_random_op(node):
            node.args = (_op_name(node), *node.args)
            node.op, node.target = "call_function", rng.seeded_op
            modified = True
        elif _is_module_dropout(gm, node):
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(str(node.target))
            node.op, node.target = "call_function", rng.dropout_module
            node.args = (node.args[0], module)
            modified = True
        elif node.op == "call_function" and (node.target in _FUNCTIONS or node.target in _ATEN):
            x, p, training = _dropout_args(node)
            node.target = rng.dropout
            node.args, node.kwargs = (x, p, training), {}
            modified = True
    if modified:
        gm.recompile()
    return modified


_STOCHASTIC = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
               nn.FeatureAlphaDropout)


def route_module_randomness(gm: fx.GraphModule) -> PassResult:
    """Run modules that draw random numbers inside themselves under the stage's generator.

    A capture keeps some modules whole (``nn.MultiheadAttention``: its attention dropout
    draws from torch's global generator; channel-wise ``Dropout2d``); each such call becomes
    ``partitioner.runtime.rng.seeded_call(module, ...)``, which seeds the global generators
    from the stage's generator, so a checkpointed replay draws the masks the forward drew.
    Run it last, on the graph a runtime executes (the tensor-parallel pass reads these
    modules as ``call_module`` nodes).

    Returns:
        ``PassResult(gm, modified)``.
    """
    modified = False
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not _draws_inside(gm.get_submodule(str(node.target))):
            continue
        with gm.graph.inserting_before(node):
            module = gm.graph.get_attr(str(node.target))
        node.op, node.target = "call_function", rng.seeded_call
        node.args = (module, *node.args)
        modified = True
    if modified:
        gm.recompile()
    return PassResult(gm, modified)


def _draws_inside(module: nn.Module) -> bool:
    if type(module) is nn.Dropout:
        return False  # route_dropout gives it the stage's generator directly
    if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
        return True
    return any(isinstance(m, _STOCHASTIC) and float(getattr(m, "p", 0.0)) > 0
               for m in module.modules())


_RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
                     torch.randint_like, torch.bernoulli, torch.normal, torch.multinomial,
                     torch.randperm, torch.poisson}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "normal_", "uniform_", "random_", "exponential_",
                   "geometric_", "log_normal_", "cauchy_", "multinomial"}


def _is_random_op(node: fx.Node) -> bool:
    """A node drawing from torch's global generator, dropout aside (routed on its own): a
    random ``torch`` function or ``Tensor`` method (symbolic tracing), or an ATen op tagged
    ``nondeterministic_seeded`` (``torch.export``)."""
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function" or node.target in _ATEN:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    return node.target in _RANDOM_FUNCTIONS


def _op_name(node: fx.Node) -> str:
    """The name ``rng.seeded_op`` resolves a random node's target from."""
    if node.op == "call_method":
        return f".{node.target}"
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)  # "aten.randn_like.default"
    return f"torch.{node.target.__name__}"  # type: ignore[union-attr]


def _is_module_dropout(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_module":
        return False
    module = gm.get_submodule(str(node.target))
    return type(module) is nn.Dropout


def _dropout_args(node: fx.Node) -> tuple[object, object, object]:
    """(input, p, training) of a dropout call, whichever spelling it used."""
    training_name = "train" if node.target in (torch.dropout, *_ATEN) else "training"
    names, defaults = ("input", "p", training_name), (None, 0.5, True)
    values = [node.args[k] if k < len(node.args) else node.kwargs.get(name, default)
              for k, (name, default) in enumerate(zip(names, defaults))]
    return values[0], values[1], values[2]
