"""Choose what to split: Megatron's pairing, found on the graph by trying.

Megatron-LM splits a transformer so that each block needs two all-reduces forward: the first
Linear of a pair column-wise (each rank computes some output features), everything between
on those slices, the second Linear row-wise (each rank contributes a partial sum), then one
all-reduce. Self-attention is such a pair once the heads are split: q, k, v column-wise, the
output projection row-wise.

:func:`choose` finds such pairs without knowing any model: it splits one Linear column-wise,
propagates layouts from it (``tp_propagate``), and reads the conversions the plan would
need. A split value gathered whole at the input of another Linear makes that Linear the
row-wise partner; a whole value sliced to meet a split one (``k`` meeting a split ``q``)
makes its producing Linear a column-wise partner; a fused output split into parts gives the
column weight ``blocks``. It repeats until the region is closed (no gathers, no slices: a
Megatron pair) or cannot be (the seed stays alone).

Grouped-query attention has fewer key/value heads than query heads. When the degree
divides the KV heads, ``k`` and ``v`` join as column partners (each rank's KV heads repeat
into exactly its query heads). When it does not (2 KV heads over 4 ranks, one KV head in
multi-query attention), a column partner would split a head's features, so it is taken
back: ``k_proj`` and ``v_proj`` stay whole and the repeated keys and values are sliced
where the attention meets them. Rank ``r`` then takes query heads ``h`` in
``[r a/tp, (r+1) a/tp)`` against repeated KV head ``h``, which is KV head
``h // (a / kv)``: the slice is exact, costs nothing forward and one all-gather of the
gradient backward. Such a slice of keys or values is the one slice a closed region keeps.
Then:

- a Linear in no pair splits column-wise, its output gathered where it is used whole (the
  LM head: column-parallel with its logits gathered), unless its split output would meet
  whole values (a residual stream: ``x + f(x)`` with ``x`` split would slice ``f(x)`` and
  keep the stream split, gathering before every norm): then it stays whole (``replicate``);
- the largest Embedding splits by vocabulary (one all-reduce), the others stay whole, except
  an Embedding sharing its weight with a split Linear, which follows that Linear;
- an ``nn.MultiheadAttention`` call is a closed region by itself (whole inputs, one
  all-reduce, whole output): it splits by ``heads``.

Rules given by the user (``fixed``) are kept as they are; the search works around them.

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> from partitioner.passes.tensor_parallel.sites import find_sites
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = propagate_shapes(gm, (torch.randn(3, 4),))
    >>> choice = choose(gm, find_sites(gm), tp=2)
    >>> choice.kinds
    {'_0': 'colwise', '_2': 'rowwise'}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from partitioner.passes.tensor_parallel.heads import origin
from partitioner.passes.tensor_parallel.layout import Replicate, Shard
from partitioner.passes.tensor_parallel.ops import ATTENTION_PRODUCTS
from partitioner.passes.tensor_parallel.propagate import Conversion, Propagation, propagate
from partitioner.passes.tensor_parallel.sites import Site
from partitioner.runtime.tensor_parallel.sharding import (
    HEADS,
    REPLICATE,
    Sharding,
    TensorParallelError,
)

__all__ = ["Choice", "choose", "site_shardings", "kind_of", "SITE_KINDS", "SITE_WHAT"]

#: The kinds each sort of site accepts (``rowwise`` on an Embedding means ``vocab``, as in
#: DTensor's ``RowwiseParallel``).
SITE_KINDS = {"linear": ("colwise", "rowwise", REPLICATE),
              "embedding": ("vocab", "colwise", "rowwise", REPLICATE),
              "attention": (HEADS, REPLICATE)}

#: How error messages name each sort of site.
SITE_WHAT = {"linear": "a Linear", "embedding": "an Embedding",
             "attention": "an nn.MultiheadAttention"}

_MAX_ROUNDS = 64


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided.

    Attributes:
        kinds: by site node name, the kind of each site.
        blocks: by weight, the fused parts of column weights.
        pairs: each closed region found, as ``(column sites, row sites)`` by site name.
    """

    kinds: dict[str, str]
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pairs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()


