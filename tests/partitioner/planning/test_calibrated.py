"""Tests of partitioner/planning/calibrated.py: when the workload is timed before planning,
and what the timings change."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import partitioner.planning.calibrated as calibrated_module
from partitioner import partition
from partitioner.analysis import analyze
from partitioner.cost.cost import Workload
from partitioner.cost.machine import local_cluster
from partitioner.errors import CostModelError, StrategyError
from partitioner.planning.calibrated import calibrated, should_calibrate
from partitioner.planning.predict import Config, predict
from partitioner.request import PlanRequest


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)), torch.randn(8, 16)


def _setting(calibrate: bool | None, devices: list[str] | None = None):  # type: ignore[no-untyped-def]
    model, x = _model()
    analysis = analyze(model, (x,))
    devices = devices or ["cpu", "cpu"]
    request = PlanRequest.make(devices, "auto", example_inputs=(x,), calibrate=calibrate,
                               local=True)
    assert analysis.workload is not None
    return analysis, request, local_cluster(devices), analysis.workload


def test_the_default_times_only_with_this_machine_s_measured_spec(
        monkeypatch: pytest.MonkeyPatch) -> None:
    analysis, request, cluster, workload = _setting(None)
    # The tests plan with PARTITIONER_CPU_SPEC=reference: a request for fixed plans.
    assert not should_calibrate(analysis, request, cluster, workload)
    monkeypatch.setattr(calibrated_module, "measured_cpu_spec", lambda: True)
    assert should_calibrate(analysis, request, cluster, workload)
    # A step predicted over the budget is not timed by default, but is when asked for.
    monkeypatch.setattr(calibrated_module, "BUDGET", 0.0)
    assert not should_calibrate(analysis, request, cluster, workload)
    asked = replace(request, calibrate=True)
    assert should_calibrate(analysis, asked, cluster, workload)
    assert not should_calibrate(analysis, replace(request, calibrate=False), cluster, workload)


def test_the_default_leaves_meta_models_and_frozen_ones_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrated_module, "measured_cpu_spec", lambda: True)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.empty(2, 4, device="meta")
    analysis = analyze(meta, (x,))
    request = PlanRequest.make(["cpu", "cpu"], "auto", example_inputs=(x,), calibrate=None)
    assert analysis.workload is not None
    assert not should_calibrate(analysis, request, local_cluster(["cpu", "cpu"]),
                                analysis.workload)
    frozen, y = _model()
    frozen.requires_grad_(False)
    analysis = analyze(frozen, (y,))
    assert analysis.workload is not None
    assert not should_calibrate(analysis, request, local_cluster(["cpu", "cpu"]),
                                analysis.workload)


def test_the_optimizer_scale_is_measured_over_predicted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    analysis, request, cluster, workload = _setting(True)

    def timed(gm, layers, costs, inputs, spec, batch, **kw):  # type: ignore[no-untyped-def]
        assert kw["optimizer"] is True
        return [replace(c, time_scale=3.0) for c in costs], 0.25

    monkeypatch.setattr(calibrated_module, "calibrate", timed)
    scaled = calibrated(analysis, request, cluster, workload)
    assert all(layer.time_scale == 3.0 for layer in scaled.layers)
    one = local_cluster(["cpu"])
    plain = predict(replace(scaled, optimizer_scale=1.0), one, Config()).optimizer_times[0]
    assert scaled.optimizer_scale == pytest.approx(0.25 / plain)
    # The prediction charges the measured step.
    assert predict(scaled, one, Config()).optimizer_times[0] == pytest.approx(0.25)


def test_uncalibrated_workloads_are_returned_as_they_are() -> None:
    analysis, request, cluster, workload = _setting(False)
    assert calibrated(analysis, request, cluster, workload) is workload


def test_a_calibrated_partition_times_the_model_and_stays_transparent(
        capsys: pytest.CaptureFixture[str]) -> None:
    model, x = _model()
    pm = partition(model, ["cpu", "cpu"], example_inputs=(x,), calibrate=True)
    try:
        err = capsys.readouterr().err
        assert "timed 5 layers in training passes of the whole model (4 distinct, " in err
        torch.testing.assert_close(pm(x), model(x))
        assert pm.plan.predicted_step_time is not None and pm.plan.predicted_step_time > 0
    finally:
        pm.close()


def test_bad_values_are_refused() -> None:
    _, x = _model()
    with pytest.raises(StrategyError, match="calibrate='yes'.*True, False or None"):
        PlanRequest.make(["cpu"], "auto", example_inputs=(x,), calibrate="yes")  # type: ignore[arg-type]
    workload = _setting(False)[3]
    with pytest.raises(CostModelError, match="optimizer_scale=0"):
        Workload(workload.layers, workload.boundaries, workload.batch, optimizer_scale=0)


def test_partition_distributed_refuses_bad_calibrate_values_before_any_collective() -> None:
    from partitioner.distributed import partition_distributed
    model, x = _model()
    with pytest.raises(StrategyError, match="calibrate='yes'.*True, False or None"):
        partition_distributed(model, (x,), strategy="auto", calibrate="yes")  # type: ignore[arg-type]
    with pytest.raises(StrategyError, match="calibrate=True times the model for the search"):
        partition_distributed(model, (x,), pp=2, calibrate=True)
