"""Rewrite a graph into one tensor-parallel rank's program.

Given the layouts ``tp_propagate`` found, :func:`rewrite_rank` builds rank ``r``'s graph:

- every weight is replaced by rank ``r``'s slice
(``partitioner.runtime.tensor_parallel.sharding``), every other
  parameter and buffer by the rank's own copy;
- every conversion becomes a collective from ``partitioner.runtime.tensor_parallel.collectives``:
``copy_to_tp`` where a
  whole value enters a split computation, ``gather_from_tp`` / ``scatter_to_tp`` where a
  value changes between whole and split;
- a row-parallel Linear becomes product, ``reduce_from_tp``, then the bias; a vocabulary-
  parallel Embedding a masked local lookup, then ``reduce_from_tp``; an
  ``nn.MultiheadAttention`` split by heads a call of ``head_parallel_attention`` on the
  rank's copy of the module;
- size arguments of reshapes and splits become one rank's sizes, size queries on split
  tensors answer with whole sizes, and dropout on split tensors draws from the rank's own
  generator.

Each node made from an original node carries its name in ``meta["tp_source"]`` and its
layout in ``meta["tp_layout"]``. The collectives reach the rank's group through the graph
attribute ``_tp_comm``, which the runtime binds (a thread-group member in one process, a
process group across processes).

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> from partitioner.passes.tensor_parallel.propagate import propagate
    >>> from partitioner.runtime.tensor_parallel.sharding import Sharding
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = propagate_shapes(gm, (torch.randn(3, 4),))
    >>> shardings = {"0.weight": Sharding("colwise", 0, 2), "0.bias": Sharding("colwise", 0, 2),
    ...              "2.weight": Sharding("rowwise", 1, 2)}
    >>> rank1 = rewrite_rank(gm, shardings, propagate(gm, shardings, 2), rank=1)
    >>> [n.target.__name__ for n in rank1.graph.nodes if n.op == "call_function"]
    ['copy_to_tp', 'linear', 'reduce_from_tp', 'add']
    >>> tuple(rank1.get_submodule("0").weight.shape)
    (4, 4)
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from partitioner.passes.base import PassError
from partitioner.passes.dead_code import has_side_effect
from partitioner.passes.tensor_parallel.attention import attention_arguments, weights_used
from partitioner.passes.tensor_parallel.decision import (
    AttentionSite,
    ColumnSite,
    Decision,
    Resize,
    RowSite,
    ShardedDropout,
    SizeQuery,
    VocabSite,
    val,
)
from partitioner.passes.tensor_parallel.layout import EnterRegion, Layout, Replicate, Shard
from partitioner.passes.tensor_parallel.propagate import Propagation
from partitioner.passes.tensor_parallel.sites import Site, attr_tensor, is_conv1d
from partitioner.runtime import rng
from partitioner.runtime.tensor_parallel import attention as tpattention
from partitioner.runtime.tensor_parallel import collectives
from partitioner.runtime.tensor_parallel import ops as tpops
from partitioner.runtime.tensor_parallel.sharding import Sharding, shard_tensor

__all__ = ["rewrite_rank", "TensorFactory", "COMM_ATTR"]

aten = torch.ops.aten

#: The graph attribute through which a rank graph reaches its tensor-parallel group.
COMM_ATTR = "_tp_comm"

#: What a node made for an original node keeps of its metadata: the layer it belongs to.
_LAYER_KEYS = ("layer_path", "layer")

#: Makes a rank's tensor: ``(attribute path, original tensor, its sharding or None)``.
TensorFactory = Callable[[str, torch.Tensor, Sharding | None], torch.Tensor]


def _default_factory(rank: int) -> TensorFactory:
    made: dict[int, torch.Tensor] = {}

    def make(path: str, tensor: torch.Tensor, sharding: Sharding | None) -> torch.Tensor:
        if id(tensor) not in made:
            data = shard_tensor(tensor, sharding, rank) if sharding else tensor.detach().clone()
            made[id(tensor)] = (torch.nn.Parameter(data, tensor.requires_grad)
                                if isinstance(tensor, torch.nn.Parameter) else data)
        return made[id(tensor)]
    return make


def rewrite_rank(gm: fx.GraphModule, shardings: dict[str, Sharding], propagation: Propagation,
                 rank: int, *, make_tensor: TensorFactory | None = None) -> fx.GraphModule:
    """Rank ``rank``'s graph of ``gm`` under ``shardings``.

    Args:
        gm: the graph (with shapes), left unchanged.
        shardings: by ``get_attr`` target / parameter path; the rest is replicated.
        propagation: ``propagate(gm, shardings, tp)`` over the whole graph.
        rank: the tensor-parallel rank.
        make_tensor: builds the rank's tensors; it must return the same object for the same
            original tensor (tied weights, and a module's weight that a ``get_attr`` also
            names). By default each original tensor is sliced or copied once.

    Returns:
        A new ``GraphModule`` whose ``_tp_comm`` attribute the runtime must set.

    Raises:
        PassError: if ``propagation`` does not cover a call node of ``gm``.
    """
    tp = _degree(shardings)
    make = make_tensor or _default_factory(rank)
    builder = _Builder(gm, shardings, propagation, rank, tp)
    for node in gm.graph.nodes:
        builder.emit(node)
    name = f"{type(gm).__name__}TPRank{rank}"
    draft = fx.GraphModule(_root(gm, shardings, builder.graph, make), builder.graph, name)
    draft.graph.eliminate_dead_code(lambda node: has_side_effect(draft, node))
    out = fx.GraphModule(draft, draft.graph, name)  # keeps only the attributes still used
    out.graph.lint()
    if not hasattr(out, COMM_ATTR):  # a graph without collectives still takes a binding
        setattr(out, COMM_ATTR, collectives.UnboundCommunicator(rank, tp))
    return out


def _degree(shardings: dict[str, Sharding]) -> int:
    degrees = {s.tp for s in shardings.values()}
    if len(degrees) > 1:
        raise PassError(f"shardings mix tensor-parallel degrees {sorted(degrees)}")
    return degrees.pop() if degrees else 1


class _Builder:
    """Emits the rank graph node by node."""

    def __init__(self, gm: fx.GraphModule, shardings: dict[str, Sharding], prop: Propagation,
                 rank: int, tp: int) -> None:
        self.gm, self.shardings, self.prop = gm, shardings, prop
        self.rank, self.tp = rank, tp
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.converted: dict[tuple[str, Layout], fx.Node] = {}
        self._comm: fx.Node | None = None

    def comm(self) -> fx.Node:
        if self._comm is None:
            self._comm = self.graph.get_attr(COMM_ATTR)
        return self._comm

    def call(self, fn: Any, *args: Any) -> fx.Node:
        return self.graph.call_function(fn, args)

    def emit(self, node: fx.Node) -> None:
        if node.op in ("placeholder", "get_attr"):
            self.env[node.name] = self._copy(node, {})
            return
        if node.op == "output":
            self.graph.output(fx.map_arg(node.args[0], self._whole))
            return
        decision = self.prop.decisions.get(node.name)
        if decision is None:
            raise PassError(f"tensor-parallel rewrite: no layout decision for {node.name}")
        last = next(iter(reversed(self.graph.nodes)), None)
        self._emit_call(node, decision)
        # Every node made for this one (its collectives included) belongs to its layer:
        # per-layer passes (passes/outline_layers.py) see the layer whole.
        new = last.next if last is not None else next(iter(self.graph.nodes), None)
        while new is not None and new.op != "root":
            for key in _LAYER_KEYS:
                if key in node.meta and new.op != "get_attr":
                    new.meta.setdefault(key, node.meta[key])
            new = new.next

    def _emit_call(self, node: fx.Node, decision: Any) -> None:
        inputs = {name: self.convert(name, need) for name, need in decision.needs.items()}
        action = decision.action
        if isinstance(action, RowSite):
            new = self._row(node, action.site, inputs)
        elif isinstance(action, AttentionSite):
            new = self._attention(node, inputs)
        elif isinstance(action, VocabSite):
            new = self._vocab(node, action.site)
        elif isinstance(action, ColumnSite) and self._is_conv1d(node):
            new = self._conv1d(node, inputs, bias=True)
        else:
            new = self._copy(node, inputs)
            if isinstance(action, Resize):
                self._resize(new, action)
            elif isinstance(action, SizeQuery):
                self._size_query(new, action)
            elif isinstance(action, ShardedDropout):
                self._sharded_dropout(new)
        new.meta["tp_layout"] = _describe(decision)
        new.meta["tp_source"] = node.name
        self.env[node.name] = new

    def _copy(self, node: fx.Node, inputs: dict[str, fx.Node]) -> fx.Node:
        new = self.graph.node_copy(node, lambda n: inputs.get(n.name, self.env[n.name]))
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        return new

    def _whole(self, node: fx.Node) -> fx.Node:
        layout = self.prop.layouts.get(node.name)
        if isinstance(layout, Shard) and isinstance(val(node), torch.Tensor):
            return self.convert(node.name, Replicate())
        return self.env[node.name]

    def convert(self, name: str, need: Layout) -> fx.Node:
        """The value ``name`` in layout ``need`` (collectives inserted once per value)."""
        have = self.prop.layouts.get(name, Replicate())
        x = self.env[name]
        if isinstance(have, tuple) or have == need:
            return x
        key = (name, need)
        if key not in self.converted:
            if isinstance(have, Shard):
                x = self.call(collectives.gather_from_tp, x, self.comm(), have.dim, have.blocks)
            if isinstance(need, EnterRegion):
                x = self.call(collectives.copy_to_tp, x, self.comm())
            elif isinstance(need, Shard):
                x = self.call(collectives.scatter_to_tp, x, self.comm(), need.dim, need.blocks)
            self.converted[key] = x
        return self.converted[key]

    # ---- sites --------------------------------------------------------------------------

    def _is_conv1d(self, node: fx.Node) -> bool:
        return node.op == "call_module" and is_conv1d(self.gm.get_submodule(str(node.target)))

    def _input(self, node: fx.Node, inputs: dict[str, fx.Node]) -> fx.Node:
        candidates = [n for n in node.all_input_nodes if n.op != "get_attr"]
        return inputs.get(candidates[0].name, self.env[candidates[0].name])

    def _attr(self, target: str | None) -> fx.Node | None:
        return self.graph.get_attr(target) if target is not None else None

    def _conv1d(self, node: fx.Node, inputs: dict[str, fx.Node], bias: bool) -> fx.Node:
        site_weight = f"{node.target}.weight"
        module = self.gm.get_submodule(str(node.target))
        b = self._attr(f"{node.target}.bias") if bias and module.bias is not None else None
        x = self._input(node, inputs)
        return self.call(tpops.in_out_linear, x, self._attr(site_weight), b)

    def _row(self, node: fx.Node, site: Site, inputs: dict[str, fx.Node]) -> fx.Node:
        """Product without bias, all-reduce, then the bias (added once, after the sum)."""
        x = self._input(node, inputs)
        weight = self._attr(site.weight)
        if node.op == "call_module":
            product = (self._conv1d(node, inputs, bias=False) if self._is_conv1d(node)
                       else self.call(F.linear, x, weight))
        elif node.target in (aten.addmm.default, torch.addmm):
            product = self.call(aten.mm.default if node.target is aten.addmm.default
                                else torch.mm, x, weight)
        else:  # linear / matmul spellings, without their bias
            product = self.call(node.target, x, weight)
        reduced = self.call(collectives.reduce_from_tp, product, self.comm())
        if site.bias is None:
            return reduced
        return self.call(operator.add, reduced, self._attr(site.bias))

    def _attention(self, node: fx.Node, inputs: dict[str, fx.Node]) -> fx.Node:
        """The rank's heads of an ``nn.MultiheadAttention`` call, on the rank's copy of the
        module (its slices); weights nobody reads are not computed."""
        arguments = {name: fx.map_arg(value, lambda n: inputs.get(n.name, self.env[n.name]))
                     for name, value in attention_arguments(node).items()}
        if not weights_used(node):
            arguments["need_weights"] = False
        query, key, value = (arguments.pop(name) for name in ("query", "key", "value"))
        module = self.graph.get_attr(str(node.target))
        return self.graph.call_function(tpattention.head_parallel_attention,
                                        (module, self.comm(), query, key, value), arguments)

    def _vocab(self, node: fx.Node, site: Site) -> fx.Node:
        ids, padding, scale, sparse = _embedding_args(self.gm, node)
        start = self.rank * (site.shape[0] // self.tp)
        lookup = self.graph.call_function(
            tpops.vocab_embedding,
            (self.env[ids.name], self._attr(site.weight), start, padding, scale, sparse))
        return self.call(collectives.reduce_from_tp, lookup, self.comm())

    # ---- argument rewrites ------------------------------------------------------------------

    def _resize(self, new: fx.Node, action: Resize) -> None:
        args: Any = [_listify(a) for a in new.args]
        kwargs: Any = {k: _listify(v) for k, v in new.kwargs.items()}
        for path, entry in action.paths:
            where, *keys = path
            holder = args if where == "args" else kwargs
            for key in keys[:-1]:
                holder = holder[key]
            holder[keys[-1]] = self._divided(new, holder[keys[-1]], entry)
        new.args = tuple(_restore(a, o) for a, o in zip(args, new.args))
        new.kwargs = {k: _restore(v, new.kwargs[k]) for k, v in kwargs.items()}

    def _divided(self, new: fx.Node, value: Any, entry: int | None) -> Any:
        if isinstance(value, int):
            return value if value == -1 else value // self.tp
        with self.graph.inserting_before(new):
            if entry is not None:
                return self.graph.call_function(tpops.divide_entry, (value, entry, self.tp))
            return self.graph.call_function(operator.floordiv, (value, self.tp))

    def _size_query(self, new: fx.Node, action: SizeQuery) -> None:
        x = new.args[0]
        if action.what == "shape":
            new.op, new.target = "call_function", tpops.global_shape
            new.args, new.kwargs = (x, action.dim, self.tp), {}
        elif action.what == "size":
            query = new.args[1] if len(new.args) > 1 else new.kwargs["dim"]
            new.op, new.target = "call_function", tpops.global_size
            new.args, new.kwargs = (x, query, action.dim, self.tp), {}
        else:
            new.op, new.target = "call_function", tpops.global_numel
            new.args, new.kwargs = (x, self.tp), {}

    def _sharded_dropout(self, new: fx.Node) -> None:
        if new.op == "call_module":
            with self.graph.inserting_before(new):
                module = self.graph.get_attr(str(new.target))
            new.op, new.target = "call_function", tpops.sharded_dropout_module
            new.args, new.kwargs = (new.args[0], module), {}
        elif new.target is rng.dropout_module:
            new.target = tpops.sharded_dropout_module
        elif new.target in (rng.dropout, tpops.sharded_dropout):
            new.target = tpops.sharded_dropout
        else:  # F.dropout / torch.dropout / aten.dropout, before route_dropout ran
            x, p, training = [*new.args, None, None][:3]
            p = new.kwargs.get("p", 0.5 if p is None else p)
            training = new.kwargs.get("training", new.kwargs.get("train", True
                                                                 if training is None
                                                                 else training))
            new.target, new.args, new.kwargs = tpops.sharded_dropout, (x, p, training), {}


def _embedding_args(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, int | None, bool, bool]:
    """(ids, global padding row or None, scale_grad_by_freq, sparse) of an embedding call."""
    if node.op == "call_module":
        module: Any = gm.get_submodule(str(node.target))
        return (node.args[0], module.padding_idx, bool(module.scale_grad_by_freq),
                bool(module.sparse))
    if node.target is aten.embedding.default:
        args: list[Any] = [*node.args, *[-1, False, False][len(node.args) - 2:]]
        padding = int(args[2])
        return args[1], (padding if padding >= 0 else None), bool(args[3]), bool(args[4])
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
             "sparse")
    values: dict[str, Any] = {n: node.args[k] if k < len(node.args) else node.kwargs.get(n)
                              for k, n in enumerate(names)}
    padding = values["padding_idx"]
    rows = attr_tensor(gm, str(values["weight"].target)).shape[0]
    if padding is not None and padding < 0:
        padding += rows
    return values["input"], padding, bool(values["scale_grad_by_freq"]), bool(values["sparse"])


def _listify(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_listify(v) for v in value]
    return value


def _restore(value: Any, original: Any) -> Any:
    if isinstance(original, (tuple, list)):
        return type(original)(_restore(v, o) for v, o in zip(value, original))
    return value


def _describe(decision: Decision) -> str:
    out = decision.out
    return ", ".join(map(str, out)) if isinstance(out, tuple) else str(out)


def _root(gm: fx.GraphModule, shardings: dict[str, Sharding], graph: fx.Graph,
          make: TensorFactory) -> dict[str, Any]:
    """The rank graph's attributes: sliced weights, copied parameters, buffers and modules."""
    root: dict[str, Any] = {COMM_ATTR: collectives.UnboundCommunicator()}
    for node in graph.nodes:
        target = str(node.target)
        if node.op == "get_attr" and target != COMM_ATTR and target not in root:
            value = attr_tensor(gm, target)
            if isinstance(value, torch.Tensor):
                root[target] = make(target, value, shardings.get(target))
            elif isinstance(value, torch.nn.Module):  # e.g. an nn.Dropout route_dropout named
                root[target] = _copy_module(value, target, shardings, make)
            else:
                root[target] = value
        elif node.op == "call_module" and target not in root:
            root[target] = _copy_module(gm.get_submodule(target), target, shardings, make)
    return root


def _copy_module(module: torch.nn.Module, target: str, shardings: dict[str, Sharding],
                 make: TensorFactory) -> torch.nn.Module:
    """The rank's copy of a module: its tensors made by ``make``, the rest copied."""
    memo: dict[int, Any] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        path = f"{target}.{name}"
        memo[id(tensor)] = make(path, tensor, shardings.get(path))
    return copy.deepcopy(module, memo)
