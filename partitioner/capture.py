"""Capture a model as a ``torch.fx`` graph that shares the model's parameters.

``torch.fx.symbolic_trace`` is tried first: it keeps modules as ``call_module`` nodes and is
fast. Models with data-dependent control flow (transformers' GPT-2, BERT) defeat it, so
``torch.export`` (non-strict, batch dimension dynamic) is tried next; its parameter
placeholders are turned back into ``get_attr`` nodes naming the original parameters, each
``nn.MultiheadAttention`` call export inlined becomes one ``call_module`` node again, as
symbolic tracing keeps it (``partitioner.passes.fold_attention``), and the layer structure is
recovered later from each node's ``nn_module_stack``.

Either way the result is a :class:`Captured`: a ``GraphModule`` whose parameters *are* the
model's parameters (same tensor objects), plus how call arguments become placeholder values
and how the graph's output becomes what the model returns.

Example:
    >>> import torch
    >>> cap = capture(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)
    >>> cap.method
    'fx'
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

import partitioner.passes as _passes
import partitioner.runtime as _runtime
from partitioner.errors import ExampleInputsError, TraceError
from partitioner.passes.fold_attention import attention_paths, fold_attention, module_calls

__all__ = ["Captured", "capture", "module_paths"]


@dataclass
class Captured:
    """A model captured as a graph.

    Attributes:
        graph_module: the graph; its parameters and buffers are the model's own tensors.
        method: ``"fx"`` or ``"export"``.
        signature: the model's ``forward`` signature, used to bind call arguments.
        out_spec: for ``"export"``, how the flat graph outputs rebuild the model's output.
        in_spec: for ``"export"``, the structure of ``(args, kwargs)`` the graph was built for.
    """

    graph_module: fx.GraphModule
    method: str
    signature: inspect.Signature
    out_spec: pytree.TreeSpec | None = None
    in_spec: pytree.TreeSpec | None = None

    def placeholder_values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Map a call's arguments to the graph's placeholders, in order."""
        if self.method == "export":
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.in_spec:
                bound = self.signature.bind(*args, **kwargs)
                leaves, spec = pytree.tree_flatten(((), dict(bound.arguments)))
            return leaves
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = []
        for name, param in self.signature.parameters.items():
            value = bound.arguments[name]
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                values.extend(value)
            else:
                values.append(value)
        return values

    def restructure(self, output: Any) -> Any:
        """Turn the graph's output into what the model's ``forward`` returns."""
        if self.out_spec is None:
            return output
        return pytree.tree_unflatten(list(output), self.out_spec)


def module_paths(node: fx.Node) -> list[str]:
    """The qualified names of the modules enclosing ``node``, outermost first (root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [entry[0] for entry in stack.values()]
    return [p for p in paths if p]


def capture(model: nn.Module, example_inputs: tuple[Any, ...] | None,
            example_kwargs: dict[str, Any] | None = None) -> Captured:
    """Capture ``model`` as a graph sharing its parameters.

    Args:
        model: the module to capture.
        example_inputs: positional arguments of one call; needed only when symbolic tracing
            fails and ``torch.export`` must run the model.
        example_kwargs: keyword arguments of that call.

    Returns:
        A :class:`Captured`.

    Raises:
        TraceError: when both ``symbolic_trace`` and ``torch.export`` fail; the message names
            the module, the first failing line of user code and both causes.
        ExampleInputsError: when tracing fails and no example inputs were given for export.
    """
    signature = inspect.signature(model.forward)
    try:
        gm = fx.symbolic_trace(model)
        return Captured(gm, "fx", signature)
    except Exception as fx_error:
        if example_inputs is None:
            raise ExampleInputsError(
                f"torch.fx.symbolic_trace cannot trace {type(model).__name__} "
                f"({type(fx_error).__name__}: {fx_error}); capturing it with torch.export "
                "needs example inputs: pass example_inputs=(x,) with one batch") from fx_error
        try:
            return _export(model, tuple(example_inputs), dict(example_kwargs or {}), signature)
        except Exception as export_error:
            raise TraceError(_trace_message(model, fx_error, export_error)) from export_error


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            signature: inspect.Signature) -> Captured:
    bound = signature.bind(*args, **kwargs)
    batch = _batch_size((args, kwargs))
    dynamic = {name: pytree.tree_map(lambda v: _dynamic_dim(v, batch), value)
               for name, value in bound.arguments.items()}
    kept = attention_paths(model)
    try:
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False,
                                      preserve_module_call_signature=kept)
    except Exception:
        if not kept:
            raise
        # An attention called with two argument structures has no one signature to keep;
        # export inlines it then (and tensor parallelism keeps its projections whole).
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic,
                                      strict=False)
    gm, names = _unlift(program)
    fold_attention(gm, model, module_calls(program, names))
    return Captured(gm, "export", signature, program.call_spec.out_spec,
                    program.call_spec.in_spec)


def _batch_size(tree: Any) -> int | None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _dynamic_dim(value: Any, batch: int | None) -> dict[int, Any] | None:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch \
            and batch is not None and batch > 1:
        return {0: torch.export.Dim.AUTO}
    return None


def _unlift(program: torch.export.ExportedProgram) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """Replace lifted parameter/buffer/constant placeholders by ``get_attr`` nodes; also
    return each program node's counterpart, by the program's node name."""
    sig = program.graph_signature
    lifted: dict[str, str] = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                              **sig.inputs_to_lifted_tensor_constants}
    tensors: dict[str, Any] = {}
    state = program.state_dict
    for fqn in lifted.values():
        tensors[fqn] = state[fqn] if fqn in state else program.constants[fqn]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in lifted:
            new = graph.get_attr(lifted[node.name])
            new.meta = dict(node.meta)
            env[node] = new
        elif node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.eliminate_dead_code()
    alive = set(graph.nodes)
    names = {node.name: new for node, new in env.items() if new in alive}
    return fx.GraphModule(tensors, graph, class_name=type(program).__name__), names


def _trace_message(model: nn.Module, fx_error: BaseException, export_error: BaseException) -> str:
    where = _first_user_line(fx_error) or _first_user_line(export_error) or "unknown line"
    return (f"could not capture {type(model).__name__}: first failing line {where}\n"
            f"  torch.fx.symbolic_trace: {type(fx_error).__name__}: {fx_error}\n"
            f"  torch.export (non-strict): {type(export_error).__name__}: "
            f"{str(export_error).splitlines()[0] if str(export_error) else ''}\n"
            "Fix: remove data-dependent Python control flow from forward (use torch.where), "
            "or pass balance=/split_points= on an nn.Sequential of traceable children.")


# partitioner.passes and partitioner.runtime live beside partitioner/ in a source checkout.
_LIBRARY_DIRS = tuple(
    os.path.abspath(folder) + os.sep
    for folder in (os.path.dirname(torch.__file__), os.path.dirname(__file__),
                   *_passes.__path__, *_runtime.__path__))


def _first_user_line(error: BaseException) -> str | None:
    """The deepest frame of the traceback that is neither torch's nor ours."""
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames
            if not f.filename.startswith(_LIBRARY_DIRS) and not f.filename.startswith("<")]
    if not user:
        return None
    frame = user[-1]
    text = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
    return f"{frame.filename}:{frame.lineno} ({text})"
