from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from partitioner.cli import BUNDLED, main
from partitioner.plans.plan import Plan

needs_graphviz = pytest.mark.skipif(shutil.which("dot") is None,
                                    reason="Graphviz is not installed (apt-get install graphviz)")


def test_every_command_has_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("plan", "show", "viz", "simulate", "run"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out and f"partitioner {command}" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "examples:" in capsys.readouterr().out


def test_plan_then_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--devices", "3", "--chunks", "4", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pipeline: 3 stages, chunks=4" in printed and f"plan written to {out}" in printed
    plan = Plan.load(out)
    assert plan.chunks == 4 and plan.fingerprint is not None
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert plan.table() in shown and "mesh: dp=1 pp=3 tp=1" in shown
    assert main(["show", str(out), "--json"]) == 0
    assert Plan.from_dict(json.loads(capsys.readouterr().out)) == plan


def test_plan_with_balance_and_a_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "resnet", "--devices", "cpu,cpu", "--balance", "5,5",
                 "-o", str(tmp_path / "a.json")]) == 0
    assert Plan.load(tmp_path / "a.json").balance == (5, 5)
    spec = tmp_path / "spec.yaml"
    spec.write_text("devices: [cpu, cpu]\nstages:\n  - {layers: 'blocks.[0-2]'}\n"
                    "  - {layers: 'blocks.[3-5]'}\nchunks: 2\n")
    assert main(["plan", "resnet", "--spec", str(spec), "-o", str(tmp_path / "b.json")]) == 0
    plan = Plan.load(tmp_path / "b.json")
    assert plan.strategy == "spec" and plan.stages[1].layers[0] == "blocks.3"
    capsys.readouterr()


def test_module_factory_models_and_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "p.json"
    assert main(["plan", "mymodels:build", "--input", "8x16", "--devices", "2",
                 "-o", str(out)]) == 0
    assert Plan.load(out).planner.example_inputs == ("float32[8, 16]",)  # type: ignore[union-attr]
    capsys.readouterr()


def test_errors_are_reported_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "nope", "--devices", "2"]) == 1
    assert "neither bundled" in capsys.readouterr().err
    assert main(["plan", "mymissing:build", "--devices", "2"]) == 1
    assert "cannot load 'mymissing:build'" in capsys.readouterr().err
    assert main(["plan", "mlp", "--devices", "2", "--input", "8xq"]) == 1
    assert "write a shape like 64x32" in capsys.readouterr().err
    assert main(["show", "/nonexistent/plan.json"]) == 1
    assert "cannot read plan file" in capsys.readouterr().err


def test_simulate_a_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    main(["plan", "mlp", "--devices", "2", "--chunks", "4", "-o", str(out)])
    capsys.readouterr()
    assert main(["simulate", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "simulated on the cluster it was planned for" in printed and "bubble" in printed
    rows = [line for line in printed.splitlines() if line.strip().startswith("stage 0 ")]
    assert rows and "F" in rows[0] and "B" in rows[0]


def test_simulate_runs_the_simulator_on_a_named_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    main(["plan", "mlp", "--devices", "2", "--chunks", "4", "-o", str(out)])
    capsys.readouterr()
    assert main(["simulate", str(out), "--cluster", "a100-80gb:2"]) == 0
    assert "simulated on a100-80gb:2" in capsys.readouterr().out


def test_simulate_refuses_an_unknown_cluster(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    main(["plan", "mlp", "--devices", "2", "-o", str(out)])
    capsys.readouterr()
    assert main(["simulate", str(out), "--cluster", "nosuchcluster"]) != 0
    err = capsys.readouterr().err
    assert "nosuchcluster" in err and "A100-80GB" in err


def test_viz_writes_dot_without_graphviz_needs(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    main(["plan", "gpt", "--devices", "2", "-o", str(out)])
    assert main(["viz", str(out), "-o", str(tmp_path / "plan.dot")]) == 0
    assert "cluster_stage1" in (tmp_path / "plan.dot").read_text()
    assert main(["viz", str(out), "--model", "gpt", "-o", str(tmp_path / "g.dot"),
                 "--timeline", str(tmp_path / "t.dot")]) == 0
    graph = (tmp_path / "g.dot").read_text()
    assert "16x64x128" in graph  # shapes come from the model
    assert "bubble" in (tmp_path / "t.dot").read_text()
    capsys.readouterr()


@needs_graphviz
def test_viz_images_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["viz", "mlp", "--devices", "3", "--chunks", "4", "-o", str(tmp_path / "g.png"),
                 "--timeline", str(tmp_path / "t.svg"), "--report",
                 str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")
    assert "<svg" in (tmp_path / "t.svg").read_text()
    assert 'id="timeline"' in (tmp_path / "r.html").read_text()
    capsys.readouterr()


@pytest.mark.slow
def test_run_delegates_to_torchrun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, sys\n"
                      "open(sys.argv[1] + os.environ['RANK'], 'w').write(sys.argv[2])\n")
    marker = tmp_path / "rank"
    assert main(["run", "--nproc-per-node", "2", str(script), str(marker), "hello"]) == 0
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "hello"
    assert f"{sys.executable} -m torch.distributed.run" in capsys.readouterr().err


def test_bundled_models_build(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in BUNDLED)
