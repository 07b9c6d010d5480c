"""A plan records its input signature, so an export-captured model needs no example inputs again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import gpt2, mlp
from torch import nn

from partitioner import Plan, make_plan, partition
from partitioner.errors import ExampleInputsError
from partitioner.plans.signature import (
    ContainerInput,
    InputSignature,
    OpaqueInput,
    TensorInput,
    ValueInput,
    describe,
)


class Gated(nn.Module):
    """``torch.fx`` cannot trace ``if x.dim() == 2`` (a proxy in control flow); export can."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
        if x.dim() == 2:
            x = self.a(x) * scale
        if mask is not None:
            x = x * mask
        return self.b(x)


def test_describe_records_shapes_dtypes_batch_dims_and_values() -> None:
    ids = torch.zeros(4, 16, dtype=torch.int64)
    sig = describe((ids, torch.zeros(16, 4), (torch.zeros(4, 2), 3)),
                   {"mask": torch.ones(4, 16, dtype=torch.bool), "flag": None, "rate": 0.5,
                    "opts": {"k": "v"}, "cache": object()})
    assert sig is not None
    assert sig.args == (TensorInput("int64", (4, 16), 0), TensorInput("float32", (16, 4), None),
                        ContainerInput("tuple", (TensorInput("float32", (4, 2), 0),
                                                 ValueInput(3))))
    assert dict(sig.kwargs) == {"mask": TensorInput("bool", (4, 16), 0),
                                "flag": ValueInput(None), "rate": ValueInput(0.5),
                                "opts": ContainerInput("dict", (ValueInput("v"),), ("k",)),
                                "cache": OpaqueInput("object")}
    assert sig.opaque == ["kwargs['cache'] (object)"]
    assert str(sig).startswith("int64[4, 16], float32[16, 4], (float32[4, 2], 3), mask=bool")


def test_a_batch_of_one_has_no_dynamic_dimension() -> None:
    sig = describe((torch.zeros(1, 8), torch.zeros(1, 3)), None)
    assert sig is not None and [a.batch_dim for a in sig.args] == [None, None]  # type: ignore[union-attr]
    assert describe(None, None) is None


def test_signature_round_trips_and_makes_inputs_of_it() -> None:
    sig = describe((torch.zeros(4, 16, dtype=torch.int64),),
                   {"mask": torch.zeros(4, 16, dtype=torch.bool), "pair": [torch.zeros(2), 1.5],
                    "named": {"x": torch.zeros(4, 3)}})
    assert sig is not None
    again = InputSignature.from_dict(json.loads(json.dumps(sig.to_dict())))
    assert again == sig
    args, kwargs = again.example(torch.device("cpu"))
    assert args[0].shape == (4, 16) and args[0].dtype == torch.int64
    assert kwargs["mask"].dtype == torch.bool and bool(kwargs["mask"].all())
    assert isinstance(kwargs["pair"], list) and kwargs["pair"][1] == 1.5
    assert kwargs["named"]["x"].shape == (4, 3)


def test_record_writes_the_signature_into_the_plan(tmp_path: Path) -> None:
    plan = partition(mlp(), ["cpu"] * 2, example_inputs=(torch.randn(8, 12),)).plan
    assert plan.planner is not None
    assert plan.planner.signature == InputSignature((TensorInput("float32", (8, 12), 0),))
    path = tmp_path / "plan.json"
    plan.save(path)
    saved = json.loads(path.read_text())["planner"]["signature"]
    assert saved == {"args": [{"kind": "tensor", "dtype": "float32", "shape": [8, 12],
                               "batch_dim": 0}], "kwargs": {}}
    assert Plan.load(path) == plan
    balanced = make_plan(mlp(), ["cpu"] * 2, balance=[3, 4])
    assert balanced.planner is not None and balanced.planner.signature is None


def test_export_plan_with_keyword_inputs_applies_without_example_inputs(tmp_path: Path) -> None:
    model, x, mask = Gated(), torch.randn(6, 8), torch.rand(6, 8)
    first = partition(model, ["cpu", "cpu"], example_inputs=(x,),
                      example_kwargs={"mask": mask, "scale": 2.0}, chunks=2)
    assert first.plan.capture == "export"
    path = tmp_path / "plan.json"
    first.plan.save(path)
    again = partition(model, None, plan=path)
    assert again.plan == first.plan
    torch.testing.assert_close(again(x, mask=mask, scale=2.0), model(x, mask=mask, scale=2.0))
    # The other mode is captured again on first use, from the same made-up inputs.
    again.train()
    torch.testing.assert_close(again(x, mask=mask, scale=2.0), model(x, mask=mask, scale=2.0))
    assert make_plan(model, None, plan=path) == first.plan
    first.close()
    again.close()


def test_gpt2_plan_applies_without_example_inputs(tmp_path: Path) -> None:
    model = gpt2().eval()
    ids = torch.randint(0, 64, (4, 16))
    first = partition(model, ["cpu"] * 2, example_inputs=(ids,), chunks=2)
    path = tmp_path / "plan.json"
    first.plan.save(path)
    again = partition(model, None, plan=path)
    assert again.plan == first.plan and again.plan.capture == "export"
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
    first.close()
    again.close()


def test_old_export_plans_without_a_signature_still_load_and_ask_for_inputs(
        tmp_path: Path) -> None:
    model, x = Gated(), torch.randn(6, 8)
    data = make_plan(model, ["cpu", "cpu"], example_inputs=(x,)).to_dict()
    del data["planner"]["signature"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    assert plan.planner is not None and plan.planner.signature is None
    with pytest.raises(ExampleInputsError, match="records no input signature.*pass "
                                                 "example_inputs=\\(x,\\)"):
        partition(model, None, plan=path)
    pm = partition(model, None, plan=path, example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.close()


def test_inputs_recorded_by_type_only_are_not_made_up(tmp_path: Path) -> None:
    model, x = Gated(), torch.randn(6, 8)
    plan = make_plan(model, ["cpu", "cpu"], example_inputs=(x,))
    assert plan.planner is not None
    data = plan.to_dict()
    data["planner"]["signature"]["kwargs"] = {"mask": {"kind": "type", "type": "Mask"}}
    with pytest.raises(ExampleInputsError, match="kwargs\\['mask'\\] \\(Mask\\) by type only"):
        partition(model, None, plan=Plan.from_dict(data))
