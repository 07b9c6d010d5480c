"""What each operation does to layouts: the rules of tensor-parallel propagation.

:func:`decide` looks at one node, the layouts of its inputs and the whole (unsplit) shapes
shape propagation recorded, and returns a :class:`Decision`: the layout each tensor input
must have, the layout of the output, and how the node is rewritten for one rank. Rules are
exact or decline: an operation no rule understands on split inputs gets them whole again
(an all-gather) and runs replicated, which is always correct, only slower. So the choice of
what to split (``tp_match``) can only cost speed, never correctness. Reshapes, slicing and
splits have their own file (``tp_shape_ops``); decisions and what rules read, ``tp_decision``.

=================================  ==========================================================
operation                          rule
=================================  ==========================================================
element-wise (``relu``, ``+``)     split inputs keep their split; replicated inputs
                                   broadcast (size 1 there) or are sliced to match
reshapes (``view``, ``flatten``)   the split moves to the dimension holding the same
                                   slices; size arguments become one rank's sizes
``transpose``, ``permute``         the split follows its dimension
``split``, ``chunk``               along another dimension: kept; along the split
                                   dimension: only into the blocks of a fused projection
``cat``, ``stack``                 along another dimension: kept, whole pieces sliced
                                   (rotary embeddings' ``rotate_half``); along the split
                                   dimension: gathered
reductions, ``softmax``, norms     over other dimensions: kept
``matmul``, attention              batch (head) dimensions split alike on both sides: kept
size queries (``x.shape``)         answer with the whole sizes
Linear, Embedding (sites)          by their weight's sharding (``colwise``, ``rowwise``,
                                   ``vocab``)
``nn.MultiheadAttention`` (site)   by heads: whole inputs, whole output after one all-reduce
                                   (``tp_attention``)
=================================  ==========================================================

Example:
    >>> import torch
    >>> from partitioner.passes.tensor_parallel.layout import Shard
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> _ = propagate_shapes(gm, (torch.randn(2, 8),))
    >>> ctx = RuleContext(gm, tp=2, sites={}, shardings={})
    >>> x, relu = list(gm.graph.nodes)[:2]
    >>> ctx.layouts[x.name] = Shard(1)
    >>> print(decide(relu, ctx).out)
    S(1)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from partitioner.passes.tensor_parallel.attention import attention_rule
from partitioner.passes.tensor_parallel.decision import (
    Action,
    ColumnSite,
    Decision,
    Keep,
    RowSite,
    RuleContext,
    ShardedDropout,
    SizeQuery,
    VocabSite,
    arg,
    is_function,
    is_method,
    is_tensor,
    replicated,
    sharded_inputs,
    tensor_inputs,
    val,
)
from partitioner.passes.tensor_parallel.layout import R_IN, Layout, R, Shard, normalize_dim
from partitioner.passes.tensor_parallel.shape_ops import (
    CAT_FUNCTIONS,
    STACK_FUNCTIONS,
    VIEW_FUNCTIONS,
    VIEW_METHODS,
    concatenate,
    expand,
    getitem,
    indexing,
    permute,
    slicing,
    split,
    view_like,
)
from partitioner.passes.tensor_parallel.sites import Site
from partitioner.runtime import rng
from partitioner.runtime.precision import masked_fill_saturated, where_saturated
from partitioner.runtime.tensor_parallel import ops as tpops

__all__ = ["ATTENTION_PRODUCTS", "decide", "pointwise", "reduction", "norm", "matmul",
           "attention", "size_query", "site_rule", "Decision", "RuleContext"]

aten = torch.ops.aten


# ---- element-wise ---------------------------------------------------------------------------

_POINTWISE_FUNCTIONS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    operator.iadd, operator.isub, operator.imul, operator.itruediv,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.neg, torch.pow,
    torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.relu, torch.sqrt, torch.rsqrt,
    torch.abs, torch.where, torch.masked_fill, torch.clamp, torch.clip, torch.erf, torch.sin,
    torch.cos, torch.minimum, torch.maximum, torch.square, torch.reciprocal, torch.sign,
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, F.relu, F.relu6, F.gelu, F.silu, F.mish, F.tanh, F.sigmoid,
    F.leaky_relu, F.elu, F.selu, F.celu, F.softplus, F.hardtanh, F.hardswish, F.hardsigmoid,
    F.logsigmoid, F.dropout, torch.dropout, rng.dropout, rng.dropout_module,
    tpops.sharded_dropout, tpops.sharded_dropout_module, masked_fill_saturated,
    where_saturated, aten.dropout.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default,
    aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten._to_copy.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten.__and__.Tensor,
    aten.__or__.Tensor,
}
_POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "neg", "pow", "exp", "log", "tanh", "sigmoid",
    "relu", "sqrt", "rsqrt", "abs", "clamp", "clip", "masked_fill", "float", "half", "double",
    "bfloat16", "to", "type_as", "contiguous", "clone", "detach", "square", "sin", "cos",
    "erf", "sign", "reciprocal", "add_", "sub_", "mul_", "div_", "relu_", "masked_fill_",
    "clamp_", "tanh_", "sigmoid_", "neg_", "exp_", "pow_", "__and__", "__or__", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_not", "bool", "long", "int",
}
_POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
                      nn.Dropout, nn.Identity, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
                      nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid,
                      nn.Softsign, nn.Tanhshrink)
_DROPOUTS = {rng.dropout: tpops.sharded_dropout,
             rng.dropout_module: tpops.sharded_dropout_module}


def _is_pointwise(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        if node.target in _POINTWISE_FUNCTIONS:
            return True
        tags = getattr(node.target, "tags", ())
        return torch.Tag.pointwise in tags
    if node.op == "call_method":
        return node.target in _POINTWISE_METHODS
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        # A module's own parameters would get one rank's share of their gradient.
        if next(module.parameters(), None) is not None:
            return False
        return (isinstance(module, _POINTWISE_MODULES)
                or type(module).__module__ == "transformers.activations")
    return False


def _in_place(node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def pointwise(node: fx.Node, ctx: RuleContext) -> Decision:
    out = val(node)
    shards = sharded_inputs(node, ctx)
    if not shards or not isinstance(out, torch.Tensor):
        return replicated(node) if shards else Decision({}, R)
    if _in_place(node) and node.args and not isinstance(ctx.layout(node.args[0]), Shard):
        return replicated(node)  # a whole tensor written in place stays whole
    first, layout = shards[0]
    dim = layout.dim + out.dim() - val(first).dim()
    needs: dict[str, Layout] = {}
    for n in tensor_inputs(node):
        shape = val(n).shape
        d = dim - (out.dim() - len(shape))
        if d < 0 or shape[d] == 1:
            needs[n.name] = R_IN
        else:
            needs[n.name] = Shard(d, layout.blocks)
    action: Action = Keep()
    if node.op == "call_function" and node.target in _DROPOUTS:
        action = ShardedDropout()
    elif node.op == "call_module" and isinstance(ctx.gm.get_submodule(str(node.target)),
                                                 nn.Dropout):
        action = ShardedDropout()
    return Decision(needs, Shard(dim, layout.blocks), action)


# ---- reductions and normalizations -----------------------------------------------------------

_KEEP_RANK = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.cumsum,
              aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
              aten.log_softmax.int, aten.cumsum.default}
_KEEP_RANK_METHODS = {"softmax", "log_softmax", "cumsum"}
_REDUCE = {torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp,
           aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
           aten.logsumexp.default}
_REDUCE_METHODS = {"sum", "mean", "amax", "amin", "logsumexp"}
_NORMS = {F.layer_norm, F.rms_norm, aten.layer_norm.default, aten.rms_norm.default}


def reduction(node: fx.Node, ctx: RuleContext) -> Decision:
    x: Any = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    ndim = val(x).dim()
    dims = arg(node, 1, "dim")
    if dims is None or dims == []:
        return replicated(node)
    dims = [normalize_dim(int(d), ndim) for d in (dims if isinstance(dims, (list, tuple))
                                                  else [dims])]
    if layout.dim in dims:
        return replicated(node)
    keeps_rank = node.target in _KEEP_RANK or node.target in _KEEP_RANK_METHODS
    keepdim = keeps_rank or bool(arg(node, 2, "keepdim", False))
    out_dim = layout.dim if keepdim else layout.dim - sum(d < layout.dim for d in dims)
    return _with_region_inputs(node, x, layout, Shard(out_dim, layout.blocks))


def norm(node: fx.Node, ctx: RuleContext) -> Decision:
    x: Any = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    shape = arg(node, 1, "normalized_shape")
    normalized = len(shape) if isinstance(shape, (list, tuple)) else 1
    if layout.dim >= val(x).dim() - normalized:
        return replicated(node)
    return _with_region_inputs(node, x, layout, layout)


def _with_region_inputs(node: fx.Node, x: fx.Node, layout: Shard, out: Shard) -> Decision:
    needs: dict[str, Layout] = {n.name: R_IN for n in tensor_inputs(node)}
    needs[x.name] = layout
    return Decision(needs, out)


# ---- products and attention ------------------------------------------------------------------

def _broadcast_needs(operands: list[tuple[fx.Node, int]], out_dim: int, layout: Shard,
                     out_ndim: int) -> dict[str, Layout]:
    """Each operand aligned to ``out_dim`` from the right: split there, or broadcast."""
    needs: dict[str, Layout] = {}
    for n, trailing in operands:
        shape = val(n).shape
        d = out_dim - (out_ndim - len(shape))
        if d < 0 or d >= len(shape) - trailing or shape[d] == 1:
            needs[n.name] = R_IN
        else:
            needs[n.name] = Shard(d, layout.blocks)
    return needs


def matmul(node: fx.Node, ctx: RuleContext) -> Decision:
    """A product of two activations (attention scores): batch dims, rows of a, columns of b."""
    a: Any = node.args[0]
    b: Any = node.args[1]
    if not (is_tensor(a) and is_tensor(b)) or val(a).dim() < 2 or val(b).dim() < 2:
        return replicated(node) if sharded_inputs(node, ctx) else Decision({}, R)
    out_ndim = val(node).dim()
    la, lb = ctx.layout(a), ctx.layout(b)
    if not isinstance(la, Shard) and not isinstance(lb, Shard):
        return Decision({}, R)
    na, nb = val(a).dim(), val(b).dim()
    if isinstance(la, Shard) and la.dim < na - 2:
        out_dim, layout = la.dim + out_ndim - na, la
    elif isinstance(lb, Shard) and lb.dim < nb - 2:
        out_dim, layout = lb.dim + out_ndim - nb, lb
    elif isinstance(la, Shard) and la.dim == na - 2:
        return Decision({a.name: la, b.name: R_IN}, Shard(out_ndim - 2, la.blocks))
    elif isinstance(lb, Shard) and lb.dim == nb - 1:
        return Decision({a.name: R_IN, b.name: lb}, Shard(out_ndim - 1, lb.blocks))
    else:
        return replicated(node)
    needs = _broadcast_needs([(a, 2), (b, 2)], out_dim, layout, out_ndim)
    return Decision(needs, Shard(out_dim, layout.blocks))


def attention(node: fx.Node, ctx: RuleContext) -> Decision:
    """``scaled_dot_product_attention`` split along a batch (head) dimension of q, k, v."""
    q: Any = node.args[0]
    k: Any = node.args[1]
    v: Any = node.args[2]
    shards = sharded_inputs(node, ctx)
    if not shards:
        return Decision({}, R)
    out_ndim = val(node).dim()
    lq = ctx.layout(q)
    if not isinstance(lq, Shard) or lq.dim >= val(q).dim() - 2:
        return replicated(node)
    out_dim = lq.dim + out_ndim - val(q).dim()
    needs = _broadcast_needs([(q, 2), (k, 2), (v, 2)], out_dim, lq, out_ndim)
    mask = arg(node, 3, "attn_mask")
    if is_tensor(mask):
        needs.update(_broadcast_needs([(mask, 2)], out_dim, lq, out_ndim))
    return Decision(needs, Shard(out_dim, lq.blocks))


# ---- size queries and metadata ----------------------------------------------------------------

_METADATA_ATTRS = {"dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}
_METADATA_METHODS = {"dim", "ndimension", "is_floating_point", "is_contiguous", "get_device"}


def size_query(node: fx.Node, ctx: RuleContext) -> Decision | None:
    """Size and metadata queries on split tensors (``None``: the node is not one)."""
    x: Any = node.args[0] if node.args else None
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return None
    if (is_function(node, getattr) and node.args[1] in _METADATA_ATTRS) or is_method(
            node, *_METADATA_METHODS) or is_function(node, aten._assert_tensor_metadata.default):
        if "size" in node.kwargs or "stride" in node.kwargs:
            return None
        return Decision({x.name: layout}, R)
    if (is_function(node, getattr) and node.args[1] == "shape") or (
            is_method(node, "size") and len(node.args) == 1 and not node.kwargs):
        return Decision({x.name: layout}, R, SizeQuery("shape", layout.dim))
    if is_method(node, "size") or is_function(node, aten.sym_size.int):
        return Decision({x.name: layout}, R, SizeQuery("size", layout.dim))
    if is_method(node, "numel") or is_function(node, aten.sym_numel.default, torch.numel):
        return Decision({x.name: layout}, R, SizeQuery("numel", layout.dim))
    return None


# ---- sites ----------------------------------------------------------------------------------

def site_rule(node: fx.Node, site: Site, ctx: RuleContext) -> Decision:
    if site.op == "attention":
        return attention_rule(node, site, ctx)
    sharding = ctx.shardings.get(site.weight)
    out = val(node)
    inputs = tensor_inputs(node)
    x = next((n for n in inputs if n.op != "get_attr"), None)
    if sharding is None or not sharding.is_split:
        return replicated(node)
    if site.op == "embedding":
        if sharding.dim == 0:
            return Decision({}, R, VocabSite(site))
        return Decision({}, Shard(out.dim() - 1), ColumnSite(site))
    if x is None:
        return replicated(node)
    if sharding.dim == site.out_dim:
        bias = ctx.shardings.get(site.bias) if site.bias else None
        if site.bias and (bias is None or bias.dim != 0 or bias.blocks != sharding.blocks):
            ctx.problems.append(f"{site.name}: its weight is split colwise but its bias "
                                f"{site.bias} is split as {bias}; split both alike")
        return Decision({x.name: R_IN}, Shard(out.dim() - 1, sharding.blocks), ColumnSite(site))
    return Decision({x.name: Shard(val(x).dim() - 1)}, R, RowSite(site))


# ---- dispatch ---------------------------------------------------------------------------------

_PERMUTE_FUNCTIONS = {torch.transpose, torch.swapaxes, torch.t, torch.permute, torch.movedim,
                      aten.transpose.int, aten.t.default, aten.permute.default}
_PERMUTE_METHODS = {"transpose", "swapaxes", "swapdims", "t", "permute", "movedim"}
_SPLIT_FUNCTIONS = {torch.split, torch.chunk, aten.split.Tensor, aten.split_with_sizes.default,
                    aten.chunk.default}
_SLICE_FUNCTIONS = {aten.slice.Tensor, aten.select.int, torch.narrow, aten.narrow.default}
_MATMUL = {torch.matmul, operator.matmul, torch.bmm, aten.matmul.default, aten.bmm.default}
_ATTENTION = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
#: The products of queries with keys (and of weights with values).
ATTENTION_PRODUCTS = frozenset(_ATTENTION | _MATMUL)

Rule = Callable[[fx.Node, RuleContext], Decision]


def _rule(node: fx.Node, gm: fx.GraphModule) -> Rule | None:
    target = node.target
    if node.op == "call_method":
        table: dict[str, Rule] = {
            **dict.fromkeys(VIEW_METHODS, view_like), "expand": expand,
            **dict.fromkeys(_PERMUTE_METHODS, permute), "split": split, "chunk": split,
            "narrow": slicing, "select": slicing, "matmul": matmul,
            **dict.fromkeys(_KEEP_RANK_METHODS | _REDUCE_METHODS, reduction)}
        return table.get(str(target))
    if node.op == "call_function":
        for targets, rule in ((VIEW_FUNCTIONS, view_like), (_PERMUTE_FUNCTIONS, permute),
                              (_SPLIT_FUNCTIONS, split), (_SLICE_FUNCTIONS, slicing),
                              (_MATMUL, matmul), (_ATTENTION, attention),
                              (CAT_FUNCTIONS | STACK_FUNCTIONS, concatenate),
                              (_KEEP_RANK | _REDUCE, reduction), (_NORMS, norm)):
            if target in targets:
                return rule
        if target in (torch.Tensor.expand, aten.expand.default):
            return expand
        if target is operator.getitem:
            return getitem if not is_tensor(node.args[0]) else indexing
    return None


def decide(node: fx.Node, ctx: RuleContext) -> Decision:
    """The :class:`Decision` for a call node, given the layouts of its inputs."""
    site = ctx.sites.get(node.name)
    if site is not None:
        return site_rule(node, site, ctx)
    if not sharded_inputs(node, ctx) and not isinstance(ctx.layout(node.args[0] if node.args
                                                            else None), tuple):
        return Decision({}, _replicated_out(node))
    query = size_query(node, ctx)
    if query is not None:
        return query
    rule = _rule(node, ctx.gm)
    if rule is not None:
        return rule(node, ctx)
    if _is_pointwise(node, ctx.gm):
        return pointwise(node, ctx)
    return replicated(node)


def _replicated_out(node: fx.Node) -> Any:
    out = val(node)
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return tuple(R for _ in out)
    return R
