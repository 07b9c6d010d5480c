"""The tensor-parallel pass: decide how every weight is split, then write each rank's graph.

Two steps, each usable on its own:

1. :func:`choose_shardings` decides (``tp_match``: Megatron pairs found by propagation,
   column-wise lone Linears, the vocabulary-parallel Embedding; ``fixed`` kinds override),
   settles fused-projection blocks by propagating to a fixed point, and checks every size
   divides; it returns a :class:`TensorParallelChoice`.
2. :func:`merge_split_layers` joins layers between which split values flow, so that a
   pipeline boundary never falls inside a Megatron region;
3. :func:`shard_graph` turns a graph (the whole model, or one pipeline stage of it) into rank
   ``r``'s graph under those shardings (``tp_rewrite``) and checks, on fake tensors, that
   every value has the shape one rank should hold.

The layouts, op rules and rewrite live in ``tp_layout``, ``tp_ops``, ``tp_propagate``,
``tp_sites``, ``tp_match`` and ``tp_rewrite``.

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = propagate_shapes(gm, (torch.randn(3, 4),))
    >>> choice = choose_shardings(gm, tp=2)
    >>> {name: s.kind for name, s in choice.shardings.items()}
    {'0.weight': 'colwise', '0.bias': 'colwise', '2.weight': 'rowwise', '2.bias': 'replicate'}
    >>> choice.forward_collectives
    {'all_reduce': 1}
    >>> rank0 = shard_graph(gm, choice.shardings, rank=0).graph_module
    >>> tuple(rank0.get_submodule("2").weight.shape)
    (4, 4)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.passes.base import PassError, PassResult
from partitioner.passes.group_layers import Layer
from partitioner.passes.tensor_parallel.attention import heads_problem
from partitioner.passes.tensor_parallel.decision import AttentionSite, RowSite, VocabSite
from partitioner.passes.tensor_parallel.heads import heads_problems
from partitioner.passes.tensor_parallel.layout import Shard
from partitioner.passes.tensor_parallel.match import choose, kind_of, site_shardings
from partitioner.passes.tensor_parallel.propagate import Propagation, propagate
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR, TensorFactory, rewrite_rank
from partitioner.passes.tensor_parallel.sites import Site, find_sites
from partitioner.runtime.tensor_parallel.collectives import ShapeCommunicator
from partitioner.runtime.tensor_parallel.sharding import (
    Sharding,
    ShardSizeError,
    TensorParallelError,
)

__all__ = ["TensorParallelChoice", "ShardedGraph", "choose_shardings", "shard_graph",
           "merge_split_layers"]

_MAX_ROUNDS = 16


@dataclass(frozen=True)
class TensorParallelChoice:
    """How a graph's weights are split.

    Attributes:
        tp: the degree.
        shardings: by graph attribute (parameter path), every site weight and bias.
        kinds: by site name, the kind each layer runs as.
        pairs: the Megatron regions found, ``(column layers, row layers)``.
        propagation: layouts and conversions of the whole graph under ``shardings``.
    """

    tp: int
    shardings: dict[str, Sharding]
    kinds: dict[str, str]
    pairs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    propagation: Propagation = field(default_factory=Propagation, repr=False)

    @property
    def forward_collectives(self) -> dict[str, int]:
        """Collectives one forward runs: all-reduces (row Linears, vocab Embeddings) and
        all-gathers (split values used whole)."""
        counts: Counter[str] = Counter()
        for decision in self.propagation.decisions.values():
            if isinstance(decision.action, (RowSite, VocabSite)):
                counts["all_reduce"] += 1
            elif isinstance(decision.action, AttentionSite):
                counts["all_reduce"] += decision.action.reduces
        for conversion in self.propagation.conversions:
            if conversion.gathers:
                counts["all_gather"] += 1
        return dict(counts)


@dataclass(frozen=True)
class ShardedGraph(PassResult):
    """The result of :func:`shard_graph`: rank ``rank``'s graph (``graph_module``)."""

    rank: int = 0
    propagation: Propagation = field(default_factory=Propagation, repr=False)


