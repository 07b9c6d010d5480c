"""One predictor (issue #18): a plan's header, notes, ``explain()``, ``partitioner simulate``
and its predicted timeline show the same step time, the one
``partitioner.planning.simulate.predict_step`` recorded, for every kind of plan."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from models import gpt2, mlp
from torch import nn

import partitioner.api as api
from partitioner import Cluster, Mesh, make_plan, partition
from partitioner.cli import main
from partitioner.cli.models import load_model
from partitioner.planning.records import from_record
from partitioner.planning.simulate import predict_step, simulate
from partitioner.plans.explain import format_seconds
from partitioner.plans.plan import Plan
from partitioner.viz.timeline import Timeline, format_span, predicted_timeline


def _deep_mlp() -> nn.Sequential:
    return mlp((16, 64, 64, 64, 64, 64, 64, 64, 8))


def _pipeline(schedule: str) -> Callable[[], Plan]:
    def plan() -> Plan:
        return make_plan(_deep_mlp(), ["cpu"] * 2, "pipeline", example_inputs=(
            torch.randn(16, 16),), chunks=4, schedule=schedule)
    return plan


def _replicas() -> Plan:
    return make_plan(_deep_mlp(), ["cpu"] * 2, example_inputs=(torch.randn(16, 16),),
                     mesh=Mesh(dp=2, pp=1, tp=1))


def _tensor_parallel_auto() -> Plan:
    model, example = load_model("mlp")  # auto's search, its mesh fixed to dp=2 x tp=2
    return make_plan(model, ["cpu"] * 4, example_inputs=example, mesh=Mesh(dp=2, pp=1, tp=2))


def _tensor_parallel_pipeline() -> Plan:
    return make_plan(gpt2(), ["cpu"] * 4, example_inputs=(torch.randint(0, 64, (4, 16)),),
                     mesh=Mesh(dp=1, pp=2, tp=2))


def _tuned_overruled() -> Plan:
    """Tuning measures the ranking's pick slowest: the second-ranked candidate runs (its
    record first, the one every display reads)."""
    model, x = _deep_mlp(), torch.randn(16, 16)
    timed: list[object] = []

    def clock(module: nn.Module, *args: object, **kwargs: object) -> float:
        plan = getattr(module, "plan", None)
        if plan is None:
            return 1.0  # the model alone on one device
        key = (plan.mesh, plan.chunks, plan.schedule, plan.checkpoint)
        timed.append(key)
        return 2.0 if key == timed[0] else 1.0

    real = api.time_training_steps
    api.time_training_steps = clock
    try:
        plan = partition(model, ["cpu"] * 2, example_inputs=(x,), tune=2).plan
    finally:
        api.time_training_steps = real
    assert plan.candidates[0]["rank"] > 1, plan.explain()
    return plan


def _cluster() -> Plan:
    return make_plan(_deep_mlp(), Cluster.preset("A100-80GB"),
                     example_inputs=(torch.randn(64, 16),))


PLANS: dict[str, Callable[[], Plan]] = {
    "1f1b": _pipeline("1f1b"), "gpipe": _pipeline("gpipe"),
    "interleaved": _pipeline("interleaved"), "zero_bubble": _pipeline("zero_bubble"),
    "replicas": _replicas, "tensor_parallel_auto": _tensor_parallel_auto,
    "tensor_parallel_pipeline": _tensor_parallel_pipeline, "cluster": _cluster,
    "tuned_overruled": _tuned_overruled,
}


@pytest.fixture(scope="module", params=sorted(PLANS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[str, Path]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stages sharing the host's memory
        plan = PLANS[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "plan.json"
    plan.save(path)
    return request.param, path


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_plans_are_of_each_kind(saved: tuple[str, Path]) -> None:
    kind, path = saved
    plan = Plan.load(path)
    mesh = plan.mesh or Mesh()
    expected = {"replicas": lambda: mesh.dp == 2, "cluster": lambda: not plan.devices[0]
                .startswith("cpu"), "tensor_parallel_auto": lambda: mesh.tp > 1,
                "tensor_parallel_pipeline": lambda: (mesh.tp, mesh.pp) == (2, 2),
                "tuned_overruled": lambda: plan.candidates[0]["rank"] > 1}
    assert expected.get(kind, lambda: plan.schedule == kind)(), (kind, plan.table())


def test_every_display_shows_the_same_step_time(saved: tuple[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    kind, path = saved
    plan = Plan.load(path)
    step = plan.predicted_step_time
    assert step is not None and step > 0
    shown = _printed(capsys, "show", str(path))
    header = shown.splitlines()[0]
    assert f"predicted step {step * 1e3:.2f} ms" in header, header
    notes = re.findall(r"predicted (\S+ m?s) per step", shown.split("\nnote:", 1)[-1])
    assert all(note == format_seconds(step) for note in notes), (kind, shown)
    chosen = re.search(r"chosen: .*?, predicted (\S+ m?s) per step", plan.explain())
    assert chosen and chosen.group(1) == format_seconds(step), plan.explain()
    simulated = _printed(capsys, "simulate", str(path))
    assert f"  step {step * 1e3:.2f} ms, bubble {plan.predicted_bubble:.0%}" in simulated
    drawn = tmp_path / "t.svg"
    _printed(capsys, "viz", str(path), "--timeline", str(drawn))
    assert f", {format_span(step, 's')}; bubble" in drawn.read_text()


def test_the_numbers_are_the_one_predictors(saved: tuple[str, Path]) -> None:
    _, path = saved
    plan = Plan.load(path)
    record = plan.candidates[0]
    prediction, cluster = from_record(record)
    assert cluster is not None
    result = simulate(plan)
    assert plan.predicted_step_time == record["step_time"] == result.step_time
    assert predict_step(prediction, cluster).step_time == result.step_time
    assert plan.predicted_bubble == record["bubble"] == result.bubble
    for timeline in (predicted_timeline(plan), Timeline.of(result)):
        assert timeline.makespan == pytest.approx(result.step_time, rel=1e-12)
        assert timeline.bubble == pytest.approx(result.bubble, abs=1e-9)


def test_the_ranking_shown_is_the_step_times_shown(saved: tuple[str, Path]) -> None:
    _, path = saved
    records = sorted(Plan.load(path).candidates, key=lambda r: r.get("rank", 0))
    times = [r["step_time"] for r in records]
    assert times == sorted(times)
    # The best-ranked runs, unless tuning measured another faster.
    tuned = any("measured_step_time" in r for r in records)
    assert records[0].get("chosen", True) != tuned


def test_the_timeline_ends_after_the_optimizer() -> None:
    plan = _replicas()
    result = simulate(plan)
    timeline = predicted_timeline(plan)
    last_backward = max(b.end for b in timeline.bars if b.phase in "BW")
    assert result.pipeline_time == pytest.approx(last_backward)
    assert {b.phase for b in timeline.bars if b.end > last_backward} <= {"R", "O"}
    assert timeline.makespan == result.step_time > result.pipeline_time
