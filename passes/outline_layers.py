"""Give each layer of a stage graph its own module call, so per-layer hooks (FSDP) can fire.

A graph captured with ``torch.export`` (transformers' models) reads every parameter with a
``get_attr`` of the root and calls no submodules: a hook registered on a layer never runs,
so FSDP could only gather the whole stage at once. This pass moves the nodes of each layer
(``node.meta["layer_path"]``, written by ``flatten_sequential``) into a ``GraphModule``
installed *at that layer's own path*, and calls it from the stage graph. The moved
``get_attr`` and ``call_module`` targets become relative to the layer, so the parameters
keep their qualified names (``transformer.h.0.attn.c_attn.weight``): ``state_dict()``,
checkpoints and optimizers see the same names and the same ``Parameter`` objects.

A layer is outlined only when that is exact:

* every parameter and buffer its module holds is read by its nodes and by no other node
  (a weight tied to another layer stays with the stage, read as before);
* every value its nodes read from outside is computed before its first node (the call
  replaces the nodes where the first one stood);
* it holds a parameter that requires a gradient (a unit with nothing to shard is no unit).

A layer whose module is called once, and read by nothing else (``symbolic_trace`` keeps
leaf modules as calls; a tensor-parallel rewrite may put a collective beside the call), is a
unit as it is. ``get_attr`` nodes are hoisted to the top first
(they read no values), so a tensor shared by layers is read once, before any of them.

Example:
    >>> import torch
    >>> from torch import fx, nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = nn.Parameter(torch.ones(4, 4))
    >>> root = nn.Module()
    >>> root.block = Block()
    >>> graph = fx.Graph()
    >>> x = graph.placeholder("x")
    >>> w = graph.get_attr("block.w")
    >>> y = graph.call_function(torch.matmul, (x, w))
    >>> y.meta["layer_path"] = "block"
    >>> _ = graph.output(y)
    >>> gm = fx.GraphModule(root, graph)
    >>> result = outline_layers(gm)
    >>> result.units, [n.op for n in gm.graph.nodes], list(dict(gm.named_parameters()))
    (('block',), ['placeholder', 'call_module', 'output'], ['block.w'])
    >>> torch.equal(gm(torch.eye(4)), torch.ones(4, 4))
    True
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from partitioner.passes.base import PassResult

__all__ = ["outline_layers", "Outlined"]


@dataclass(frozen=True)
class Outlined(PassResult):
    """What :func:`outline_layers` returns: the graph module and the paths of the modules
    that are now called once per forward, each holding its layer's parameters."""

    units: tuple[str, ...] = ()


def outline_layers(gm: fx.GraphModule) -> Outlined:
    """Outline each layer of ``gm`` into a module at its own path, in place.

    Returns:
        ``Outlined(gm, modified, units)``: ``units`` in graph order, the layers outlined
        now and those already called as one module.
    """
    _hoist_attributes(gm)
    regions = _regions(gm)
    units: list[str] = []
    modified = False
    for path, nodes in regions.items():
        if _called_whole(gm, path, nodes):
            units.append(path)
            continue
        if _outline(gm, path, nodes):
            units.append(path)
            modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    return Outlined(gm, modified, tuple(units))


def _hoist_attributes(gm: fx.GraphModule) -> None:
    """Move every ``get_attr`` right after the placeholders, in order (it reads no
    values)."""
    nodes = list(gm.graph.nodes)
    attrs = [n for n in nodes if n.op == "get_attr"]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not attrs:
        return
    if placeholders:
        place = placeholders[-1]
    else:
        place = attrs[0]
        nodes[0].prepend(place)
    for node in attrs:
        if node is not place:
            place.append(node)
            place = node


