"""Capture a model as a ``torch.fx`` graph that shares the model's parameters.

``torch.fx.symbolic_trace`` is tried first: it keeps modules as ``call_module`` nodes and is
fast. Its tracer looks into the ``torch.nn`` modules that hold repeated blocks
(``nn.TransformerEncoder``), so each block is a layer. Models with data-dependent control
flow (transformers' GPT-2, BERT) defeat it, and so do buffers updated in ``forward``
(``self.steps += 1`` runs on the real buffer while tracing and leaves no node; the update is
undone): ``torch.export`` (non-strict, batch dimension dynamic) is tried next, and
``passes/unlift`` turns its lifted parameters back into the model's own tensors. Its graph
holds only for what it was traced with (fixed non-batch sizes, Python values baked in,
guards on the batch size), which :attr:`Captured.rules` records for the first stage to check
(``passes/export_rules``, ``passes/guard_inputs``).

Either way the result is a :class:`Captured`: a ``GraphModule`` whose parameters *are* the
model's parameters (same tensor objects), plus how call arguments become placeholder values
and how the graph's output becomes what the model returns. A ``forward`` that returns no
tensor is refused.

Example:
    >>> import torch
    >>> cap = capture(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)
    >>> cap.method
    'fx'
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

import partitioner.passes as _passes
import partitioner.runtime as _runtime
from partitioner.errors import (
    CallError,
    ExampleInputsError,
    PlanMismatchError,
    SideEffectWarning,
    TraceError,
)
from partitioner.passes import python_state
from partitioner.passes.autograd_functions import functions_as_calls, functions_called
from partitioner.passes.export_rules import export_rules
from partitioner.passes.fake_device import fake_device, restore_meta
from partitioner.passes.flatten_sequential import expanded_modules
from partitioner.passes.fold_attention import attention_paths, fold_attention, module_calls
from partitioner.passes.guard_inputs import InputRules
from partitioner.passes.mode_blocks import IN_BLOCK, ModeBlocks, modes, refuse_live_blocks
from partitioner.passes.non_persistent import keep_non_persistent, non_persistent_names
from partitioner.passes.tensor_hooks import hook_nodes, hooks_problem, hooks_registered
from partitioner.passes.unbake_dtypes import unbake_dtypes
from partitioner.passes.unlift import unlift

__all__ = ["Captured", "capture", "bind", "module_paths", "example_error", "describe_inputs",
           "arrange", "user_line"]

# partitioner.passes and partitioner.runtime live beside partitioner/ in a source checkout.
LIBRARY_DIRS = tuple(
    os.path.abspath(folder) + os.sep
    for folder in (os.path.dirname(torch.__file__), os.path.dirname(__file__),
                   *_passes.__path__, *_runtime.__path__))


@dataclass
class Captured:
    """A model captured as a graph.

    Attributes:
        graph_module: the graph; its parameters and buffers are the model's own tensors.
        method: ``"fx"`` or ``"export"``.
        signature: the model's ``forward`` signature, used to bind call arguments.
        out_spec: for ``"export"``, how the flat graph outputs rebuild the model's output.
        in_spec: for ``"export"``, the structure of ``(args, kwargs)`` the graph was built for.
        rules: for ``"export"``, what the graph holds for (shapes, constants, batch sizes);
            the first stage checks every micro-batch against them.
        writes: the buffers ``forward`` updates in place, batch norm statistics aside
            (``"export"`` writes every update back; these ones micro-batches and checkpoint
            replays would repeat).
    """

    graph_module: fx.GraphModule
    method: str
    signature: inspect.Signature
    out_spec: pytree.TreeSpec | None = None
    in_spec: pytree.TreeSpec | None = None
    rules: InputRules | None = None
    writes: tuple[str, ...] = ()

    def placeholder_values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Map a call's arguments to the graph's placeholders, in order."""
        if self.in_spec is not None:
            return pytree.tree_leaves(arrange(self.signature, self.in_spec, args, kwargs))
        bound = bind(self.signature, args, kwargs)
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


