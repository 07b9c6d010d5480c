"""``pm.step(x, y, loss_fn)``: a training step in the plan's schedule, from ``partition``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.errors import StrategyError


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).double()


def _train(step: object, model: nn.Module, params: list[nn.Parameter]) -> list[float]:
    optimizer = torch.optim.SGD(params, lr=0.05)
    generator = torch.Generator().manual_seed(3)  # the pipeline draws from the global one
    losses = []
    for _ in range(3):
        x = torch.randn(12, 8, dtype=torch.float64, generator=generator)
        y = torch.randn(12, 4, dtype=torch.float64, generator=generator)
        optimizer.zero_grad()
        losses.append(step(x, y))  # type: ignore[operator]
        optimizer.step()
    return losses


def _trains_like(pm: nn.Module, reference: nn.Module) -> None:
    """Three SGD steps with ``pm.step`` equal full-batch training of ``reference``."""
    loss_fn = nn.MSELoss()
    try:
        ours = _train(lambda a, b: pm.step(a, b, loss_fn), pm, list(pm.parameters()))

        def plain(a: torch.Tensor, b: torch.Tensor) -> float:
            loss = loss_fn(reference(a), b)
            loss.backward()
            return loss.item()

        theirs = _train(plain, reference, list(reference.parameters()))
        assert ours == pytest.approx(theirs, rel=1e-10)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(pm.state_dict()[key], value, rtol=1e-10, atol=1e-10)
    finally:
        pm.close()  # type: ignore[operator]


@pytest.mark.parametrize("tensor_parallel", [None, 2])
def test_step_trains_like_full_batch_training(tensor_parallel: int | None) -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(12, 8, dtype=torch.float64)
    pm = partition(model, ["cpu", "cpu"], "pipeline" if tensor_parallel is None else "auto",
                   example_inputs=(x,), chunks=4, tensor_parallel=tensor_parallel)
    _trains_like(pm, reference)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
@pytest.mark.parametrize("tensor_parallel", [None, 2])
def test_step_runs_the_plans_schedule(schedule: str, tensor_parallel: int | None) -> None:
    if schedule == "interleaved" and tensor_parallel:
        pytest.skip("the tensor-parallel front cuts no model chunks (auto never plans it)")
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(12, 8, dtype=torch.float64)
    pm = partition(model, ["cpu"] * (4 if tensor_parallel else 2), "pipeline",
                   example_inputs=(x,), chunks=2 if schedule == "interleaved" else 4,
                   schedule=schedule, tensor_parallel=tensor_parallel)
    assert pm.plan.schedule == schedule
    _trains_like(pm, reference)


def test_step_sums_with_loss_reduction_sum() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    x, y = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=3)
    try:
        loss = pm.step(x, y, nn.MSELoss(reduction="sum"), loss_reduction="sum")
        expected = nn.MSELoss(reduction="sum")(reference(x), y)
        expected.backward()
        assert loss == pytest.approx(expected.item(), rel=1e-10)
        for ours, theirs in zip(pm.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-10)
    finally:
        pm.close()


def test_step_refuses_an_unknown_loss_reduction() -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = partition(_mlp(), ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2)
    try:
        with pytest.raises(StrategyError, match="loss_reduction='avg'; use one of"):
            pm.step(x, None, lambda out, _: out.sum(), loss_reduction="avg")
    finally:
        pm.close()
