"""The rule for ``nn.MultiheadAttention`` calls: split by heads, one all-reduce.

torch's attention keeps q, k and v in one fused ``in_proj_weight``; split as one Linear, each
rank would hold a third of the fused rows (rank 0 all of q, ...), and the head reshape
inside ``F.multi_head_attention_forward`` could not follow. Both captures keep an
``nn.MultiheadAttention`` call as one ``call_module`` node (``passes/fold_attention.py`` for
``torch.export``), so the tensor-parallel pass treats the whole call as one site, like
GPT-2's fused ``c_attn`` followed by its ``c_proj``:

- each rank holds the rows of its ``num_heads // tp`` heads in each of q, k, v (the fused
  weight and bias split as three blocks), the same entries of ``bias_k``/``bias_v``, and
  the matching columns of ``out_proj.weight`` (``Site.parts``);
- its inputs are whole (entering the parallel region: their gradients are summed over the
  ranks), its output whole after one all-reduce of the partial output projections
  (``partitioner.runtime.tensor_parallel.attention``);
- head-averaged attention weights are whole (a second all-reduce, only if something reads
  them); per-head weights stay split along the head dimension.

A head count that does not divide by the degree is a problem naming the module, its heads,
the degree and the fix.

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> from partitioner.passes.tensor_parallel.sites import find_sites
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn = torch.nn.MultiheadAttention(8, 4, batch_first=True)
    ...     def forward(self, x):
    ...         return self.attn(x, x, x, need_weights=False)[0]
    >>> gm = torch.fx.symbolic_trace(Block())
    >>> _ = propagate_shapes(gm, (torch.randn(2, 3, 8),))
    >>> site = find_sites(gm)[0]
    >>> site.op, site.heads, heads_problem(site, 2), heads_problem(site, 3) is not None
    ('attention', 4, None, True)
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch.fx as fx
from torch import nn

from partitioner.passes.tensor_parallel.decision import (
    AttentionSite,
    Decision,
    RuleContext,
    replicated,
    tensor_inputs,
    val,
)
from partitioner.passes.tensor_parallel.layout import R_IN, Layout, R, Shard
from partitioner.passes.tensor_parallel.sites import Site
from partitioner.runtime.tensor_parallel.sharding import Sharding

__all__ = ["attention_rule", "attention_arguments", "heads_problem", "weights_used"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def attention_arguments(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in (``query``, ..., ``is_causal``)."""
    bound = _SIGNATURE.bind(None, *node.args, **node.kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self")
    return arguments


def heads_problem(site: Site, tp: int) -> str | None:
    """Why ``site``'s heads cannot split over ``tp`` ranks, with the fix; ``None`` if they can."""
    if site.heads % tp == 0:
        return None
    degrees = [d for d in range(1, site.heads + 1) if site.heads % d == 0]
    return (f"{site.name} (nn.MultiheadAttention, {site.heads} heads): {site.heads} heads do "
            f"not split over tensor_parallel={tp}; use a degree dividing {site.heads} "
            f"({', '.join(map(str, degrees))}) or keep it whole with "
            f"tensor_parallel={{{site.name!r}: 'replicate'}}")


def weights_used(node: fx.Node) -> bool:
    """Whether anything reads the call's attention weights (its second result)."""
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return True  # the whole tuple travels on
        if user.args[1] not in (0, -2) and user.users:
            return True
    return False


def attention_rule(node: fx.Node, site: Site, ctx: RuleContext) -> Decision:
    """How an ``nn.MultiheadAttention`` call runs on a rank (see the module docstring)."""
    have = {path: ctx.shardings.get(path) for path, *_ in site.parts}
    if not any(s is not None and s.is_split for s in have.values()):
        return replicated(node)
    expected = {path: Sharding(kind, dim, ctx.tp, blocks)
                for path, kind, dim, blocks in site.parts}
    if have != expected:
        ctx.problems.append(
            f"{site.name}: an nn.MultiheadAttention splits only by heads, with "
            f"{', '.join(f'{p} {s.kind} dim {s.dim}' for p, s in expected.items())}; got "
            f"{', '.join(f'{p} {s}' for p, s in have.items())}; give it the kind 'heads' or "
            "'replicate'")
        return replicated(node)
    problem = heads_problem(site, ctx.tp)
    if problem is not None:
        ctx.problems.append(problem)
        return replicated(node)
    needs: dict[str, Layout] = {
        n.name: R_IN if val(n).is_floating_point() else R for n in tensor_inputs(node)}
    out = val(node)
    weights = out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
    averaged = bool(attention_arguments(node)["average_attn_weights"])
    reads = weights is not None and weights_used(node)
    layout: Layout = R if weights is None or averaged else Shard(weights.dim() - 3)
    return Decision(needs, (R, layout), AttentionSite(site, 1 + int(reads and averaged)))