def bind(signature: inspect.Signature, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """``signature.bind``, its refusal a :class:`CallError` saying how to call.

    Raises:
        CallError: the arguments do not fit ``forward``'s parameters.
    """
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as error:
        given = [f"{type(a).__name__}" for a in args] + [f"{k}=" for k in kwargs]
        raise CallError(f"the partitioned model was called with ({', '.join(given)}): {error}; "
                        f"call it as the model's forward{signature}") from None


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
        TraceError: when both ``symbolic_trace`` and ``torch.export`` fail (the message names
            the module, the first failing line of user code and both causes), or ``forward``
            returns no tensor.
        ExampleInputsError: when tracing fails and no example inputs were given for export.
    """
    signature = inspect.signature(model.forward)
    before = python_state.snapshot(model)
    with hooks_registered() as hooks:
        captured = _captured(model, signature, example_inputs, example_kwargs)
    hooks += hook_nodes(captured.graph_module) if captured.method == "fx" else []
    if hooks:
        raise TraceError(hooks_problem(type(model).__name__, hooks))
    _check_output(model, captured.graph_module)
    _warn_side_effects(model, before)
    keep_non_persistent(captured.graph_module, non_persistent_names(model))
    return captured


def _captured(model: nn.Module, signature: inspect.Signature,
              example_inputs: tuple[Any, ...] | None,
              example_kwargs: dict[str, Any] | None) -> Captured:
    """Symbolic tracing, else ``torch.export`` (:func:`capture`'s two ways)."""
    try:
        captured = Captured(_symbolic_trace(model), "fx", signature)
    except Exception as fx_error:
        if example_inputs is None:
            raise ExampleInputsError(
                f"torch.fx.symbolic_trace cannot trace {type(model).__name__} "
                f"({type(fx_error).__name__}: {fx_error}); capturing it with torch.export "
                "needs example inputs: pass example_inputs=(x,) with one batch") from fx_error
        args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
        try:
            with functions_called() as functions:
                exported = export_graph(model, args, kwargs, list(signature.parameters))
            _refuse_functions(model, functions, fx_error)
        except TraceError:
            raise
        except Exception as export_error:
            wrong = example_error(model, args, kwargs)
            if wrong is not None:
                raise wrong from export_error
            raise TraceError(_trace_message(model, fx_error, export_error)) from export_error
        counters = tuple(name for name in exported.writes if not _norm_statistic(model, name))
        captured = Captured(exported.graph_module, "export", signature, exported.out_spec,
                            exported.in_spec, exported.rules, counters)
    return captured


def _refuse_functions(model: nn.Module, functions: list[type], fx_error: Exception) -> None:
    """Refuse a model ``torch.export`` captured through a ``torch.autograd.Function`` of its
    own: export keeps the Function's forward ops and drops its backward, so the partitioned
    model would compute other gradients than the model (symbolic tracing keeps it whole)."""
    if functions:
        names = ", ".join(f"{f.__module__}.{f.__qualname__}" for f in functions[:3])
        raise TraceError(
            f"could not capture {type(model).__name__} without changing its gradients: it "
            f"calls torch.autograd.Function {names}, whose forward torch.export traces "
            "and whose own backward it drops, and torch.fx.symbolic_trace (which keeps it "
            f"whole) failed ({type(fx_error).__name__}: {fx_error}). Fix: make forward "
            "symbolically traceable (no Python control flow on tensors or shapes), or "
            "partition an nn.Sequential of traceable children with balance=")


def _warn_side_effects(model: nn.Module, before: python_state.State) -> None:
    """Warn (:class:`SideEffectWarning`) when capturing changed plain Python state of a
    module (the graph holds tensor code only, so the partitioned model never repeats it),
    and put that state back as it was."""
    changed = python_state.changes(model, before)
    python_state.restore(model, before)  # no tracing proxies left in the user's model
    if changed:
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        warnings.warn(SideEffectWarning(
            f"{type(model).__name__}.forward changed Python state while it was captured: "
            f"{'; '.join(changed[:3])}{more}. The partitioned model runs the captured "
            "tensor code only and never repeats that change; keep such state in a buffer "
            "(register_buffer, updated with tensor operations) or outside forward"),
            stacklevel=3)


def _norm_statistic(model: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` is a batch norm's running statistic (each micro-batch counts
    as a batch: the README's documented restriction)."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return isinstance(module, nn.modules.batchnorm._NormBase) and leaf in (
        "running_mean", "running_var", "num_batches_tracked")


class _Tracer(fx.Tracer):
    """``symbolic_trace``'s tracer, looking into the ``torch.nn`` modules that hold repeated
    blocks (``nn.TransformerEncoder``'s ``layers``), so that each block becomes a layer."""

    def __init__(self, through: set[str]) -> None:
        super().__init__()
        self.through = through

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.through:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self.modes = modes()
        self.blocks = ModeBlocks()
        with self.blocks:
            graph = super().trace(root, concrete_args)
        refuse_live_blocks(graph)  # ModeLost: torch.export captures it instead
        return graph

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any,
                    name: str | None = None, type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # Recorded inside a grad-mode or autocast block, or under another mode than the trace
        # began in: the graph would run it in the caller's mode (the context manager leaves
        # no node), even where the block changed nothing while tracing.
        if kind != "placeholder" and (self.blocks.depth or modes() != self.modes):
            node.meta[IN_BLOCK] = True
        return node


class _BufferWritten(Exception):
    """``forward`` updated a buffer with tensor code symbolic tracing runs but cannot record."""


def _symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` that refuses (and undoes) buffer updates it would lose.

    Symbolic tracing hands ``forward`` the real buffers, so ``self.steps += 1`` runs once
    on the real tensor while tracing and leaves no node: the graph would never update it.
    """
    buffers = dict(model.named_buffers())
    versions = {name: _version(b) for name, b in buffers.items()}
    saved = {name: b.detach().clone() for name, b in buffers.items()}
    tracer = _Tracer(expanded_modules(model))
    try:
        with functions_as_calls(tracer):
            graph = tracer.trace(model)
    finally:
        written = [name for name, b in buffers.items() if _version(b) != versions[name]]
        with torch.no_grad():
            for name in written:
                buffers[name].copy_(saved[name])
    if written:
        raise _BufferWritten(f"forward updates buffer {written[0]} in place, which symbolic "
                             "tracing cannot record")
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place write counter (-1 for inference tensors, which keep none)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1


def _check_output(model: nn.Module, gm: fx.GraphModule) -> None:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found: list[fx.Node] = []
    fx.map_arg(output.args, found.append)
    if not found:
        raise TraceError(f"{type(model).__name__}.forward returns {output.args[0]!r}, no "
                         "tensor: a pipeline hands the last stage's output back to the caller "
                         "(and its gradient into backward); return the output tensors "
                         "(compute a loss outside the model or return it)")


def example_error(model: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> ExampleInputsError | None:
    """An error naming the example inputs if the model itself rejects them, else ``None``.

    Runs ``model`` once without gradients and puts its buffers back afterwards (a
    training-mode batch norm would otherwise count the batch). A model built on the meta
    device cannot tell: called on real inputs it fails on its own meta tensors ("Cannot copy
    out of meta tensor", ``.item()`` of a meta mask) whatever the inputs are, so it gets
    ``None`` and the caller's own error stands.
    """
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as error:
        where = user_line(error)
        return ExampleInputsError(
            f"example inputs do not fit {type(model).__name__}: calling it on "
            f"{describe_inputs(model, args, kwargs)} raises {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
            f"{f' (at {where})' if where else ''}; pass example_inputs=(...) with the shapes and "
            "dtypes of one real batch of the inputs forward takes")
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
    return None


def describe_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``x: (8, 5) float32, scale=2.0``: each argument with its shape, or its value."""
    try:
        arguments = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except TypeError:
        arguments = {f"args[{i}]": a for i, a in enumerate(args)} | kwargs
    parts = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            parts.append(f"{name}: {tuple(value.shape)} {dtype}")
        else:
            shown = pytree.tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor)
                                    else v, value)
            parts.append(f"{name}={shown!r}")
    return ", ".join(parts) or "no inputs"


@dataclass(frozen=True)
class Exported:
    """A model captured by ``torch.export``.

    Attributes:
        graph_module: the graph; its attributes are the model's own parameters and buffers.
        in_spec: the structure of ``(args, kwargs)`` the graph was traced with.
        out_spec: how the graph's outputs rebuild what ``forward`` returns.
        rules: what the graph holds for (checked before each micro-batch).
        writes: the buffers ``forward`` updates in place (written back by ``copy_``).
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    rules: InputRules
    writes: tuple[str, ...]


def export_graph(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 names: Sequence[str]) -> Exported:
    """Export ``model`` on one example batch, its batch dimension dynamic.

    Args:
        model: the module.
        args: positional example inputs.
        kwargs: keyword example inputs.
        names: ``forward``'s parameter names, in order (to name inputs in messages).

    Raises:
        TraceError: ``forward`` updates a parameter in place.
        Exception: whatever ``torch.export`` raises when it cannot trace.
    """
    signature = inspect.signature(model.forward)
    kwargs = _with_defaults(signature, args, kwargs)
    batch = _batch_size((args, kwargs))
    bound = signature.bind(*args, **kwargs)
    dynamic = {name: pytree.tree_map(lambda v: _dynamic_dim(v, batch), value)
               for name, value in bound.arguments.items()}
    with _without_cache(model, kwargs), fake_device(model, args, kwargs) as (fake_args,
                                                                          fake_kwargs, on):
        program = _export(model, fake_args, fake_kwargs, dynamic, signature)
        unlifted = unlift(program, type(model).__name__)
    if on is not None:  # a meta-built model, captured on fake tensors on device ``on``
        restore_meta(unlifted.graph_module, model, on)
    # Each nn.MultiheadAttention call export inlined becomes one call_module again, as
    # symbolic tracing keeps it (tensor parallelism splits it by heads).
    fold_attention(unlifted.graph_module, model, module_calls(program, unlifted.nodes))
    # fp32 facts the capture baked in (dtype assertions, finfo(float32).min fills) would
    # fail under a bf16/fp16 autocast.
    unbake_dtypes(unlifted.graph_module)
    example = arrange(signature, program.call_spec.in_spec, args, kwargs)
    batched = [_dynamic_dim(v, batch) is not None for v in pytree.tree_leaves(example)]
    rules = export_rules(program, example, names, batched, batch)
    return Exported(unlifted.graph_module, program.call_spec.in_spec, program.call_spec.out_spec,
                    rules, unlifted.writes)


@contextlib.contextmanager
def _without_cache(model: nn.Module, kwargs: dict[str, Any]) -> Iterator[None]:
    """``model.config.use_cache`` off while exporting, unless the call passes ``use_cache``.

    A transformers model with caching on (GPT-2's default) returns its key/value cache, an
    object export cannot return and a pipeline has no use for: the graph is captured as
    with ``use_cache=False``. The user's config is put back.
    """
    config: Any = getattr(model, "config", None)
    if "use_cache" not in kwargs or kwargs["use_cache"] is not None \
            or not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any,
            signature: inspect.Signature) -> torch.export.ExportedProgram:
    """``torch.export`` with the batch dynamic and every attention's call signature kept."""
    kept = attention_paths(model)
    try:
        return _export_kept(model, args, kwargs, dynamic, signature, kept)
    except Exception:
        if not kept:
            raise
        # An attention called with two argument structures has no one signature to keep;
        # export inlines it then (and tensor parallelism keeps its projections whole).
        return _export_kept(model, args, kwargs, dynamic, signature, ())


def _export_kept(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any,
                 signature: inspect.Signature, kept: tuple[str, ...]
                 ) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False,
                                   preserve_module_call_signature=kept)
    except AssertionError:
        if inspect.Parameter.VAR_KEYWORD not in [p.kind for p in signature.parameters.values()]:
            raise
        # torch.export cannot take dynamic shapes for **kwargs: the batch stays the example's
        # (the input guard then refuses other sizes instead of computing them wrongly).
        return torch.export.export(model, args, kwargs, strict=False,
                                   preserve_module_call_signature=kept)


def _with_defaults(signature: inspect.Signature, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus every parameter the example left to its default, by keyword.

    Export bakes non-tensor inputs in as constants; passing the defaults makes them graph
    inputs the guard compares, so a later ``flag=False`` is refused instead of ignored.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    given = set(list(signature.parameters)[:len(args)]) | set(kwargs)
    extra = {name: bound.arguments[name] for name, p in signature.parameters.items()
             if p.kind in named and name not in given}
    return {**kwargs, **extra}


def arrange(signature: inspect.Signature, in_spec: pytree.TreeSpec, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments in the structure ``in_spec`` (the example's), defaults filled in.

    The example may have passed ``scale`` by keyword and the call positionally, or left a
    default out: the graph's inputs are the example's leaves, in the example's order.

    Raises:
        PlanMismatchError: the call's inputs have another structure than the example's.
    """
    if pytree.tree_flatten((args, kwargs))[1] == in_spec:
        return args, kwargs
    args_spec, kwargs_spec = in_spec.children()
    bound = bind(signature, args, kwargs)
    bound.apply_defaults()
    kinds = {name: p.kind for name, p in signature.parameters.items()}
    named = {k: v for k, v in bound.arguments.items()
             if kinds[k] is not inspect.Parameter.VAR_KEYWORD}
    for key, value in bound.arguments.items():
        if kinds[key] is inspect.Parameter.VAR_KEYWORD:
            named.update(value)  # **kwargs: each entry is an input of its own
    if inspect.Parameter.VAR_POSITIONAL in kinds.values():
        positional = tuple(args)
    else:
        positional = tuple(named.pop(name) for name in list(named)[:args_spec.num_children])
    extra = sorted(set(named) - set(kwargs_spec.context) - set(signature.parameters))
    missing = sorted(set(kwargs_spec.context) - set(named))
    if extra or missing:
        raise PlanMismatchError(
            f"the call passes {extra or 'no'} keyword arguments the example inputs did not and "
            f"lacks {missing or 'none'} of theirs; the captured graph takes the example's "
            "arguments: call with those, or partition with example inputs like the calls")
    arranged = (positional, {key: named[key] for key in kwargs_spec.context})
    got = pytree.tree_flatten(arranged)[1]
    if got != in_spec:
        raise PlanMismatchError(f"the call's inputs are structured as {got} but the graph "
                                f"was captured for {in_spec}; call with inputs structured "
                                "like the example inputs")
    return arranged


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


def _trace_message(model: nn.Module, fx_error: BaseException, export_error: BaseException) -> str:
    if _returns_cache(export_error):
        return (f"could not capture {type(model).__name__}: forward returns a key/value cache "
                f"({_cache_type(export_error)}), which a "
                "pipeline cannot pass on; pass use_cache=False (in example_kwargs and in "
                f"each call) or set model.config.use_cache = False before partitioning")
    where = (user_line(fx_error) or user_line(export_error)
             or user_line(export_error, modules=True) or "unknown line")
    return (f"could not capture {type(model).__name__}: first failing line {where}\n"
            f"  torch.fx.symbolic_trace: {type(fx_error).__name__}: {fx_error}\n"
            f"  torch.export (non-strict): {type(export_error).__name__}: "
            f"{str(export_error).splitlines()[0] if str(export_error) else ''}\n"
            "Fix: remove data-dependent Python control flow from forward (use torch.where), "
            "or pass balance=/split_points= on an nn.Sequential of traceable children.")


def _returns_cache(error: BaseException) -> bool:
    """Whether export failed on a transformers cache object in the output."""
    text = str(error)
    return text.startswith("Found <class") and "Cache" in _cache_type(error) \
        and "in output" in text


def _cache_type(error: BaseException) -> str:
    """``DynamicCache`` out of export's "Found <class '...DynamicCache'> in output"."""
    return str(error).split(">")[0].split(".")[-1].strip("'")


def user_line(error: BaseException, *, modules: bool = False) -> str | None:
    """The deepest frame of ``error``'s traceback that is neither torch's nor ours.

    With ``modules``, frames of ``torch.nn``'s modules count as the model's code too (an
    ``nn.Transformer`` fails inside ``torch/nn/modules/transformer.py``).
    """
    nn_dir = os.path.join(os.path.dirname(torch.__file__), "nn") + os.sep
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if not f.filename.startswith("<") and (
        not f.filename.startswith(LIBRARY_DIRS) or (modules and f.filename.startswith(nn_dir)))]
    if not user:
        return None
    frame = user[-1]
    text = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
    return f"{frame.filename}:{frame.lineno} in {frame.name} ({text})"
