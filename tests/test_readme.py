"""Every code block of the README runs, on small inputs, so the README cannot rot.

The fenced blocks are read from ``README.md`` itself. Python blocks run in a fresh process
in a temporary folder, each in its own namespace, after a prelude that makes the names the
README leaves to the reader (``model``, ``x``, ``y``, ``loss_fn``, ``optimizer``, ``llama``,
``tokens``, ``labels``, ``build_model``) small; bash lines starting with ``partitioner`` or
``torchrun`` run as written in that folder, after the YAML block is written as ``spec.yaml``.

Substitutions, each for a reason:

- ``devices=[...]`` (the README's "your devices") becomes three ``"cpu"`` devices; the
  model for the first blocks has the 7 layers ``balance=[3, 2, 2]`` needs and the modules
  ``layer2`` and ``head`` that ``split_points=`` names.
- Blocks that name ``h.*`` layers or ``out/gpt.plan.json`` use the bundled ``gpt`` model
  (the one the ``partitioner plan gpt`` line planned).
- Statements calling ``partition_distributed`` or a ``dpm`` are left out: they need a
  ``torch.distributed`` world (the ``torchrun`` block runs one, in the slow tier).
- A ``.png`` output becomes ``.svg`` when Graphviz is not installed.
- Not run: ``pip install`` lines (they change the environment), ``python -m pytest`` (this
  suite) and ``python examples/train_pipeline.py`` (300 training steps; it is the main job
  and runs under ``tests/test_examples.py``'s own terms, if any).

The default tier runs the fast blocks (about 30 s); ``tune=True``, the Llama block and
``torchrun`` are marked ``slow``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # where the block starts in README.md


def readme_blocks(text: str | None = None) -> list[Block]:
    """Every fenced block with a language, in README order."""
    text = README.read_text() if text is None else text
    return [Block(m.group(1), m.group(2), text[:m.start()].count("\n") + 1)
            for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M)]


_PRELUDE = """
import torch, torch.nn as nn
from collections import OrderedDict
import partitioner
globals().update({k: getattr(partitioner, k) for k in partitioner.__all__})
torch.manual_seed(0)
"""
_SEQUENTIAL = """
model = nn.Sequential(OrderedDict([
    ("layer0", nn.Linear(16, 32)), ("act0", nn.ReLU()), ("layer1", nn.Linear(32, 32)),
    ("layer2", nn.Linear(32, 32)), ("act2", nn.ReLU()), ("layer3", nn.Linear(32, 32)),
    ("head", nn.Linear(32, 4))]))
x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
loss_fn = nn.functional.cross_entropy
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
"""
_GPT = """
from partitioner.cli.models import load_model
model, (x,) = load_model("gpt")
"""
_LLAMA = """
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                     max_position_embeddings=64)
def build_model():
    return LlamaForCausalLM(config)
llama = build_model()
tokens = torch.randint(0, 128, (16, 16))
labels = tokens
loss_fn = lambda out, target: out.logits.float().mean()
optimizer = torch.optim.SGD(llama.parameters(), lr=0.01)
"""


def _setup(code: str) -> str:
    """The prelude a block needs (see the module docstring)."""
    if "llama" in code:
        return _LLAMA
    if "h.*" in code or "gpt.plan.json" in code:
        return _GPT
    return _SEQUENTIAL


def _runnable(code: str) -> str:
    """The block with the substitutions of the module docstring."""
    code = code.replace("devices=[...]", 'devices=["cpu"] * 3')
    tree = ast.parse(code)
    kept = [node for node in tree.body
            if "partition_distributed(" not in ast.unparse(node)
            and not re.search(r"\bdpm\.", ast.unparse(node))]
    return "\n".join(ast.unparse(node) for node in kept)


def _script(blocks: list[Block]) -> str:
    """One program running each block in a fresh namespace, naming a failing block's line."""
    parts = [f"import traceback, sys\nPRELUDE = {_PRELUDE!r}\n"]
    for block in blocks:
        body = _setup(block.code) + "\n" + _runnable(block.code)
        parts.append(f"print('README block at line {block.line}', flush=True)\n"
                     f"exec(compile(PRELUDE + {body!r}, 'README.md:{block.line}', 'exec'), {{}})")
    return "\n".join(parts) + "\n"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _run(args: list[str], cwd: Path, timeout: float = 600) -> None:
    done = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"


