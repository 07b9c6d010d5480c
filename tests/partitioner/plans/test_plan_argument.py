"""``plan=`` mistakes name the value and the fix (``partitioner/apply.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from models import mlp

from partitioner import make_plan, partition
from partitioner.apply import load_plan
from partitioner.errors import PartitionError, PlanFormatError, SpecError


@pytest.mark.parametrize(("value", "shown"), [
    (42, "plan=42 is not a plan \\(it is of type int\\)"),
    (["plan.json"], "plan=\\['plan.json'\\] is not a plan \\(it is of type list\\)"),
    (b"plan.json", "plan=b'plan.json' is not a plan \\(it is of type bytes\\)"),
    (True, "plan=True is not a plan \\(it is of type bool\\)")])
def test_plan_of_another_type_names_the_value_and_what_to_pass(value: Any, shown: str) -> None:
    fix = "pass the path of a plan or spec file \\(str or Path\\), a Plan, a Spec"
    for call in (lambda: partition(mlp(), None, plan=value),
                 lambda: make_plan(mlp(), None, plan=value), lambda: load_plan(value)):
        with pytest.raises(PlanFormatError, match=f"{shown}; {fix}") as caught:
            call()
        assert isinstance(caught.value, ValueError)


def test_a_long_plan_value_is_shortened() -> None:
    with pytest.raises(PlanFormatError) as caught:
        partition(mlp(), None, plan=list(range(10_000)))  # type: ignore[arg-type]
    assert len(str(caught.value)) < 200


def test_plan_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    for call in (lambda: partition(mlp(), None, plan=str(missing)),
                 lambda: make_plan(mlp(), None, plan=missing)):
        with pytest.raises(SpecError, match=f"'{missing}': it does not exist .*check the path"):
            call()


def test_an_empty_plan_path() -> None:
    with pytest.raises(PartitionError, match="plan='' is an empty path"):
        partition(mlp(), None, plan="")
