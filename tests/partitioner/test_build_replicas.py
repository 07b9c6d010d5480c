"""Tests of partitioner/build.py's build_replicas: data-parallel replicas in one process are
transparent (outputs and gradients of the unsplit model) and train like it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from models import gpt2, grads_match, mlp
from replicated import replicated, same
from torch import nn
from tp_models import mlp_pair

from partitioner.analysis import analyze
from partitioner.build import build_replicas
from partitioner.errors import DeviceError, StrategyError
from partitioner.planning.planner import plan_request
from partitioner.plans.plan import Mesh
from partitioner.request import PlanRequest
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.replica_copy import GraphReplica
from partitioner.runtime.tensor_parallel.module import TensorParallelModule
from partitioner.tensor_parallel import plan_tensor_parallel


class KeywordsAndTuple(nn.Module):
    """Takes a keyword input and returns a tuple (logits, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = torch.tanh(self.a(x))
        return self.b(hidden) + self.c(extra), hidden


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("make", [mlp, _dropout_model], ids=["mlp", "dropout_eval"])
def test_outputs_and_gradients_equal_the_model(dp: int, make: type) -> None:
    model = make().double().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(10, 12, dtype=torch.float64)  # 10 over 4 replicas: 3, 3, 2, 2
    with replicated(model, (x,), dp) as pm:
        assert [type(r) for r in pm.replicas] == [GraphReplica] * dp
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = pm(x1)
        same(out, reference(x))
        out.pow(3).mean().backward()
        reference(x2).pow(3).mean().backward()
    grads_match(model, reference)
    same(x1.grad, x2.grad)


@pytest.mark.parametrize("dp", [2, 4])
def test_keyword_inputs_and_tuple_outputs(dp: int) -> None:
    model = KeywordsAndTuple().double()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 6, dtype=torch.float64)
    extra = torch.randn(7, 4, dtype=torch.float64)
    with replicated(model, (x,), dp, kwargs={"extra": extra}) as pm:
        logits, hidden = pm(x, extra=extra)
        want_logits, want_hidden = reference(x, extra=extra)
        same(logits, want_logits)
        same(hidden, want_hidden)
        (logits.square().sum() + hidden.sum()).backward()
        (want_logits.square().sum() + want_hidden.sum()).backward()
    grads_match(model, reference)


def test_pipeline_replicas_equal_the_model() -> None:
    model = mlp().double()
    reference = copy.deepcopy(model)
    x = torch.randn(9, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2, pp=2, chunks=2) as pm:
        assert [type(r) for r in pm.replicas] == [PartitionedModule] * 2
        same(pm(x), reference(x))
        pm(x).sum().backward()
        reference(x).sum().backward()
    grads_match(model, reference)


@pytest.mark.slow
def test_exported_gpt2_equals_the_model() -> None:
    """torch.export capture (its graphs deep-copied for replica 1, captured again for
    training mode) and a ModelOutput joined across replicas."""
    model = gpt2(dropout=0.1).double().eval()
    reference = copy.deepcopy(model)
    x = torch.randint(0, 64, (5, 8))
    with replicated(model, (x,), dp=2) as pm:
        assert pm.plan.capture == "export"
        out = pm(x)
        same(out.logits, reference(x).logits)
        out.logits.square().sum().backward()
        reference(x).logits.square().sum().backward()
        grads_match(model, reference)
        pm.train()
        assert not torch.allclose(pm(x).logits, reference(x).logits)


