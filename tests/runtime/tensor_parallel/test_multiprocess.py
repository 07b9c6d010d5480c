"""Tensor parallelism across processes on gloo: every rank a process, one thread each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results
from tp_models import TinyGPT

from partitioner.tensor_parallel import plan_tensor_parallel

WORKER = Path(__file__).resolve().parent / "tp_dist_worker.py"
MODELS = ["mlp", "block", "gpt2", "encoder"]


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    """One world per degree runs every model (the processes start once)."""
    tp = request.param
    runs = launch(WORKER, tp, ["transparency", json.dumps(MODELS)], timeout=240)
    return tp, results(runs)


@pytest.mark.slow
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
        assert r["worst"]["norm"] < 1e-5  # clip_grad_norm_ with the unsplit model's norm
        # each rank holds about 1/tp of the split weights, not the whole model
        assert r["local_params"] < r["full_params"]


@pytest.mark.slow
def test_a_block_forward_runs_two_all_reduces_across_processes(world: Any) -> None:
    _, per_rank = world
    for rank in per_rank:
        for model in ("block", "encoder"):  # attention by heads: torch's, and nanoGPT's
            record = next(r for r in rank if r["model"] == model)
            assert record["forward_counts"] == {"all_reduce/forward": 2}, model


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    {"pp": 2, "dp": 1, "tp": 2, "batch": 4, "chunks": 2, "schedule": "1f1b",
     "checkpoint": "never"},
    {"pp": 2, "dp": 2, "tp": 2, "batch": 4, "chunks": 2, "schedule": "gpipe",
     "checkpoint": "except_last", "clip": 0.5},
    {"pp": 2, "dp": 1, "tp": 2, "batch": 4, "chunks": 2, "schedule": "1f1b",
     "checkpoint": "always", "plan": [3, 4]},
], ids=["pp2xtp2", "dp2xpp2xtp2", "plan-file"])
def test_partition_distributed_with_tensor_parallel_stages(cfg: dict[str, Any],
                                                           tmp_path: Path) -> None:
    """``partition_distributed(..., tp=2)``: the multi-process pipeline (P2P between stages,
    bucketed gradient all-reduce between replicas) runs tensor-parallel stage graphs. After
    3 steps every weight, gathered whole by ``state_dict()``, equals single-process
    full-batch training, and so do the losses (and, with ``clip``, the gradient norms); the
    checkpoint holds the whole model, and a run resumed from it (weights and split momentum
    buffers) takes a 4th step that still matches."""
    world = cfg["pp"] * cfg["dp"] * cfg["tp"]
    balance = cfg.get("plan")
    if balance:  # a tensor-parallel plan made in this process, run from its file
        torch.manual_seed(0)
        setup = plan_tensor_parallel(TinyGPT(n_layer=2), [["cpu"] * cfg["tp"]] * cfg["pp"],
                                     cfg["tp"], example_inputs=(torch.zeros(4, 8).long(),),
                                     balance=balance)
        setup.plan.save(tmp_path / "tp.plan.json")
        cfg = {**cfg, "plan": str(tmp_path / "tp.plan.json")}
    args = ["mesh", json.dumps({**cfg, "dir": str(tmp_path)})]
    per_rank = results(launch(WORKER, world, args, timeout=300))
    records = [rank[0] for rank in per_rank]
    if balance:
        assert all(r["balance"] == balance for r in records)  # the file's split ran
    stages = {tuple(r["checked"]) for r in records}
    assert len(stages) == cfg["pp"]  # each stage checked its own, different weights
    for r in records:
        assert r["mesh"] == [cfg["pp"], cfg["tp"]]
        assert r["shard_specs"] > 0
        assert r["worst"] < 1e-5 and r["resumed"] < 1e-5
        assert r["local_numel"] < r["whole_numel"]  # a rank holds slices, not its whole stage
        assert len(r["losses"]) == 4
        for got, expected in zip(r["losses"], r["expected_losses"]):
            assert abs(got - expected) < 1e-5
        # clip_grad_norm_ sees the unsplit model's norm: slices once, copies once
        assert r["norms"] == pytest.approx(r["expected_norms"], rel=1e-5)
    if "clip" in cfg:
        assert len(records[0]["norms"]) == 4 and max(records[0]["expected_norms"]) > cfg["clip"]
