"""Dead-code elimination: drop nodes whose values nobody uses.

A thin pass over ``torch.fx.Graph.eliminate_dead_code`` (which keeps impure nodes such as
in-place buffer updates), with the pass shape and a postcondition.

Example:
    >>> import torch
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         unused = x * 2
    ...         return x + 1
    >>> eliminate_dead_code(torch.fx.symbolic_trace(M())).modified
    True
"""

from __future__ import annotations

import torch.fx as fx

from partitioner.passes.base import PassError, PassResult
from partitioner.passes.protect_inputs import mutates_first_argument

__all__ = ["eliminate_dead_code", "has_side_effect"]


def has_side_effect(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` must stay even if nobody uses its value.

    torch's own test misses in-place methods (``x.add_(1)``), ``inplace=True`` calls and
    ``torch.relu_``, which symbolic tracing produces; their effect is the write.
    """
    return node.is_impure() or (node.op.startswith("call_") and mutates_first_argument(gm, node))


def eliminate_dead_code(gm: fx.GraphModule) -> PassResult:
    """Remove unused pure nodes from ``gm`` in place.

    Raises:
        PassError: if the graph no longer lints afterwards.
    """
    modified = gm.graph.eliminate_dead_code(lambda node: has_side_effect(gm, node))
    try:
        gm.graph.lint()
    except Exception as error:
        raise PassError(f"eliminate_dead_code broke the graph: {error}") from error
    if modified:
        gm.recompile()
    return PassResult(gm, modified)
