"""Refuse inputs a ``torch.export`` graph does not hold for, instead of computing wrong values.

``torch.export`` traces ``forward`` once, with the example inputs. Every dimension but the
batch is fixed to the example's size, non-tensor inputs (``scale=2.0``, ``flag=True``) are
baked in as constants, and Python branches on the batch size are taken once and recorded as
*guards* (``if x.shape[0] > 4`` records ``batch > 4``, the batch range becoming ``[5, inf)``;
``x.view(8, -1)`` fixes the batch to 8). The graph holds only where those records hold: a
micro-batch of 2 rows through the first graph silently takes the branch of the example.

:class:`InputRules` keeps what the capture recorded (per input a shape pattern or constant,
the batch symbols' ranges and the guards); :func:`guard_inputs` puts an :class:`InputGuard`
in front of the graph, which checks every call (every micro-batch, in a pipeline's first
stage) and raises :class:`~partitioner.errors.PlanMismatchError` naming the input, the value
and the source line of the guard when one is known.

Like ``torch.export``'s own runtime check, a dynamic batch whose recorded range starts at 2
(export assumes sizes 0 and 1 away) accepts 1; a branch on ``batch == 1`` is the one kind
this cannot see, since export decided it false without recording a guard
(``docs/design/007-export-guards.md``).

Example:
    >>> import sympy, torch
    >>> batch = sympy.Symbol("s0", integer=True, positive=True)
    >>> rules = InputRules((InputRule("x", (batch, 4), True),), ((batch, 5, None),),
    ...                    (BatchGuard(batch > 4, "model.py:7"),), 8)
    >>> rules.problems([torch.zeros(6, 4)])
    []
    >>> print(rules.problems([torch.zeros(2, 4)])[0])  # doctest: +ELLIPSIS
    input x has 2 rows (the batch), but forward tested the batch size at model.py:7 ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.utils._sympy.printers import PythonPrinter

from partitioner.errors import PlanMismatchError
from partitioner.passes.base import PassError, PassResult

__all__ = ["InputRule", "BatchGuard", "InputRules", "InputGuard", "guard_inputs", "FREE"]

#: :attr:`InputRule.value` of a non-tensor input the graph reads (not baked in).
FREE = "<free>"

Dim: TypeAlias = int | sympy.Expr


@dataclass(frozen=True)
class InputRule:
    """What one graph input must be.

    Attributes:
        name: the input as the caller spells it (``input_ids``, ``kwargs['mask']``).
        shape: for a tensor, per dimension a size (fixed) or an expression of the batch
            symbols; ``None`` for a non-tensor input.
        batched: whether capture asked for dimension 0 to be dynamic (the batch).
        value: for a non-tensor input, the value baked into the graph, or :data:`FREE`.
    """

    name: str
    shape: tuple[Dim, ...] | None
    batched: bool = False
    value: Any = FREE

    def pattern(self) -> str:
        """The shape the graph holds for, the batch spelled ``batch``: ``(batch, 8)``."""
        dims = [str(d) if isinstance(d, int) else _spell(d) for d in self.shape or ()]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


@dataclass(frozen=True)
class BatchGuard:
    """A condition on the batch size that ``forward``'s code relied on.

    Attributes:
        expr: a sympy boolean of the batch symbols (``s0 > 4``).
        where: the source line that tested it (``model.py:7``), or ``""``.
    """

    expr: sympy.Basic
    where: str = ""


@dataclass(frozen=True)
class InputRules:
    """Everything a captured graph assumes about its inputs.

    Attributes:
        inputs: one rule per graph placeholder, in order.
        ranges: per batch symbol, the smallest and largest size (``None``: unbounded).
        guards: conditions on the batch symbols recorded while tracing.
        example_batch: the batch size of the example inputs the graph was traced with.
    """

    inputs: tuple[InputRule, ...]
    ranges: tuple[tuple[sympy.Symbol, int, int | None], ...] = ()
    guards: tuple[BatchGuard, ...] = ()
    example_batch: int | None = None

    def problems(self, values: Sequence[Any]) -> list[str]:
        """Why ``values`` (one per placeholder) fall outside what the graph holds for."""
        if len(values) != len(self.inputs):
            return [f"the call gives {len(values)} inputs but the captured graph takes "
                    f"{len(self.inputs)} ({', '.join(r.name for r in self.inputs)}); call "
                    "the model with the arguments of the example inputs"]
        found: list[str] = []
        sizes: dict[sympy.Symbol, int] = {}
        for rule, value in zip(self.inputs, values):
            found += _input_problems(rule, value, sizes, self.example_batch)
        if found:
            return found
        return self._batch_problems(sizes)

    def _batch_problems(self, sizes: dict[sympy.Symbol, int]) -> list[str]:
        name, b = self._batch_input(sizes)
        if b is None:
            return []
        found = []
        for guard in self.guards:
            if guard.expr.free_symbols <= sizes.keys() and _false(guard.expr, sizes):
                where = f" at {guard.where}" if guard.where else ""
                found.append(f"input {name} has {b} rows (the batch), but forward tested the "
                             f"batch size{where} and the graph holds only where "
                             f"`{_spell(guard.expr)}` (true for the example batch of "
                             f"{self.example_batch}); {_FIX}")
        if found:
            return found
        for symbol, low, high in self.ranges:
            size = sizes.get(symbol)
            # torch.export assumes 0 and 1 away and lets them through at run time (lo <= 2).
            if size is not None and ((low > 2 and size < low) or (high is not None and
                                                                    size > high)):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                found.append(f"input {name} has {size} rows (the batch), but the graph "
                             f"torch.export captured holds only for batches of {bound} "
                             f"(forward tests the batch size); {_FIX}")
        return found

    def _batch_input(self, sizes: dict[sympy.Symbol, int]) -> tuple[str, int | None]:
        for rule in self.inputs:
            if rule.batched and rule.shape and isinstance(rule.shape[0], sympy.Symbol) \
                    and rule.shape[0] in sizes:
                return rule.name, sizes[rule.shape[0]]
        return "", None

    def check(self, values: Sequence[Any]) -> None:
        """Raise unless the graph holds for ``values``.

        Raises:
            PlanMismatchError: naming each input that does not fit and why.
        """
        found = self.problems(values)
        if found:
            raise PlanMismatchError("; ".join(found))


_FIX = ("call with batches whose every micro-batch (batch / chunks rows) meets it, or pass "
        "other chunks=, or make forward independent of the batch size (torch.where "
        "instead of if)")


def _input_problems(rule: InputRule, value: Any, sizes: dict[sympy.Symbol, int],
                    example_batch: int | None) -> list[str]:
    if rule.shape is None:
        if rule.value is FREE or _same(value, rule.value):
            return []
        return [f"input {rule.name} is {_show(value)} but torch.export baked "
                f"{_show(rule.value)} into the captured graph; call with the example's value, "
                f"or partition again with example inputs holding {rule.name}={_show(value)}"]
    if not isinstance(value, torch.Tensor) or value.dim() != len(rule.shape):
        return [f"input {rule.name} is {_show(value)} but the captured graph takes a tensor "
                f"of shape {rule.pattern()}; call with inputs shaped like the example inputs"]
    for k, (want, size) in enumerate(zip(rule.shape, value.shape)):
        if isinstance(want, sympy.Symbol):
            if sizes.setdefault(want, int(size)) != size:
                return [f"input {rule.name} has {size} rows but another input has "
                        f"{sizes[want]}; split every batched input alike"]
        elif isinstance(want, int) and want != size:
            return [_fixed_problem(rule, tuple(value.shape), k, example_batch)]
    return []


def _fixed_problem(rule: InputRule, shape: tuple[int, ...], k: int,
                   example_batch: int | None) -> str:
    if k == 0 and rule.batched:
        return (f"input {rule.name} has {shape[0]} rows (the batch), but torch.export fixed "
                f"the batch of the captured graph to the example's {example_batch}: forward "
                "uses the batch size as a constant (e.g. x.view(8, -1)) or takes **kwargs "
                "(torch.export cannot make those dynamic); "
                "call with that batch and chunks=1, or write forward with x.shape[0] "
                "(x.view(x.shape[0], -1))")
    return (f"input {rule.name} has shape {shape} but the graph torch.export captured holds "
            f"only for {rule.pattern()} (every dimension but the batch is fixed to the "
            "example inputs'); call with inputs of that shape, or partition with "
            "example_inputs shaped like the calls")


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, (int, float, str, bool, type(None))) else \
        type(value).__name__


def _false(expr: sympy.Basic, sizes: dict[sympy.Symbol, int]) -> bool:
    result = expr.xreplace({s: sympy.Integer(v) for s, v in sizes.items()})
    return result is sympy.false or result is False


def _same(value: Any, expected: Any) -> bool:
    try:
        return bool(type(value) is type(expected) and value == expected)
    except Exception:  # a comparison that does not give a bool: not the same
        return False


def _spell(expr: sympy.Basic) -> str:
    """An expression with every batch symbol spelled ``batch``."""
    renamed = expr.xreplace({s: sympy.Symbol("batch") for s in expr.free_symbols})
    return str(PythonPrinter().doprint(renamed))


class InputGuard(nn.Module):
    """A graph's first node: checks the call's inputs against :class:`InputRules`.

    Args:
        rules: what the graph holds for.
    """

    _is_impure = True  # it returns nothing; dead-code elimination must keep it

    def __init__(self, rules: InputRules) -> None:
        super().__init__()
        self.rules = rules

    def forward(self, *values: Any) -> None:
        self.rules.check(values)


_TARGET = "input_guard"


def guard_inputs(gm: fx.GraphModule, rules: InputRules) -> PassResult:
    """Insert an :class:`InputGuard` call after ``gm``'s placeholders.

    Args:
        gm: a graph whose placeholders are the captured graph's inputs, in order.
        rules: what they must be.

    Returns:
        ``PassResult(gm, modified=True)``.

    Raises:
        PassError: if the placeholders and the rules differ in number, or ``gm`` is guarded.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(rules.inputs):
        raise PassError(f"guard_inputs: {len(placeholders)} placeholders for "
                        f"{len(rules.inputs)} input rules")
    if hasattr(gm, _TARGET):
        raise PassError(f"guard_inputs: {type(gm).__name__} is guarded already")
    gm.add_submodule(_TARGET, InputGuard(rules))
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
            node = gm.graph.call_module(_TARGET, ())
    else:
        with gm.graph.inserting_after(anchor):
            node = gm.graph.call_module(_TARGET, tuple(placeholders))
    node.meta["val"] = None  # it returns nothing (later passes read every node's value)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, True)
