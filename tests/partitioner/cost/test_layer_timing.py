"""Tests of partitioner/cost/layer_timing.py: layers timed in training passes of the model."""

from __future__ import annotations

import doctest
import time

import torch
from torch import nn

import partitioner.cost.layer_timing
from partitioner.analysis import analyze
from partitioner.cost.layer_timing import instrumented, time_layers


class Sleep(torch.autograd.Function):
    """A layer whose forward takes 50 ms and whose backward takes 100 ms."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x * 1.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return grad


class Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x)


def test_a_slow_layer_s_forward_and_backward_are_charged_to_it() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Slow(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    analysis = analyze(model, (torch.randn(4, 8),))
    assert analysis.inputs is not None
    names = [layer.name for layer in analysis.layers]
    times = time_layers(analysis.captured.graph_module, analysis.layers, analysis.inputs,
                        repeats=1, warmup=1).layers
    slow = names.index("1")
    forward, backward = times[slow]
    assert forward > 0.04 and backward > 0.08, times
    others = [t for k, t in enumerate(times) if k != slow]
    assert all(f < 0.025 and b < 0.05 for f, b in others), times


def test_a_layer_whose_outputs_need_no_gradient_has_no_backward() -> None:
    frozen = nn.Linear(8, 8).requires_grad_(False)
    model = nn.Sequential(frozen, nn.ReLU(), nn.Linear(8, 2))
    analysis = analyze(model, (torch.randn(4, 8),))
    assert analysis.inputs is not None
    times = time_layers(analysis.captured.graph_module, analysis.layers, analysis.inputs,
                        repeats=1, warmup=0).layers
    assert [b for _, b in times[:2]] == [0.0, 0.0] and times[2][1] > 0
    assert all(f > 0 for f, _ in times)


def test_the_clocked_copy_computes_what_the_graph_does_and_leaves_it_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    analysis = analyze(model, (x,))
    gm = analysis.captured.graph_module
    before = [n.format_node() for n in gm.graph.nodes]
    copy = instrumented(gm, analysis.layers)
    clock = partitioner.cost.layer_timing._Clock(len(analysis.layers))
    partitioner.cost.layer_timing._RUNNING.append(clock)
    try:
        torch.testing.assert_close(copy(x), gm(x))
    finally:
        partitioner.cost.layer_timing._RUNNING.pop()
    assert [n.format_node() for n in gm.graph.nodes] == before
    assert dict(copy.named_parameters()).keys() == dict(gm.named_parameters()).keys()
    assert all(p is q for p, q in zip(copy.parameters(), gm.parameters()))
    assert all(s > 0 for s in clock.starts)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.layer_timing).failed == 0


def test_the_optimizer_is_timed_without_changing_the_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    analysis = analyze(model, (torch.randn(4, 8),))
    assert analysis.inputs is not None
    before = [p.detach().clone() for p in model.parameters()]
    timed = time_layers(analysis.captured.graph_module, analysis.layers, analysis.inputs,
                        repeats=2, warmup=1, optimizer=True)
    assert timed.optimizer is not None and timed.optimizer > 0
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert time_layers(analysis.captured.graph_module, analysis.layers, analysis.inputs,
                       repeats=1, warmup=0).optimizer is None
