"""The HTML report: self-contained, drawn with Graphviz or without it, and rendered in headless
Chromium (when installed) the graph and the timeline must show."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from models import ResidualCNN

from partitioner import partition, visualize
from partitioner.viz import predicted_timeline

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                         "google-chrome")) if p), None)
HAS_GRAPHVIZ = shutil.which("dot") is not None and shutil.which("neato") is not None
PATH = os.environ.get("PATH", "")  # Chromium runs with it even where Graphviz is hidden


@pytest.fixture(params=["hidden", "installed"])
def graphviz(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> str:
    """Each report test runs with Graphviz hidden (an empty PATH) and, where it is installed,
    with it."""
    if request.param == "installed" and not HAS_GRAPHVIZ:
        pytest.skip("Graphviz is not installed (apt-get install graphviz)")
    if request.param == "hidden":
        empty = tmp_path / "empty-path"
        empty.mkdir()
        monkeypatch.setenv("PATH", str(empty))
    return str(request.param)


def _report(tmp_path: Path) -> Path:
    x = torch.randn(6, 3, 8, 8)
    pm = partition(ResidualCNN(), ["cpu"] * 3, example_inputs=(x,), chunks=3)
    pm(x).sum().backward()
    path = visualize(pm, tmp_path / "report.html")
    pm.close()
    return path


def test_report_is_self_contained(tmp_path: Path, graphviz: str) -> None:
    text = _report(tmp_path).read_text()
    assert text.count("<svg") == 3 and text.count("</svg>") == 3  # memory, graph, timeline
    graph = text[text.index('id="graph"'):text.index('id="timeline"')]
    timeline = text[text.index('id="timeline"'):]
    assert graph.count('class="node"') >= 10 and "cluster_stage2" in graph
    assert timeline.count("<title>bar") == 2 * 3 * 3
    assert 'id="plan-table"' in text and 'id="graph"' in text and 'id="timeline"' in text
    assert "measured timeline" in text
    # nothing to fetch: no scripts, no remote images, links or style sheets
    for remote in ("<script", 'src="http', 'href="http', "@import", "<link"):
        assert remote not in text


def test_report_of_a_bare_plan_uses_the_predicted_timeline(tmp_path: Path,
                                                           graphviz: str) -> None:
    from models import mlp

    from partitioner import make_plan
    plan = make_plan(mlp(), ["cpu"] * 2, "pipeline", example_inputs=(torch.randn(4, 12),),
                     chunks=2)
    text = visualize(plan, tmp_path / "plan.html").read_text()
    assert "predicted timeline" in text
    assert predicted_timeline(plan).bubble > 0


def _chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1280,2200", "--hide-scrollbars"]
    return subprocess.run([CHROMIUM, *flags, *extra, url], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PATH": PATH})


@pytest.mark.slow  # a browser per case
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed "
                                             "(apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path: Path, graphviz: str) -> None:
    report = _report(tmp_path)
    dom = _chromium(tmp_path, report.as_uri(), "--dump-dom").stdout
    graph = dom[dom.index('id="graph"'):dom.index('id="timeline"')]
    timeline = dom[dom.index('id="timeline"'):]
    assert "<svg" in graph and graph.count('class="node"') >= 10
    assert "cluster_stage2" in graph
    assert "<svg" in timeline and timeline.count("<title>bar") == 2 * 3 * 3

    shot, blank_shot = tmp_path / "report.png", tmp_path / "blank.png"
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    _chromium(tmp_path, report.as_uri(), f"--screenshot={shot}")
    _chromium(tmp_path, blank.as_uri(), f"--screenshot={blank_shot}")
    assert shot.read_bytes().startswith(b"\x89PNG")
    # A blank page compresses to almost nothing; the drawn report does not.
    assert shot.stat().st_size > 5 * blank_shot.stat().st_size
    assert shot.stat().st_size > 30_000
