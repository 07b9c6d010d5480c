from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from models import LongSkip, ResidualCNN, gpt2, mlp
from torch import nn

from partitioner import Plan, partition
from partitioner.apply import PlanMismatchError
from partitioner.errors import ExampleInputsError
from partitioner.plans.plan import Mesh, PlanFormatError, ShardSpec, Stage

jsonschema = pytest.importorskip("jsonschema")  # a test extra (absent on the GPU machine)


def _schema() -> dict:
    return json.loads(resources.files("partitioner.plans").joinpath("plan_schema.json").read_text())


def _saved(tmp_path: Path, plan: Plan) -> Path:
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_saved_plans_validate_against_the_shipped_schema(tmp_path: Path) -> None:
    x = torch.randn(6, 3, 8, 8)
    plans = [partition(ResidualCNN(), ["cpu"] * 3, example_inputs=(x,), chunks=3).plan,
             partition(mlp(), ["cpu"] * 2, balance=[3, 4]).plan,
             Plan("pipeline", ("cpu",), (Stage(0, "cpu", ("a",)),),
                  shard_specs={"a.weight": ShardSpec(0, "colwise")})]
    for plan in plans:
        jsonschema.validate(json.loads(_saved(tmp_path, plan).read_text()), _schema())


def test_schema_rejects_what_loading_rejects() -> None:
    bad = {"format": "partitioner.plan", "version": 1, "strategy": "x", "devices": ["cpu"],
           "stages": [{"index": 0, "device": "cpu", "layers": []}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _schema())
    with pytest.raises(PlanFormatError, match="stages\\[0\\].layers: \\[\\]; give a non-empty"):
        Plan.from_dict(bad)


def test_plan_file_records_everything_the_format_promises(tmp_path: Path) -> None:
    x = torch.randn(8, 12)
    plan = partition(mlp(), ["cpu"] * 3, "pipeline", example_inputs=(x,), chunks=4,
                     checkpoint="never", schedule="1f1b").plan
    data = json.loads(_saved(tmp_path, plan).read_text())
    assert data["mesh"] == {"dp": 1, "pp": 3, "tp": 1}
    assert data["shard_specs"] == {}
    assert data["chunks"] == 4 and data["checkpoint"] == "never" and data["schedule"] == "1f1b"
    assert data["virtual_stages"] == 1
    assert data["planner"]["strategy"] == "pipeline"
    assert data["planner"]["example_inputs"] == ["float32[8, 12]"]
    assert all(s["predicted_time"] > 0 and s["predicted_memory"] > 0 for s in data["stages"])
    # What stage 0 sends is its last layer's output: (8 rows / 4 chunks) x width floats.
    widths = {"0": 32, "1": 32, "2": 32, "3": 32, "4": 16, "5": 16}
    last = data["stages"][0]["layers"][-1]
    assert data["stages"][0]["send_bytes"] == 2 * widths[last] * 4
    assert data["fingerprint"]["parameters"]["0.weight"] == {"shape": [32, 12],
                                                             "dtype": "float32"}


def test_send_bytes_are_one_replica_s_micro_batch() -> None:
    """With replicas the batch is split over them before the micro-batches: stage 0 of a
    dp=2 x pp=2 plan of 8 rows in 2 micro-batches sends 2 rows (it said 4, the whole
    batch's micro-batch, while the graph drawing said 2)."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    plan = partition(model, ["cpu"] * 4, example_inputs=(torch.randn(8, 64),),
                     mesh=Mesh(dp=2, pp=2, tp=1), chunks=2).plan
    assert plan.mesh == Mesh(dp=2, pp=2, tp=1) and plan.chunks == 2
    assert plan.stages[0].send_bytes == 8 // 2 // 2 * 64 * 4


def test_plan_file_is_diff_friendly(tmp_path: Path) -> None:
    plan = partition(mlp(), ["cpu"] * 2, balance=[3, 4]).plan
    text = _saved(tmp_path, plan).read_text()
    lines = text.splitlines()
    assert '  "devices": ["cpu", "cpu"],' in lines
    # one tensor a line, with its shape inline
    assert '      "0.weight": {"shape": [32, 12], "dtype": "float32"},' in lines
    assert plan.to_json() == Plan.load(tmp_path / "plan.json").to_json()


def test_applying_a_saved_plan_reproduces_stages_and_results(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = ResidualCNN(), torch.randn(6, 3, 8, 8)
    first = partition(model, ["cpu"] * 3, example_inputs=(x,), chunks=3, checkpoint="always")
    path = _saved(tmp_path, first.plan)
    again = partition(model, None, plan=path)
    assert again.plan == first.plan
    assert [s.layers for s in again.plan.stages] == [s.layers for s in first.plan.stages]
    torch.testing.assert_close(again(x), first(x))
    torch.testing.assert_close(again(x), model(x))
    first.close()
    again.close()


def test_applying_a_plan_to_the_same_architecture_with_other_weights(tmp_path: Path) -> None:
    x = torch.randn(4, 8)
    path = _saved(tmp_path, partition(LongSkip(), ["cpu"] * 3, example_inputs=(x,)).plan)
    other = LongSkip()
    pm = partition(other, ["cpu"] * 3, plan=str(path))
    torch.testing.assert_close(pm(x), other(x))
    pm.close()


def test_applying_a_plan_to_another_model_lists_the_differences(tmp_path: Path) -> None:
    path = _saved(tmp_path, partition(mlp(), ["cpu"] * 2, balance=[3, 4]).plan)
    with pytest.raises(PlanMismatchError) as caught:
        partition(mlp((12, 32, 40, 16, 6)), None, plan=path)
    message = str(caught.value)
    assert "parameter 2.weight: shape (32, 32) in the plan, (40, 32) in the model" in message
    assert isinstance(caught.value, ValueError)


def test_applying_a_plan_refuses_disagreeing_arguments(tmp_path: Path) -> None:
    plan = partition(mlp(), ["cpu"] * 2, balance=[3, 4], chunks=2).plan
    with pytest.raises(PlanMismatchError, match="chunks=4 but the plan says 2"):
        partition(mlp(), None, plan=plan, chunks=4)
    with pytest.raises(PlanMismatchError, match="devices=.* but the plan runs on"):
        partition(mlp(), ["cpu"] * 3, plan=plan)
    with pytest.raises(PlanMismatchError, match="balance= is given"):
        partition(mlp(), None, plan=plan, balance=[2, 5])


def test_a_hand_made_plan_without_fingerprint_applies_by_layer_names() -> None:
    plan = Plan("manual", ("cpu", "cpu"), (Stage(0, "cpu", ("0", "1", "2")),
                                          Stage(1, "cpu", ("3", "4", "5", "6"))), chunks=2)
    model, x = mlp(), torch.randn(4, 12)
    pm = partition(model, ["cpu", "cpu"], plan=plan)
    assert pm.plan.balance == (3, 4)
    torch.testing.assert_close(pm(x), model(x))
    pm.close()
    wrong = Plan("manual", ("cpu",), (Stage(0, "cpu", ("0", "9")),))
    with pytest.raises(PlanMismatchError, match=r"the plan has \['9'\], which this model lacks"):
        partition(model, None, plan=wrong)


def test_hand_made_tensor_parallel_plans_are_checked_not_trusted() -> None:
    """A tensor-parallel plan runs (tests/partitioner/test_apply_parallel_plans.py) once the
    tensor-parallel front, given its settings, makes the same plan; this one lists the
    layers unmerged and no shard specs."""
    stages = (Stage(0, "cpu", tuple(str(k) for k in range(7))),)
    plan = Plan("x", ("cpu",), stages, mesh=Mesh(1, 1, 2))
    with pytest.raises(ExampleInputsError, match="tp=2"):
        partition(mlp(), None, plan=plan)
    with pytest.raises(PlanMismatchError, match="tp=2.*does not fit this model.*re-plan"):
        partition(mlp(), None, plan=plan, example_inputs=(torch.randn(4, 12),))
    pm = partition(mlp(), None, plan=Plan("x", ("cpu",), stages, schedule="1f1b"))
    assert pm.pipeline().schedule_kind.name == "1f1b"  # every schedule runs here
    pm.close()


def test_export_captured_plan_applies_exactly(tmp_path: Path) -> None:
    model = gpt2().eval()
    ids = torch.randint(0, 64, (4, 16))
    # A pipeline plan (saved tensor-parallel plans: tests/partitioner/test_apply_parallel_plans.py).
    first = partition(model, ["cpu"] * 2, "pipeline", example_inputs=(ids,), chunks=2)
    again = partition(model, None, plan=_saved(tmp_path, first.plan), example_inputs=(ids,))
    assert again.plan == first.plan and again.plan.capture == "export"
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
    first.close()
    again.close()


def test_version_1_files_without_the_new_fields_still_load(tmp_path: Path) -> None:
    old = {"format": "partitioner.plan", "version": 1, "strategy": "balance",
           "devices": ["cpu"], "stages": [{"index": 0, "device": "cpu", "layers": ["a"],
                                           "predicted_time": None, "predicted_memory": None,
                                           "param_bytes": None}],
           "chunks": 1, "checkpoint": "never", "schedule": "gpipe", "capture": "fx",
           "predicted_step_time": None, "predicted_bubble": None, "notes": []}
    plan = Plan.from_dict(old)
    assert plan.mesh == Mesh(1, 1, 1) and plan.fingerprint is None and plan.shard_specs == {}


def test_loading_runs_no_code(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "plan.json"
    path.write_bytes(pickle.dumps(nn.Linear(2, 2)))
    with pytest.raises(PlanFormatError):
        Plan.load(path)
    sneaky = tmp_path / "sneaky.json"
    marker = tmp_path / "ran"
    stage = {"index": 0, "device": "cpu", "layers": [f"__import__('os').system('touch {marker}')"]}
    sneaky.write_text(json.dumps({"format": "partitioner.plan", "version": 1, "strategy": "x",
                                  "devices": ["cpu"], "stages": [stage]}))
    assert Plan.load(sneaky).layers == tuple(stage["layers"])
    assert not marker.exists()


def test_malformed_fields_raise_plan_format_errors() -> None:
    base = {"format": "partitioner.plan", "version": 1, "strategy": "x", "devices": ["cpu"],
            "stages": [{"index": 0, "device": "cpu", "layers": ["a"]}]}
    for key, value, match in (("mesh", {"dp": 0}, "mesh.dp: 0; give an integer >= 1"),
                              ("shard_specs", {"a.w": {"dim": 0, "kind": "diag"}}, "diag"),
                              ("stages", [{"index": 0, "device": "cpu"}],
                               r"stages\[0\].layers: missing")):
        with pytest.raises(PlanFormatError, match=match):
            Plan.from_dict({**base, key: value})
