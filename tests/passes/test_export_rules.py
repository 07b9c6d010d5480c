from __future__ import annotations

import torch
from models import BatchBranch, FixedBatch
from torch import nn

from partitioner.passes.export_rules import export_rules
from partitioner.passes.guard_inputs import FREE


def _rules(model: nn.Module, x: torch.Tensor, kwargs: dict | None = None) -> object:
    kwargs = kwargs or {}
    dynamic = {"x": {0: torch.export.Dim.AUTO}, **{k: None for k in kwargs}}
    program = torch.export.export(model, (x,), kwargs, dynamic_shapes=dynamic, strict=False)
    leaves = len(torch.utils._pytree.tree_leaves(((x,), kwargs)))
    return export_rules(program, ((x,), kwargs), ["x", *kwargs], [True] + [False] * (leaves - 1),
                        int(x.shape[0]))


def test_a_branch_on_the_batch_is_a_guard_with_its_line() -> None:
    rules = _rules(BatchBranch(), torch.randn(8, 8))
    (guard,) = rules.guards
    assert "models.py" in guard.where and "x.shape[0] > 4" in guard.where
    ((_, low, high),) = rules.ranges
    assert (low, high) == (5, None)
    assert rules.inputs[0].pattern() == "(batch, 8)" and rules.example_batch == 8


def test_a_fixed_batch_is_a_number() -> None:
    rules = _rules(FixedBatch(), torch.randn(8, 8))
    assert rules.inputs[0].shape == (8, 8) and rules.inputs[0].batched


def test_python_values_are_baked_in() -> None:
    class Gate(nn.Module):
        def forward(self, x: torch.Tensor, flag: bool = True,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
            return x * 2 if flag else x

    rules = _rules(Gate(), torch.randn(4, 3), {"flag": True, "mask": None})
    assert [(r.name, r.value) for r in rules.inputs[1:]] == [("flag", True), ("mask", None)]
    assert rules.inputs[0].value is FREE
