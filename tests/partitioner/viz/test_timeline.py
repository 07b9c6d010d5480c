from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import mlp

from partitioner import make_plan, partition
from partitioner.plans.plan import Plan, Stage
from partitioner.runtime.schedule import Action, bubble_fraction
from partitioner.runtime.schedule_generators import gpipe
from partitioner.viz import (
    Timeline,
    measured_timeline,
    predicted_timeline,
    timeline_dot,
    visualize_timeline,
)


def _plan(times: list[float | None], chunks: int) -> Plan:
    stages = tuple(Stage(j, "cpu", (f"l{j}",), predicted_time=t) for j, t in enumerate(times))
    return Plan("balance", ("cpu",) * len(times), stages, chunks=chunks)


def test_predicted_timeline_without_costs_is_the_clock_tick_model() -> None:
    t = predicted_timeline(_plan([None, None, None], 4))
    assert t.unit == "tick" and t.source == "predicted"
    assert t.makespan == 18.0  # F + B = 3 ticks, (m + P - 1) x 3
    assert t.bubble == pytest.approx(bubble_fraction(gpipe(3, 4)))
    assert len(t.bars) == 2 * 3 * 4


def test_predicted_timeline_uses_each_stages_time() -> None:
    t = predicted_timeline(_plan([0.003, 0.006], 2))
    assert t.unit == "s"
    first = {(b.stage, b.phase, b.microbatch): (b.start, b.end) for b in t.bars}
    assert first[(0, "F", 0)] == pytest.approx((0.0, 0.001))
    assert first[(1, "F", 0)] == pytest.approx((0.001, 0.003))
    assert first[(1, "B", 1)][1] - first[(1, "B", 1)][0] == pytest.approx(0.004)
    # the slow stage is the bottleneck: its backwards run back to back
    assert first[(1, "B", 0)][0] == pytest.approx(first[(1, "B", 1)][1])


def test_any_action_like_timeline_is_accepted() -> None:
    events = [(SimpleNamespace(stage=0, phase="forward", microbatch=0), 1.0, 2.0),
              SimpleNamespace(action=SimpleNamespace(stage=1, phase="B", microbatch=0),
                              start=2.0, end=4.0)]
    t = Timeline.of(events)
    assert [(b.stage, b.phase, b.start, b.end) for b in t.bars] == [(0, "F", 0.0, 1.0),
                                                                   (1, "B", 1.0, 3.0)]
    assert t.bubble == pytest.approx(1 - 3 / 6)
    with pytest.raises(ValueError, match="empty"):
        Timeline.of([])
    with pytest.raises(ValueError, match="not \\(action, start, end\\)"):
        Timeline.of([(object(), 0, 1)])


def test_measured_timeline_of_a_run() -> None:
    x = torch.randn(8, 12)
    pm = partition(mlp(), ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=4)
    with pytest.raises(ValueError, match="has not run yet"):
        measured_timeline(pm)
    pm(x).sum().backward()
    t = measured_timeline(pm)
    assert sorted(str(Action(b.stage, *_phase(b.phase), b.microbatch)) for b in t.bars) == \
        sorted(str(a) for stage in gpipe(2, 4) for a in stage)
    assert 0 < t.bubble < 1
    pm.close()


def _phase(letter: str) -> tuple:
    from partitioner.runtime.schedule import Phase
    return (Phase(letter),)


def test_timeline_dot_draws_rows_bars_and_the_bubble() -> None:
    plan = _plan([None, None], 2)
    text = timeline_dot(predicted_timeline(plan), plan)
    assert text.count("[pos=") >= 2 + 2 + 8
    assert 'label="F0"' in text and 'label="B1"' in text and "bubble (grey)" in text
    assert 'label="device 1: cpu (stage 1)"' in text


@pytest.mark.skipif(shutil.which("neato") is None, reason="Graphviz is not installed")
def test_timeline_images(tmp_path: Path) -> None:
    plan = make_plan(mlp(), ["cpu"] * 3, example_inputs=(torch.randn(8, 12),), chunks=4)
    svg = visualize_timeline(plan, tmp_path / "t.svg").read_text()
    assert "<svg" in svg and ">F3<" in svg
    assert visualize_timeline(plan, tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
