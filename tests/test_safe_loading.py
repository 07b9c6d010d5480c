"""What the project tells users to run loads checkpoints safely: every ``torch.load`` in the
docs, examples and library passes ``weights_only=True``, and the torch it requires defaults
to it (2.6 and later), so a pickled file cannot run code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CALL = re.compile(r"torch\.load\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


def _texts() -> list[Path]:
    folders = ("docs", "examples", "partitioner", "passes", "runtime")
    found = [ROOT / "README.md"]
    for folder in folders:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return found


def test_every_torch_load_shown_or_called_passes_weights_only() -> None:
    unsafe = [f"{path.relative_to(ROOT)}: torch.load({args})" for path in _texts()
              for args in _CALL.findall(path.read_text()) if args.strip()
              and "weights_only=True" not in args]
    assert not unsafe, "torch.load without weights_only=True: " + "; ".join(unsafe)


def test_the_required_torch_loads_weights_only_by_default() -> None:
    found = re.search(r'"torch>=(\d+)\.(\d+)', (ROOT / "pyproject.toml").read_text())
    assert found is not None
    assert (int(found[1]), int(found[2])) >= (2, 6)
