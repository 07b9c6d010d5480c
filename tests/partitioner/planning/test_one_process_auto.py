"""Tests of issue #13's planning side in one process: the search over everything that runs
here (partitioner/planning/auto.py, planner.py), schedule=/virtual_stages=/memory_reserve=
(partitioner/request.py, api.py), Plan.virtual_stages (partitioner/plans/plan.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import make_plan, partition
from partitioner.analysis import analyze
from partitioner.api import build, route
from partitioner.cost.devices import Cluster
from partitioner.cost.machine import local_cluster
from partitioner.errors import (
    MemoryLimitError,
    PartitionError,
    ScheduleError,
    StageCountError,
)
from partitioner.planning.auto import LOCAL_RUNTIME, configurations, executable
from partitioner.planning.planner import plan_from, shardable_degrees
from partitioner.planning.predict import predict
from partitioner.plans.explain import format_bytes
from partitioner.plans.plan import Plan, PlanFormatError, Stage
from partitioner.request import PlanRequest
from partitioner.runtime.tensor_parallel.module import TensorParallelModule


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 8192), nn.ReLU(), nn.Linear(8192, 2048))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_the_wide_mlp_on_four_cpus_picks_tensor_parallelism_and_trains_alike() -> None:
    model, x = _mlp(), torch.randn(8, 2048)
    pm = partition(model, ["cpu"] * 4, example_inputs=(x,))
    assert isinstance(pm, TensorParallelModule)
    assert pm.plan.mesh is not None and pm.plan.mesh.tp == 4
    assert pm.plan.strategy == "tensor_parallel" and pm.plan.shard_specs
    assert "chosen: dp=1 tp=4" in pm.plan.explain()
    out = pm(x)
    out.square().mean().backward()
    got = {k: pm.full_tensor(k, grad=True) for k in model.state_dict()}
    expected = model(x)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    for key, grad in _grads(model).items():
        torch.testing.assert_close(got[key], grad, atol=1e-5, rtol=1e-4)
    pm.close()


def test_make_plan_here_returns_the_plan_partition_runs() -> None:
    plan = make_plan(_mlp(), ["cpu"] * 4, example_inputs=(torch.randn(8, 2048),))
    assert plan.mesh is not None and plan.mesh.tp == 4 and plan.shard_specs


def test_a_degree_the_layers_do_not_divide_by_is_not_chosen() -> None:
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    analysis = analyze(model, (torch.randn(4, 8),))
    assert shardable_degrees(analysis, model, 4) == (2,)


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_executable_configuration_builds_and_matches_the_model(n: int) -> None:
    model, x = _small(), torch.randn(8, 16)
    analysis = analyze(model, (x,))
    assert analysis.workload is not None
    cluster = local_cluster(["cpu"] * n)
    degrees = shardable_degrees(analysis, model, n)
    configs = [c for c in configurations(analysis.workload, cluster, tp_degrees=degrees)
               if executable(c, cluster) is None]
    assert any(c.tp > 1 for c in configs) and any(c.tp == 1 for c in configs)
    expected = model(x)
    expected.sum().backward()
    reference = _grads(model)
    assert any(c.dp > 1 for c in configs)
    for c in configs:
        model.zero_grad()
        if c.dp > 1:  # what auto builds for it: the planner's plan, routed
            request = PlanRequest.make(["cpu"] * n, "auto", example_inputs=(x,))
            plan = plan_from(predict(analysis.workload, cluster, c), analysis.layer_names,
                             cluster, strategy="replicas")
            pm = build(model, analysis, route(model, analysis, plan, request), request)
        else:
            tp = {"tensor_parallel": c.tp} if c.tp > 1 else {}
            pm = partition(model, ["cpu"] * (c.tp * c.pp),
                           "pipeline" if c.tp == 1 else "auto", example_inputs=(x,),
                           chunks=c.chunks, checkpoint=c.checkpoint, schedule=c.schedule,
                           **tp)
        assert (pm.plan.mesh.dp, pm.plan.mesh.tp) == (c.dp, c.tp), c.label
        out = pm(x)
        out.sum().backward()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4, msg=c.label)
        holder = pm.replicas[0] if c.dp > 1 else pm
        for key, grad in reference.items():
            got = holder.full_tensor(key, grad=True) if c.tp > 1 else dict(
                model.named_parameters())[key].grad
            torch.testing.assert_close(got, grad, atol=1e-5, rtol=1e-4, msg=c.label)
        pm.close()


def test_the_memory_reserve_bounds_every_stage() -> None:
    model, x = _small(), torch.randn(8, 16)
    whole = make_plan(model, ["cpu"], "pipeline", example_inputs=(x,), memory_reserve=0.0)
    need = int(whole.stages[0].predicted_memory or 0)
    limit = need * 1.5  # fits with no reserve, not with half of it held back
    make_plan(model, ["cpu"], "pipeline", example_inputs=(x,), memory_limit=limit,
              memory_reserve=0.0)
    with pytest.raises(MemoryLimitError):
        make_plan(model, ["cpu"], "pipeline", example_inputs=(x,), memory_limit=limit,
                  memory_reserve=0.5)
    plan = make_plan(model, ["cpu"] * 2, example_inputs=(x,), memory_limit=limit,
                     memory_reserve=0.25)
    assert all((s.predicted_memory or 0) <= 0.75 * limit for s in plan.stages)
    assert plan.planner is not None and plan.planner.memory_reserve == 0.25
    assert "memory_reserve=0.25" in plan.explain()
    assert any("memory reserve 25%" in note for note in plan.notes)


def test_cluster_presets_keep_the_reserve() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
    cluster = Cluster.preset("A100-80GB")
    plan = make_plan(model, cluster, example_inputs=(torch.empty(64, 4096, device="meta"),))
    usable = 0.9 * cluster.device.memory_bytes
    assert all((s.predicted_memory or 0) <= usable for s in plan.stages)
    assert plan.candidates[0]["capacity"] == pytest.approx(usable)


def test_explain_prints_binary_units() -> None:
    assert format_bytes(12.5 * 2**30) == "12.5 GiB"
    assert format_bytes(3 * 2**20) == "3 MiB"
    plan = make_plan(_small(), ["cpu"] * 2, "pipeline", example_inputs=(torch.randn(8, 16),))
    assert "iB" in plan.explain() and " GB" not in plan.explain()


@pytest.mark.parametrize("reserve", [1.0, -0.1, 1.5, "0.1", True])
def test_a_bad_memory_reserve_is_refused(reserve: object) -> None:
    with pytest.raises(MemoryLimitError, match=r"memory_reserve=.* outside \[0, 1\).*pass"):
        make_plan(_small(), ["cpu"] * 2, example_inputs=(torch.randn(8, 16),),
                  memory_reserve=reserve)  # type: ignore[arg-type]


def test_an_unknown_schedule_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ScheduleError, match="schedule='pipedream'.*'gpipe'") as info:
        partition(_small(), ["cpu"] * 2, example_inputs=(torch.randn(8, 16),),
                  schedule="pipedream")
    assert isinstance(info.value, (PartitionError, ValueError))


def test_virtual_stages_need_a_schedule_with_chunks() -> None:
    with pytest.raises(ScheduleError, match="virtual_stages=2 needs.*schedule="):
        make_plan(_small(), ["cpu"] * 2, example_inputs=(torch.randn(8, 16),),
                  virtual_stages=2)
    with pytest.raises(ScheduleError, match="virtual_stages=0"):
        make_plan(_small(), ["cpu"] * 2, example_inputs=(torch.randn(8, 16),),
                  schedule="interleaved", virtual_stages=0)


def test_too_many_virtual_stages_for_the_layers_are_refused() -> None:
    with pytest.raises(StageCountError, match="virtual_stages=4 on 2 devices makes 8 "
                                              "virtual stages.*7 layers; pass virtual_stages "
                                              "<= 3"):
        make_plan(_small(), ["cpu"] * 2, "pipeline", example_inputs=(torch.randn(8, 16),),
                  schedule="interleaved", virtual_stages=4)


def test_pipeline_with_interleaved_plans_virtual_stages() -> None:
    plan = make_plan(_small(), ["cpu"] * 2, "pipeline", example_inputs=(torch.randn(8, 16),),
                     schedule="interleaved", virtual_stages=3, chunks=2)
    assert (plan.schedule, plan.virtual_stages, len(plan.stages)) == ("interleaved", 3, 6)
    assert [s.device for s in plan.stages] == ["cpu"] * 6 and plan.devices == ("cpu", "cpu")
    assert plan.mesh is not None and plan.mesh.pp == 2
    assert Plan.from_dict(plan.to_dict()) == plan
    default = make_plan(_small(), ["cpu"] * 2, "pipeline", example_inputs=(torch.randn(8, 16),),
                        schedule="interleaved")
    assert default.virtual_stages == 3 and default.chunks == 2  # most of 4,3,2; m = P


def test_pipeline_with_a_schedule_plans_it() -> None:
    plan = make_plan(_small(), ["cpu"] * 2, "pipeline", example_inputs=(torch.randn(8, 16),),
                     schedule="1f1b", chunks=4)
    assert plan.schedule == "1f1b" and plan.candidates[0]["config"]["schedule"] == "1f1b"


def test_auto_with_a_schedule_searches_only_it() -> None:
    x = torch.randn(8, 16)
    for name in LOCAL_RUNTIME.schedules:
        plan = make_plan(_small(), ["cpu"] * 2, example_inputs=(x,), schedule=name)
        assert {r["config"]["schedule"] for r in plan.candidates} == {name}
    with pytest.raises(ScheduleError, match="schedule='zb' is not a registered schedule"):
        partition(_small(), ["cpu"] * 2, example_inputs=(x,), schedule="zb")


def test_auto_with_tensor_parallel_keeps_the_degree_and_searches_the_rest() -> None:
    model, x = _small(), torch.randn(8, 16)
    pm = partition(model, ["cpu"] * 4, example_inputs=(x,), tensor_parallel=2)
    assert pm.plan.mesh is not None and (pm.plan.mesh.tp, pm.plan.mesh.pp) == (2, 2)
    assert pm.plan.planner is not None and pm.plan.planner.strategy == "auto"
    assert len(pm.plan.candidates) > 1  # chunks and checkpoint were searched
    assert all(r["config"]["tp"] == 2 for r in pm.plan.candidates)
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-4)
    pm.close()


def test_virtual_stage_plans_load_and_older_plans_default_to_one() -> None:
    stages = tuple(Stage(k, "cpu", (str(k),)) for k in range(4))
    plan = Plan("pipeline", ("cpu", "cpu"), stages, chunks=2, schedule="interleaved",
                virtual_stages=2)
    data = plan.to_dict()
    assert data["virtual_stages"] == 2 and Plan.from_dict(data) == plan
    old = Plan("pipeline", ("cpu", "cpu"), stages[:2]).to_dict()
    del old["virtual_stages"]
    assert Plan.from_dict(old).virtual_stages == 1
    with pytest.raises(PlanFormatError, match=r"stages\[1\].device is 'cpu:1' but "
                                              r"devices\[1\] is 'cpu'"):
        Plan("p", ("cpu", "cpu"), (stages[0], Stage(1, "cpu:1", ("1",)), *stages[2:]),
             virtual_stages=2)
    with pytest.raises(PlanFormatError, match="3 stages but 2 devices x virtual_stages=2"):
        Plan("p", ("cpu", "cpu"), stages[:3], virtual_stages=2)


def test_a_small_head_split_by_tensor_parallelism_plans() -> None:
    """Regression: a 32 -> 4 head's split activations exceeded what it keeps, its memory
    came out negative at tp=2 and auto crashed with a ProblemError."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    plan = make_plan(model, ["cpu"] * 2, example_inputs=(torch.randn(256, 32),))
    assert plan.mesh is not None and plan.mesh.dp * plan.mesh.pp * plan.mesh.tp == 2


def test_tensor_parallel_ranks_on_one_gpu_are_not_executable() -> None:
    """auto must not offer what the runtime refuses: two tensor-parallel ranks on one GPU
    (replicas and pipelines there run)."""
    from partitioner.cost.devices import DEVICES, LINKS
    from partitioner.planning.auto import Config

    shared = Cluster(DEVICES["H200"], 1, 4, LINKS["pcie4"], None, 1,
                     ("cuda:0", "cuda:0", "cuda:1", "cuda:1"))
    assert "ranks share cuda:0" in str(executable(Config(tp=2, pp=2), shared))
    assert executable(Config(dp=2, pp=2), shared) is None
    assert executable(Config(tp=2, pp=2), Cluster.local_devices(
        ["cpu"] * 4, [DEVICES["H200"]] * 4)) is None
    apart = Cluster(DEVICES["H200"], 1, 4, LINKS["pcie4"], None, 1,
                    ("cuda:0", "cuda:1", "cuda:0", "cuda:1"))
    assert executable(Config(tp=2, pp=2), apart) is None
