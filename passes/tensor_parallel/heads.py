"""Head counts of attentions a capture inlined, and the degrees that split them.

An attention written with separate projections (transformers' Llama, Mistral, Qwen; nanoGPT)
is captured as Linears, reshapes and a product of queries with keys
(``scaled_dot_product_attention``, or ``q @ k.T`` followed by a softmax). The automatic
choice (``tp_match``) splits it by heads when the degree divides the query heads: ``q_proj``
column-wise, ``o_proj`` row-wise, and ``k_proj``/``v_proj`` column-wise when the degree also
divides the key/value heads, whole (their repeated heads sliced per rank) otherwise.

A degree that divides neither (6 heads over 4 ranks) leaves the attention whole on every
rank, which is correct but quietly gives up most of what tensor parallelism is for, so
:func:`heads_problems` reports it, with the degrees that work and the rule that keeps the
attention whole on purpose. Attentions whose query projection a user rule names are left
as the user asked.

Example:
    >>> print(heads_fix(6, 2, 4, "model.layers.*.self_attn"))  # doctest: +NORMALIZE_WHITESPACE
    6 query heads and 2 KV heads do not split over tensor_parallel=4; use a degree dividing
    6 (1, 2, 3, 6) (KV heads are split when it divides 2, kept whole otherwise), or keep the
    attention whole with tensor_parallel={'model.layers.*.self_attn.*': 'replicate'}
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from partitioner.passes.tensor_parallel.decision import tensor_inputs, val
from partitioner.passes.tensor_parallel.sites import Site

__all__ = ["AttentionHeads", "find_attention_heads", "heads_problems", "heads_fix", "origin"]

aten = torch.ops.aten

_SDPA = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
_MATMUL = {operator.matmul, torch.matmul, torch.Tensor.matmul, torch.bmm, aten.matmul.default,
           aten.bmm.default}
_SOFTMAX = {F.softmax, torch.softmax, aten._softmax.default, aten.softmax.int}
_SOFTMAX_HOPS = 4


@dataclass(frozen=True)
class AttentionHeads:
    """One inlined attention: where it is and how many heads it has.

    Attributes:
        node: the product of queries with keys.
        query: the site projecting the queries.
        key: the site projecting the keys (``None`` if not found).
        heads: query heads.
        kv_heads: key/value heads (``heads`` for plain multi-head attention).
    """

    node: fx.Node
    query: Site
    key: Site | None
    heads: int
    kv_heads: int


def origin(node: fx.Node, by_node: dict[str, Site]) -> Site | None:
    """The one site whose output ``node`` is made from, through operations whose other
    operands come from no site (views, activations, rotary embeddings' ``cos``/``sin``);
    ``None`` if there is none or several."""
    found: set[str] = set()
    seen: set[str] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.name in by_node:
            found.add(current.name)
            if len(found) > 1:
                return None
            continue
        todo.extend(n for n in tensor_inputs(current) if n.op not in ("placeholder", "get_attr"))
    return by_node[found.pop()] if found else None


def find_attention_heads(gm: fx.GraphModule, sites: list[Site]) -> list[AttentionHeads]:
    """Every inlined attention of ``gm`` whose queries come from one Linear site."""
    by_node = {s.node: s for s in sites}
    found = []
    for node, q, k in _products(gm):
        query = origin(q, by_node)
        if query is None or query.op != "linear":
            continue
        heads, head_dim = int(val(q).shape[-3]), int(val(q).shape[-1])
        key = origin(k, by_node)
        kv_heads = heads
        if key is not None and key is not query and key.op == "linear":
            features = int(key.shape[key.out_dim])
            kv_heads = features // head_dim if features % head_dim == 0 else heads
        found.append(AttentionHeads(node, query, key, heads, kv_heads))
    return found


def heads_problems(gm: fx.GraphModule, sites: list[Site], tp: int,
                   fixed: dict[str, str] | None = None) -> list[str]:
    """Why the inlined attentions of ``gm`` cannot split over ``tp`` ranks, with the fix.

    Args:
        gm: the graph, with shapes.
        sites: its sites.
        tp: the degree.
        fixed: kinds the user chose, by site node name; attentions whose query projection
            is named there are not checked.

    Returns:
        One line per distinct attention pattern (layers differing only by index share one).
    """
    problems: dict[str, str] = {}
    for found in find_attention_heads(gm, sites):
        if found.heads % tp == 0 or found.query.node in (fixed or {}):
            continue
        owner = found.query.name.rpartition(".")[0] or found.query.name
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", owner)
        problems.setdefault(pattern, f"{pattern}: " + heads_fix(found.heads, found.kv_heads,
                                                                 tp, pattern))
    return list(problems.values())


def heads_fix(heads: int, kv_heads: int, tp: int, pattern: str) -> str:
    """The message for ``heads`` query heads (``kv_heads`` KV heads) over ``tp`` ranks."""
    what = (f"{heads} query heads and {kv_heads} KV heads" if kv_heads != heads
            else f"{heads} heads")
    degrees = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
    kv = (f" (KV heads are split when it divides {kv_heads}, kept whole otherwise)"
          if kv_heads != heads else "")
    return (f"{what} do not split over tensor_parallel={tp}; use a degree dividing {heads} "
            f"({degrees}){kv}, or keep the attention whole with "
            f"tensor_parallel={{{pattern + '.*'!r}: 'replicate'}}")


def _products(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(node, queries, keys)`` of each product of 4-D queries with keys."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or len(node.args) < 2:
            continue
        q, k = node.args[0], node.args[1]
        if not (isinstance(q, fx.Node) and isinstance(k, fx.Node)):
            continue
        if not (isinstance(val(q), torch.Tensor) and isinstance(val(k), torch.Tensor)):
            continue
        if val(q).dim() != 4 or val(k).dim() != 4:
            continue
        if node.target in _SDPA or (node.target in _MATMUL and _feeds_softmax(node)):
            yield node, q, k


def _feeds_softmax(node: fx.Node) -> bool:
    """Whether scores reach a softmax through a few single-input steps (scale, mask)."""
    frontier = [node]
    for _ in range(_SOFTMAX_HOPS):
        frontier = [user for n in frontier for user in n.users]
        if any(u.op == "call_function" and u.target in _SOFTMAX for u in frontier):
            return True
        if any(u.op == "call_method" and u.target == "softmax" for u in frontier):
            return True
    return False
