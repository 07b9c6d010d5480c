"""A model's own torch.autograd.Function keeps its backward through partitioning, or the
capture refuses it (torch.export would drop the backward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.errors import TraceError
from partitioner.passes.autograd_functions import functions_as_calls, functions_called


class Twice(torch.autograd.Function):
    """The identity forward, a backward that doubles: inlining its forward halves grads."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class Doubling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Twice.apply(x)


class ShapeBranch(nn.Module):
    """Python control flow on a shape: symbolic tracing fails, torch.export succeeds."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 8:
            x = self.a(x)
        return self.b(Twice.apply(x))


def _grads(model: nn.Module, run: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run(x).pow(2).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_function_s_own_backward_survives_a_pipeline(chunks: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Doubling(), nn.Linear(8, 8), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    pm = partition(model, ["cpu", "cpu"], strategy="pipeline", chunks=chunks,
                   example_inputs=(x,))
    try:
        torch.testing.assert_close(pm(x), model(x))
        theirs, ours = _grads(model, model, x), _grads(model, pm, x)
    finally:
        pm.close()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, msg=name)
    # The double is visible: the first layer's gradient is not what inlining gives.
    model.zero_grad(set_to_none=True)
    plain = nn.Sequential(model[0], nn.Identity(), model[2], model[3])
    inlined = _grads(model, plain, x)["0.weight"]
    assert not torch.allclose(inlined, theirs["0.weight"])


def test_a_model_only_export_captures_is_refused_when_it_calls_a_function() -> None:
    with pytest.raises(TraceError, match=r"Twice.*drops.*symbolically traceable") as info:
        partition(ShapeBranch(), ["cpu", "cpu"], strategy="pipeline",
                  example_inputs=(torch.randn(4, 8),))
    assert "ShapeBranch" in str(info.value)


def test_function_apply_is_restored_after_tracing_fails() -> None:
    kept = torch.autograd.Function.__dict__["apply"]
    tracer = torch.fx.Tracer()
    with pytest.raises(RuntimeError, match="boom"), functions_as_calls(tracer):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"), functions_called():
        raise RuntimeError("boom")
    assert torch.autograd.Function.__dict__["apply"] is kept
    # Functions still run normally outside tracing.
    x = torch.ones(2, requires_grad=True)
    Twice.apply(x).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [2.0, 2.0]


def test_functions_called_names_only_functions_outside_torch() -> None:
    x = torch.ones(2, requires_grad=True)
    with functions_called() as seen:
        Twice.apply(x)
        torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
    assert seen == [Twice]


class _Checkpointed(nn.Module):
    """A block through ``torch.utils.checkpoint`` (transformers' gradient checkpointing)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)), x,
                                                 use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_model_checkpointing_itself_trains_as_it_does(reentrant: bool) -> None:
    """Regression: ``checkpoint(..., use_reentrant=True)`` was captured by torch.export with
    its Function's forward inlined under ``no_grad`` and its backward dropped: no parameter
    got a gradient (``.grad`` None on all ten), silently. The checkpointed function is now
    traced as it is (the same values and gradients; ``checkpoint=`` saves the memory)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), *[_Checkpointed(reentrant) for _ in range(4)])
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2,
                   calibrate=False)
    pm.step(x, y, nn.functional.mse_loss)
    for got, want in zip([p.grad for p in pm.parameters()], expected):
        assert got is not None
        torch.testing.assert_close(got, want)
