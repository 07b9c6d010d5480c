"""Timelines with a row per device, for every plan kind auto can return: pipelines,
tensor parallel, replicas, replicas of pipelines, tp x pp; measured and predicted."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from partitioner import make_plan, partition
from partitioner.cli.zoo import gpt
from partitioner.plans.plan import Mesh, Plan
from partitioner.viz import measured_timeline, predicted_timeline, timeline_dot
from partitioner.viz.mesh import device_rows
from partitioner.viz.timeline import row_name

MESHES = [Mesh(pp=2), Mesh(tp=2), Mesh(dp=2), Mesh(dp=2, pp=2), Mesh(pp=2, tp=2),
          Mesh(dp=2, tp=2)]


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return gpt(n_layer=2, n_embd=16, n_head=2, vocab=32, seq=8), torch.zeros(8, 8,
                                                                             dtype=torch.long)


def _rows(text: str) -> set[str]:
    return set(re.findall(r'label="(device \d+: [^"]*)"', text))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_measured_timeline_has_a_row_per_device(mesh: Mesh) -> None:
    model, x = _model()
    devices = ["cpu"] * (mesh.dp * mesh.pp * mesh.tp)
    pm = partition(model, devices, example_inputs=(x,), chunks=2, mesh=mesh)
    try:
        for _ in range(2):
            pm(x).float().mean().backward()
        t = measured_timeline(pm)
    finally:
        pm.close()
    assert t.source == "measured" and t.stages == list(range(len(devices)))
    # every device computed a forward and a backward
    assert all({"F", "B"} <= {b.phase for b in t.bars if b.stage == d}
               for d in range(len(devices)))
    assert len(_rows(timeline_dot(t, pm.plan))) == len(devices)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_predicted_timeline_has_a_row_per_device(mesh: Mesh) -> None:
    model, x = _model()
    plan = make_plan(model, ["cpu"] * (mesh.dp * mesh.pp * mesh.tp), example_inputs=(x,),
                     chunks=2, mesh=mesh)
    t = predicted_timeline(plan)
    rows = device_rows(plan)
    assert t.stages == [r.index for r in rows]
    assert [row_name(t, r.index) for r in rows] == [r.name for r in rows]
    # replicas and ranks repeat their pipeline position's prediction
    same = [r for r in rows if r.stage == 0]
    bars = [[(b.phase, b.start) for b in t.bars if b.stage == r.index] for r in same]
    assert all(b == bars[0] for b in bars)


def test_dp2_pp2_timeline_has_four_named_rows() -> None:
    model, x = _model()
    plan = make_plan(model, ["cpu"] * 4, example_inputs=(x,), chunks=2,
                     mesh=Mesh(dp=2, pp=2))
    assert _rows(timeline_dot(predicted_timeline(plan), plan)) == {
        "device 0: cpu (replica 0, stage 0)", "device 1: cpu (replica 0, stage 1)",
        "device 2: cpu (replica 1, stage 0)", "device 3: cpu (replica 1, stage 1)"}


def test_interleaved_plan_without_costs_is_drawn_by_clock_ticks() -> None:
    # Regression: the clock-tick fallback built the schedule without the plan's virtual
    # stages ("interleaved needs virtual >= 2") for a plan auto itself chose.
    from partitioner.plans.plan import Stage

    stages = tuple(Stage(k, "cpu", (f"l{k}",)) for k in range(4))
    plan = Plan("auto", ("cpu", "cpu"), stages, chunks=2, schedule="interleaved",
                virtual_stages=2)
    t = predicted_timeline(dataclasses.replace(plan, candidates=()))
    assert t.unit == "tick" and t.stages == [0, 1]
    assert len(t.bars) == 2 * 4 * 2  # F and B of 4 virtual stages x 2 micro-batches
