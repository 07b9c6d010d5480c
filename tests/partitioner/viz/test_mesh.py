"""The graph shows the mesh: which devices each stage runs on, how tensor parallelism splits
each layer, shapes per micro-batch, stage titles that edge labels cannot cover, and memory
per device as bars."""

from __future__ import annotations

import re

import torch

from partitioner import make_plan
from partitioner.analysis import analyze
from partitioner.cli.zoo import gpt
from partitioner.plans.plan import Mesh
from partitioner.viz import diagram, to_dot
from partitioner.viz.memory import device_memory, memory_svg
from partitioner.viz.mesh import layer_splits
from partitioner.viz.report import report_html


def _planned(mesh: Mesh, chunks: int = 2) -> tuple:
    torch.manual_seed(0)
    model = gpt(n_layer=2, n_embd=16, n_head=2, vocab=32, seq=8)
    x = torch.zeros(8, 8, dtype=torch.long)
    plan = make_plan(model, ["cpu"] * (mesh.dp * mesh.pp * mesh.tp), example_inputs=(x,),
                     chunks=chunks, mesh=mesh)
    return plan, analyze(model, (x,), need_costs=False)


def test_tp2_drawing_names_both_devices_and_each_split() -> None:
    plan, analysis = _planned(Mesh(tp=2))
    for detail in ("layers", "blocks"):
        text = to_dot(diagram(analysis, plan, detail))
        assert "stage 0 on devices 0+1 (cpu; tp=2)" in text
        assert "h.0\\nattn.c_attn column, attn.c_proj row\\nmlp.c_fc column, mlp.c_proj row" \
            in text or "attn.c_attn column, attn.c_proj row" in text
        assert "wte\\nvocab split" in text and "ln_f\\ntp: replicated" in text
    splits = layer_splits(plan)
    assert splits["h.1"] == ("attn.c_attn: column, attn.c_proj: row, mlp.c_fc: column, "
                             "mlp.c_proj: row")
    nodes = to_dot(diagram(analysis, plan, "nodes"))
    assert "h.0.mlp.c_fc\\nLinear\\ncolumn split" in nodes
    assert "h.0.mlp.c_proj\\nLinear\\nrow split" in nodes


def test_replicas_drawing_names_each_replicas_devices() -> None:
    plan, analysis = _planned(Mesh(dp=2, pp=2))
    text = to_dot(diagram(analysis, plan, "layers"))
    assert "stage 0 on devices 0, 2 (cpu; 2 replicas)" in text
    assert "stage 1 on devices 1, 3 (cpu; 2 replicas)" in text
    assert "mesh dp=2 x pp=2 x tp=1 (4 devices)" in text


def test_edges_show_micro_batch_shapes() -> None:
    # batch 8 over 2 replicas and 2 micro-batches each: 2 rows per micro-batch
    plan, analysis = _planned(Mesh(dp=2, pp=2))
    labels = re.findall(r'label="([^"]*)"\]', to_dot(diagram(analysis, plan, "layers")))
    shapes = {s for label in labels for s in re.findall(r"\b\d+x\d+(?:x\d+)*\b", label)}
    assert "2x8x16" in shapes and "2x8" in shapes
    assert not any(s.startswith(("8x", "4x")) for s in shapes), shapes


def test_stage_titles_keep_clear_of_arrows_and_labels() -> None:
    # A stage's title sits above an invisible box as wide as itself, left of the stage's
    # first box on that rank, so the arrow entering the stage passes right of the title;
    # arrows between stages leave a rank free for their labels (minlen=2).
    plan, analysis = _planned(Mesh(pp=2))
    text = to_dot(diagram(analysis, plan, "layers"))
    for j in range(2):
        title = re.search(rf"subgraph cluster_stage{j} {{\n\s+label=\"([^\"]+)\"", text)
        assert title is not None and title.group(1).startswith(f"stage {j} on cpu")
        room = re.search(rf'"room_stage{j}" \[label="", style=invis, width=([\d.]+)', text)
        assert room is not None and float(room.group(1)) * 72 >= 6 * len(title.group(1))
        assert re.search(rf'{{rank=same; "room_stage{j}" -> "L\d+" \[style=invis\];}}', text)
    cross = [line for line in text.splitlines() if "penwidth=2.2" in line]
    assert cross and all("minlen=2" in line for line in cross)


def test_memory_per_device_bars_beside_the_table() -> None:
    plan, analysis = _planned(Mesh(dp=2, pp=2))
    held = device_memory(plan)
    assert [name for name, _ in held] == [
        "device 0: cpu (replica 0, stage 0)", "device 1: cpu (replica 0, stage 1)",
        "device 2: cpu (replica 1, stage 0)", "device 3: cpu (replica 1, stage 1)"]
    assert held[0][1] == held[2][1] == plan.stages[0].predicted_memory
    assert memory_svg(plan).count('class="memory-bar"') == 4
    page = report_html(plan, analysis, None)
    assert page.index('id="plan-table"') < page.index('id="memory"') < page.index('id="graph"')
