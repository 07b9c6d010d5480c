"""The sharded optimizer (ZeRO-1): same weights as plain data parallelism, resharded resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results

from partitioner.distributed import partition_distributed
from partitioner.errors import StrategyError

WORKER = Path(__file__).resolve().parent / "zero_worker.py"


def _equal(world: int, mesh: dict[str, int]) -> list[dict[str, Any]]:
    per_rank = results(launch(WORKER, world, ["equal", json.dumps(mesh)], timeout=300))
    return [record for records in per_rank for record in records]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "mesh"), [(2, {"pp": 1, "dp": 2}),
                                             (2, {"pp": 1, "dp": 2, "generic": True}),
                                             (4, {"pp": 2, "dp": 2}),
                                             (4, {"pp": 1, "dp": 4}),
                                             (4, {"pp": 1, "dp": 2, "tp": 2})],
                         ids=["dp2", "dp2-nccl-collectives", "pp2xdp2", "dp4", "tp2xdp2"])
def test_three_steps_equal_plain_data_parallelism(world: int, mesh: dict[str, int]) -> None:
    records = _equal(world, mesh)
    assert len(records) == 2 * world   # AdamW and SGD with momentum on every rank
    for record in records:
        # float64: the slices step exactly as the whole tensors; clipping (which bites:
        # every norm is above max_norm) sees the global norm over the slices.
        assert record["weight_diff"] < 1e-10, record
        assert record["loss_diff"] < 1e-10 and record["norm_diff"] < 1e-10, record
        assert record["clipped"] and record["moved"] > 1e-4, record
        assert record["grads_in_buffer"]   # parameters and .grad: views of the flat buffers
        # Each replica holds 1 / dp of the state (padding to a multiple of dp aside).
        dp = mesh["dp"]
        assert record["state_elements"] <= record["plain_state_elements"] // dp + dp, record


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_a_step_makes_no_full_size_copy_of_the_parameters_or_gradients(dp: int) -> None:
    records = results(launch(WORKER, dp, ["lean", json.dumps({"dp": dp})], timeout=300))
    for (record,) in records:
        # Backward accumulates into the flat gradients, the reduce-scatter reads them, the
        # all-gather writes the flat parameters: what is new is a slice (1 / dp) or smaller.
        assert record["grads_in_buffer"], record
        assert record["largest"] <= record["params"] // dp + dp, record
        # The slice now holds the average, not this replica's sum: adding to it is refused.
        assert "without zero_grad" in record["error"], record


@pytest.fixture(scope="module", params=["ckpt.pt", "ckpt"], ids=["one-file", "folder"])
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[int, list[dict[str, Any]]]:
    # One file gathered on rank 0 (checkpoint_io), or a DCP folder (sharded_checkpoint).
    path = tmp_path_factory.mktemp("zero") / request.param
    out = {}
    for dp, write in [(2, True), (1, False), (4, False)]:
        args = json.dumps({"dp": dp, "path": str(path), "write": write})
        out[dp] = results(launch(WORKER, dp, ["resume", args], timeout=300))[0]
    return out


@pytest.mark.slow
def test_a_checkpoint_written_at_dp2_resumes_at_dp1_and_dp4(
        resumed: dict[int, list[dict[str, Any]]]) -> None:
    written = resumed[2][0]["losses"]
    for dp in (1, 4):
        # Step 3 checks the weights, step 4 the resharded AdamW moments and step count.
        assert resumed[dp][0]["losses"] == pytest.approx(written, abs=1e-10, rel=0)
        assert resumed[dp][0]["steps"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt.pt", "ckpt"], ids=["one-file", "folder"])
def test_a_tensor_parallel_sharded_checkpoint_resumes_exactly(tmp_path: Path,
                                                              name: str) -> None:
    args = json.dumps({"path": str(tmp_path / name)})
    for (record,) in results(launch(WORKER, 4, ["resume_tp", args], timeout=300)):
        # tp=2 x dp=2: the moments are cut over tp, then over dp, and put back on load.
        assert record["resumed"] == pytest.approx(record["written"], abs=1e-12, rel=0)


@pytest.mark.slow
def test_sharding_with_one_replica_names_dp_and_the_fix(
        resumed: dict[int, list[dict[str, Any]]]) -> None:
    message = resumed[1][1]["error"]
    assert "optimizer_sharding=True with dp=1" in message and "dp=2 or more" in message


def test_optimizer_sharding_must_be_a_bool() -> None:
    with pytest.raises(StrategyError, match="optimizer_sharding='yes'.*True .* or False"):
        partition_distributed(torch.nn.Linear(2, 2), optimizer_sharding="yes")  # type: ignore[arg-type]
