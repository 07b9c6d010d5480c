"""The multi-process pipeline: every weight after 3 steps equals full-batch training.

(Linear weight gradients are fused into ``.grad`` by default; one configuration runs
without, so both paths are checked.)

Worlds of 2 and 4 gloo processes run PP=2, PP=4, DP=2 and PP=2 x DP=2 with GPipe and 1F1B
in every checkpoint mode, each from a copy of one float64 model, and compare every
parameter of their stage with single-process full-batch training after 3 SGD-with-momentum
steps. In float64 the only differences are the order of sums (micro-batches accumulate, and
replicas average), so parameters agree to ~1e-16; the bound 1e-12 leaves room for that and
nothing else (a wrong loss weight or a missed micro-batch shows at 1e-2). The processes start
once per world; every configuration runs in them one after another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from distributed_harness import launch, results
from models import LongSkip

from partitioner.errors import (
    ChunksError,
    CommunicationError,
    ScheduleError,
    StageExecutionError,
    StrategyError,
)
from partitioner.runtime.distributed.p2p import PipeLinks
from partitioner.runtime.distributed.pipeline import DistributedPipeline, LossError, StageInterface
from partitioner.runtime.schedule_registry import Runtime, schedule_kind, schedule_names
from partitioner.runtime.stage import StageRunner

WORKER = Path(__file__).with_name("dist_worker.py")
TOLERANCE = 1e-12

TWO = [
    dict(pp=2, dp=1, schedule="gpipe", checkpoint="never", chunks=4),
    dict(pp=2, dp=1, schedule="gpipe", checkpoint="always", chunks=3),
    dict(pp=2, dp=1, schedule="1f1b", checkpoint="except_last", chunks=4, balance=[3, 3]),
    dict(pp=2, dp=1, schedule="1f1b", checkpoint="always", chunks=5, model="mlp"),
    dict(pp=1, dp=2, schedule="gpipe", checkpoint="never", chunks=2),
    dict(pp=1, dp=2, schedule="1f1b", checkpoint="except_last", chunks=1, bucket_mb=0.0003),
    dict(pp=2, dp=1, schedule="1f1b", checkpoint="never", chunks=4, fuse=False, clip=0.05),
    dict(pp=2, dp=1, schedule="1f1b", checkpoint="except_last", chunks=4, model="gpt2", batch=4),
    dict(pp=2, dp=1, schedule="zero_bubble", checkpoint="never", chunks=4),
    dict(pp=2, dp=1, schedule="zero_bubble", checkpoint="except_last", chunks=3, model="mlp",
         fuse=False),
    dict(pp=2, dp=1, schedule="interleaved", checkpoint="never", chunks=4, virtual=2),
    dict(pp=2, dp=1, schedule="interleaved", checkpoint="always", chunks=2, virtual=3,
         model="mlp", balance=[2, 1, 2, 1, 2, 1]),
]
FOUR = [
    dict(pp=4, dp=1, schedule="gpipe", checkpoint="except_last", chunks=4),
    dict(pp=4, dp=1, schedule="1f1b", checkpoint="never", chunks=5),
    dict(pp=4, dp=1, schedule="1f1b", checkpoint="always", chunks=3, model="mlp"),
    dict(pp=2, dp=2, schedule="gpipe", checkpoint="never", chunks=3),
    dict(pp=2, dp=2, schedule="1f1b", checkpoint="always", chunks=4, bucket_mb=0.0003),
    dict(pp=2, dp=2, schedule="gpipe", checkpoint="except_last", chunks=2, model="tied",
         clip=0.05),
    dict(pp=4, dp=1, schedule="zero_bubble", checkpoint="never", chunks=6),
    dict(pp=2, dp=2, schedule="zero_bubble", checkpoint="except_last", chunks=4),
    dict(pp=4, dp=1, schedule="interleaved", checkpoint="never", chunks=4, virtual=2,
         model="mlp", balance=[1, 1, 1, 1, 1, 1, 1, 2]),
    dict(pp=2, dp=2, schedule="interleaved", checkpoint="except_last", chunks=2, virtual=2),
    dict(pp=4, dp=1, schedule="v_shape", checkpoint="except_last", chunks=4, virtual=2,
         model="mlp", balance=[1, 1, 1, 1, 1, 1, 1, 2]),
    dict(pp=2, dp=2, schedule="v_shape", checkpoint="always", chunks=2, virtual=2),
]


def _name(cfg: dict[str, Any]) -> str:
    return (f"{cfg.get('model', 'longskip')}-pp{cfg['pp']}-dp{cfg['dp']}-{cfg['schedule']}-"
            f"{cfg['checkpoint']}-m{cfg['chunks']}{'' if cfg.get('fuse', True) else '-unfused'}"
            f"{'-clip' if 'clip' in cfg else ''}"
            f"{'-v' + str(cfg['virtual']) if 'virtual' in cfg else ''}")


@pytest.fixture(scope="module")
def world_of_two() -> list[list[dict[str, Any]]]:
    return results(launch(WORKER, 2, ["train", json.dumps(TWO)], timeout=360))


@pytest.fixture(scope="module")
def world_of_four() -> list[list[dict[str, Any]]]:
    return results(launch(WORKER, 4, ["train", json.dumps(FOUR)], timeout=480))


def _check(per_rank: list[list[dict[str, Any]]], index: int) -> None:
    records = [rank_records[index] for rank_records in per_rank]
    cfg = records[0]["config"]
    covered: set[str] = set()
    for r in records:
        assert r["max_diff"] < TOLERANCE, (r["rank"], r["max_diff"])
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOLERANCE, abs=TOLERANCE)
        if r["replica"] == 0:
            covered |= set(r["keys"])
        m, p, j, v = cfg["chunks"], cfg["pp"], r["stage"], cfg.get("virtual", 1)
        bound = schedule_kind(cfg["schedule"]).in_flight(p, m, j, v)
        assert r["peak_in_flight"] <= bound, (r["rank"], r["peak_in_flight"], bound)
        if cfg["schedule"] in ("gpipe", "1f1b", "zero_bubble"):  # the bound is reached
            assert r["peak_in_flight"] == bound, (r["rank"], r["peak_in_flight"], bound)
    for keys in records[0]["aliases"]:                  # tied: one tensor, several keys
        if covered & set(keys):
            covered |= set(keys)
    assert covered == set(records[0]["all_keys"])       # every weight was checked
    assert len({tuple(r["plan_balance"]) for r in records}) == 1
    assert records[0]["checkpoint_diff"] < TOLERANCE     # rank 0's consolidated file
    if "clip" in cfg:  # the whole model's gradient norm, on every rank, and it clipped
        for r in records:
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-9)
        assert max(records[0]["ref_norms"]) > cfg["clip"]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TWO)), ids=[_name(c) for c in TWO])
def test_two_ranks_equal_full_batch_training(world_of_two: Any, index: int) -> None:
    _check(world_of_two, index)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FOUR)), ids=[_name(c) for c in FOUR])
def test_four_ranks_equal_full_batch_training(world_of_four: Any, index: int) -> None:
    _check(world_of_four, index)


@pytest.fixture(scope="module")
def mistakes() -> dict[str, dict[str, Any]]:
    records = results(launch(WORKER, 1, ["errors", "{}"], timeout=120))[0]
    return {r["case"]: r for r in records}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "kind", "phrase"), [
    ("tp", "StrategyError", "pass a whole number of tensor-parallel shards >= 1"),
    ("tp_rules", "StrategyError", "pass tp=2 (or more) with them"),
    ("tp_world", "MeshError", "tp=2"),
    ("dp", "MeshError", "pick sizes whose product is 1"),
    ("mesh", "MeshError", "pp=2"),
    ("wrong_model", "StrategyError", "the plan was made for another model"),
    ("loss", "LossError", "return a scalar tensor"),
    ("closed", "ClosedError", "cannot train: this DistributedModel was closed"),
])
def test_mistakes_raise_partition_errors_naming_a_fix(mistakes: Any, case: str, kind: str,
                                                      phrase: str) -> None:
    record = mistakes[case]
    assert record["type"] == kind and record["partition_error"], record
    assert phrase in record["message"]


@pytest.mark.slow
def test_the_model_starts_in_the_models_mode(mistakes: Any) -> None:
    """Regression (issue #12): a DistributedModel of a model in eval mode said training."""
    assert mistakes["mode"] == {"case": "mode", "evaluating": False, "training": True}


@pytest.mark.slow
def test_calling_the_stage_says_to_use_step(mistakes: Any) -> None:
    assert mistakes["call"]["type"] == "TypeError"
    assert "dpm.step(inputs, targets, loss_fn)" in mistakes["call"]["message"]


@pytest.mark.slow
def test_a_saved_plan_runs_as_written_unless_overridden(mistakes: Any) -> None:
    assert mistakes["plan_file"] == {"case": "plan_file", "balance": [9], "schedule": "1f1b"}
    assert mistakes["plan_override"] == {"case": "plan_override", "schedule": "gpipe",
                                         "chunks": 2}


# One stage in this process (no process group): the executor's own arithmetic.

def _pipeline(model: torch.nn.Module, chunks: int, **options: Any) -> DistributedPipeline:
    gm = fx.symbolic_trace(model)
    cpu = torch.device("cpu")
    return DistributedPipeline(StageRunner(0, gm, cpu), n_stages=1,
                               links=PipeLinks(None, None, None, cpu),
                               interfaces=lambda micro: [{0: StageInterface(None, None)}]
                               * len(micro),
                               chunks=chunks, **options)


def _full_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                loss_fn: Any) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.item(), grads


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_micro_batches_are_weighted_to_full_batch(schedule: str, checkpoint: str) -> None:
    model = LongSkip(8).double()
    x, y = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    want_loss, want = _full_batch(model, x, y, F.mse_loss)
    pipe = _pipeline(model, 4, schedule=schedule, checkpoint=checkpoint)   # 3, 3, 2, 2 rows
    loss = pipe.step([x], y, F.mse_loss, seed=0)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)


