from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from partitioner.cli import BUNDLED, main, one_line
from partitioner.errors import PlanFormatError
from partitioner.plans.plan import Plan, Stage

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.fixture
def hand_plan(tmp_path: Path) -> Path:
    """A two-stage plan written by hand (no model, no costs): quick to load and draw."""
    path = tmp_path / "hand.json"
    Plan("balance", ("cpu", "cpu"), (Stage(0, "cpu", ("a",)), Stage(1, "cpu", ("b",))),
         chunks=2).save(path)
    return path


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``argv``; it must fail with exactly one line on stderr (no traceback)."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"partitioner {argv[0]}: error: "), err
    assert "Traceback" not in err
    return err


def test_user_mistakes_are_one_line_each(tmp_path: Path, hand_plan: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    spec = tmp_path / "spec.yaml"
    spec.write_text("stages: []\n")
    script = tmp_path / "job.py"
    script.write_text("")
    (tmp_path / "folder.dot").mkdir()
    not_a_plan = tmp_path / "other.json"
    not_a_plan.write_text('{"a": 1}')
    cases = {  # argv: what the line must say
        ("viz", str(hand_plan), "-o", str(blocker / "g.dot")):
            f"cannot write {blocker / 'g.dot'}: {blocker} is a file, not a folder",
        ("viz", str(hand_plan), "-o", str(tmp_path / "folder.dot")):
            f"cannot write {tmp_path / 'folder.dot'}: Is a directory",
        ("viz", str(hand_plan), "-o", str(tmp_path)): "use .dot, .svg, .png, .pdf, .html",
        ("viz", str(hand_plan), "--model", "os:getcwd", "-o", "g.dot"):
            "os:getcwd() returned a str, not a torch.nn.Module",
        ("plan", "json:loads", "--devices", "2"):
            "calling json:loads() failed: TypeError",
        ("plan", "os:sep", "--devices", "2"): "os:sep is a str, not a function",
        ("plan", ":", "--devices", "2"): "neither bundled",
        ("simulate", "mlp"): "pass --devices",
        ("plan", "mlp", "--devices", "2", "--input", "0x64"): "every size must be positive",
        ("run", str(tmp_path / "missing.py")): "does not exist",
        ("run", "--nproc-per-node", "x", str(script)): "--nproc-per-node 'x'",
        ("run", "--nproc-per-node", "0", str(script)): "--nproc-per-node '0'",
        ("run", "--nnodes", "3:1", str(script)): "MIN:MAX",
        ("run",): "name the training script",
        ("show", str(spec)): "is a spec, not a plan",
        ("show", str(not_a_plan)): "format is None, expected",
        ("viz", str(blocker), "-o", "g.dot"): "neither a plan or spec file",
        ("viz", str(hand_plan), "--measure", "--timeline", "t.dot"): "pass --model",
        ("viz", str(hand_plan), "--timeline", "t.html"): "as a timeline",
        ("simulate", str(hand_plan), "-o", "t.gif"): "as a timeline",
    }
    for argv, says in cases.items():
        assert says in _one_line_error(capsys, list(argv)), argv


def test_an_unwritable_plan_file_is_one_line(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "folder.json").mkdir()
    err = _one_line_error(capsys, ["plan", "mlp", "--devices", "2", "--balance", "5,6",
                                   "-o", str(tmp_path / "folder.json")])
    assert f"cannot write {tmp_path / 'folder.json'}: Is a directory" in err


def test_a_png_without_graphviz_says_what_to_install(
        hand_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot, no neato
    err = _one_line_error(capsys, ["viz", str(hand_plan), "-o", str(tmp_path / "g.png")])
    assert "apt-get install graphviz" in err and ".svg or .html" in err
    assert not (tmp_path / "g.png").exists()
    assert main(["viz", str(hand_plan), "-o", str(tmp_path / "g.svg"), "--timeline",
                 str(tmp_path / "t.svg"), "--report", str(tmp_path / "r.html")]) == 0
    assert "cluster_stage1" in (tmp_path / "g.svg").read_text()
    assert (tmp_path / "r.html").read_text().count("<svg") == 3
    capsys.readouterr()


def test_argument_errors_are_one_line_pointing_at_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["plan", "mlp", "--chunks", "x"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["partitioner plan: error: argument --chunks: invalid int "
                                "value: 'x'; see partitioner plan --help"]


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlanFormatError, match="cannot read plan file"):
        main(["--debug", "show", "/nonexistent/plan.json"])
    with pytest.raises(PlanFormatError):
        main(["show", "/nonexistent/plan.json", "--debug"])
    monkeypatch.setenv("PARTITIONER_DEBUG", "1")
    with pytest.raises(PlanFormatError):
        main(["show", "/nonexistent/plan.json"])


def test_one_line_joins_lists_and_drops_what_torch_fx_appends() -> None:
    listed = ("the plan was made for another model:\n  - module 'a' is missing\n"
              "  - module 'b' is missing\nre-plan this model")
    assert one_line(listed) == ("the plan was made for another model: module 'a' is missing; "
                                "module 'b' is missing; re-plan this model")
    many = "problems:\n" + "\n".join(f"  - p{k}" for k in range(12)) + "\nfix them"
    assert one_line(many, limit=3) == ("problems: p0; p1; p2; and 9 more (--debug shows them "
                                       "all); fix them")
    fx = ("shape propagation failed at node _0: RuntimeError: bad shapes\n\nWhile executing "
          "%_0 : ...\nOriginal traceback:\nNone\nUse tlparse to see full graph.")
    assert one_line(fx) == "shape propagation failed at node _0: RuntimeError: bad shapes"
    yaml = "x.yaml is not valid YAML: while parsing\n  in line 1:\n    : :\n    ^"
    assert one_line(yaml) == "x.yaml is not valid YAML: while parsing; in line 1:; : :"


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "partitioner.cli", *argv], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_a_shape_mismatch_is_one_line_without_torch_logs() -> None:
    # torch logs a failed fake-tensor kernel with its traceback (139 lines in all, once).
    done = _cli("plan", "mlp", "--devices", "2", "--input", "64x5", "-o", os.devnull)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert "example inputs do not fit" in done.stderr and "(64, 5)" in done.stderr


def test_help_does_not_import_torch() -> None:
    code = textwrap.dedent("""
        import sys
        from partitioner.cli import main
        for argv in ([], ["plan"], ["show"], ["viz"], ["simulate"], ["run"]):
            try:
                main([*argv, "--help"])
            except SystemExit:
                pass
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True, cwd=ROOT)
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_numpy_is_a_dependency_because_torch_warns_without_it() -> None:
    # torch itself looks for numpy while it is imported; hidden, it warns on every run.
    hide = textwrap.dedent("""
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "numpy":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Hide())
        import torch
        """)
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True,
                          timeout=120, check=True, cwd=ROOT)
    assert "Failed to initialize NumPy" in done.stderr  # when not, numpy may be dropped
    listed = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(),
                       re.M | re.S)
    assert listed is not None and re.search(r'"numpy[><=]', listed.group(1))
    with_numpy = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                                text=True, timeout=120, check=True, cwd=ROOT)
    assert "NumPy" not in with_numpy.stderr


def test_show_counts_parameters_and_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tiny.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), "
        "torch.randn(6, 4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "p.json"
    assert main(["plan", "tiny:build", "--devices", "2", "-o", str(out)]) == 0
    # the one tensor returned is one input of 6 rows, not six inputs
    assert Plan.load(out).planner.example_inputs == ("float32[6, 4]",)  # type: ignore[union-attr]
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    # 4*8 + 8 + 8*2 + 2 = 58 elements in 4 tensors (once "4 parameters")
    assert "model: Sequential, 58 parameters in 4 tensors" in shown


def test_simulate_a_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    main(["plan", "mlp", "--devices", "2", "--chunks", "4", "-o", str(out)])
    capsys.readouterr()
    assert main(["simulate", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "simulated on the cluster it was planned for" in printed and "bubble" in printed
    rows = [line for line in printed.splitlines() if line.strip().startswith("dev 0 ")]
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
    main(["plan", "gpt", "--devices", "2", "--strategy", "pipeline", "-o", str(out)])
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
