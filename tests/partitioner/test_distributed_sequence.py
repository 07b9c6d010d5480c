"""partition_distributed(..., tp=2, sequence_parallel=True): every stage's tp slice runs its
replicated region on sequence shards across gloo processes (shard_stage in
partitioner/tensor_parallel.py, passes/tensor_parallel/sequence_parallel.py), with the stage
boundaries whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results
from torch import nn

from partitioner import Options, partition_distributed
from partitioner.errors import OptionsError, StrategyError
from partitioner.planning.options import resolve_options

WORKER = Path(__file__).resolve().parent / "sp_worker.py"
SEQ, TP = 8, 2


@pytest.fixture(scope="module", params=[1, 2], ids=["tp2", "pp2xtp2"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    """One world per mesh: a float64 TinyGPT trained 3 SGD steps with and without SP."""
    pp = request.param
    cfg = {"pp": pp, "tp": TP, "batch": 4, "chunks": 2, "meta": pp == 1}
    per_rank = results(launch(WORKER, pp * TP, [json.dumps(cfg)], timeout=300))
    return pp, [rank[0] for rank in per_rank]


@pytest.mark.slow
def test_sequence_parallel_trains_like_tensor_parallel_and_the_model(world: Any) -> None:
    """Losses of 3 SGD steps (momentum) equal plain tensor parallelism's and the
    unpartitioned model's, and so do the weights after them, in float64."""
    _, records = world
    for r in records:
        assert r["dtype"] == "torch.float64"
        assert r["sp"]["losses"] == pytest.approx(r["expected"], rel=1e-12, abs=1e-12)
        assert r["sp"]["losses"] == pytest.approx(r["tp"]["losses"], rel=1e-12, abs=1e-12)
        assert r["worst"]["sp"] < 1e-12 and r["worst"]["tp"] < 1e-12


@pytest.mark.slow
def test_sequence_parallel_rank_graphs_hold_sequence_shards(world: Any) -> None:
    """With SP every all-reduce of the forward is a reduce-scatter, layer norms see
    ``seq / tp`` rows, each stage's output is gathered whole before it leaves, and the rank
    keeps fewer activation bytes for the backward."""
    pp, records = world
    assert sorted({r["sp"]["stage"] for r in records}) == list(range(pp))
    for r in records:
        sp, tp = r["sp"], r["tp"]
        assert sp["nodes"]["reduce_from_tp"] == 0
        assert sp["nodes"]["reduce_scatter_to_sp"] == tp["nodes"]["reduce_from_tp"] > 0
        assert sp["nodes"]["all_gather_from_sp"] > 0
        assert "all_reduce/forward" not in sp["counts"]
        assert sp["counts"]["reduce_scatter/forward"] == tp["counts"]["all_reduce/forward"]
        assert tp["norm_rows"] == [SEQ]
        # Stage 0 runs on shards from the embedding on; a later stage's first norm reads
        # its whole input (the boundary), the others shards.
        assert sp["norm_rows"] == ([SEQ // TP] if sp["stage"] == 0 else [SEQ // TP, SEQ])
        assert sp["output_made_by"] == ["gather_from_tp"]
        assert sp["kept_bytes"] < tp["kept_bytes"]  # activations kept for the backward
        # ... and the plan says so: costed as it runs (partitioner/cost/sequence_cost.py)
        assert sp["predicted_memory"] < tp["predicted_memory"]


@pytest.mark.slow
def test_sequence_parallel_on_a_meta_built_model(world: Any) -> None:
    """A meta-built model's stage graphs carry meta shapes; each rank's slice is real: the
    pass still finds its shards, and the loss equals plain tensor parallelism's."""
    pp, records = world
    if pp != 1:
        pytest.skip("run in the tp2 world only")
    for r in records:
        meta = r["meta"]
        assert meta["sp"]["nodes"]["reduce_scatter_to_sp"] > 0
        assert meta["sp"]["losses"] == pytest.approx(meta["tp"]["losses"], rel=1e-6)


@pytest.mark.slow
def test_sequence_parallel_with_virtual_stages_is_refused(world: Any) -> None:
    pp, records = world
    if pp == 1:
        pytest.skip("virtual stages need pp >= 2: run in the pp2xtp2 world")
    for r in records:
        assert "virtual_stages=2" in r["virtual_refused"]
        assert "virtual_stages=1" in r["virtual_refused"]  # or tp=1: either fixes it


def test_sequence_parallel_needs_tp_across_processes() -> None:
    # Refused before torch.distributed starts: every rank raises alike.
    with pytest.raises(StrategyError, match=r"sequence_parallel=True with tp=1.*pass tp=2"):
        partition_distributed(nn.Linear(4, 4), (torch.randn(2, 4),), sequence_parallel=True)
    with pytest.raises(StrategyError, match=r"tp=None.*pass tp=2"):
        partition_distributed(nn.Linear(4, 4), (torch.randn(2, 4),), strategy="auto",
                              options=Options(sequence_parallel=True))


def test_sequence_parallel_is_an_option() -> None:
    assert resolve_options(sequence_parallel=True).sequence_parallel
    assert resolve_options(Options(sequence_parallel=True)).sequence_parallel
    assert not resolve_options().sequence_parallel
    with pytest.raises(OptionsError, match="sequence_parallel='yes'"):
        Options(sequence_parallel="yes")  # type: ignore[arg-type]
