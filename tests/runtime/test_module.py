"""Tests of runtime/module.py: the one-process PartitionedModule stands in for the model."""

from __future__ import annotations

import pytest
import torch
from models import gpt2
from torch import nn

from partitioner import partition
from partitioner.errors import ClosedError


def test_a_model_in_eval_mode_gives_a_module_in_eval_mode() -> None:
    """Regression (issue #12): ``model.eval(); pm = partition(model, ...)`` gave a module in
    training mode, whose pipeline (captured again by torch.export in training mode) ran
    dropout: outputs differed from the model's without any error."""
    model = gpt2(dropout=0.1).eval()
    x = torch.randint(0, 64, (6, 8))
    pm = partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=2)
    try:
        assert pm.training is False
        with torch.no_grad():
            torch.testing.assert_close(pm(x).logits, model(x).logits)
        pm.train()
        assert model.training
        with torch.no_grad():  # the training-mode pipeline does run dropout
            assert not torch.allclose(pm(x).logits, model.eval()(x).logits)
    finally:
        pm.close()


@pytest.mark.parametrize("training", [True, False])
def test_starts_in_the_models_mode_with_fx_capture(training: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train(training)
    with partition(model, ["cpu"] * 2, balance=[2, 1]) as pm:
        assert pm.training is training
        assert model.training is training


def test_close_twice_and_running_after_close_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with partition(model, ["cpu"] * 2, balance=[1, 1]) as pm:
        torch.testing.assert_close(pm(x), model(x))
    pm.close()  # idempotent
    with pytest.raises(ClosedError, match="run the pipeline"):
        pm(x)
    assert sorted(pm.state_dict()) == sorted(model.state_dict())


def test_clip_grad_norm_is_the_models() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(6, 4)
    with partition(model, ["cpu"] * 2, balance=[2, 1], chunks=3) as pm:
        pm(x).pow(2).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        norm = pm.clip_grad_norm_(0.01)
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(grads))
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(clipped) == pytest.approx(0.01, rel=1e-3)