def _regions(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Each layer path's call nodes, in graph order, with the ``get_attr`` nodes read only
    by them."""
    regions: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        path = node.meta.get("layer_path")
        if node.op.startswith("call_") and isinstance(path, str) and path:
            regions.setdefault(path, []).append(node)
    owner = {n: path for path, nodes in regions.items() for n in nodes}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            paths = {owner.get(user) for user in node.users}
            path = paths.pop() if len(paths) == 1 else None
            # An attribute outside the layer's module (a queue the stage shares) is passed
            # in, read where it was.
            if path is not None and _relative(str(node.target), path) is not None:
                regions[path].append(node)
    return regions


def _called_whole(gm: fx.GraphModule, path: str, nodes: list[fx.Node]) -> bool:
    """The layer's module is called, once, and nothing else reads inside it (the layer's
    other nodes, a tensor-parallel collective around the call, read no tensor of it)."""
    calls = [n for n in nodes if n.op == "call_module" and n.target == path]
    if len(calls) != 1:
        return False
    for node in gm.graph.nodes:
        if node is not calls[0] and node.op in ("get_attr", "call_module") and (
                node.target == path or _relative(str(node.target), path) is not None):
            return False
    try:
        return _has_trainable(gm.get_submodule(path))
    except AttributeError:
        return False


def _has_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _relative(target: str, path: str) -> str | None:
    return target[len(path) + 1:] if target.startswith(path + ".") else None


def _outline(gm: fx.GraphModule, path: str, nodes: list[fx.Node]) -> bool:
    """Move ``nodes`` into a module at ``path``; ``False`` (nothing changed) when that
    would not be exact (see the module docstring)."""
    try:
        owner = gm.get_submodule(path)
    except AttributeError:
        return False
    if isinstance(owner, fx.GraphModule) or not _has_trainable(owner):
        return False
    inside = set(nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    read: set[str] = set()
    for node in nodes:
        if node.op in ("get_attr", "call_module"):
            rel = _relative(str(node.target), path)
            if rel is None:
                return False
            read.add(rel)
    for node in gm.graph.nodes:  # nothing else may reach into the layer's module
        if node not in inside and node.op in ("get_attr", "call_module") and (
                node.target == path or _relative(str(node.target), path) is not None):
            return False
    held = [name for name, _ in owner.named_parameters(remove_duplicate=False)]
    held += [name for name, _ in owner.named_buffers(remove_duplicate=False)]
    if not all(name in read or any(name.startswith(r + ".") for r in read) for name in held):
        return False
    calls = sorted((n for n in nodes if n.op != "get_attr"), key=order.__getitem__)
    if not calls:
        return False
    first = calls[0]
    inputs: list[fx.Node] = []
    for node in sorted(nodes, key=order.__getitem__):
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                if order[arg] >= order[first]:
                    return False
                inputs.append(arg)
    outputs = [n for n in sorted(nodes, key=order.__getitem__)
               if any(user not in inside for user in n.users)]
    sub = _subgraph_module(owner, path, nodes, inputs, outputs, order)
    _install(gm, path, sub)
    with gm.graph.inserting_before(first):
        call = gm.graph.call_module(path, tuple(inputs))
        call.meta["layer_path"] = path
        if "layer" in first.meta:
            call.meta["layer"] = first.meta["layer"]
        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(call)
        else:
            for k, out in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, k))
                item.meta.update(call.meta)
                out.replace_all_uses_with(item)
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        gm.graph.erase_node(node)
    return True


def _subgraph_module(owner: nn.Module, path: str, nodes: list[fx.Node],
                     inputs: list[fx.Node], outputs: list[fx.Node],
                     order: dict[fx.Node, int]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = graph.placeholder(arg.name)
        env[arg].meta.update(arg.meta)
    for node in sorted(nodes, key=order.__getitem__):
        copy = graph.node_copy(node, lambda n: env[n])
        if node.op in ("get_attr", "call_module"):
            copy.target = _relative(str(node.target), path)  # type: ignore[assignment]
        env[node] = copy
    result = [env[n] for n in outputs]
    graph.output(result[0] if len(result) == 1 else tuple(result))
    sub = fx.GraphModule(owner, graph, class_name=type(owner).__name__)
    _keep_non_persistent(owner, sub)
    return sub


def _keep_non_persistent(owner: nn.Module, sub: nn.Module) -> None:
    """``GraphModule`` registers every copied buffer as persistent: restore the owner's."""
    for name, module in owner.named_modules():
        for buffer in getattr(module, "_non_persistent_buffers_set", ()):
            try:
                target = sub.get_submodule(name) if name else sub
            except AttributeError:
                continue
            if buffer in target._buffers:
                target._non_persistent_buffers_set.add(buffer)


def _install(gm: fx.GraphModule, path: str, sub: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = gm.get_submodule(parent_path) if parent_path else gm
    setattr(parent, name, sub)

