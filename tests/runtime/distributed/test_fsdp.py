"""sharding="fsdp": torch's FSDP2 over the replicas trains as plain data parallelism does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results

from partitioner.distributed import partition_distributed
from partitioner.errors import PartitionError
from partitioner.runtime.distributed.fsdp import fsdp_problem

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"


def _records(world: int, scenario: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    per_rank = results(launch(WORKER, world, [scenario, json.dumps(args)], timeout=300))
    return [record for records in per_rank for record in records]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "mesh"), [(2, {"pp": 1, "dp": 2}),
                                             (4, {"pp": 1, "dp": 4}),
                                             (4, {"pp": 2, "dp": 2})],
                         ids=["dp2", "dp4", "pp2xdp2"])
def test_three_steps_equal_plain_data_parallelism(world: int, mesh: dict[str, int]) -> None:
    records = _records(world, "equal", mesh)
    assert len(records) == 2 * world   # AdamW and SGD with momentum on every rank
    for record in records:
        # float64: FSDP's shards step as the whole tensors; clipping (which bites: every
        # norm is above max_norm) sees the global norm over the shards.
        assert record["weight_diff"] < 1e-12, record
        assert record["loss_diff"] < 1e-12 and record["norm_diff"] < 1e-12, record
        assert record["eval_diff"] < 1e-12, record
        assert record["clipped"] and record["moved"] > 1e-4, record
        # Each replica holds 1/dp of the parameters, gradients and optimizer state.
        share = record["plain_param_elements"] // mesh["dp"]
        assert record["param_elements"] == share, record
        assert record["grad_elements"] == share, record
        assert record["state_elements"] == record["plain_state_elements"] // mesh["dp"], record


@pytest.mark.slow
def test_float32_steps_equal_plain_data_parallelism() -> None:
    records = _records(2, "equal", {"pp": 1, "dp": 2, "dtype": "float32"})
    assert len(records) == 4
    for record in records:
        # A sum of two replicas' float32 gradients in another order: rounding only.
        assert record["weight_diff"] < 1e-5 and record["loss_diff"] < 1e-5, record
        assert record["moved"] > 1e-4 and record["param_elements"] * 2 == \
            record["plain_param_elements"], record


@pytest.mark.slow
@pytest.mark.parametrize(("model", "chunks", "units"), [("mlp", 1, 9), ("mlp", 2, 9),
                                                        ("llama", 1, 5)],
                         ids=["mlp-one-micro-batch", "mlp-two", "llama-one-micro-batch"])
def test_each_layer_is_its_own_unit(model: str, chunks: int, units: int) -> None:
    """Per-layer FSDP units: leaf modules as they are called, a torch.export capture's
    layers outlined into modules (embedding, 2 decoder layers, norm, head). With one
    micro-batch a step a layer is freed after its forward (FSDP alone, ZeRO-3); with
    several, all stay gathered until the step's reduce-scatter (torch's pipelining)."""
    records = _records(2, "layers", {"model": model, "chunks": chunks, "dp": 2})
    assert len(records) == 2
    for record in records:
        assert record["units"] == units, record
        assert record["names_equal"], record
        assert record["loss_diff"] < 1e-12 and record["weight_diff"] < 1e-12, record
        assert record["param_elements"] * 2 >= record["plain_param_elements"] - units
        seen = record["seen"]
        assert len(seen) == units * 2 * chunks, seen  # every layer, every forward
        if chunks == 1:
            # The layer starting and at most the one FSDP prefetched, never the rest.
            assert max(seen) <= 2, seen
        else:
            assert max(seen) == units, seen  # the second micro-batch: all still gathered


@pytest.mark.slow
def test_a_model_too_small_for_the_mesh_is_refused_on_every_rank() -> None:
    records = _records(4, "refuse", {})
    assert len(records) == 4
    for record in records:
        assert record["error"] is not None, record
        assert "dp=4" in record["error"] and "largest first dim is 1" in record["error"]
        assert "pass dp <= 1" in record["error"]


def test_fsdp_problem_names_the_sizes_and_the_fix() -> None:
    params = [("0.weight", torch.nn.Parameter(torch.zeros(3, 8))),
              ("0.bias", torch.nn.Parameter(torch.zeros(3)))]
    message = fsdp_problem(params, dp=4, stage=1)
    assert message is not None
    assert "dp=4" in message and "stage 1" in message and "(3, 8)" in message
    assert "replica 3 would hold nothing" in message and "pass dp <= 3" in message
    assert fsdp_problem(params, dp=3, stage=1) is None
    assert fsdp_problem(params, dp=1, stage=0) is None


def test_partition_distributed_refuses_an_unknown_sharding() -> None:
    with pytest.raises(PartitionError, match="sharding='zero' is unknown"):
        partition_distributed(torch.nn.Linear(2, 2), sharding="zero")


def test_optimizer_sharding_true_beside_fsdp_is_refused() -> None:
    with pytest.raises(PartitionError, match="sharding=.fsdp. and sharding .optimizer. given"):
        partition_distributed(torch.nn.Linear(2, 2), optimizer_sharding=True, sharding="fsdp")
