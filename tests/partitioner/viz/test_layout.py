"""The layout that draws graphs without Graphviz: rows, stage frames, lanes for long arrows."""

from __future__ import annotations

import doctest
import itertools

import pytest
import torch
from models import LongSkip, ResidualCNN

import partitioner.viz.layout
from partitioner import partition
from partitioner.plans.plan import Plan, Stage
from partitioner.viz.graph import diagram
from partitioner.viz.layout import Layout, Placed, layout


def _overlap(a: Placed, b: Placed) -> bool:
    return (abs(a.x - b.x) < (a.width + b.width) / 2
            and abs(a.y - b.y) < (a.height + b.height) / 2)


def _check(placed: Layout) -> None:
    boxes = list(placed.boxes.values())
    assert not [(a.box.id, b.box.id) for a, b in itertools.combinations(boxes, 2)
                if _overlap(a, b)]
    for a, b in itertools.pairwise(placed.frames):
        assert a.y1 < b.y0, "stage frames overlap"
    for p in boxes:
        if p.box.stage is not None:
            f = next(f for f in placed.frames if f.stage == p.box.stage)
            assert f.x0 < p.x - p.width / 2 and p.x + p.width / 2 < f.x1
            assert f.y0 < p.y - p.height / 2 and p.y + p.height / 2 < f.y1
        assert 0 <= p.x - p.width / 2 and p.x + p.width / 2 <= placed.width
        assert 0 <= p.y - p.height / 2 and p.y + p.height / 2 <= placed.height
    for (u, v), points in placed.routes.items():
        # every arrow runs downwards, from the bottom of its source to the top of its target
        assert [y for _, y in points] == sorted(y for _, y in points), (u, v)
        assert points[0][1] == placed.boxes[u].y + placed.boxes[u].height / 2
        assert points[-1][1] == placed.boxes[v].y - placed.boxes[v].height / 2


@pytest.fixture(scope="module")
def skip_model() -> tuple[Plan, object]:
    pm = partition(LongSkip(), ["cpu"] * 3, example_inputs=(torch.randn(8, 8),), chunks=2)
    pm.close()
    return pm.plan, pm.analysis


def test_boxes_frames_and_arrows_do_not_collide(skip_model: tuple[Plan, object]) -> None:
    plan, analysis = skip_model
    for detail in ("nodes", "layers"):
        _check(layout(diagram(analysis, plan, detail)))


def test_a_long_arrow_gets_a_lane_clear_of_the_boxes(skip_model: tuple[Plan, object]) -> None:
    plan, analysis = skip_model
    placed = layout(diagram(analysis, plan, "nodes"))
    long = max(placed.routes.items(), key=lambda item: len(item[1]))
    (u, v), points = long
    assert len(points) > 4, "the skip from the first layer to the end spans many rows"
    for x, y in points[1:-1]:
        for p in placed.boxes.values():
            assert not (abs(p.x - x) < p.width / 2 and abs(p.y - y) < p.height / 2), (u, v, p)


def test_a_residual_cnn_is_laid_out_in_stage_order() -> None:
    x = torch.randn(6, 3, 8, 8)
    pm = partition(ResidualCNN(), ["cpu"] * 3, example_inputs=(x,), chunks=3)
    placed = layout(diagram(pm.analysis, pm.plan, "nodes"))
    pm.close()
    _check(placed)
    assert [f.stage for f in placed.frames] == [0, 1, 2]
    rows = {j: [p.row for p in placed.boxes.values() if p.box.stage == j] for j in range(3)}
    assert max(rows[0]) < min(rows[1]) and max(rows[1]) < min(rows[2])


def test_a_bare_plan_is_a_column_of_layers() -> None:
    plan = Plan("balance", ("cpu", "cpu"), (Stage(0, "cpu", ("a", "b")), Stage(1, "cpu", ("c",))))
    placed = layout(diagram(None, plan))
    _check(placed)
    xs = {round(p.x, 3) for p in placed.boxes.values()}
    assert len(xs) == 1, "a chain is drawn straight down"


def test_doctests() -> None:
    assert doctest.testmod(partitioner.viz.layout).failed == 0
