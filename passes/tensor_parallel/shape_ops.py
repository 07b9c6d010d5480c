"""Rules for operations that move elements between dimensions: reshapes, permutations,
slicing, indexing and splits.

A reshape keeps a split when the slices of the split dimension are slices of one output
dimension (``tp_layout.shard_through_view``); its size arguments then become one rank's
sizes (``Resize``). Permutations move the split with its dimension; slicing and indexing keep
it when they leave the split dimension whole. A split along the split dimension is exact only
when its pieces are the fused blocks of a column weight (q, k, v of one projection); it then
asks (``block_requests``) for the producing weight to be split per block.

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> gm = torch.fx.symbolic_trace(lambda x: x.view(2, 4, 8))
    >>> _ = propagate_shapes(gm, (torch.randn(2, 32),))
    >>> ctx = RuleContext(gm, tp=2, sites={}, shardings={})
    >>> x, view = list(gm.graph.nodes)[:2]
    >>> ctx.layouts[x.name] = Shard(1)
    >>> decision = view_like(view, ctx)
    >>> print(decision.out, decision.action)
    S(1) Resize(paths=((('args', 2), None),))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from partitioner.passes.tensor_parallel.decision import (
    Action,
    ArgPath,
    Decision,
    Keep,
    Resize,
    RuleContext,
    arg,
    is_function,
    is_method,
    replicated,
    tensor_inputs,
    val,
)
from partitioner.passes.tensor_parallel.layout import R, Shard, normalize_dim, shard_through_view

__all__ = ["view_like", "expand", "permute", "slicing", "indexing", "split", "concatenate",
           "getitem", "VIEW_METHODS", "VIEW_FUNCTIONS", "CAT_FUNCTIONS", "STACK_FUNCTIONS"]

aten = torch.ops.aten

VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze"}
VIEW_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze,
                   torch.unsqueeze, aten.view.default, aten.reshape.default,
                   aten._unsafe_view.default, aten.flatten.using_ints, aten.unflatten.int,
                   aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                   aten.unsqueeze.default}
CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate, aten.cat.default}
STACK_FUNCTIONS = {torch.stack, aten.stack.default}
_SIZED = {"view", "reshape", torch.reshape, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default}


def _size_entries(node: fx.Node) -> list[tuple[ArgPath, Any]]:
    """The size arguments of a view/reshape/expand, one per output dimension."""
    for name in ("size", "shape"):
        if name in node.kwargs:
            sizes = node.kwargs[name]
            if isinstance(sizes, (list, tuple)):
                return [(("kwargs", name, k), v) for k, v in enumerate(sizes)]
            return [(("kwargs", name), sizes)]
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        return [(("args", 1, k), v) for k, v in enumerate(node.args[1])]
    return [(("args", k), node.args[k]) for k in range(1, len(node.args))]


def _resize_at(node: fx.Node, entries: list[tuple[ArgPath, Any]], dim: int,
               out_ndim: int) -> Resize:
    """Divide the size argument that gives output dimension ``dim``."""
    if len(entries) == 1 and isinstance(val(entries[0][1]), (tuple, list, torch.Size)):
        return Resize(((entries[0][0], dim),))  # one argument holding the whole shape
    if len(entries) != out_ndim:
        return Resize(())
    path, value = entries[dim]
    if isinstance(value, int) and value == -1:
        return Resize(())
    return Resize(((path, None),))


def view_like(node: fx.Node, ctx: RuleContext) -> Decision:
    x: Any = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    a, b = tuple(val(x).shape), tuple(val(node).shape)
    dim = shard_through_view(a, b, layout.dim)
    if dim is None or (layout.blocks is not None and a[layout.dim] != b[dim]):
        return replicated(node)
    if b[dim] % ctx.tp:
        ctx.problems.append(
            f"{ctx.where(node)} reshapes a tensor split along a dimension of size "
            f"{a[layout.dim]} into shape {list(b)}, whose dim {dim} (size {b[dim]}) does not "
            f"divide by tp={ctx.tp} (for attention: {b[dim]} heads over {ctx.tp} ranks)")
        return replicated(node)
    action: Action = Keep()
    if node.target in _SIZED:
        action = _resize_at(node, _size_entries(node), dim, len(b))
    elif is_function(node, torch.unflatten, aten.unflatten.int) or is_method(node, "unflatten"):
        start = normalize_dim(int(arg(node, 1, "dim")), len(a))
        sizes = arg(node, 2, "sizes")
        if start <= dim < start + len(sizes) and sizes[dim - start] != -1:
            path: ArgPath = ("args", 2, dim - start) if len(node.args) > 2 else (
                "kwargs", "sizes", dim - start)
            action = Resize(((path, None),))
    return Decision({x.name: layout}, Shard(dim, layout.blocks), action)


def expand(node: fx.Node, ctx: RuleContext) -> Decision:
    x: Any = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    out_ndim = val(node).dim()
    dim = layout.dim + out_ndim - val(x).dim()
    return Decision({x.name: layout}, Shard(dim, layout.blocks),
                    _resize_at(node, _size_entries(node), dim, out_ndim))


def _permutation(node: fx.Node, ndim: int) -> list[int] | None:
    """``perm`` with output dim ``k`` = input dim ``perm[k]``, if the node permutes."""
    perm = list(range(ndim))
    if is_function(node, torch.transpose, torch.swapaxes, aten.transpose.int) or is_method(
            node, "transpose", "swapaxes", "swapdims"):
        d0 = normalize_dim(int(arg(node, 1, "dim0")), ndim)
        d1 = normalize_dim(int(arg(node, 2, "dim1")), ndim)
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if is_function(node, torch.t, aten.t.default) or is_method(node, "t"):
        return perm[::-1]
    if is_function(node, torch.permute, aten.permute.default) or is_method(node, "permute"):
        dims: Any = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [normalize_dim(int(d), ndim) for d in dims]
    if is_function(node, torch.movedim) or is_method(node, "movedim"):
        src, dst = arg(node, 1, "source"), arg(node, 2, "destination")
        if not isinstance(src, int) or not isinstance(dst, int):
            return None
        src, dst = normalize_dim(src, ndim), normalize_dim(dst, ndim)
        order = [d for d in range(ndim) if d != src]
        order.insert(dst, src)
        return order
    return None


def permute(node: fx.Node, ctx: RuleContext) -> Decision:
    x: Any = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    perm = _permutation(node, val(x).dim())
    if perm is None:
        return replicated(node)
    return Decision({x.name: layout}, Shard(perm.index(layout.dim), layout.blocks))


def _full(start: Any, stop: Any, step: Any, size: int) -> bool:
    return (start in (None, 0) and (stop is None or (isinstance(stop, int) and stop >= size))
            and step in (None, 1))


def slicing(node: fx.Node, ctx: RuleContext) -> Decision:
    """``aten.slice``, ``select``, ``narrow``: fine unless they cut the split dimension."""
    x: Any = node.args[0]
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    ndim = val(x).dim()
    dim = normalize_dim(int(arg(node, 1, "dim", 0)), ndim)
    if dim != layout.dim:
        removed = is_function(node, aten.select.int) or is_method(node, "select")
        out_dim = layout.dim - (1 if removed and dim < layout.dim else 0)
        return Decision({x.name: layout}, Shard(out_dim, layout.blocks))
    if is_function(node, aten.slice.Tensor) and _full(
            arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1),
            int(val(x).shape[dim])):
        return Decision({x.name: layout}, layout)
    return replicated(node)


def indexing(node: fx.Node, ctx: RuleContext) -> Decision:
    """``x[...]`` with slices, ints, ``None`` and ``...`` that leave the split whole."""
    x, index = node.args[0], node.args[1]
    assert isinstance(x, fx.Node)
    layout = ctx.layout(x)
    if not isinstance(layout, Shard):
        return Decision({}, R)
    items = list(index) if isinstance(index, tuple) else [index]
    ndim = val(x).dim()
    if sum(i is Ellipsis for i in items) > 1 or any(
            not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
        return replicated(node)
    used = sum(1 for i in items if isinstance(i, (int, slice)))
    expanded: list[Any] = []
    for item in items:
        expanded += [slice(None)] * (ndim - used) if item is Ellipsis else [item]
    expanded += [slice(None)] * (ndim - sum(1 for i in expanded if i is not None))
    in_dim = out_dim = 0
    for item in expanded:
        if item is None:
            out_dim += 1
            continue
        if in_dim == layout.dim:
            if isinstance(item, slice) and _full(item.start, item.stop, item.step,
                                                 int(val(x).shape[in_dim])):
                return Decision({x.name: layout}, Shard(out_dim, layout.blocks))
            return replicated(node)
        in_dim += 1
        out_dim += 0 if isinstance(item, int) else 1
    return replicated(node)


def split(node: fx.Node, ctx: RuleContext) -> Decision:
    """``split``/``chunk``: the outputs of a split along the split dimension are split only
    when the pieces are exactly the fused blocks (then each piece is split on its own)."""
    x: Any = node.args[0]
    layout = ctx.layout(x)
    pieces = val(node)
    if not isinstance(layout, Shard):
        return Decision({}, tuple(R for _ in pieces))
    ndim = val(x).dim()
    dim = normalize_dim(int(arg(node, 2, "dim", 0)), ndim)
    if dim != layout.dim:
        return Decision({x.name: layout}, tuple(layout for _ in pieces))
    sizes = tuple(int(p.shape[dim]) for p in pieces)
    if len(sizes) == 1:
        return Decision({x.name: layout}, (layout,))
    if layout.blocks != sizes:
        if layout.blocks is None:
            _request_blocks(x, sizes, ctx)
        return replicated(node)
    action: Action = Keep()
    if not (is_function(node, torch.chunk, aten.chunk.default) or is_method(node, "chunk")):
        sizes_arg = arg(node, 1, "split_size_or_sections" if node.op == "call_function"
                         else "split_size")
        path: ArgPath = ("args", 1) if len(node.args) > 1 else ("kwargs", next(
            k for k in node.kwargs if k.startswith("split")))
        if isinstance(sizes_arg, (list, tuple)):
            action = Resize(tuple(((*path, k), None) for k in range(len(sizes_arg))))
        else:
            action = Resize(((path, None),))
    return Decision({x.name: layout}, tuple(Shard(dim) for _ in pieces), action)


def concatenate(node: fx.Node, ctx: RuleContext) -> Decision:
    """``cat``/``stack`` along another dimension than the split keep it (whole pieces are
    sliced to match: rotary embeddings' ``cat((-x2, x1), -1)`` on split heads); along the
    split dimension the pieces' slices interleave, so they are gathered first."""
    pieces: Any = arg(node, 0, "tensors")
    shards = [(n, ctx.layout(n)) for n in pieces
              if isinstance(n, fx.Node) and isinstance(ctx.layout(n), Shard)]
    if not shards:
        return Decision({}, R)
    first, layout = shards[0]
    ndim = val(first).dim()
    if any(not isinstance(n, fx.Node) or val(n).dim() != ndim for n in pieces):
        return replicated(node)  # legacy empty (0,) pieces, constants: keep it simple
    stacked = node.target in STACK_FUNCTIONS
    dim = normalize_dim(int(arg(node, 1, "dim", 0)), ndim + int(stacked))
    if not stacked and dim == layout.dim:
        return replicated(node)
    out_dim = layout.dim + int(stacked and dim <= layout.dim)
    return Decision({n.name: layout for n in pieces}, Shard(out_dim, layout.blocks))


def _request_blocks(x: fx.Node, sizes: tuple[int, ...], ctx: RuleContext) -> None:
    """Ask for the column site producing ``x`` to be split as fused blocks ``sizes``."""
    node = x
    while node.name not in ctx.sites:
        inputs = tensor_inputs(node)
        if len(inputs) != 1:
            return
        node = inputs[0]
    site = ctx.sites[node.name]
    if site.shape[site.out_dim] == sum(sizes):
        ctx.block_requests[site.weight] = sizes


def getitem(node: fx.Node, ctx: RuleContext) -> Decision:
    source, index = node.args[0], node.args[1]
    layouts = ctx.layout(source)
    if isinstance(layouts, tuple) and isinstance(index, int):
        return Decision({}, layouts[index])
    return Decision({}, R)
