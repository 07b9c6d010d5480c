"""Tests of partitioner/planning/compile.py: one capture, every strategy planned from it; a
tensor-parallel choice merges its layers on the same capture (no second capture)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import partitioner.analysis as analysis_module
from partitioner import make_plan, partition
from partitioner.analysis import analyze, merge_like
from partitioner.errors import PartitionError
from partitioner.planning.compile import compile_model, split_layers
from partitioner.request import PlanRequest
from partitioner.runtime.tensor_parallel.module import TensorParallelModule


def _wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 8192), nn.ReLU(), nn.Linear(8192, 2048))


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every capture the analysis runs, by model class."""
    seen: list[str] = []
    real = analysis_module.capture

    def counted(model: nn.Module, *args: object, **kwargs: object) -> object:
        seen.append(type(model).__name__)
        return real(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(analysis_module, "capture", counted)
    return seen


def test_auto_choosing_tensor_parallelism_captures_once(captures: list[str]) -> None:
    model, x = _wide(), torch.randn(8, 2048)
    pm = partition(model, ["cpu"] * 4, example_inputs=(x,))
    assert isinstance(pm, TensorParallelModule) and pm.plan.mesh.tp == 4
    assert captures == ["Sequential"]
    out = pm(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-4)
    pm.close()


def test_make_plan_captures_once_and_returns_what_partition_runs(captures: list[str]) -> None:
    model, x = _wide(), torch.randn(8, 2048)
    plan = make_plan(model, ["cpu"] * 4, example_inputs=(x,))
    assert captures == ["Sequential"]
    assert plan.mesh is not None and plan.mesh.tp == 4 and plan.shard_specs
    assert any(n.startswith("chosen:") for n in plan.notes)


def test_compile_keeps_the_search_record_for_a_split_plan() -> None:
    model, x = _wide(), torch.randn(8, 2048)
    request = PlanRequest.make(["cpu"] * 4, example_inputs=(x,))
    analysis, plan, split = compile_model(model, request)
    assert split is not None and split.shard_plan.tp == 4
    assert plan.candidates and plan.candidates[0].get("chosen")
    assert [n for names in split.layer_names for n in names] == \
        split.unmerged.layer_names
    assert list(plan.layers) == analysis.layer_names


def test_split_layers_merges_a_column_row_pair_on_the_same_capture() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    analysis = analyze(model, (torch.randn(4, 16),))
    merged, split = split_layers(analysis, model, 2)
    assert merged.captured is analysis.captured
    assert len(merged.layers) < len(analysis.layers)
    assert merged.workload is not None and len(merged.workload.layers) == len(merged.layers)
    assert merged.boundaries is not None and len(merged.boundaries) == len(merged.layers) + 1
    assert ["0", "1", "2"] in split.layer_names


def test_a_fresh_capture_merges_alike() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(4, 16)
    analysis = analyze(model, (x,))
    merged, split = split_layers(analysis, model, 2)
    fresh = analyze(model, (x,), need_costs=False)
    alike = merge_like(fresh.layers, split.layer_names)
    assert [(layer.name, layer.nodes) for layer in alike] == \
        [(layer.name, layer.nodes) for layer in merged.layers]
    with pytest.raises(PartitionError, match="other layers"):
        merge_like(fresh.layers[1:], split.layer_names)
