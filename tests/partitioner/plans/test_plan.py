from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import mlp

from partitioner import Plan, partition
from partitioner.plans.plan import PlanFormatError, Stage


def test_plan_round_trips_through_json(tmp_path: Path) -> None:
    pm = partition(mlp(), devices=["cpu"] * 3, example_inputs=(torch.randn(4, 12),), chunks=2)
    path = tmp_path / "plan.json"
    pm.plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "partitioner.plan" and data["version"] == 1
    assert Plan.load(path) == pm.plan


def test_plan_table_lists_every_stage() -> None:
    pm = partition(mlp(), devices=["cpu"] * 3, example_inputs=(torch.randn(4, 12),))
    table = pm.plan.table()
    assert len(table.splitlines()) == 2 + 1 + 3  # summary, header, rule, 3 stages
    assert "predicted step" in table


def test_plan_validation_collects_problems() -> None:
    with pytest.raises(PlanFormatError, match="2 stages but 1 devices.*chunks=0"):
        Plan("pipeline", ("cpu",), (Stage(0, "cpu", ("a",)), Stage(1, "cpu", ("b",))), chunks=0)


def test_stage_without_layers_is_refused() -> None:
    with pytest.raises(PlanFormatError, match="stage 0 has no layers"):
        Stage(0, "cpu", ())


def test_loading_rejects_other_formats(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something", "version": 1}))
    with pytest.raises(PlanFormatError, match="format is 'something'"):
        Plan.load(path)


def test_balance_property_and_layers() -> None:
    pm = partition(mlp(), devices=["cpu"] * 2, balance=[3, 4])
    assert pm.plan.balance == (3, 4)
    assert pm.plan.layers == tuple(str(k) for k in range(7))
    assert pm.plan.strategy == "balance"
