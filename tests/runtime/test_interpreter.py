"""One interpreter, every schedule, in one process: training equals full-batch training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

from partitioner.errors import BackwardError, StrategyError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads
from partitioner.runtime.fused_linear import WeightGrads, deferring, linear_module
from partitioner.runtime.local import LocalPipeline, fill_drain
from partitioner.runtime.schedule import validate
from partitioner.runtime.schedule_registry import SCHEDULES, Runtime, schedule_kind
from partitioner.runtime.stage import StageRunner

CPU = torch.device("cpu")


def _model(n_layers: int = 8, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n_layers // 2):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers).double()


def _stages(model: nn.Sequential, n: int, fuse: bool = True) -> list[fx.GraphModule]:
    per = len(model) // n
    graphs = []
    for k in range(n):
        part = nn.Sequential(*[copy.deepcopy(layer) for layer in model[k * per:(k + 1) * per]])
        gm = fx.symbolic_trace(_Tupled(part))
        if fuse:
            fuse_weight_grads(gm)
        graphs.append(gm)
    return graphs


class _Tupled(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.body(x)),)


def _reference(model: nn.Sequential, n_stages: int) -> nn.Module:
    """The unsplit model, as the stages compute it (a tanh after each stage)."""
    per = len(model) // n_stages
    return nn.Sequential(*[_Tupled(nn.Sequential(*model[k * per:(k + 1) * per]))
                           for k in range(n_stages)])


def _run_reference(reference: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for stage in reference:
        (x,) = stage(x)
    return x


CASES = [("gpipe", 2, 1), ("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
         ("interleaved", 2, 2), ("interleaved", 2, 4), ("zero_bubble", 2, 1),
         ("zero_bubble", 4, 1), ("v_shape", 2, 2), ("v_shape", 3, 2)]


def test_every_registered_schedule_is_covered_and_runs_in_one_process() -> None:
    assert {name for name, _, _ in CASES} == set(SCHEDULES)
    assert all(kind.runs_on(Runtime.ONE_PROCESS) for kind in SCHEDULES.values())


@pytest.mark.parametrize(("schedule", "p", "v"), CASES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_three_steps_equal_full_batch_training(schedule: str, p: int, v: int, checkpoint: str,
                                               reduction: str) -> None:
    model = _model()
    stages = _stages(model, p * v)
    reference = _reference(copy.deepcopy(model), p * v)
    m = 2 * p if schedule == "interleaved" else 5
    pipe = LocalPipeline(stages, [CPU] * p, chunks=m, checkpoint=checkpoint, schedule=schedule,
                         virtual=v)
    params = [q for g in stages for q in g.parameters()]
    ours = torch.optim.SGD(params, lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_fn = nn.MSELoss(reduction=reduction)
    torch.manual_seed(1)
    try:
        for _ in range(3):
            x, y = torch.randn(2 * m + 1, 6, dtype=torch.float64), torch.randn(2 * m + 1, 6,
                                                                               dtype=torch.float64)
            ours.zero_grad()
            loss = pipe.step([x], y, loss_fn, loss_reduction=reduction,
                             restructure=lambda out: out[0])
            theirs.zero_grad()
            expected = loss_fn(_run_reference(reference, x), y)
            expected.backward()
            assert loss == pytest.approx(expected.item(), rel=1e-10)
            ours.step()
            theirs.step()
        for a, b in zip(params, reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_memory_bound_of_1f1b_and_zero_bubble_holds(schedule: str) -> None:
    p, m = 4, 8
    pipe = LocalPipeline(_stages(_model(), p), [CPU] * p, chunks=m, schedule=schedule)
    try:
        pipe.step([torch.randn(16, 6, dtype=torch.float64)], None,
                  lambda out, _: out[0].square().mean())
        bound = [schedule_kind(schedule).in_flight(p, m, j) for j in range(p)]
        assert pipe.peak_in_flight == bound == [4, 3, 2, 1]
    finally:
        pipe.close()
    gpipe = LocalPipeline(_stages(_model(), p), [CPU] * p, chunks=m)
    try:
        gpipe.step([torch.randn(16, 6, dtype=torch.float64)], None,
                   lambda out, _: out[0].square().mean())
        assert gpipe.peak_in_flight == [m] * p
    finally:
        gpipe.close()


def test_zero_bubble_defers_the_linear_weight_gradients_to_w() -> None:
    layer = nn.Linear(3, 2).double()
    runner = StageRunner(0, fx.symbolic_trace(_Tupled(layer)), CPU)
    fuse_weight_grads(runner.graph_module)
    (out,) = runner.forward(0, [torch.randn(4, 3, dtype=torch.float64)], grad=True,
                            checkpoint=False, split=True)
    runner.backward(0, [torch.ones_like(out)])
    fused = [q for q in runner.graph_module.parameters()]
    assert all(q.grad is None for q in fused) and runner.in_flight == 1
    runner.weight(0)
    assert all(q.grad is not None for q in fused) and runner.in_flight == 0
    with pytest.raises(BackwardError, match="no input-gradient half of micro-batch 0"):
        runner.weight(0)


def test_weight_grads_queue_only_inside_deferring() -> None:
    layer, queued = nn.Linear(3, 2), WeightGrads()
    linear_module(torch.randn(2, 3), layer).sum().backward()
    assert layer.weight.grad is not None and len(queued) == 0
    layer.weight.grad = None
    with deferring(queued):
        y = linear_module(torch.randn(2, 3), layer)
    y.sum().backward()
    assert layer.weight.grad is None and len(queued) == 1


def test_pm_call_then_backward_still_runs_in_fill_drain_order_for_any_schedule() -> None:
    model = _model()
    stages = _stages(model, 4)
    reference = _reference(copy.deepcopy(model), 4)
    pipe = LocalPipeline(stages, [CPU] * 2, chunks=4, schedule="interleaved", virtual=2)
    try:
        x = torch.randn(8, 6, dtype=torch.float64)
        (out,) = pipe.run([x])
        out.square().sum().backward()
        _run_reference(reference, x).square().sum().backward()
        for a, b in zip([q for g in stages for q in g.parameters()], reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    finally:
        pipe.close()


def test_fill_drain_is_a_valid_schedule_over_virtual_stages() -> None:
    for p, m, v in [(1, 1, 1), (2, 3, 2), (3, 2, 3), (4, 4, 1)]:
        validate(fill_drain(p, m, v), p, m, v)


def test_step_refuses_an_unknown_loss_reduction() -> None:
    pipe = LocalPipeline(_stages(_model(), 2), [CPU] * 2, chunks=2)
    try:
        with pytest.raises(StrategyError, match="loss_reduction='avg'; use one of "
                                                "\\('mean', 'sum'\\)"):
            pipe.step([torch.randn(4, 6, dtype=torch.float64)], None,
                      lambda out, _: out[0].sum(), loss_reduction="avg")
    finally:
        pipe.close()