def choose_shardings(gm: fx.GraphModule, tp: int, *, root: nn.Module | None = None,
                     fixed: dict[str, str] | None = None,
                     sites: list[Site] | None = None) -> TensorParallelChoice:
    """Decide how to split ``gm``'s weights over ``tp`` ranks.

    Args:
        gm: the whole model's graph, with ``meta["val"]`` from shape propagation.
        tp: the tensor-parallel degree (>= 1).
        root: the user's model, to name layers as the rules do (see ``tp_sites``).
        fixed: kinds chosen by the user, by site node name.
        sites: ``find_sites(gm, root)``, if already found.

    Returns:
        A :class:`TensorParallelChoice`.

    Raises:
        ShardSizeError: listing every layer whose split dimension does not divide by ``tp``.
        TensorParallelError: if two layers sharing a weight want it split differently.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tp={tp!r}; pass a positive int")
    sites = find_sites(gm, root) if sites is None else sites
    heads = heads_problems(gm, sites, tp, fixed)
    if heads:
        raise ShardSizeError("tensor parallelism cannot split these attentions by heads:\n  "
                             + "\n  ".join(heads))
    choice = choose(gm, sites, tp, fixed)
    blocks = dict(choice.blocks)
    for _ in range(_MAX_ROUNDS):
        shardings = _merge(sites, choice.kinds, tp, blocks)
        _check_sizes(gm, sites, choice.kinds, shardings)
        result = propagate(gm, shardings, tp, sites=sites)
        new = {k: v for k, v in result.block_requests.items() if blocks.get(k) != v}
        if not new:
            break
        blocks.update(new)
    if result.problems:
        raise ShardSizeError("tensor parallelism cannot split these layers:\n  "
                             + "\n  ".join(dict.fromkeys(result.problems))
                             + "\nFix: pass a tp dividing these sizes, or keep the layers "
                               "whole with tensor_parallel={'<layer>': 'replicate'}")
    names = {s.node: s.name for s in sites}
    return TensorParallelChoice(tp, shardings, {names[k]: v for k, v in choice.kinds.items()},
                                choice.pairs, result)


def _merge(sites: list[Site], kinds: dict[str, str], tp: int,
           blocks: dict[str, tuple[int, ...]]) -> dict[str, Sharding]:
    """Every site's weight and bias shardings; a weight two sites share must agree."""
    shardings: dict[str, Sharding] = {}
    owner: dict[str, Site] = {}
    for site in sites:
        for attr, sharding in site_shardings(site, kinds[site.node], tp,
                                             blocks.get(site.weight)).items():
            if attr in shardings and shardings[attr].dim != sharding.dim:
                first = owner[attr]
                raise TensorParallelError(
                    f"{first.name} and {site.name} share {attr} but would split it as "
                    f"{kind_of(first, shardings[attr])} (dim {shardings[attr].dim}) and "
                    f"{kinds[site.node]} (dim {sharding.dim}); give both layers rules that "
                    "split the shared weight along the same dimension")
            if attr not in shardings or (sharding.blocks and not shardings[attr].blocks):
                shardings[attr] = sharding  # the first site names the kind
            owner.setdefault(attr, site)
    return shardings


def _check_sizes(gm: fx.GraphModule, sites: list[Site], kinds: dict[str, str],
                 shardings: dict[str, Sharding]) -> None:
    problems = []
    for site in sites:
        sharding = shardings[site.weight]
        if not sharding.is_split:
            continue
        if site.op == "attention":
            problem = heads_problem(site, sharding.tp)
            problems += [problem] if problem else []
            continue
        what = {0: "rows", 1: "columns"}[int(sharding.dim or 0)]
        for problem in sharding.check(site.shape, site.weight):
            problems.append(f"{site.name} ({kinds[site.node]}, weight {list(site.shape)}): "
                            f"splitting its {what}: {problem}")
    if problems:
        raise ShardSizeError("tensor parallelism cannot split these layers:\n  "
                             + "\n  ".join(dict.fromkeys(problems))
                             + "\nFix: pass a tp dividing these sizes, or keep the layers "
                               "whole with tensor_parallel={'<layer>': 'replicate'}")


def shard_graph(gm: fx.GraphModule, shardings: dict[str, Sharding], rank: int, *,
                make_tensor: TensorFactory | None = None, check: bool = True) -> ShardedGraph:
    """Rank ``rank``'s graph of ``gm`` (which may be one pipeline stage of the model).

    Args:
        gm: a graph with ``meta["val"]``; values it receives and returns are whole.
        shardings: by attribute path of ``gm`` (from :func:`choose_shardings`).
        rank: the tensor-parallel rank.
        make_tensor: builds the rank's tensors (see ``tp_rewrite.rewrite_rank``).
        check: run the new graph on fake tensors and compare every value's shape with the
            shape rank ``rank`` should hold (postcondition).

    Returns:
        A :class:`ShardedGraph`; bind its ``_tp_comm`` attribute to the rank's group.

    Raises:
        TensorParallelError: if the shardings do not fit the graph (sizes, weight and bias
            split differently).
        PassError: if the postcondition fails (a bug, not a user mistake).
    """
    tp = next(iter({s.tp for s in shardings.values()}), 1)
    result = propagate(gm, shardings, tp)
    if result.problems:
        raise TensorParallelError("tensor parallelism cannot split this graph as asked:\n  "
                                  + "\n  ".join(dict.fromkeys(result.problems)))
    out = rewrite_rank(gm, shardings, result, rank, make_tensor=make_tensor)
    if check:
        _check_shapes(gm, out, result, tp)
    return ShardedGraph(out, True, rank, result)


