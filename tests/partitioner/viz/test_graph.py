from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from models import LongSkip, ResidualCNN, mlp

from partitioner import make_plan, partition, visualize
from partitioner.cli import load_model
from partitioner.plans.plan import Plan, Stage
from partitioner.viz import GraphvizNotFound, diagram, to_dot
from partitioner.viz import dot as dot_module

needs_graphviz = pytest.mark.skipif(shutil.which("dot") is None,
                                    reason="Graphviz is not installed (apt-get install graphviz)")


def test_nodes_are_grouped_by_stage_and_cross_edges_carry_bytes() -> None:
    x = torch.randn(8, 8)
    pm = partition(LongSkip(), ["cpu"] * 3, example_inputs=(x,), chunks=2)
    d = diagram(pm.analysis, pm.plan)
    assert d.detail == "nodes"
    stages = {box.id: box.stage for box in d.boxes}
    assert set(stages.values()) == {None, 0, 1, 2}
    cross = [e for e in d.edges if e.cross]
    assert cross and all(e.bytes_per_microbatch for e in cross)
    # the skip from stage 0 to stage 2 is one edge, (8 / 2 chunks) x 8 floats
    long = [e for e in cross if stages[e.source] == 0 and stages[e.target] == 2]
    assert long and long[0].bytes_per_microbatch == 4 * 8 * 4 and long[0].label == "4x8"
    assert all(stages[e.source] == stages[e.target] for e in d.edges if not e.cross
               and stages[e.source] is not None and stages[e.target] is not None)
    pm.close()


def test_dot_has_a_cluster_per_stage_coloured_by_device() -> None:
    x = torch.randn(6, 3, 8, 8)
    pm = partition(ResidualCNN(), ["cpu"] * 3, "pipeline", example_inputs=(x,))
    text = to_dot(diagram(pm.analysis, pm.plan, "layers"))
    for j in range(3):
        assert f"subgraph cluster_stage{j}" in text
        assert f'fillcolor="{dot_module.device_color(j)}"' in text
    assert "penwidth=2.2" in text and "/micro-batch" in text
    assert '"L0" [label="stem.0"' in text
    pm.close()


def test_a_bare_plan_is_drawn_layer_by_layer() -> None:
    plan = make_plan(mlp(), ["cpu"] * 2, balance=[3, 4])
    d = diagram(None, plan)
    assert d.detail == "layers"
    assert [b.label for b in d.boxes if b.kind == "layer"] == list(plan.layers)
    assert [e for e in d.edges if e.cross] == [d.edges[3]]
    with pytest.raises(ValueError, match="needs the model's graph"):
        diagram(None, plan, "nodes")


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_gpt2_xl_collapses_to_a_readable_block_view() -> None:
    model, example = load_model("gpt2-xl")
    plan = make_plan(model, ["cpu"] * 8, "pipeline", example_inputs=example, chunks=8)
    from partitioner.analysis import analyze
    d = diagram(analyze(model, example, need_costs=False), plan)
    assert d.detail == "blocks"
    layers = [b for b in d.boxes if b.kind == "layer"]
    assert len(layers) <= 16, [b.label for b in layers]
    assert any("(7 layers)" in b.label for b in layers)
    cross = [e for e in d.edges if e.cross]
    assert len(cross) == 7
    assert all(e.label == "1x1024x1600" and e.bytes_per_microbatch == 1024 * 1600 * 4
               for e in cross)


def test_dot_and_svg_need_no_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dot_module.shutil, "which", lambda name: None)
    plan = Plan("balance", ("cpu",), (Stage(0, "cpu", ("a",)),))
    assert visualize(plan, tmp_path / "p.dot").read_text().startswith("digraph plan {")
    svg = visualize(plan, tmp_path / "p.svg").read_text()
    assert svg.startswith("<svg") and 'id="cluster_stage0"' in svg
    for image in ("p.png", "p.pdf"):
        with pytest.raises(GraphvizNotFound, match="apt-get install graphviz"):
            visualize(plan, tmp_path / image)


@needs_graphviz
def test_svg_and_png_are_drawn(tmp_path: Path) -> None:
    x = torch.randn(6, 3, 8, 8)
    pm = partition(ResidualCNN(), ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=3)
    svg = visualize(pm, tmp_path / "g.svg").read_text()
    assert "<svg" in svg and "cluster_stage1" in svg and "KB/micro&#45;batch" in svg
    png = visualize(pm.plan, tmp_path / "g.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    pm.close()


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    plan = Plan("balance", ("cpu",), (Stage(0, "cpu", ("a",)),))
    with pytest.raises(ValueError, match="use .dot, .svg"):
        visualize(plan, tmp_path / "p.jpeg")
