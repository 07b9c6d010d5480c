"""Tensor parallelism across processes on gloo: every rank a process, one thread each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from distributed_harness import launch, results

WORKER = Path(__file__).resolve().parent / "tp_dist_worker.py"
MODELS = ["mlp", "block", "gpt2"]


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    """One world per degree runs every model (the processes start once)."""
    tp = request.param
    runs = launch(WORKER, tp, ["transparency", json.dumps(MODELS)], timeout=240)
    return tp, results(runs)


@pytest.mark.parametrize("model", MODELS)
def test_split_over_processes_equals_the_unsplit_model(world: Any, model: str) -> None:
    """Outputs, gradients and weights after 3 SGD steps match on every rank (the worker
    asserts with torch's default float32 tolerances; here we check every rank ran it)."""
    tp, per_rank = world
    records = [next(r for r in rank if r["model"] == model) for rank in per_rank]
    assert [r["rank"] for r in records] == list(range(tp))
    for r in records:
        assert r["tp"] == tp
        assert r["worst"]["weight"] < 1e-5
        # each rank holds about 1/tp of the split weights, not the whole model
        assert r["local_params"] < r["full_params"]


def test_a_block_forward_runs_two_all_reduces_across_processes(world: Any) -> None:
    _, per_rank = world
    for rank in per_rank:
        block = next(r for r in rank if r["model"] == "block")
        assert block["forward_counts"] == {"all_reduce/forward": 2}


@pytest.mark.parametrize("cfg", [
    {"pp": 2, "dp": 1, "tp": 2, "batch": 4, "chunks": 2, "schedule": "1f1b",
     "checkpoint": "never"},
    {"pp": 2, "dp": 2, "tp": 2, "batch": 4, "chunks": 2, "schedule": "gpipe",
     "checkpoint": "except_last"},
], ids=["pp2xtp2", "dp2xpp2xtp2"])
def test_tensor_parallel_stages_in_the_distributed_pipeline(cfg: dict[str, Any]) -> None:
    """The multi-process pipeline (P2P between stages, bucketed gradient all-reduce between
    replicas) runs tensor-parallel stage graphs: after 3 steps every weight, gathered over
    its tensor-parallel group, equals single-process full-batch training, and so do the
    losses."""
    world = cfg["pp"] * cfg["dp"] * cfg["tp"]
    per_rank = results(launch(WORKER, world, ["mesh", json.dumps(cfg)], timeout=300))
    records = [rank[0] for rank in per_rank]
    stages = {tuple(r["checked"]) for r in records}
    assert len(stages) == cfg["pp"]  # each stage checked its own, different weights
    for r in records:
        assert r["mesh"] == [cfg["pp"], cfg["tp"]]
        assert r["worst"] < 1e-5
        for got, expected in zip(r["losses"], r["expected_losses"]):
            assert abs(got - expected) < 1e-5
