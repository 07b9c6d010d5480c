"""The shape of the house: one installed namespace, imports pointing one way, no cycles.

``docs/design/006-layout.md`` says what lives where; these tests keep it true.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The source folders and the installed names they map to (pyproject's package-dir).
SOURCES = {"partitioner": "partitioner", "passes": "partitioner.passes",
           "runtime": "partitioner.runtime"}
# What each room may import of the project besides itself (imports point down this list).
# The front (partitioner's own modules) may import anything.
ALLOWED = {
    "partitioner.errors": set(),
    "partitioner.runtime": {"partitioner.errors"},
    "partitioner.passes": {"partitioner.errors", "partitioner.runtime"},
    "partitioner.cost": {"partitioner.errors", "partitioner.runtime", "partitioner.passes"},
    "partitioner.plans": {"partitioner.errors", "partitioner.runtime"},
    # A predicted timeline is the planner's simulation of the plan, drawn (one predictor).
    "partitioner.viz": {"partitioner.errors", "partitioner.runtime", "partitioner.plans",
                        "partitioner.planning.simulate"},
    "partitioner.planning": {"partitioner.errors", "partitioner.runtime", "partitioner.passes",
                             "partitioner.cost", "partitioner.plans", "partitioner.analysis",
                             "partitioner.request"},
}
ROOMS = ("cost", "planning", "plans", "viz", "passes", "runtime")


def _modules() -> dict[str, Path]:
    found = {}
    for folder, installed in SOURCES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((installed, *parts)).removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Every import of the project's modules in ``path`` (inside functions too): the module
    and the names taken from it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names if a.name.split(".")[0] in SOURCES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            if base.split(".")[0] in SOURCES:
                out.append((base, tuple(a.name for a in node.names)))
    return out


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _room(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in ROOMS else name


def test_every_import_uses_the_installed_names() -> None:
    modules = _modules()
    wrong = [(name, target) for name, path in modules.items()
             for target, _ in _imports(name, path) if target.split(".")[0] != "partitioner"]
    assert not wrong, f"imports by source folder names instead of partitioner.*: {wrong}"


def test_no_import_cycles_counting_imports_inside_functions() -> None:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target, names in _imports(name, path):
            for full in (target, *(f"{target}.{n}" for n in names)):
                found = _resolve(full, modules)
                if found is not None and found != name and not name.startswith(found + "."):
                    graph.add_edge(name, found)
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]])
                                                      for c in cycles[:5])


def test_imports_point_down_the_layers() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        room = _room(name)
        if room not in ALLOWED:
            continue  # the front may import anything
        for target, _ in _imports(name, path):
            found = _resolve(target, modules)
            if found is None or _room(found) == room or found == "partitioner":
                continue
            if _room(found) not in ALLOWED[room] and found not in ALLOWED[room]:
                wrong.append(f"{name} -> {found}")
    assert not wrong, "imports against the layering: " + ", ".join(wrong)


def test_no_module_imports_another_modules_private_names() -> None:
    modules = _modules()
    private = [f"{name} imports {target}.{n}" for name, path in modules.items()
               for target, names in _imports(name, path) for n in names
               if n.startswith("_") and _resolve(target, modules) != name]
    assert not private, "; ".join(private)


def test_errors_is_a_leaf_and_holds_the_error_classes() -> None:
    modules = _modules()
    assert _imports("partitioner.errors", modules["partitioner.errors"]) == []


def test_one_module_object_per_file() -> None:
    names = []
    for package in ("partitioner", "partitioner.passes", "partitioner.runtime"):
        path = importlib.import_module(package).__path__
        names += [info.name for info in pkgutil.walk_packages(path, package + ".")]
    for name in names:
        importlib.import_module(name)
    files: dict[str, str] = {}
    ours = [ROOT / folder for folder in SOURCES]
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).is_absolute() and any(Path(path).resolve().is_relative_to(f)
                                                     for f in ours):
            assert name.startswith("partitioner"), f"{path} imported as {name}"
            assert files.setdefault(str(Path(path).resolve()), name) == name, path


def test_files_stay_small_and_the_front_stays_short() -> None:
    sizes = {path: len(path.read_text().splitlines()) for path in _modules().values()}
    big = {str(p.relative_to(ROOT)): n for p, n in sizes.items() if n > 600}
    assert not big, f"split these files (over 600 lines): {big}"
    front = sorted(p.name for p in (ROOT / "partitioner").glob("*.py"))
    assert len(front) <= 12, f"partitioner/ holds {len(front)} modules: {front}"


def test_every_subpackage_says_what_it_owns() -> None:
    for name, path in _modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert len(doc.split()) >= 12, f"{name}'s __init__ docstring is too short"


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    # Built from a copy of the tracked files: setuptools' build/ in the checkout may hold
    # modules that no longer exist.
    source = tmp_path / "source"
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    tracked = listed.stdout.split() if listed.returncode == 0 else [
        str(p.relative_to(ROOT)) for folder in ("partitioner", "passes", "runtime")
        for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ] + ["pyproject.toml", "README.md"]
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
             str(source)]
    # This environment's setuptools if it builds wheels, else pip's isolated build (PyPI).
    if subprocess.run([*build, "--no-build-isolation"], capture_output=True).returncode:
        subprocess.run(build, check=True, capture_output=True)
    wheel = next(tmp_path.glob("partitioner-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"partitioner"}
    for member in ("partitioner/passes/base.py", "partitioner/runtime/schedule.py",
                   "partitioner/passes/tensor_parallel/rewrite.py",
                   "partitioner/runtime/distributed/mesh.py",
                   "partitioner/plans/plan_schema.json", "partitioner/py.typed"):
        assert member in names, member


def _accelerator_tests(path: Path) -> list[str]:
    """Where ``path`` names the accelerator itself: a ``"cuda"``/``"nccl"`` string (or
    ``"cuda:..."``), ``torch.cuda`` or ``.is_cuda``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value in ("cuda", "nccl") or node.value.startswith("cuda:")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
        elif isinstance(node, ast.Attribute) and (node.attr == "is_cuda" or (
                node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_only_the_device_layer_names_the_accelerator() -> None:
    modules = _modules()
    found = [hit for name, path in modules.items() if name != "partitioner.runtime.device"
             for hit in _accelerator_tests(path)]
    assert not found, "ask partitioner.runtime.device instead: " + ", ".join(found)
    assert _accelerator_tests(modules["partitioner.runtime.device"])  # the check can fire
