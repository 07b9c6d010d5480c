"""Plain SVG, drawn in Python: the graph and the timeline without Graphviz."""

from __future__ import annotations

import doctest
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from models import LongSkip, mlp

import partitioner.viz.svg
from partitioner import make_plan, partition, visualize
from partitioner.viz import GraphvizNotFound, predicted_timeline, visualize_timeline
from partitioner.viz.graph import diagram
from partitioner.viz.svg import graph_svg, timeline_svg

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def no_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphviz hidden, whether or not this machine has it: a PATH with nothing on it."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _groups(svg: str, cls: str) -> list[ET.Element]:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]


def test_graph_svg_draws_stages_boxes_and_the_bytes_across() -> None:
    pm = partition(LongSkip(), ["cpu"] * 3, example_inputs=(torch.randn(8, 8),), chunks=2)
    d = diagram(pm.analysis, pm.plan)
    pm.close()
    svg = graph_svg(d)
    clusters = _groups(svg, "cluster")
    assert [c.get("id") for c in clusters] == ["cluster_stage0", "cluster_stage1",
                                               "cluster_stage2"]
    assert len(_groups(svg, "node")) == len(d.boxes)
    assert len(_groups(svg, "edge")) == len(d.edges)
    assert "128 B/micro-batch" in svg  # (8 / 2 chunks) x 8 floats across a stage
    assert 'stroke="#dc2626"' in svg and "stage 2 on cpu" in svg


def test_svg_files_are_drawn_without_graphviz(tmp_path: Path, no_graphviz: None) -> None:
    plan = make_plan(mlp(), ["cpu"] * 3, "pipeline", example_inputs=(torch.randn(8, 12),),
                     chunks=4)
    graph = visualize(plan, tmp_path / "g.svg").read_text()
    assert len(_groups(graph, "cluster")) == 3
    timeline = visualize_timeline(plan, tmp_path / "t.svg").read_text()
    bars = _groups(timeline, "node")
    # forward and backward, per stage, per micro-batch; then each device's optimizer step
    assert len(bars) == 2 * 3 * 4 + 3
    assert all(b.findtext(f"{SVG}title", "").startswith(f"bar{k}:") for k, b in enumerate(bars))
    assert ">F3<" in timeline and "bubble (grey)" in timeline
    with pytest.raises(GraphvizNotFound, match="apt-get install graphviz.*\\.svg or \\.html"):
        visualize(plan, tmp_path / "g.png")
    with pytest.raises(GraphvizNotFound, match="'neato'"):
        visualize_timeline(plan, tmp_path / "t.pdf")
    assert not (tmp_path / "g.png").exists()


def test_timeline_svg_puts_bars_at_their_times() -> None:
    plan = make_plan(mlp(), ["cpu"] * 2, example_inputs=(torch.randn(8, 12),), chunks=2)
    t = predicted_timeline(plan)
    bars = _groups(timeline_svg(t, plan), "node")
    rects = [b.find(f"{SVG}rect") for b in bars]
    xs = [float(r.get("x", 0)) for r in rects if r is not None]
    widths = [float(r.get("width", 0)) for r in rects if r is not None]
    scale = widths[0] / (t.bars[0].end - t.bars[0].start)
    for bar, x, w in zip(t.bars, xs, widths):
        assert x - xs[0] == pytest.approx((bar.start - t.bars[0].start) * scale, abs=0.05)
        assert w == pytest.approx(max((bar.end - bar.start) * scale, 0.5), abs=0.05)  # visible


def test_doctests() -> None:
    assert doctest.testmod(partitioner.viz.svg).failed == 0
