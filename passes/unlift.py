"""Turn a ``torch.export`` program back into a graph that uses the model's own tensors.

``torch.export`` lifts parameters, buffers and constant tensors to graph inputs. :func:`unlift`
makes each a ``get_attr`` node naming the model's tensor (so the graph shares the model's
parameters), keeps the user outputs only, and keeps every in-place update of a buffer
(``self.steps += 1``, batch norm statistics): torch writes them with ``copy_`` in the graph
itself, older versions returned them as extra outputs, which become ``copy_`` nodes right
where the new value is computed (so whichever stage computes it writes it). It reports the
buffers written, so callers can refuse to repeat them per micro-batch.

Example:
    >>> import torch
    >>> class Count(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("steps", torch.zeros(()))
    ...     def forward(self, x):
    ...         self.steps += 1
    ...         return x * 2
    >>> model = Count()
    >>> result = unlift(torch.export.export(model, (torch.ones(2),), strict=False))
    >>> result.writes, result.graph_module.get_buffer("steps") is model.steps
    (('steps',), True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import OutputKind

from partitioner.errors import TraceError
from partitioner.passes.base import PassResult

__all__ = ["Unlifted", "unlift"]


@dataclass(frozen=True)
class Unlifted(PassResult):
    """The result of :func:`unlift`: the graph, the buffers ``forward`` writes, and each
    program node's counterpart in the graph by the program's node name (nodes dead code
    elimination removed are left out)."""

    writes: tuple[str, ...] = ()
    nodes: dict[str, fx.Node] = field(default_factory=dict)


def unlift(program: torch.export.ExportedProgram, model_name: str = "model") -> Unlifted:
    """The program's graph with its parameters, buffers and constants as ``get_attr`` nodes.

    Args:
        program: what ``torch.export.export`` returned.
        model_name: the model's class name, for messages.

    Returns:
        An :class:`Unlifted` (``modified=True``): the graph returns the user outputs only.

    Raises:
        TraceError: ``forward`` modifies a parameter in place.
    """
    sig = program.graph_signature
    lifted: dict[str, str] = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                              **sig.inputs_to_lifted_tensor_constants}
    state = program.state_dict
    tensors = {fqn: state[fqn] if fqn in state else program.constants[fqn]
               for fqn in lifted.values()}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, fx.Node] = {}
    outputs: list[fx.Node] = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in lifted:
            new = graph.get_attr(lifted[node.name])
            new.meta = dict(node.meta)
            env[node] = attrs[lifted[node.name]] = new
        elif node.op == "output":
            outputs = list(node.args[0])
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    # Older torch gives buffer updates as outputs; newer writes them with copy_ itself.
    kept, writes = _outputs(program, outputs, model_name)
    for fqn, value in writes:
        _write_back(graph, attrs[fqn], env[value])
    graph.output(tuple(env[n] if isinstance(n, fx.Node) else n for n in kept))
    graph.eliminate_dead_code(lambda n: n.is_impure() or n.target is torch.ops.aten.copy_.default)
    buffers = set(sig.inputs_to_buffers.values())
    # Other attributes are the program's own (the bodies of torch.no_grad() regions).
    root: dict[str, Any] = {**tensors, **{str(n.target): _attr(program.graph_module, str(
        n.target)) for n in graph.nodes if n.op == "get_attr" and n.target not in tensors}}
    gm = fx.GraphModule(root, graph, class_name=type(program).__name__)
    gm.graph.lint()
    written = _written(gm)
    changed = sorted(written & set(sig.inputs_to_parameters.values()))
    if changed:
        raise TraceError(f"{model_name}.forward modifies parameter {changed[0]} in place; a "
                         "pipeline cannot replay that per micro-batch: update it outside "
                         "forward (e.g. in the training loop)")
    alive = set(gm.graph.nodes)
    nodes = {node.name: new for node, new in env.items() if new in alive}
    return Unlifted(gm, True, tuple(sorted(written & buffers)), nodes)


def _attr(module: torch.nn.Module, target: str) -> Any:
    for name in target.split("."):
        module = getattr(module, name)
    return module


def _written(gm: fx.GraphModule) -> set[str]:
    """The attributes some node writes in place, also inside ``torch.no_grad()`` bodies."""
    return {str(n.target) for n in _written_nodes(gm) if n.op == "get_attr"}


def _written_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes (attributes, placeholders) some node of ``gm`` writes in place: arguments
    the schema marks as written (``add_``, ``copy_``), a training ``aten.batch_norm``'s
    running statistics (its schema does not say so), and the operands a higher-order op's
    body writes (``wrap_with_set_grad_enabled(False, body, weight)``)."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        body = next((k for k, a in enumerate(node.args) if isinstance(a, fx.Node)
                     and a.op == "get_attr"
                     and isinstance(_attr(gm, str(a.target)), fx.GraphModule)), None)
        if body is not None:
            inner = _attr(gm, str(node.args[body].target))
            slots = [n for n in inner.graph.nodes if n.op == "placeholder"]
            operands = node.args[body + 1:]
            found |= {operands[k] for k, slot in enumerate(slots)
                      if k < len(operands) and slot in _written_nodes(inner)
                      and isinstance(operands[k], fx.Node)}
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            continue
        training_norm = node.target is torch.ops.aten.batch_norm.default and bool(
            node.args[5] if len(node.args) > 5 else node.kwargs.get("training"))
        for k, argument in enumerate(schema.arguments):
            value = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
            if (argument.is_write or (training_norm and k in (3, 4))) and \
                    isinstance(value, fx.Node):
                found.add(value)
    return found


def _outputs(program: torch.export.ExportedProgram, outputs: list[Any],
             model_name: str) -> tuple[list[Any], list[tuple[str, fx.Node]]]:
    """The user outputs, and (buffer, new value) per buffer ``forward`` updates."""
    kept, writes = [], []
    for spec, value in zip(program.graph_signature.output_specs, outputs):
        if spec.kind is OutputKind.USER_OUTPUT:
            kept.append(value)
        elif spec.kind is OutputKind.BUFFER_MUTATION:
            writes.append((str(spec.target), value))
        elif spec.kind is OutputKind.PARAMETER_MUTATION:
            raise TraceError(f"{model_name}.forward modifies parameter {spec.target} in "
                             "place; a pipeline cannot replay that per micro-batch: update "
                             "it outside forward (e.g. in the training loop)")
        # USER_INPUT_MUTATION: stages get their own copies of the inputs (as with torch.fx).
    return kept, writes


def _write_back(graph: fx.Graph, buffer: fx.Node, value: fx.Node) -> None:
    with graph.inserting_after(value):
        write = graph.call_function(torch.ops.aten.copy_.default, (buffer, value))
    # The write belongs to the layer that computed the value (its module stack).
    write.meta = {k: v for k, v in value.meta.items() if k in ("nn_module_stack", "stack_trace")}
    write.meta["writes_buffer"] = str(buffer.target)


