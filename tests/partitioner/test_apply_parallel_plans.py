"""Tests of partitioner/apply.py, plans/placement.py and api.route: saved plans with replicas or
tensor-parallel shards apply again exactly, with or without example inputs, and plans that
do not fit the call or the model are refused naming the value and the fix."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import Plan, make_plan, partition
from partitioner.cost.devices import REFERENCE_CPU
from partitioner.cost.machine import pinned_cpu_spec
from partitioner.errors import ExampleInputsError, PlanMismatchError, SpecError
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.replicas import ReplicatedModule
from partitioner.runtime.tensor_parallel.module import TensorParallelModule


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(),
                         nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _tp_plan(model: nn.Module, x: torch.Tensor, tmp_path: Path, dp: int = 1) -> Path:
    """A saved tensor-parallel plan (2 stages of 2 ranks, 2 micro-batches), its mesh given
    ``dp`` replicas."""
    with partition(model, ["cpu"] * 4, "pipeline", example_inputs=(x,), tensor_parallel=2,
                   chunks=2) as tm:
        data = json.loads(json.dumps(tm.plan.to_dict()))
    assert [s["layers"] for s in data["stages"]] == [["0", "3"], ["4"]]  # merged pairs
    data["mesh"]["dp"] = dp
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def _replicas_plan(model: nn.Module, x: torch.Tensor, tmp_path: Path) -> Path:
    """A saved plan of 2 replicas, each a pipeline of 2 stages."""
    made = make_plan(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=2)
    data = json.loads(json.dumps(made.to_dict()))
    data["mesh"]["dp"] = 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def _grads(module: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    holder = module.module if isinstance(module, ReplicatedModule) else module
    if isinstance(holder, TensorParallelModule):
        found = {k: holder.full_tensor(k, grad=True) for k, _ in model.named_parameters()}
        return {k: g for k, g in found.items() if g is not None}
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _transparent(module: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """Outputs and gradients of ``module`` (wrapping ``model``) equal a copy of the model's."""
    reference = copy.deepcopy(model)
    out = module(x)
    out.pow(2).mean().backward()
    expected = reference(x)
    expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    got = _grads(module, model)
    assert sorted(got) == sorted(k for k, _ in reference.named_parameters())
    for key, p in reference.named_parameters():
        torch.testing.assert_close(got[key], p.grad, atol=1e-5, rtol=1e-4, msg=key)


CASES = {"tensor_parallel": (1, TensorParallelModule), "dp_x_tp": (2, ReplicatedModule)}


