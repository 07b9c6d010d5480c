"""The design docs name every module, so a reader finds each file's reason for being.

A module is named when some ``docs/design/*.md`` holds its source path from the package
folder (``viz/mesh.py``, ``distributed/mesh.py``, or ``partitioner/api.py``), its installed
dotted name (``partitioner.viz.mesh``), or, when no other module has that file name, the
bare file name (``replicas.py``) as the tree in ``006-layout.md`` lists them. Packages'
``__init__.py`` and ``__main__.py`` are named by their folder.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"partitioner": "partitioner", "passes": "partitioner.passes",
           "runtime": "partitioner.runtime"}


def _modules() -> list[Path]:
    return sorted(path for folder in SOURCES for path in (ROOT / folder).rglob("*.py")
                  if path.name not in ("__init__.py", "__main__.py"))


def _names(path: Path, unique: bool) -> list[str]:
    """Every spelling that names ``path`` in a doc."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    dotted = ".".join((SOURCES[parts[0]], *parts[1:]))
    spellings = [dotted, "/".join(path.relative_to(ROOT).parts)]
    if len(parts) > 2:  # viz/mesh.py for partitioner/viz/mesh.py
        spellings.append("/".join((*parts[-2:-1], path.name)))
    if unique:
        spellings.append(path.name)
    return spellings


def _unnamed() -> list[Path]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "design").glob("*.md")))
    counts = Counter(p.name for p in _modules())
    return [p for p in _modules()
            if not any(name in text for name in _names(p, counts[p.name] == 1))]


def test_every_module_is_named_in_a_design_doc() -> None:
    missing = _unnamed()
    assert not missing, (
        "modules named in no docs/design/*.md:\n"
        + "\n".join(f"  {p.relative_to(ROOT)}: add the line \"- `{p.relative_to(ROOT)}`: "
                    "<what it holds>\" to its folder's list under 'Every module, one line "
                    "each' in docs/design/006-layout.md"
                    for p in missing))


def test_a_new_module_would_be_reported(tmp_path: Path) -> None:
    # The rule itself: a path only a doc names counts, a bare shared file name does not.
    module = ROOT / "partitioner" / "viz" / "mesh.py"
    assert "viz/mesh.py" in _names(module, unique=False)
    assert "mesh.py" not in _names(module, unique=False)
    assert "partitioner.viz.mesh" in _names(module, unique=True)
