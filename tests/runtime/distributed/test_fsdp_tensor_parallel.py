"""sharding="fsdp" with tp >= 2: FSDP2 cuts each tensor-parallel rank's slices over the ranks
holding the same stage and tp rank (runtime/distributed/fsdp.py), as torchtitan composes
them, and trains, clips, checkpoints and resumes as tp x dp without sharding does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results

from partitioner.errors import StrategyError
from partitioner.runtime.distributed.fsdp import check_fsdp

WORKER = Path(__file__).resolve().parent / "fsdp_tp_worker.py"
MESHES = [("mlp", 1), ("gpt", 1), ("mlp", 2)]
IDS = ["tp2xdp2", "tp2xdp2-fused-qkv", "pp2xtp2xdp2"]


def _records(scenario: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    world = 4 * args.get("pp", 1)
    per_rank = results(launch(WORKER, world, [scenario, json.dumps(args)], timeout=400))
    assert all(len(records) == 1 for records in per_rank), per_rank
    return [records[0] for records in per_rank]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "pp", "sp"), [(*m, False) for m in MESHES] + [("gpt", 1, True)],
                         ids=[*IDS, "tp2xdp2-sequence-parallel"])
def test_fsdp_over_tp_slices_trains_like_tp_and_the_whole_model(model: str, pp: int,
                                                                 sp: bool) -> None:
    """Three clipped AdamW steps in float64: the losses, gradient norms and weights equal
    tp x dp without sharding and the unpartitioned model; each rank holds half of its tp
    slice's parameters, gradients and optimizer state. With sequence parallelism too: the
    graph's sums of the norms' weight gradients run on FSDP's gathered slices."""
    records = _records("equal", {"model": model, "pp": pp, "sp": sp})
    assert sorted({(r["stage"], r["shard"]) for r in records}) == \
        [(j, t) for j in range(pp) for t in range(2)]
    for r in records:
        assert r["losses"] == pytest.approx(r["plain_losses"], rel=1e-12, abs=1e-12), r
        assert r["losses"] == pytest.approx(r["expected"], rel=1e-12, abs=1e-12), r
        # Clipping bites (every norm is above 0.01) and sees the whole model's norm: each
        # element of the shards counts once over tp x dp.
        assert r["norms"] == pytest.approx(r["expected_norms"], rel=1e-12), r
        assert min(r["norms"]) > 0.01
        assert r["weight_diff_plain"] < 1e-12 and r["weight_diff_whole"] < 1e-12, r
        assert r["eval_diff"] < 1e-12 and r["moved"] > 1e-3, r
        assert r["dtensors"], r  # state_dict(): DTensors of the whole tensors
        assert r["param_elements"] * 2 == r["plain_param_elements"], r
        assert r["grad_elements"] == r["param_elements"], r
        assert r["state_elements"] * 2 == r["plain_state_elements"], r


@pytest.mark.slow
@pytest.mark.parametrize(("model", "pp"), MESHES, ids=IDS)
def test_an_fsdp_tp_folder_resumes_exactly_and_converts_to_the_whole_model(
        tmp_path: Path, model: str, pp: int) -> None:
    """A folder saved at tp=2 x dp=2 with FSDP (each piece where tp then FSDP cut it)
    resumes exactly with FSDP and without; ``checkpoint_to_state_dict`` gives the whole
    model's state dict, whose one file an FSDP model loads (and ``load_state_dict`` of its
    DTensors or of whole tensors puts back); a one-file save is refused."""
    records = _records("resume", {"model": model, "pp": pp, "path": str(tmp_path / "ckpt")})
    for r in records:
        assert r["resumed"] == r["written"] and r["plain"] == r["written"], r
        assert r["load_diff"] == 0.0 and r["file_diff"] == 0.0, r
        assert "save to a folder" in r["one_file_error"], r
        assert r["state_dict_error"] == "", r
    assert records[0]["converted_diff"] < 1e-12, records[0]


def test_fsdp_refusals_name_the_value_and_the_fix() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    cases = [(dict(dp=1, virtual=1, tied=False), "dp=1.*pass dp=2 or more"),
             (dict(dp=2, virtual=2, tied=False), "virtual_stages=2.*pass virtual_stages=1"),
             (dict(dp=2, virtual=1, tied=True), "tied across pipeline stages.*sharding="),
             (dict(dp=8, virtual=1, tied=False), "dp=8.*replica 4 would hold nothing")]
    for kwargs, message in cases:
        with pytest.raises(StrategyError, match=message):
            check_fsdp([gm], gm, stage=0, split=False, **kwargs)
    check_fsdp([gm], gm, dp=2, stage=0, virtual=1, split=False, tied=False)