@pytest.mark.parametrize("inputs", [True, False], ids=["with_inputs", "without_inputs"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tensor_parallel_plan_round_trips(case: str, inputs: bool, tmp_path: Path) -> None:
    dp, kind = CASES[case]
    model, x = _model(), torch.randn(6, 8)
    path = _tp_plan(model, x, tmp_path, dp)
    saved = Plan.load(path)
    given: dict[str, Any] = {"example_inputs": (x,)} if inputs else {}
    with partition(model, None, plan=path, **given) as again:
        assert isinstance(again, kind)
        assert again.plan == saved
        if dp > 1:
            assert [type(r) for r in again.replicas] == [TensorParallelModule] * dp
        _transparent(again, model, x)
    assert make_plan(model, None, plan=path, **given) == saved


@pytest.mark.parametrize("inputs", [True, False], ids=["with_inputs", "without_inputs"])
def test_a_replicas_plan_round_trips(inputs: bool, tmp_path: Path) -> None:
    model, x = _model(), torch.randn(6, 8)
    path = _replicas_plan(model, x, tmp_path)
    saved = Plan.load(path)
    given: dict[str, Any] = {"example_inputs": (x,)} if inputs else {}
    with partition(model, ["cpu"] * 4, plan=path, **given) as again:
        assert isinstance(again, ReplicatedModule) and again.plan == saved
        assert [type(r) for r in again.replicas] == [PartitionedModule] * 2
        assert again.dp == 2
        _transparent(again, model, x)
    assert make_plan(model, None, plan=path, **given) == saved


# A CPU whose replicas cost nothing beyond their compute, on cores that two workers share
# without losing speed: auto then picks replicas for a small model (with the reference CPU's
# measured cost per replica, and its sharing gains, it picks a pipeline).
_FREE_REPLICAS = replace(REFERENCE_CPU, replica_overhead=0.0, thread_latency=0.0,
                         shared_speedup=(1.0, 2.0, 2.0, 2.0), shared_sizes=())


def test_a_fresh_replicas_choice_of_auto_round_trips(tmp_path: Path) -> None:
    """What ``strategy="auto"`` returns and saves applies again to the same module kind."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), torch.randn(6, 8)
    with pinned_cpu_spec(_FREE_REPLICAS):
        first = partition(model, ["cpu"] * 2, example_inputs=(x,))
    assert isinstance(first, ReplicatedModule)  # small layers: replicas beat a pipeline
    first.plan.save(tmp_path / "auto.json")
    again = partition(model, None, plan=tmp_path / "auto.json")
    assert type(again) is type(first) and again.plan == first.plan
    _transparent(again, model, x)
    first.close()
    again.close()


@pytest.mark.parametrize(("devices", "match"), [
    (["cpu"] * 3, "gives 3 devices but the plan's mesh dp=1 x pp=2 x tp=2 = 4 devices.*pass 4"),
    (["cpu"] * 8, "gives 8 devices"),
    (["cpu", "meta", "cpu", "cpu"], None),  # meta devices are refused before the plan
])
def test_the_wrong_devices_for_the_mesh_are_refused(devices: list[str], match: str | None,
                                                    tmp_path: Path) -> None:
    model, x = _model(), torch.randn(6, 8)
    path = _tp_plan(model, x, tmp_path)
    if match is None:
        with pytest.raises(ValueError):
            partition(model, devices, plan=path)
        return
    with pytest.raises(PlanMismatchError, match=match):
        partition(model, devices, plan=path)


def test_replica_zero_must_start_on_the_plans_devices(tmp_path: Path) -> None:
    model, x = _model(), torch.randn(6, 8)
    data = json.loads(_replicas_plan(model, x, tmp_path).read_text())
    data["devices"] = ["cpu:0", "cpu:1"]
    for stage, device in zip(data["stages"], data["devices"]):
        stage["device"] = device
    plan = Plan.from_dict(data)
    with pytest.raises(PlanMismatchError, match=r"devices=None but the plan lists only replica "
                                                r"0's stage devices \['cpu:0', 'cpu:1'\].*"
                                                "pass devices= with all 4"):
        partition(model, None, plan=plan)
    with pytest.raises(PlanMismatchError, match=r"starts replica 0's stages on \['cpu', 'cpu'\] "
                                                r"but the plan runs them on \['cpu:0', "
                                                r"'cpu:1'\]"):
        partition(model, ["cpu"] * 4, plan=plan)
    with partition(model, ["cpu:0", "cpu:1", "cpu", "cpu"], plan=plan) as pm:
        assert pm.devices == [torch.device("cpu", 0), torch.device("cpu")]


def test_an_edited_shard_spec_is_refused_naming_it(tmp_path: Path) -> None:
    model, x = _model(), torch.randn(6, 8)
    path = _tp_plan(model, x, tmp_path)
    data = json.loads(path.read_text())
    data["shard_specs"]["2.weight"] = {"dim": 0, "kind": "colwise"}
    with pytest.raises(PlanMismatchError, match=r"shard_specs\['2.weight'\] is "
                                                r"ShardSpec\(dim=1, kind='rowwise'\) here, "
                                                r"ShardSpec\(dim=0, kind='colwise'\) in the "
                                                r"plan; re-plan the model"):
        partition(model, None, plan=data)


def test_unmerged_layer_names_are_refused(tmp_path: Path) -> None:
    """A tensor-parallel stage must list merged layers: '0' holds layers 0..2 (a pair)."""
    model, x = _model(), torch.randn(6, 8)
    data = json.loads(_tp_plan(model, x, tmp_path).read_text())
    data["stages"][0]["layers"] = ["0", "1", "2", "3"]
    with pytest.raises(PlanMismatchError, match=r"tensor-parallel plan \(tp=2, balance \[4, 1\]\)"
                                                r" does not fit this model: .*re-plan"):
        partition(model, None, plan=data, example_inputs=(x,))
    data["stages"][0]["layers"] = ["3", "0"]
    with pytest.raises(PlanMismatchError, match=r"stage 0 holds layers \['0', '3'\] here, "
                                                r"\['3', '0'\] in the plan"):
        partition(model, None, plan=data, example_inputs=(x,))


def test_a_degree_the_model_does_not_divide_by_is_refused(tmp_path: Path) -> None:
    model, x = _model(), torch.randn(6, 8)
    data = json.loads(_tp_plan(model, x, tmp_path).read_text())
    data["mesh"]["tp"] = 3
    with pytest.raises(PlanMismatchError, match="tp=3.*does not fit this model"):
        partition(model, ["cpu"] * 6, plan=data)


def test_a_tensor_parallel_plan_of_another_model_is_refused(tmp_path: Path) -> None:
    path = _tp_plan(_model(), torch.randn(6, 8), tmp_path)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(PlanMismatchError, match="made for another model"):
        partition(other, None, plan=path)


def test_an_old_tensor_parallel_plan_without_a_signature_asks_for_inputs(
        tmp_path: Path) -> None:
    model, x = _model(), torch.randn(6, 8)
    data = json.loads(_tp_plan(model, x, tmp_path).read_text())
    del data["planner"]["signature"]
    with pytest.raises(ExampleInputsError, match=r"split over tp=2 ranks.*pass "
                                                 r"example_inputs=\(x,\)"):
        partition(model, None, plan=data)
    with partition(model, None, plan=data, example_inputs=(x,)) as tm:
        torch.testing.assert_close(tm(x), model(x), atol=1e-5, rtol=1e-4)


def test_a_spec_with_a_mesh_is_not_run_as_a_pipeline() -> None:
    """Regression: a spec's mesh was only recorded, and partition ran a pipeline silently."""
    model = _model()
    spec = {"devices": ["cpu", "cpu"], "balance": [4, 3], "mesh": {"tp": 2}}
    assert make_plan(model, None, plan=spec).mesh.tp == 2  # type: ignore[union-attr]
    with pytest.raises(SpecError, match="mesh dp=1, tp=2.*drop 'mesh'"):
        partition(model, None, plan=spec)


def test_a_fresh_tensor_parallel_choice_of_auto_round_trips(tmp_path: Path) -> None:
    """The wide MLP on four CPUs: auto picks tp=4 (test_one_process_auto.py); its saved plan
    applies again without inputs, to a tensor-parallel module computing the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 8192), nn.ReLU(), nn.Linear(8192, 2048))
    x = torch.randn(8, 2048)
    with partition(model, ["cpu"] * 4, example_inputs=(x,)) as first:
        assert isinstance(first, TensorParallelModule) and first.plan.strategy != "pipeline"
        first.plan.save(tmp_path / "auto.json")
    with partition(model, None, plan=tmp_path / "auto.json") as again:
        assert isinstance(again, TensorParallelModule) and again.plan == first.plan
        with torch.no_grad():
            torch.testing.assert_close(again(x), model(x), atol=1e-5, rtol=1e-4)


def test_a_spec_that_auto_plans_as_replicas_runs_as_replicas() -> None:
    """Regression: a spec compiled to auto's replicas choice kept dp=1 in its mesh, and
    partition ran one replica's pipeline on the first device alone."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), torch.randn(6, 8)
    with pinned_cpu_spec(_FREE_REPLICAS):
        direct = make_plan(model, ["cpu"] * 2, example_inputs=(x,))
        assert direct.mesh is not None and direct.mesh.dp == 2
        spec = {"devices": ["cpu", "cpu"]}
        assert make_plan(model, None, plan=spec, example_inputs=(x,)).mesh == direct.mesh
        pm = partition(model, None, plan=spec, example_inputs=(x,))
    with pm:
        assert isinstance(pm, ReplicatedModule) and pm.dp == 2
        _transparent(pm, model, x)
