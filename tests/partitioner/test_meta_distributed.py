"""A model built on the meta device, partitioned over processes: each rank materializes and
loads only its share, and training matches the whole model's (``partition_distributed``,
``partitioner.runtime.materialize``, ``DistributedModel.load`` of a whole-model state dict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results
from meta_models import batches, build, build_tied, param_bytes, train_whole
from torch import nn

from partitioner import make_plan, partition_distributed
from partitioner.errors import InitError, MemoryLimitError

WORKER = Path(__file__).with_name("meta_worker.py")
STEPS = 3


def _whole_model(path: Path, tied: bool = False) -> torch.nn.Module:
    """The model with real weights, its state dict saved to ``path`` (what ranks load)."""
    torch.manual_seed(0)
    model = (build_tied() if tied else build()).double()
    torch.save(model.state_dict(), path)
    return model


def _run(tmp_path: Path, pp: int | None, tp: int | None, world: int = 0, **extra: Any
         ) -> tuple[list[dict[str, Any]], torch.nn.Module]:
    """Train the meta-built model on ``pp x tp`` ranks (or ``world``) from the whole
    model's weights file; return every rank's record and the whole model trained alike,
    in this process."""
    weights, saved = tmp_path / "whole.pt", tmp_path / "trained.pt"
    model = _whole_model(weights, bool(extra.get("tied")))
    args = dict(pp=pp, tp=tp, steps=STEPS, weights=str(weights), save=str(saved), **extra)
    runs = launch(WORKER, world or (pp or 1) * (tp or 1), [json.dumps(args)], timeout=300)
    records = [r[0] for r in results(runs)]
    losses = train_whole(model, batches(STEPS))
    for record in records:
        assert record["losses"] == pytest.approx(losses, abs=1e-10)
    trained = torch.load(saved)["model"]
    assert trained.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-10, msg=key)
    return records, model


def _check_memory(records: list[dict[str, Any]], model: torch.nn.Module, share: float) -> None:
    """Each rank holds its share of the parameters, and its resident memory grew by about
    that while it built its stage: far from the whole model."""
    whole = param_bytes(model)
    for record in records:
        assert record["param_bytes"] == pytest.approx(share * whole, rel=0.01)
        grown = (record["hwm_built_kib"] - record["hwm_before_kib"]) * 1024
        # Measured: pp=2 ~34 MB, pp=2 x tp=2 25-33 MB (a share of 17 MB plus one whole
        # layer, 8.4 MB, while slicing it) of 67 MB.
        assert grown < 0.6 * whole, (record, whole)
        assert record["still_meta"] > 0  # the model object itself was never filled


@pytest.mark.slow
def test_meta_model_trains_on_two_stages_within_a_memory_limit_too_small_for_it(
        tmp_path: Path) -> None:
    limit = 160e6  # the planner's whole-model estimate is ~236 MB, a stage's ~118 MB
    with torch.device("meta"):
        meta = build().double()
    example = (batches(1)[0][0],)
    with pytest.raises(MemoryLimitError):
        make_plan(meta, ["cpu"], "pipeline", example_inputs=example, chunks=2,
                  memory_limit=limit)
    records, model = _run(tmp_path, pp=2, tp=1, memory_limit=limit)
    assert [r["stage"] for r in records] == [0, 1]
    _check_memory(records, model, share=0.5)


@pytest.mark.slow
def test_meta_model_trains_on_two_stages_of_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    records, model = _run(tmp_path, pp=2, tp=2)
    assert [r["stage"] for r in records] == [0, 0, 1, 1]
    _check_memory(records, model, share=0.25)


@pytest.mark.slow
def test_meta_model_with_a_weight_tied_across_ranks_trains_like_the_whole_model(
        tmp_path: Path) -> None:
    """Each rank materializes the tied weight alike; the tie's gradients are still summed
    (the ties are found before the rank's stage gets its real tensors)."""
    records, _ = _run(tmp_path, pp=2, tp=1, tied=True)
    assert [r["stage"] for r in records] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(pp=2, schedule="interleaved", virtual_stages=2),  # two stages per rank
    dict(pp=None, strategy="auto"),  # whatever mesh the search chooses for two ranks
], ids=["interleaved", "auto"])
def test_meta_model_trains_like_the_whole_model_on_other_meshes(
        tmp_path: Path, options: dict[str, Any]) -> None:
    records, _ = _run(tmp_path, tp=None, world=2, **options)
    assert len(records) == 2


class _Table(nn.Module):
    """A module holding a parameter, without reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table.sum(0)


def test_a_meta_model_nothing_can_initialize_is_refused_before_starting_any_rank() -> None:
    """Refused on every rank alike, before torch.distributed starts (no world needed)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), _Table(), nn.Linear(8, 8))
    with pytest.raises(InitError, match=r"1 \(_Table\).*init_fn=fn"):
        partition_distributed(model, example_inputs=(torch.randn(2, 8),), pp=2)


def test_init_fn_for_a_real_model_is_refused_before_starting_any_rank() -> None:
    with pytest.raises(InitError, match="tensors are real"):
        partition_distributed(nn.Linear(8, 8), example_inputs=(torch.randn(2, 8),), pp=2,
                              init_fn=lambda module: None)
