"""Keep every ``nn.MultiheadAttention`` call one node in a ``torch.export`` graph.

``torch.fx.symbolic_trace`` keeps torch's own modules whole (``call_module``), but
``torch.export`` inlines ``nn.MultiheadAttention`` into some forty aten ops in which batch and
heads share one dimension and the fused q/k/v projection is cut apart; nothing downstream
can see the heads any more (tensor parallelism needs them). The capture asks export to
record each attention call's inputs and outputs (``preserve_module_call_signature``); this
pass puts back one ``call_module`` node per call, with the call's own arguments, routes the
call's results through it and erases the inlined ops. The graph then holds attention as a
symbolic trace would, whichever capture ran.

A model that *is* an ``nn.MultiheadAttention`` has no call to record: its whole graph is the
call, kept as the submodule :data:`ROOT_ATTENTION` of the graph module (the model's own
object, so the parameters stay shared).

Example:
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> x = torch.randn(2, 3, 8)
    >>> program = torch.export.export(layer, (x,), strict=False,
    ...                               preserve_module_call_signature=attention_paths(layer))
    >>> gm = program.module()
    >>> names = {n.name: n for n in gm.graph.nodes}
    >>> fold_attention(gm, layer, module_calls(program, names)).modified
    True
    >>> [n.op for n in gm.graph.nodes if n.target == "self_attn"]
    ['call_module']
    >>> torch.allclose(gm(x), layer(x))
    True
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

from partitioner.passes.base import PassError, PassResult

__all__ = ["ModuleCall", "ROOT_ATTENTION", "attention_paths", "module_calls", "fold_attention"]

#: The graph module's name for the model itself when the model is an attention module.
ROOT_ATTENTION = "attention"

_MISSING = object()  # a value the graph being folded lacks


@dataclass(frozen=True)
class ModuleCall:
    """One call of a submodule, as graph values.

    Attributes:
        path: the module's qualified name (``""``: the model itself).
        args: positional arguments: graph nodes or constants.
        kwargs: keyword arguments: graph nodes or constants.
        outputs: the call's result with graph nodes (or constants) as leaves.
    """

    path: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: Any = None


def attention_paths(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of ``model``'s ``nn.MultiheadAttention`` submodules (not itself)."""
    return tuple(name for name, module in model.named_modules()
                 if name and type(module) is nn.MultiheadAttention)


def module_calls(program: ExportedProgram, names: dict[str, fx.Node]) -> list[ModuleCall]:
    """The calls ``program`` recorded, with graph values from ``names`` (program node name ->
    node of the graph being folded); the model's own call comes first. Calls reading a value
    the graph lacks, or arguments other than tensors and constants, are left out; results
    the graph lacks (nobody read them) are ``None``."""
    calls = []
    root = _root_call(program, names)
    if root is not None:
        calls.append(root)
    for entry in program.module_call_graph:
        signature = entry.signature
        if not entry.fqn or signature is None:
            continue
        inputs = [_value(a, names) for a in signature.inputs]
        # A result the graph lacks was never read (dead code is gone): nothing to route.
        outputs = [None if v is _MISSING else v
                   for v in (_value(a, names) for a in signature.outputs)]
        if any(v is _MISSING for v in inputs):
            continue
        path = entry.fqn.partition("@")[0]  # "attn@1": the second call of attn
        call = _call(path, inputs, signature.in_spec, outputs, signature.out_spec)
        if call is not None:
            calls.append(call)
    return calls


def _call(path: str, inputs: list[Any], in_spec: pytree.TreeSpec, outputs: list[Any],
          out_spec: pytree.TreeSpec) -> ModuleCall | None:
    """The call whose flat inputs and outputs are these; ``None`` if they do not fit the
    specs (a signature this pass does not understand is left alone)."""
    try:
        args, kwargs = pytree.tree_unflatten(inputs, in_spec)
        result = pytree.tree_unflatten(outputs, out_spec)
    except (ValueError, TypeError):
        return None
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        return None
    return ModuleCall(path, tuple(args), dict(kwargs), result)


def _value(argument: Any, names: dict[str, fx.Node]) -> Any:
    if isinstance(argument, TensorArgument):
        return names.get(argument.name, _MISSING)
    if isinstance(argument, ConstantArgument):
        return argument.value
    return _MISSING


