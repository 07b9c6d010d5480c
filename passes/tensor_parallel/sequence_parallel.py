"""Sequence parallelism: a tensor-parallel rank graph's replicated region on sequence shards.

Megatron's sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", 2022). Under tensor parallelism alone, what lies between a
row-parallel product's all-reduce and the next column-parallel product's entry (residual
adds, norms, dropout) runs on the whole activation on every rank. :func:`sequence_parallel`
rewrites one rank's graph (``shard_graph``'s) so that it runs on this rank's ``s / tp``
tokens instead:

- every ``reduce_from_tp`` whose value is split along ``dim`` becomes
  ``reduce_scatter_to_sp`` (``partitioner.runtime.tensor_parallel.sequence``);
- its users that work token by token (element-wise operations, layer and RMS norms over the
  last dimension, dropout) follow it onto the shards, their other whole inputs sliced
  (``scatter_to_tp``: the activation's size, or a value broadcast over it that spans the
  sequence, such as a ``(T, C)`` position embedding, by its rows) and the parameters they
  use entered with ``copy_to_tp`` (each rank sees its tokens' share of the weight
  gradient: the backward sums them);
- a read of a shard's shape (``x.shape``, ``x.size(d)``) becomes ``whole_size``: the whole
  value's size, from the shard's, with no collective;
- a ``copy_to_tp`` of a shard (the entry of the next column-parallel product) becomes
  ``all_gather_from_sp``; any other user gets the whole value back (``gather_from_tp``).

The activations kept for the backward between the pairs are then divided by ``tp``; the
bytes communicated stay those of the all-reduces (a ring all-reduce is a reduce-scatter
and an all-gather). Shards dropout draws from the rank's own generator, as dropout on
split tensors does in tensor parallelism.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> from partitioner.passes.tensor_parallel.shard_graph import choose_shardings, shard_graph
    >>> model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8))
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = propagate_shapes(gm, (torch.randn(2, 4, 8),))
    >>> rank = shard_graph(gm, choose_shardings(gm, 2).shardings, 0).graph_module
    >>> out = sequence_parallel(rank, gm, 2).graph_module
    >>> names = [n.target.__name__ for n in out.graph.nodes if n.op == "call_function"]
    >>> names[2], names[-2:]
    ('reduce_scatter_to_sp', ['layer_norm', 'gather_from_tp'])
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.passes.base import PassError, PassResult
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.runtime import rng
from partitioner.runtime.tensor_parallel import collectives, sequence
from partitioner.runtime.tensor_parallel import ops as tpops
from partitioner.runtime.tensor_parallel.collectives import ShapeCommunicator

__all__ = ["sequence_parallel", "TOKENWISE"]

aten = torch.ops.aten

TOKENWISE: frozenset[Any] = frozenset({
    operator.add, operator.mul, operator.sub, operator.truediv, operator.neg,
    torch.add, torch.mul, torch.sub, torch.div, torch.rsqrt, torch.tanh, torch.sigmoid,
    torch.pow, torch.relu, F.gelu, F.silu, F.relu, F.layer_norm, F.rms_norm,
    aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.rsqrt.default,
    aten.pow.Tensor_Scalar, aten.gelu.default, aten.silu.default, aten.neg.default,
    aten.to.dtype, aten._to_copy.default, aten.tanh.default, aten.relu.default,
    aten.layer_norm.default,
    "add", "mul", "sub", "div", "pow", "rsqrt", "to", "float", "type_as", "tanh",
})
"""Operations that work token by token (on the last dimension only): the ones a sequence
shard may go through. ``mean`` over the last dimension is one too (checked by argument)."""

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Identity)
_DROPOUTS = (rng.dropout_module, rng.dropout, tpops.sharded_dropout,
             tpops.sharded_dropout_module)


def sequence_parallel(gm: fx.GraphModule, whole: fx.GraphModule, tp: int,
                      dim: int = 1) -> PassResult:
    """Run ``gm``'s replicated region on sequence shards (see the module's docstring).

    Args:
        gm: one rank's graph (``shard_graph(...).graph_module``), rewritten in place.
        whole: the graph it was made from, with ``meta["val"]`` (the example's shapes).
        tp: the tensor-parallel degree.
        dim: the sequence dimension of the activations (1 for ``(batch, seq, hidden)``).

    Returns:
        The module and whether any all-reduce became a reduce-scatter (none does when no
        reduced value has ``dim`` divisible by ``tp``).

    Raises:
        PassError: ``gm`` does not run on fake tensors of ``whole``'s example shapes.
    """
    shapes = _shapes(gm, whole, tp)
    rewriter = _Rewriter(gm, shapes, tp, dim)
    for node in list(gm.graph.nodes):
        rewriter.visit(node)
    if rewriter.changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, rewriter.changed)


def _shapes(gm: fx.GraphModule, whole: fx.GraphModule, tp: int) -> dict[str, torch.Size]:
    """Every tensor value's shape on one rank, from a run on fake tensors."""
    placeholders = [n.meta.get("val") for n in whole.graph.nodes if n.op == "placeholder"]
    comm = getattr(gm, COMM_ATTR)
    setattr(gm, COMM_ATTR, ShapeCommunicator(0, tp))
    found: dict[str, torch.Size] = {}
    # Shapes found on a meta-built model are on meta; the rank's tensors are real.
    home = next((t.device for t in [*gm.parameters(), *gm.buffers()]), None)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            inputs = pytree.tree_map(lambda v: _fake(mode, v, home), placeholders)

            class _Watch(fx.Interpreter):
                def run_node(self, n: fx.Node) -> Any:
                    value = super().run_node(n)
                    if isinstance(value, torch.Tensor):
                        found[n.name] = value.shape
                    return value
            _Watch(gm).run(*inputs)
    except Exception as error:
        raise PassError(f"sequence_parallel: the rank graph does not run on fake tensors: "
                        f"{type(error).__name__}: {error}") from error
    finally:
        setattr(gm, COMM_ATTR, comm)
    return found


class _Rewriter:
    """Moves shards forward from each all-reduce, node by node in graph order."""

    def __init__(self, gm: fx.GraphModule, shapes: dict[str, torch.Size], tp: int,
                 dim: int) -> None:
        self.gm, self.shapes, self.tp, self.dim = gm, shapes, tp, dim
        self.graph = gm.graph
        self.sharded: set[fx.Node] = set()
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.changed = False

    def comm(self, before: fx.Node) -> fx.Node:
        found = next((n for n in self.graph.nodes
                      if n.op == "get_attr" and n.target == COMM_ATTR), None)
        if found is not None:
            return found
        with self.graph.inserting_before(before):
            return self.graph.get_attr(COMM_ATTR)

    def splittable(self, node: fx.Node) -> bool:
        shape = self.shapes.get(node.name)
        return shape is not None and len(shape) > self.dim and shape[self.dim] % self.tp == 0 \
            and shape[self.dim] >= self.tp

    def visit(self, node: fx.Node) -> None:
        if node.op == "call_function" and node.target is collectives.reduce_from_tp \
                and self.splittable(node):
            node.target = sequence.reduce_scatter_to_sp
            node.args = (*node.args, self.dim)
            self.sharded.add(node)
            self.changed = True
            return
        inputs = [n for n in node.all_input_nodes if n in self.sharded]
        if not inputs or _checks_dtype_only(node):
            return
        if _reads_shape(node) and node.args[0] in self.sharded:
            self.whole_size(node)
            return
        if node.op == "call_function" and node.target is collectives.copy_to_tp:
            node.target = sequence.all_gather_from_sp
            node.args = (node.args[0], node.args[1], self.dim)
            return
        if self.tokenwise(node) and self.follow(node):
            self.sharded.add(node)
            return
        for n in inputs:
            node.replace_input_with(n, self.whole(n))

    def tokenwise(self, node: fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(self.gm.get_submodule(str(node.target)), (*_NORMS, nn.Dropout))
        if (node.op == "call_method" and node.target == "mean") or node.target is aten.mean.dim:
            return self._last_dim_only(node)
        if node.op == "call_function" and node.target in _DROPOUTS:
            return True
        return node.target in TOKENWISE and node.op in ("call_function", "call_method")

    def _last_dim_only(self, node: fx.Node) -> bool:
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        x = node.args[0]
        ndim = len(self.shapes.get(x.name, ())) if isinstance(x, fx.Node) else 0
        return bool(dims) and ndim > 0 \
            and all(isinstance(d, int) and d % ndim == ndim - 1 for d in dims) \
            and bool(node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2]))

    def follow(self, node: fx.Node) -> bool:
        """Rewrite ``node``'s whole inputs for a shard; ``False`` (nothing changed) when one
        of them cannot be sliced (it spans the sequence but is not the activation's size)."""
        out = self.shapes.get(node.name)
        if out is None:
            return False
        plan: dict[fx.Node, str | int] = {}
        for n in node.all_input_nodes:
            if n in self.sharded or (n.op == "get_attr" and n.target == COMM_ATTR):
                continue
            shape = self.shapes.get(n.name)
            if shape is None:
                continue
            at = self.dim - (len(out) - len(shape))  # its dim facing the sequence
            if self._broadcast(shape, len(out)):
                plan[n] = "enter" if self._parameter(n) else "keep"
            elif at >= 0 and shape[at] == out[self.dim]:
                # The activation's size, or a value broadcast over it that spans the
                # sequence (a (T, C) position embedding): this rank's positions of it.
                plan[n] = at
            else:
                return False
        for n, how in plan.items():
            if how == "enter":
                node.replace_input_with(n, self.call(node, collectives.copy_to_tp, n))
            elif isinstance(how, int):
                node.replace_input_with(n, self.call(node, collectives.scatter_to_tp, n,
                                                     how))
        if node.op == "call_module" and isinstance(self.gm.get_submodule(str(node.target)),
                                                   nn.Dropout):
            self._shard_dropout(node)
        elif node.op == "call_function" and node.target in (rng.dropout_module, rng.dropout):
            node.target = tpops.sharded_dropout_module \
                if node.target is rng.dropout_module else tpops.sharded_dropout
        self._enter_module_parameters(node)
        return True

    def _broadcast(self, shape: torch.Size, ndim: int) -> bool:
        """Whether a value of ``shape`` broadcasts against the activation without spanning
        its sequence dimension (a norm's weight, a bias, a scalar)."""
        at = self.dim - (ndim - len(shape))
        return at < 0 or shape[at] == 1

    def _parameter(self, node: fx.Node) -> bool:
        if node.op != "get_attr":
            return False
        value = _attr(self.gm, str(node.target))
        return isinstance(value, torch.Tensor) and value.requires_grad

    def _enter_module_parameters(self, node: fx.Node) -> None:
        """A norm module's weight gets partial gradients on each rank: call it functionally
        on its weights entered with ``copy_to_tp``."""
        if node.op != "call_module":
            return
        module = self.gm.get_submodule(str(node.target))
        if not isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or not list(module.parameters()):
            return
        weights: list[fx.Node | None] = []
        for name in ("weight", "bias"):
            tensor = getattr(module, name, None)
            if tensor is None:
                weights.append(None)
                continue
            with self.graph.inserting_before(node):
                got = self.graph.get_attr(f"{node.target}.{name}")
            weights.append(self.call(node, collectives.copy_to_tp, got))
        x = node.args[0]
        if isinstance(module, nn.LayerNorm):
            node.op, node.target = "call_function", F.layer_norm
            node.args = (x, tuple(module.normalized_shape), weights[0], weights[1], module.eps)
        else:
            node.op, node.target = "call_function", F.rms_norm
            shape = tuple(module.normalized_shape)
            node.args = (x, shape, weights[0], module.eps)
        node.kwargs = {}

    def _shard_dropout(self, node: fx.Node) -> None:
        with self.graph.inserting_before(node):
            module = self.graph.get_attr(str(node.target))
        node.op, node.target = "call_function", tpops.sharded_dropout_module
        node.args, node.kwargs = (node.args[0], module), {}

    def whole_size(self, node: fx.Node) -> None:
        """A read of a shard's shape (``x.shape``, ``x.size(d)``) answers the whole value's,
        from the shard's own (no all-gather just to read a size)."""
        which = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if node.target is getattr:  # x.shape
            which = None
        node.op, node.target = "call_function", sequence.whole_size
        node.args = (node.args[0], self.dim, self.tp, *(() if which is None else (which,)))
        node.kwargs = {}
        self.changed = True

    def call(self, before: fx.Node, fn: Any, x: fx.Node, *rest: Any) -> fx.Node:
        comm = self.comm(before)
        with self.graph.inserting_before(before):
            return self.graph.call_function(fn, (x, comm, *rest))

    def whole(self, node: fx.Node) -> fx.Node:
        """The whole value of shard ``node`` (one all-gather, shared by its users)."""
        if node not in self.gathered:
            comm = self.comm(node)
            with self.graph.inserting_after(node):
                gathered = self.graph.call_function(collectives.gather_from_tp,
                                                    (node, comm, self.dim))
            self.gathered[node] = gathered
        return self.gathered[node]


def _fake(mode: FakeTensorMode, value: Any, home: torch.device | None) -> Any:
    """``value`` as a fake tensor (on ``home`` when ``value`` is on the meta device)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_meta and home is not None and home.type != "meta":
        return torch.empty(tuple(value.shape), dtype=value.dtype, device=home)
    return mode.from_tensor(value)


def _reads_shape(node: fx.Node) -> bool:
    """``x.shape``, ``x.size()``/``x.size(d)`` or export's ``sym_size(x, d)``."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] == "shape"
    if node.op == "call_method":
        return node.target == "size"
    return node.op == "call_function" and node.target is aten.sym_size.int


def _checks_dtype_only(node: fx.Node) -> bool:
    """An export-time metadata assertion that does not check sizes (a shard passes it)."""
    return node.target is aten._assert_tensor_metadata.default \
        and node.kwargs.get("size") is None and len(node.args) < 2


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