@pytest.mark.parametrize("pp", [1, 2])
def test_switching_to_eval_mode_stops_dropout(pp: int) -> None:
    """The other mode's graphs are captured on first use, from every replica's thread."""
    model = _dropout_model().double().train()
    reference = copy.deepcopy(model).eval()
    x = torch.randn(8, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2, pp=pp, balance=[2, 2] if pp == 2 else None) as pm:
        assert not torch.allclose(pm(x), reference(x))
        pm.eval()
        assert [r.training for r in pm.replicas] == [False, False]
        same(pm(x), reference(x))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3,
           use_step: bool = True) -> list[float]:
    """``steps`` SGD steps on the batch; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        if use_step and hasattr(model, "step"):
            losses.append(model.step(x, y, nn.functional.mse_loss))
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    return losses


@pytest.mark.parametrize("use_step", [True, False], ids=["step", "forward_backward"])
@pytest.mark.parametrize("dp,pp", [(2, 1), (4, 1), (2, 2)])
def test_sgd_steps_equal_full_batch_training(dp: int, pp: int, use_step: bool) -> None:
    """With a mean loss the replicas' summed gradients are the full batch's mean gradient:
    step() weights each share's mean loss by its share of the batch."""
    model = mlp().double()
    reference = copy.deepcopy(model)
    x = torch.randn(10, 12, dtype=torch.float64)
    y = torch.randn(10, 6, dtype=torch.float64)
    with replicated(model, (x,), dp, pp) as pm:
        losses = _train(pm, x, y, use_step=use_step)
    want = _train(reference, x, y)
    assert losses == pytest.approx(want, abs=1e-10)
    for p, q in zip(model.parameters(), reference.parameters()):
        same(p, q)


def test_state_dict_has_the_models_keys_and_loads_into_every_replica() -> None:
    model = mlp().double()
    x = torch.randn(4, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        assert list(pm.state_dict()) == list(model.state_dict())
        other = mlp().double()
        pm.load_state_dict(other.state_dict())
        same(pm(x), other(x))  # replica 1 (the second half) took the loaded weights too
        assert pm.plan.mesh == Mesh(2, 1, 1)


def _parts(model: nn.Module, x: torch.Tensor, devices: int, mesh: Mesh) -> tuple:
    request = PlanRequest.make(["cpu"] * mesh.pp, "pipeline", example_inputs=(x,), local=True)
    analysis = analyze(model, request.example_inputs, request.kwargs)
    plan = dataclasses.replace(plan_request(analysis, request), mesh=mesh)
    return analysis, plan, dataclasses.replace(request, devices=("cpu",) * devices)


def test_wrong_device_count_refused() -> None:
    model, x = mlp(), torch.randn(4, 12)
    analysis, plan, request = _parts(model, x, 3, Mesh(2, 1, 1))
    with pytest.raises(DeviceError, match="dp=2 x pp=1 x tp=1 needs 2 devices but 3"):
        build_replicas(model, analysis, plan, request)


def test_tensor_parallel_replicas_need_their_setup() -> None:
    model, x = mlp(), torch.randn(4, 12)
    analysis, plan, request = _parts(model, x, 4, Mesh(2, 1, 1))
    plan = dataclasses.replace(plan, mesh=Mesh(2, 1, 2))
    with pytest.raises(StrategyError, match="tp=2 but no tensor-parallel setup"):
        build_replicas(model, analysis, plan, request)


@pytest.mark.parametrize("pp", [1, 2])
def test_tensor_parallel_replicas_equal_the_model(pp: int) -> None:
    model = nn.Sequential(mlp_pair(), nn.Tanh(), mlp_pair()).double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 16, dtype=torch.float64)
    y = torch.randn(6, 16, dtype=torch.float64)
    setup = plan_tensor_parallel(model, ["cpu"] * 2 * pp, 2, example_inputs=(x,))
    plan = dataclasses.replace(setup.plan, mesh=Mesh(2, pp, 2))
    request = dataclasses.replace(setup.request, devices=(torch.device("cpu"),) * 4 * pp)
    with build_replicas(model, setup.analysis, plan, request, setup) as pm:
        assert [type(r) for r in pm.replicas] == [TensorParallelModule] * 2
        assert list(pm.state_dict()) == list(model.state_dict())
        losses = _train(pm, x, y, steps=2)
        state = pm.state_dict()
    want = _train(reference, x, y, steps=2)
    assert losses == pytest.approx(want, abs=1e-10)
    for key, value in reference.state_dict().items():
        same(state[key], value)