def site_shardings(site: Site, kind: str, tp: int,
                   blocks: tuple[int, ...] | None = None) -> dict[str, Sharding]:
    """The shardings of a site's weight and bias for ``kind``.

    Raises:
        TensorParallelError: if the site does not accept ``kind``.
    """
    if kind not in SITE_KINDS[site.op]:
        raise TensorParallelError(
            f"{site.name}: {SITE_WHAT[site.op]} cannot be split {kind!r}; use one of "
            f"{', '.join(SITE_KINDS[site.op])}")
    whole = Sharding("replicate", None, tp)
    if kind == "replicate":
        return {site.weight: whole, **({site.bias: whole} if site.bias else {}),
                **{path: whole for path, *_ in site.parts}}
    if site.op == "attention":
        return {path: Sharding(part_kind, dim, tp, part_blocks)
                for path, part_kind, dim, part_blocks in site.parts}
    if site.op == "embedding":
        dim = 1 if kind == "colwise" else 0
        return {site.weight: Sharding("colwise" if dim else "vocab", dim, tp)}
    if kind == "colwise":
        out = {site.weight: Sharding("colwise", site.out_dim, tp, blocks)}
        if site.bias:
            out[site.bias] = Sharding("colwise", 0, tp, blocks)
        return out
    out = {site.weight: Sharding("rowwise", site.in_dim, tp)}
    if site.bias:
        out[site.bias] = whole
    return out


def kind_of(site: Site, sharding: Sharding) -> str:
    """The kind a site runs as when its weight is split as ``sharding``."""
    if sharding.dim is None or not sharding.is_split:
        return "replicate"
    if site.op == "attention":
        return "heads"
    if site.op == "embedding":
        return "vocab" if sharding.dim == 0 else "colwise"
    return "colwise" if sharding.dim == site.out_dim else "rowwise"


def choose(gm: fx.GraphModule, sites: list[Site], tp: int,
           fixed: dict[str, str] | None = None) -> Choice:
    """Pick a kind for every site of ``gm`` (see the module docstring).

    Args:
        gm: the graph, with shapes.
        sites: its sites (``find_sites``).
        tp: the tensor-parallel degree.
        fixed: kinds the user chose, by site node name; never changed.

    Returns:
        A :class:`Choice`.
    """
    kinds = dict(fixed or {})
    blocks: dict[str, tuple[int, ...]] = {}
    pairs = []
    by_node = {s.node: s for s in sites}
    for site in sites:
        if site.op != "linear" or site.node in kinds or _tied_to_chosen(site, sites, kinds):
            continue
        region = _grow(gm, sites, by_node, site, tp, kinds)
        if region is None:
            continue
        cols, rows, found, whole = region
        kinds.update({c.node: "colwise" for c in cols})
        kinds.update({w.node: "replicate" for w in whole})
        kinds.update({r.node: "rowwise" for r in rows})
        blocks.update(found)
        pairs.append((tuple(c.name for c in cols), tuple(r.name for r in rows)))
    for site in sites:
        if site.op == "linear" and site.node not in kinds:
            kinds[site.node] = (_follow_tie(site, sites, kinds)
                                or _lone_kind(gm, sites, site, tp))
    for site in sites:
        if site.op == "attention" and site.node not in kinds:
            kinds[site.node] = "heads"
    embeddings = [s for s in sites if s.op == "embedding" and s.node not in kinds]
    largest = max(embeddings, key=lambda s: s.shape[0] * s.shape[1], default=None)
    for site in embeddings:
        kinds[site.node] = _follow_tie(site, sites, kinds) or (
            "vocab" if site is largest else "replicate")
    return Choice(kinds, blocks, tuple(pairs))


def _lone_kind(gm: fx.GraphModule, sites: list[Site], site: Site, tp: int) -> str:
    """``colwise`` for a Linear in no pair whose split output is only ever gathered;
    ``replicate`` if its output features do not divide by ``tp`` (a classifier of 5 labels
    over 2 ranks), or if it would slice whole values to meet it (the split would spread)."""
    sharding = site_shardings(site, "colwise", tp)[site.weight]
    if sharding.check(site.shape, site.weight):
        return "replicate"
    result = propagate(gm, site_shardings(site, "colwise", tp), tp, sites=sites,
                       start=site.node)
    return "replicate" if any(c.slices for c in result.conversions) else "colwise"


def _tied_to_chosen(site: Site, sites: list[Site], kinds: dict[str, str]) -> bool:
    return any(s.weight == site.weight and s.node in kinds and s is not site for s in sites)


def _follow_tie(site: Site, sites: list[Site], kinds: dict[str, str]) -> str | None:
    """The kind that splits ``site``'s weight like an already chosen site sharing it."""
    for other in sites:
        if other is site or other.weight != site.weight or other.node not in kinds:
            continue
        sharding = site_shardings(other, kinds[other.node], 2)[other.weight]
        if sharding.dim is None:
            return "replicate"
        for kind in SITE_KINDS[site.op]:
            mine = site_shardings(site, kind, 2)[site.weight]
            if mine.dim == sharding.dim:
                return kind
        return "replicate"
    return None


