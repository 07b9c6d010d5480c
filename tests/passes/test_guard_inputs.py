from __future__ import annotations

import pytest
import sympy
import torch

from partitioner.errors import PassError, PlanMismatchError
from partitioner.passes.guard_inputs import (
    BatchGuard,
    InputGuard,
    InputRule,
    InputRules,
    guard_inputs,
)

B = sympy.Symbol("s0", integer=True, positive=True)


def _rules(*guards: BatchGuard, low: int = 2, high: int | None = None) -> InputRules:
    return InputRules((InputRule("x", (B, 4), True), InputRule("scale", None, value=2.0)),
                      ((B, low, high),), guards, 8)


def test_inputs_the_graph_holds_for_pass() -> None:
    rules = _rules(BatchGuard(B > 4, "m.py:3"), low=5)
    assert rules.problems([torch.zeros(5, 4), 2.0]) == []
    assert rules.problems([torch.zeros(100, 4), 2.0]) == []


def test_a_batch_failing_a_guard_names_the_line_and_the_condition() -> None:
    rules = _rules(BatchGuard(B > 4, "m.py:3 (if x.shape[0] > 4:)"), low=5)
    (problem,) = rules.problems([torch.zeros(4, 4), 2.0])
    assert "input x has 4 rows" in problem and "m.py:3" in problem
    assert "`batch > 4`" in problem and "example batch of 8" in problem


def test_guards_that_are_no_range_are_checked() -> None:
    even = BatchGuard(sympy.Eq(sympy.Mod(B, 2), 0))
    rules = _rules(even)
    assert rules.problems([torch.zeros(6, 4), 2.0]) == []
    assert "batch % 2" in rules.problems([torch.zeros(5, 4), 2.0])[0]
    not_three = _rules(BatchGuard(sympy.Ne(B, 3)))
    assert not_three.problems([torch.zeros(3, 4), 2.0]) != []


def test_range_bounds_refuse_and_one_passes_like_torch_export() -> None:
    assert _rules(low=2).problems([torch.zeros(1, 4), 2.0]) == []
    assert "at least 5" in _rules(low=5).problems([torch.zeros(3, 4), 2.0])[0]
    assert "between 2 and 9" in _rules(high=9).problems([torch.zeros(10, 4), 2.0])[0]


def test_fixed_dimensions_and_fixed_batch() -> None:
    rules = _rules()
    assert "(batch, 4)" in rules.problems([torch.zeros(8, 5), 2.0])[0]
    fixed = InputRules((InputRule("x", (8, 4), True),), (), (), 8)
    assert "fixed the batch" in fixed.problems([torch.zeros(4, 4)])[0]
    assert fixed.problems([torch.zeros(8, 4)]) == []


def test_baked_constants_must_match() -> None:
    rules = _rules()
    assert "baked 2.0" in rules.problems([torch.zeros(8, 4), 3.0])[0]
    masked = InputRules((InputRule("mask", None, value=None),))
    assert "a tensor of shape (2, 3)" in masked.problems([torch.zeros(2, 3)])[0]
    assert masked.problems([None]) == []


def test_batched_inputs_must_agree_and_counts_must_match() -> None:
    two = InputRules((InputRule("x", (B, 4), True), InputRule("y", (B,), True)))
    assert "another input has 4" in two.problems([torch.zeros(4, 4), torch.zeros(3)])[0]
    assert "takes 2" in two.problems([torch.zeros(4, 4)])[0]


def test_guard_module_refuses_in_the_graph() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    result = guard_inputs(gm, InputRules((InputRule("x", (B, 4), True),), ((B, 5, None),)))
    assert result.modified
    guards = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "input_guard"]
    assert len(guards) == 1 and isinstance(gm.input_guard, InputGuard)
    assert gm(torch.zeros(6, 4)).shape == (6, 2)
    with pytest.raises(PlanMismatchError, match="at least 5"):
        gm(torch.zeros(3, 4))
    gm.graph.eliminate_dead_code()  # the guard returns nothing yet must stay
    assert any(n.target == "input_guard" for n in gm.graph.nodes)


def test_guard_inputs_checks_its_preconditions() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    with pytest.raises(PassError, match="1 placeholders for 2 input rules"):
        guard_inputs(gm, _rules())
    guard_inputs(gm, InputRules((InputRule("x", (B, 4), True),)))
    with pytest.raises(PassError, match="guarded already"):
        guard_inputs(gm, InputRules((InputRule("x", (B, 4), True),)))