def _bash_lines(block: Block) -> list[str]:
    """The block's commands (continued lines joined, comments dropped)."""
    text = block.code.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _command(line: str) -> list[str]:
    words = line.split()
    if shutil.which("dot") is None:
        words = [w[:-4] + ".svg" if w.endswith(".png") else w for w in words]
    if words[0] == "partitioner":
        return [sys.executable, "-m", "partitioner.cli", *words[1:]]
    return words


def _blocks(lang: str, slow: bool) -> list[Block]:
    heavy = ("tune=True", "llama", "torchrun")
    return [b for b in readme_blocks() if b.lang == lang
            and any(h in b.code for h in heavy) == slow]


def _prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files the README's blocks read: its spec.yaml, and the plan its CLI lines write.
    The ``partitioner`` lines run through the command's ``main`` in this process (the
    command line's own code; a process each would spend most of its time importing)."""
    from partitioner.cli import main

    spec = next(b for b in readme_blocks() if b.lang == "yaml")
    (tmp_path / "spec.yaml").write_text(spec.code)
    monkeypatch.chdir(tmp_path)
    for block in _blocks("bash", slow=False):
        for line in _bash_lines(block):
            if line.startswith("partitioner "):
                assert main(_command(line)[3:]) == 0, line


def test_readme_blocks_are_found() -> None:
    blocks = readme_blocks()
    assert {"python", "bash", "yaml"} <= {b.lang for b in blocks}
    assert any("partitioner viz" in b.code for b in blocks)
    assert readme_blocks("x\n```python\nprint(1)\n```\n") == [Block("python", "print(1)\n", 2)]


def test_substitutions() -> None:
    code = 'pm = partition(model, devices=[...], balance=[3, 2, 2])\n' \
           'dpm = partition_distributed(model, (x,),\n    pp=2)\nloss = dpm.step(x); opt.step()\n'
    assert _runnable(code) == ("pm = partition(model, devices=['cpu'] * 3, balance=[3, 2, 2])"
                               "\nopt.step()")
    assert _bash_lines(Block("bash", "a --b \\\n    c  # note\n# only a comment\n", 1)) == \
        ["a --b      c"]


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_readme_cli_and_python_blocks_run(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _prepare(tmp_path, monkeypatch)  # the bash block: plan, show, viz --measure
    assert (tmp_path / "out" / "gpt.plan.json").exists()
    script = tmp_path / "readme_blocks.py"
    script.write_text(_script(_blocks("python", slow=False)))
    _run([sys.executable, str(script)], tmp_path)


@pytest.mark.slow
def test_readme_slow_python_blocks_run(tmp_path: Path) -> None:
    script = tmp_path / "readme_blocks.py"
    script.write_text(_script(_blocks("python", slow=True)))
    _run([sys.executable, str(script)], tmp_path, timeout=900)


@pytest.mark.slow
def test_readme_torchrun_lines_run(tmp_path: Path) -> None:
    for block in _blocks("bash", slow=True):
        for line in _bash_lines(block):
            if line.startswith("torchrun"):
                words = line.split()
                words[words.index(next(w for w in words if w.endswith(".py")))] = str(
                    ROOT / "examples" / "train_distributed.py")
                _run([sys.executable, "-m", "torch.distributed.run", *words[1:],
                      "--steps", "3"], tmp_path, timeout=900)


def test_every_readme_picture_comes_from_a_readme_command() -> None:
    sys.path.insert(0, str(ROOT / "docs" / "images"))
    try:
        import regenerate
    finally:
        sys.path.remove(str(ROOT / "docs" / "images"))
    text = README.read_text()
    assert regenerate.check(text) == []
    assert regenerate.shown_pictures(text) <= set(regenerate.PICTURES)
    assert regenerate.check("![a](docs/images/new.png)")[0].startswith(
        "README shows docs/images/new.png")
