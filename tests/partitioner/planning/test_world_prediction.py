"""A plan of sizes the caller gave, predicted as the world's processes run it.

``partition_distributed(model, x, dp=2, pp=2)`` cuts the model as one process's pipeline
would; ``predicted_as_run`` then costs that split on the world's ranks (replicas
all-reducing over the link, every rank stepping its own optimizer, the loss all-reduce and
the rank's cold start after a wait). Before, such a plan recorded one process's ``dp=1``
pipeline (its header said ``dp=1`` whatever ran). The multi-process end of this is in
``tests/partitioner/test_distributed_auto.py`` (its ``given`` cases).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import pytest
import torch
from torch import nn

from partitioner import make_plan
from partitioner.analysis import analyze
from partitioner.cost.devices import REFERENCE_CPU
from partitioner.planning.predict import Config, predict
from partitioner.planning.simulate import predict_step, simulate
from partitioner.planning.world import REFERENCE_LOOPBACK, world_cluster
from partitioner.planning.world_prediction import predicted_as_run
from partitioner.runtime.mesh import Mesh


@pytest.fixture(scope="module")
def case() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 128), nn.ReLU(),
                                                          nn.Linear(128, 64))])
    x = torch.randn(16, 64)
    plan = make_plan(model, ["cpu", "cpu"], example_inputs=(x,), chunks=2, checkpoint="never",
                     schedule="1f1b")
    world = world_cluster(["here"] * 4, "cpu", cpu=REFERENCE_CPU, link=REFERENCE_LOOPBACK)
    return plan, analyze(model, (x,)).workload, world


def test_the_mesh_that_runs_is_predicted_on_the_worlds_ranks(case: tuple) -> None:
    plan, workload, world = case
    given = replace(plan, mesh=Mesh(dp=2, pp=2, tp=1))
    ran = predicted_as_run(given, workload, world)
    (record,) = ran.candidates
    assert record["label"] == "dp=2 tp=1 pp=2 m=2 1f1b ckpt=never"
    assert record["chosen"] and record["cluster"]["processes"]
    # Its own split is kept: the stages the ranks run are the ones costed.
    assert record["boundaries"] == [0, *accumulate(len(s.layers) for s in plan.stages)]
    assert [s.layers for s in ran.stages] == [s.layers for s in plan.stages]
    # One predictor: header, record and simulation agree.
    assert ran.predicted_step_time == record["step_time"] == simulate(ran).step_time
    # What it is: two replicas of one replica's batch each, across processes.
    whole = replace(workload, batch=2 * workload.batch, splits=None)
    expected = predict_step(predict(whole, world, Config(dp=2, pp=2, chunks=2, schedule="1f1b"),
                                    record["boundaries"]), world)
    assert ran.predicted_step_time == pytest.approx(expected.step_time, rel=1e-12)
    # The one-process pipeline of one replica it recorded before is another figure.
    assert ran.predicted_step_time != pytest.approx(plan.predicted_step_time, rel=0.01)
    assert any(n.startswith("predicted as 4 ranks run it") for n in ran.notes)
    assert not any(n.startswith("chosen:") for n in ran.notes)


def test_stage_times_follow_the_worlds_costs(case: tuple) -> None:
    plan, workload, _ = case
    two = world_cluster(["here"] * 2, "cpu", cpu=REFERENCE_CPU, link=REFERENCE_LOOPBACK)
    ran = predicted_as_run(replace(plan, mesh=Mesh(dp=1, pp=2, tp=1)), workload, two)
    (record,) = ran.candidates
    for stage, profile in zip(ran.stages, record["stages"]):
        assert stage.predicted_time == pytest.approx(profile["forward"] + profile["backward"])


def test_sizes_the_cost_model_refuses_leave_no_figure_for_another_run(case: tuple) -> None:
    plan, workload, world = case
    odd = replace(plan, mesh=Mesh(dp=2, pp=2, tp=1), schedule="interleaved")  # v = 1
    ran = predicted_as_run(odd, workload, world)
    assert ran.predicted_step_time is None and ran.candidates == ()
    why = next(n for n in ran.notes if n.startswith("step not predicted for these ranks: "))
    assert "interleaved" in why, why


def test_explain_names_the_processes_and_the_link_they_were_costed_over(case: tuple) -> None:
    plan, workload, world = case
    text = predicted_as_run(replace(plan, mesh=Mesh(dp=2, pp=2, tp=1)), workload,
                            world).explain()
    assert f"ranks: 4 processes, costed over {world.intra_node.name}." in text.splitlines()
    why = text.splitlines()[-1]
    assert why.startswith("chosen: dp=2 tp=1 pp=2 ")
    assert "the ranks are processes sharing this host's cores" in why
    assert "worker keeps its share of the threads" not in why  # one process's wording
    assert "ranks:" not in plan.explain()  # the one-process plan it was cut from


def test_a_world_whose_cluster_cannot_be_told_keeps_its_plan_without_a_figure(
        case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes given run on any rank layout: where the world's cluster cannot be inferred
    (ranks not laid out node by node, say) the plan runs without a predicted step, and a
    note says why, instead of failing or keeping one process's figure."""
    import partitioner.planning.world_agreement as agreement
    from partitioner.errors import DeviceError

    def refuse(option: object, device: object) -> None:
        raise DeviceError("the ranks are not laid out node by node (hosts ['a', 'b', 'a'])")

    plan, workload, _ = case
    monkeypatch.setattr(agreement.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(agreement, "infer_cluster", refuse)
    ran = agreement.predicted_for_world(replace(plan, mesh=Mesh(dp=2, pp=2, tp=1)), workload,
                                        torch.device("cpu"), "fp32")
    assert ran.predicted_step_time is None and ran.candidates == ()
    assert ran.notes[-1] == ("step not predicted for these ranks: the ranks are not laid out "
                             "node by node (hosts ['a', 'b', 'a'])")
    assert [s.layers for s in ran.stages] == [s.layers for s in plan.stages]


def test_a_plan_whose_layers_are_not_the_captures_gets_no_figure(case: tuple) -> None:
    plan, workload, world = case
    fewer = replace(workload, layers=workload.layers[:-1], boundaries=workload.boundaries[:-1])
    ran = predicted_as_run(replace(plan, mesh=Mesh(dp=2, pp=2, tp=1)), fewer, world)
    assert ran.predicted_step_time is None and ran.candidates == ()
    assert ran.notes[-1].startswith("step not predicted for these ranks: the plan's "
                                    f"{len(workload.layers)} layers are not the capture's")