def _root_call(program: ExportedProgram, names: dict[str, fx.Node]) -> ModuleCall | None:
    """The model's own call: its user inputs in, the graph's outputs out."""
    inputs = [_value(spec.arg, names) for spec in program.graph_signature.input_specs
              if spec.kind == InputKind.USER_INPUT]
    output = next(n for n in program.graph.nodes if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    outputs = [names.get(v.name, _MISSING) if isinstance(v, fx.Node) else v for v in results]
    if any(v is _MISSING for v in (*inputs, *outputs)):
        return None
    return _call("", inputs, program.call_spec.in_spec, outputs, program.call_spec.out_spec)


def fold_attention(gm: fx.GraphModule, model: nn.Module,
                   calls: Sequence[ModuleCall]) -> PassResult:
    """Replace the inlined ops of every attention call in ``calls`` by one ``call_module``.

    Args:
        gm: a graph captured from ``model`` by ``torch.export``, modified in place.
        model: the captured model.
        calls: the recorded calls (:func:`module_calls`); those of other modules are skipped.

    Returns:
        ``PassResult(gm, modified)``.

    Raises:
        PassError: if the folded graph does not lint (a bug).
    """
    modified = False
    modules = dict(model.named_modules())
    moved: dict[fx.Node, fx.Node] = {}  # a folded call's result -> the node reading it now
    for call in calls:
        module = modules.get(call.path)
        if type(module) is not nn.MultiheadAttention:
            continue
        call = _moved(call, moved)
        if call.path:
            modified |= _fold(gm, call, call.path, module, moved)
        elif _whole_graph(gm, call):
            gm.add_submodule(ROOT_ATTENTION, module)
            modified |= _fold(gm, call, ROOT_ATTENTION, module, moved)
            _drop_unused(gm)
    if modified:
        try:
            gm.graph.lint()
        except Exception as error:
            raise PassError(f"fold_attention broke the graph: {error}") from error
        gm.recompile()
    return PassResult(gm, modified)


def _drop_unused(gm: fx.GraphModule) -> None:
    """Drop the graph module's own copies of the attention's tensors, now read through its
    submodule :data:`ROOT_ATTENTION` (one name per tensor, as in any capture)."""
    used = {str(n.target).split(".")[0] for n in gm.graph.nodes
            if n.op in ("get_attr", "call_module")}
    names = [name for name, _ in (*gm.named_parameters(recurse=False),
                                  *gm.named_buffers(recurse=False), *gm.named_children())]
    for name in names:
        if name not in used:
            delattr(gm, name)


def _whole_graph(gm: fx.GraphModule, call: ModuleCall) -> bool:
    """Whether ``call`` (the model's own) reads only the graph's placeholders."""
    nodes = [v for v in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(v, fx.Node)]
    return all(n.op == "placeholder" and n.graph is gm.graph for n in nodes)


def _moved(call: ModuleCall, moved: dict[fx.Node, fx.Node]) -> ModuleCall:
    """``call`` reading the results of calls folded before it from their new nodes."""
    def where(value: Any) -> Any:
        return moved.get(value, value) if isinstance(value, fx.Node) else value
    args, kwargs, outputs = pytree.tree_map(where, (call.args, call.kwargs, call.outputs))
    return ModuleCall(call.path, args, kwargs, outputs)


def _fold(gm: fx.GraphModule, call: ModuleCall, target: str, module: nn.Module,
          moved: dict[fx.Node, fx.Node]) -> bool:
    """One call: a ``call_module`` node before its first result, results read from it."""
    results = call.outputs if isinstance(call.outputs, (tuple, list)) else (call.outputs,)
    nodes = [r for r in results if isinstance(r, fx.Node)]
    if not nodes:
        return False
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    first = min(nodes, key=order.__getitem__)
    inputs = [v for v in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(v, fx.Node)]
    if any(order.get(n, len(order)) >= order[first] for n in inputs):
        return False  # not a call export recorded in execution order; leave it inlined
    with gm.graph.inserting_before(first):
        new = gm.graph.call_module(target, call.args, call.kwargs)
        new.meta["nn_module_stack"] = _stack(first, call.path, module)
        for index, result in enumerate(results):
            if isinstance(result, fx.Node) and result.users:
                item = gm.graph.call_function(operator.getitem, (new, index))
                item.meta["nn_module_stack"] = new.meta["nn_module_stack"]
                result.replace_all_uses_with(item)
                moved[result] = item
    if call.path:
        gm.add_submodule(call.path, module)
    _erase_inlined(gm, call.path, keep={new})
    return True


def _stack(node: fx.Node, path: str, module: nn.Module) -> dict[str, Any]:
    """``node``'s module stack up to and including the attention module."""
    stack = dict(node.meta.get("nn_module_stack") or {})
    if not path:
        return {}
    out: dict[str, Any] = {}
    for key, entry in stack.items():
        out[key] = entry
        if isinstance(entry, tuple) and entry[0] == path:
            return out
    out[path] = (path, f"{type(module).__module__}.{type(module).__qualname__}")
    return out


def _erase_inlined(gm: fx.GraphModule, path: str, keep: set[fx.Node]) -> None:
    """Erase the attention's inlined ops nobody reads any more (in-place ones too: they
    write tensors of the attention's own, never its inputs)."""
    for node in reversed(list(gm.graph.nodes)):
        if node in keep or node.users:
            continue
        if node.op == "get_attr":
            inside = not path or str(node.target).startswith(f"{path}.")
        elif node.op in ("call_function", "call_method"):
            stack = node.meta.get("nn_module_stack") or {}
            inside = not path or any(isinstance(e, tuple) and e[0] == path
                                     for e in stack.values())
        else:
            continue
        if inside:
            gm.graph.erase_node(node)