#: A closed region: column sites, row sites, fused blocks, and the sites it keeps whole
#: (key and value projections whose heads do not split: their outputs are sliced).
_Region = tuple[list[Site], list[Site], dict[str, tuple[int, ...]], list[Site]]


def _grow(gm: fx.GraphModule, sites: list[Site], by_node: dict[str, Site], seed: Site, tp: int,
          kinds: dict[str, str]) -> _Region | None:
    """Grow a Megatron region from ``seed``; ``None`` if it does not close."""
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    nodes = {n.name: n for n in gm.graph.nodes}
    cols: list[Site] = [seed]
    rows: list[Site] = []
    blocks: dict[str, tuple[int, ...]] = {}
    rejected: list[Site] = []
    added: tuple[Site, Conversion] | None = None
    known_problems = 0
    for _ in range(_MAX_ROUNDS):
        shardings: dict[str, Sharding] = {}
        for c in cols:
            shardings.update(site_shardings(c, "colwise", tp, blocks.get(c.weight)))
        for r in rows:
            shardings.update(site_shardings(r, "rowwise", tp))
        start = min((c.node for c in cols), key=order.__getitem__)
        result = propagate(gm, shardings, tp, sites=sites, start=start)
        new_blocks = {k: v for k, v in result.block_requests.items() if blocks.get(k) != v}
        if added is not None and _misfits(result, added[1], known_problems, new_blocks):
            # The partner's split does not give the slices the region needs (2 KV heads
            # over 4 ranks, or one KV head split along its features): keep it whole and
            # slice its output where the region meets it instead.
            cols.remove(added[0])
            rejected.append(added[0])
            added = None
            continue
        known_problems, added = len(result.problems), None
        if new_blocks:
            blocks.update(new_blocks)
            continue
        grown = False
        for conversion in result.conversions:
            partner = _partner(conversion.node, conversion.value, conversion.have,
                               conversion.need, nodes, by_node, kinds, cols + rows + rejected)
            if partner is None:
                if conversion.gathers or (conversion.slices
                                          and not _keys_or_values(conversion, nodes)):
                    return None
                continue
            (cols if partner[1] == "colwise" else rows).append(partner[0])
            added = (partner[0], conversion) if partner[1] == "colwise" else None
            grown = True
            break
        if not grown:
            return (cols, rows, blocks, rejected) if rows else None
    return None


def _misfits(result: Propagation, motive: Conversion, known_problems: int,
             new_blocks: dict[str, tuple[int, ...]]) -> bool:
    """Whether a column partner added for ``motive`` (a whole value sliced to meet a split
    one) failed: sizes stopped dividing, or the value still arrives in the wrong layout."""
    if len(result.problems) > known_problems:
        return True
    return not new_blocks and any((c.node, c.value) == (motive.node, motive.value)
                                  for c in result.conversions)


def _keys_or_values(conversion: Conversion, nodes: dict[str, fx.Node]) -> bool:
    """Whether a conversion slices the whole keys or values of an attention whose queries
    are split by heads (grouped-query attention with fewer KV heads than ranks: each rank
    takes the repeated KV heads of its query heads)."""
    consumer = nodes.get(conversion.node)
    if consumer is None or consumer.target not in ATTENTION_PRODUCTS:
        return False
    operands = [a for a in consumer.args[1:3] if isinstance(a, fx.Node)]
    return any(a.name == conversion.value for a in operands)


def _partner(consumer: str, value: str, have: object, need: object, nodes: dict[str, fx.Node],
             by_node: dict[str, Site], kinds: dict[str, str],
             taken: list[Site]) -> tuple[Site, str] | None:
    """The site a conversion asks to join the region, with its kind, if any."""
    site = by_node.get(consumer)
    if isinstance(have, Shard) and isinstance(need, Replicate):
        # A split value used whole by a Linear: that Linear can take it split (row-wise).
        if site is None or site.op != "linear" or site.node in kinds or site in taken:
            return None
        if have.blocks is None and have.dim == len(nodes[value].meta["val"].shape) - 1:
            return site, "rowwise"
        return None
    if not isinstance(have, Shard) and isinstance(need, Shard):
        # A whole value sliced to meet a split one: split its producing Linear instead.
        source = origin(nodes[value], by_node)
        if source is None or source.op != "linear" or source.node in kinds or source in taken:
            return None
        return source, "colwise"
    return None