def test_sum_reduced_losses_are_not_reweighted() -> None:
    model = LongSkip(8).double()
    x, y = torch.randn(9, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target, reduction="sum")

    want_loss, want = _full_batch(model, x, y, loss_fn)
    pipe = _pipeline(model, 3, loss_reduction="sum")
    assert pipe.step([x], y, loss_fn, seed=0) == pytest.approx(want_loss, rel=1e-12)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)


def test_evaluate_returns_the_loss_without_touching_gradients() -> None:
    model = LongSkip(8).double()
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    want_loss, _ = _full_batch(model, x, y, F.mse_loss)
    model.zero_grad(set_to_none=True)
    assert _pipeline(model, 2).evaluate([x], y, F.mse_loss, seed=0) == pytest.approx(want_loss)
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_function_error_names_the_stage_and_micro_batch() -> None:
    def broken(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise KeyError("logits")

    with pytest.raises(StageExecutionError, match="loss_fn raised on stage 0 \\(micro-batch 0"):
        _pipeline(LongSkip(8), 2).step([torch.randn(4, 8)], torch.randn(4, 8), broken, seed=0)
    with pytest.raises(LossError, match="returned \\(2, 8\\)"):
        _pipeline(LongSkip(8), 2).step([torch.randn(4, 8)], torch.randn(4, 8),
                                       lambda out, y: out - y, seed=0)


def test_targets_must_match_the_batch_and_options_are_checked() -> None:
    with pytest.raises(ChunksError, match="targets have batch size 3 but the inputs 4"):
        _pipeline(LongSkip(8), 2).step([torch.randn(4, 8)], torch.randn(3, 8), F.mse_loss,
                                       seed=0)
    with pytest.raises(StrategyError, match="schedule='zb'.*loss_reduction='max'"):
        _pipeline(LongSkip(8), 2, schedule="zb", loss_reduction="max")


def test_a_failed_loss_all_reduce_is_a_communication_error(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # Regression: gloo's bare RuntimeError from the loss all-reduce, after a peer died,
    # escaped as this rank's own failure; it must read as a failed exchange.
    def dead_peer(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:4331")

    pipe = _pipeline(LongSkip(8).double(), 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *args: "gloo")
    monkeypatch.setattr(dist, "all_reduce", dead_peer)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(CommunicationError, match="the loss all-reduce over every rank "
                                                 "\\(stage 0\\) failed: .*Connection closed"):
        pipe.step([x], x, F.mse_loss, seed=0)


def test_every_registered_schedule_runs_on_both_runtimes() -> None:
    # v_shape's turn (stages P-1 and P on one rank) is handed over in memory by the links.
    names = schedule_names()
    assert set(names) == {"gpipe", "1f1b", "interleaved", "zero_bubble", "v_shape"}
    assert schedule_names([Runtime.MULTI_PROCESS]) == names
    assert schedule_names([Runtime.ONE_PROCESS]) == names


def test_schedule_and_virtual_stage_mistakes_name_the_fix() -> None:
    with pytest.raises(ScheduleError, match="needs virtual >= 2"):
        _pipeline(LongSkip(8), 2, schedule="interleaved")
    gm = fx.symbolic_trace(LongSkip(8))
    cpu = torch.device("cpu")
    runners = {0: StageRunner(0, gm, cpu), 2: StageRunner(2, gm, cpu)}
    with pytest.raises(ScheduleError, match="4 stages do not split into 3 virtual stages"):
        DistributedPipeline(runners, n_stages=4, links=PipeLinks(None, None, None, cpu),
                            interfaces=lambda micro: [], schedule="interleaved", virtual=3)
    with pytest.raises(ScheduleError, match="got 3 micro-batches; use a multiple of 2"):
        DistributedPipeline(runners, n_stages=4, links=PipeLinks(None, None, None, cpu),
                            interfaces=lambda micro: [], schedule="interleaved", virtual=2,
                            chunks=3)
    with pytest.raises(ScheduleError, match=r"holds virtual stages \[0\].*pass stages \[0, 2\]"):
        DistributedPipeline({0: runners[0]}, n_stages=4,
                            links=PipeLinks(None, None, None, cpu),
                            interfaces=lambda micro: [], schedule="interleaved", virtual=2,
                            chunks=2)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "kind", "phrase"), [
    ("virtual_pp1", "StrategyError", "pass pp >= 2 and tp=1, or virtual_stages=1"),
    ("virtual_schedule", "ScheduleError", "needs virtual >= 2"),
    ("virtual_type", "StrategyError", "virtual_stages=0; pass the model chunks per pipeline"),
    ("virtual_balance", "StrategyError", "balance has 1 entries but pp=1 x virtual_stages=2"),
    ("virtual_layers", "StrategyError", "virtual_stages=12"),
])
def test_virtual_stage_mistakes_raise_partition_errors(mistakes: Any, case: str, kind: str,
                                                       phrase: str) -> None:
    record = mistakes[case]
    assert record["type"] == kind and record["partition_error"], record
    assert phrase in record["message"]