def _check_shapes(gm: fx.GraphModule, out: fx.GraphModule, prop: Propagation, tp: int) -> None:
    """Every value of ``out`` holds exactly one rank's share of ``gm``'s value."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    original = {n.name: n for n in gm.graph.nodes}
    comm = getattr(out, COMM_ATTR)
    setattr(out, COMM_ATTR, ShapeCommunicator(0, tp))
    problems = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            # The rank's inputs arrive on its device (the stage moves them there), whatever
            # device the capture saw them on (meta for a meta-built model, the CPU for a
            # model captured there and run on a GPU).
            home = next((t.device for t in [*out.parameters(), *out.buffers()]), None)
            inputs = [pytree.tree_map(lambda v: _fake(v, home), n.meta.get("val"))
                      for n in placeholders]
            seen: dict[str, Any] = {}

            class _Watch(fx.Interpreter):
                def run_node(self, n: fx.Node) -> Any:
                    value = super().run_node(n)
                    if "tp_source" in n.meta:
                        seen[n.meta["tp_source"]] = value
                    return value
            _Watch(out).run(*inputs)
    except Exception as error:
        raise PassError(f"tensor-parallel rank graph does not run on fake tensors: "
                        f"{type(error).__name__}: {error}") from error
    finally:
        setattr(out, COMM_ATTR, comm)
    for name, value in seen.items():
        node = original.get(name)
        whole = node.meta.get("val") if node is not None else None
        layout = prop.layouts.get(name)
        if not isinstance(value, torch.Tensor) or not isinstance(whole, torch.Tensor) or (
                node is not None and node.op in ("placeholder", "get_attr")):
            continue
        expected = list(whole.shape)
        if isinstance(layout, Shard):
            expected[layout.dim] //= tp
        if list(value.shape) != expected:
            problems.append(f"{name}: {list(value.shape)} instead of {expected} ({layout})")
    if problems:
        raise PassError("tensor-parallel rewrite made values of the wrong shape: "
                        + "; ".join(problems[:5]))


def _fake(value: Any, device: torch.device | None = None) -> Any:
    """Inside a fake mode: a fresh tensor of ``value``'s shape and dtype (on ``device``
    when given, else on ``value``'s)."""
    if isinstance(value, torch.Tensor):
        where = device if device is not None else value.device
        return torch.empty(tuple(value.shape), dtype=value.dtype, device=where)
    return value


def merge_split_layers(gm: fx.GraphModule, layers: Sequence[Layer],
                       propagation: Propagation) -> tuple[Layer, ...]:
    """Join consecutive layers between which a split value flows.

    A pipeline boundary inside a Megatron region (between a column-parallel Linear and its
    row-parallel partner) would hand one rank's slices to the next stage; merging the layers
    keeps every boundary on whole values. The merged layer takes its first layer's name and
    ``node.meta["layer"]`` is renumbered.

    Args:
        gm: the graph the layers group (``partitioner.passes.group_layers``).
        layers: its layers, in order.
        propagation: layouts of ``gm`` under the chosen shardings.
    """
    index = {name: k for k, layer in enumerate(layers) for name in layer.nodes}
    split = propagation.split_values()
    joined = [False] * len(layers)  # joined[k]: layer k belongs with layer k - 1
    for node in gm.graph.nodes:
        if node.name not in split or node.name not in index:
            continue
        last = max((index[u.name] for u in node.users if u.name in index), default=0)
        for k in range(index[node.name] + 1, last + 1):
            joined[k] = True
    merged: list[list[Layer]] = []
    for k, layer in enumerate(layers):
        if joined[k] and merged:
            merged[-1].append(layer)
        else:
            merged.append([layer])
    out = tuple(Layer(group[0].name, group[0].path,
                      tuple(n for layer in group for n in layer.nodes)) for group in merged)
    nodes = {n.name: n for n in gm.graph.nodes}
    for k, layer in enumerate(out):
        for name in layer.nodes:
            nodes[name].meta["layer"] = k
    return out
