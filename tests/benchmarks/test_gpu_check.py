"""The prepared GPU check (``benchmarks/gpu_check.py``) runs where it can without a GPU: its
arguments, its table, and a clear skip without CUDA."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_arguments_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _module().parse(["--steps", "0"])
    assert info.value.code == 2 and "--steps >= 1" in capsys.readouterr().err


def test_the_table_has_a_row_per_case_with_its_ratio() -> None:
    text = _module().table([("one device", None, 0.1), ("pipeline bf16", 0.05, 0.06)], "H200")
    assert "| pipeline bf16 | 50.0 ms | 60.0 ms | 1.20 |" in text
    assert "| one device | - | 100.0 ms | - |" in text and "H200" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: runs for real")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--skip-tests"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped, no CUDA device" in done.stdout
    dry = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                         text=True, timeout=120)
    assert dry.returncode == 0 and "tensor parallel" in dry.stdout


LAYER = SCRIPT.with_name("gpu_llama_block.py")


def test_the_llama_layer_check_runs_small_on_a_cpu() -> None:
    """``--small`` times every piece of a small Llama layer on the CPU and prints one row
    each; without ``--small`` and without CUDA it skips."""
    done = subprocess.run([sys.executable, str(LAYER), "--small", "--reps", "1", "--warmup",
                           "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for row in ("| q |", "| k, v |", "| gate, up |", "| down |", "| attention |",
                "| element-wise (layer - the above) |", "| decoder layer |"):
        assert row in done.stdout, done.stdout
    if not torch.cuda.is_available():
        skipped = subprocess.run([sys.executable, str(LAYER)], capture_output=True, text=True,
                                 timeout=120)
        assert skipped.returncode == 0 and "skipped, no CUDA device" in skipped.stdout


def test_the_kernel_count_counts_ops_not_views() -> None:
    """``gpu_dispatch.aten_ops``, the planner-side count of a step's kernels: every non-view
    ATen op once (on any device), no view."""
    path = SCRIPT.with_name("gpu_dispatch.py")
    spec = importlib.util.spec_from_file_location("gpu_dispatch", path)
    assert spec is not None and spec.loader is not None
    dispatch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dispatch)
    x = torch.ones(4, 4)
    assert dispatch.aten_ops(lambda: x + 1) == 1
    assert dispatch.aten_ops(lambda: x.view(16).unsqueeze(0)) == 0
    assert dispatch.aten_ops(lambda: (x + 1).view(2, 8).sum()) == 2
