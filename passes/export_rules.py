"""Read what a ``torch.export`` program assumed about its inputs.

Every input placeholder's fake tensor holds a shape whose sizes are numbers (fixed) or
expressions of the batch symbols; non-tensor inputs were traced as the example's values;
``range_constraints`` bound each batch symbol; the shape environment's guards are the
conditions ``forward``'s branches left (``if x.shape[0] > 4`` -> ``s0 > 4``, with the source
line). :func:`export_rules` gathers them as
:class:`~partitioner.passes.guard_inputs.InputRules` for ``guard_inputs`` to check.

Example:
    >>> import torch
    >>> class Halve(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x[: x.shape[0] // 2] if x.shape[0] > 4 else x
    >>> x = torch.randn(8, 3)
    >>> auto = {"x": {0: torch.export.Dim.AUTO}}
    >>> program = torch.export.export(Halve(), (x,), dynamic_shapes=auto, strict=False)
    >>> rules = export_rules(program, ((x,), {}), ["x"], [True], 8)
    >>> rules.inputs[0].pattern(), str(rules.guards[0].expr)  # doctest: +ELLIPSIS
    ('(batch, 3)', 's... > 4')
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._sympy.numbers import int_oo

from partitioner.passes.guard_inputs import FREE, BatchGuard, InputRule, InputRules

__all__ = ["export_rules"]

_TORCH = os.path.dirname(torch.__file__) + os.sep


def export_rules(program: torch.export.ExportedProgram, example: Any, names: Sequence[str],
                 batched: Sequence[bool], batch: int | None) -> InputRules:
    """What ``program``'s graph holds for.

    Args:
        program: what ``torch.export.export`` returned.
        example: the ``(args, kwargs)`` it was traced with, in its input structure.
        names: ``forward``'s parameter names in order (to name the inputs).
        batched: per input leaf, whether its dimension 0 was asked to be dynamic.
        batch: the example's batch size.

    Returns:
        The :class:`~partitioner.passes.guard_inputs.InputRules`, one rule per input leaf.
    """
    sig = program.graph_signature
    lifted = {*sig.inputs_to_parameters, *sig.inputs_to_buffers,
              *sig.inputs_to_lifted_tensor_constants}
    placeholders = [n for n in program.graph.nodes
                    if n.op == "placeholder" and n.name not in lifted]
    leaves = pytree.tree_flatten_with_path(example)[0]
    rules = []
    symbols: set[sympy.Symbol] = set()
    for node, (path, leaf), dynamic in zip(placeholders, leaves, batched):
        value = node.meta.get("val")
        name = _input_name(path, names)
        if isinstance(value, torch.Tensor):
            shape = tuple(_dim(d) for d in value.shape)
            symbols |= {s for d in shape if isinstance(d, sympy.Expr) for s in d.free_symbols}
            rules.append(InputRule(name, shape, dynamic))
        elif isinstance(value, torch.SymInt):
            rules.append(InputRule(name, None, value=FREE))
        else:
            # Non-strict export traces Python values (None, flags, sizes) as constants: the
            # graph holds for the example's value only (attention_mask=None stays None).
            rules.append(InputRule(name, None, value=leaf))
    ranges = tuple((s, int(vr.lower), None if vr.upper in (int_oo, sympy.oo) else
                    int(vr.upper)) for s, vr in program.range_constraints.items()
                   if s in symbols)
    return InputRules(tuple(rules), ranges, _guards(placeholders, symbols), batch)


def _dim(size: int | torch.SymInt) -> int | sympy.Expr:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else expr
    return int(size)


def _input_name(path: tuple[Any, ...], names: Sequence[str]) -> str:
    """``input_ids``, ``mask['x']`` or ``args[3]``: how the caller spells a leaf's input."""
    if len(path) < 2:
        return pytree.keystr(path)
    head, key, rest = path[0], path[1], path[2:]
    if getattr(head, "idx", 1) == 0:
        index = key.idx
        base = names[index] if index < len(names) else f"args[{index}]"
    else:
        base = str(key.key)
    return base + pytree.keystr(tuple(rest))


def _guards(placeholders: list[fx.Node], symbols: set[sympy.Symbol]) -> tuple[BatchGuard, ...]:
    """The shape guards on the batch symbols, with the user line that made each."""
    modes = [getattr(n.meta.get("val"), "fake_mode", None) for n in placeholders]
    env = next((m.shape_env for m in modes if m is not None), None)
    if env is None or not symbols:
        return ()
    return tuple(BatchGuard(g.expr, _where(g.sloc)) for g in env.guards
                 if g.expr.free_symbols and g.expr.free_symbols <= symbols)


def _where(sloc: Any) -> str:
    frame = getattr(sloc, "framework_loc", None)
    if getattr(sloc, "maybe_user_loc", None):
        return str(sloc.maybe_user_loc)
    if isinstance(frame, traceback.FrameSummary) and not frame.filename.startswith(_TORCH):
        return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return ""


