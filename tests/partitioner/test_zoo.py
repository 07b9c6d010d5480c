"""The bundled models ship inside the package: the ``partitioner`` command needs no
``examples/`` folder (a pip-installed user has none)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partitioner.cli import zoo
from partitioner.cli.models import BUNDLED

ROOT = Path(__file__).resolve().parents[2]


def test_every_bundled_factory_is_in_the_zoo() -> None:
    assert all(callable(getattr(zoo, entry.factory)) for entry in BUNDLED.values())


def test_examples_models_are_the_zoos() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from examples import models
    finally:
        sys.path.remove(str(ROOT))
    assert models.gpt is zoo.gpt and models.classifier is zoo.classifier


def test_no_installed_module_imports_examples() -> None:
    found = []
    for folder in ("partitioner", "passes", "runtime"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                          if n.split(".")[0] in ("examples", "models")]
                # A path built to the source tree's examples (the way it was loaded before).
                if isinstance(node, ast.Constant) and node.value in ("examples", "models.py"):
                    found.append(f"{path.relative_to(ROOT)} builds a path to examples/")
    assert not found, found


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_cli_plans_a_bundled_model_without_examples(tmp_path: Path) -> None:
    # A fresh process in an empty folder, with `examples` unimportable, as after pip install.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys; sys.modules['examples'] = None; "
            "from partitioner.cli import main; "
            "sys.exit(main(['plan', 'mlp', '--devices', '2', '--strategy', 'pipeline', "
            "'-o', 'p.json']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "p.json").exists()


def test_zoo_gpt_runs() -> None:
    model = zoo.gpt(n_layer=1, n_embd=16, n_head=2, vocab=32, seq=8)
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 32)
