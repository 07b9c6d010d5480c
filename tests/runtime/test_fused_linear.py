"""Linear layers with weight gradients added into ``.grad`` in place: same gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioner.runtime.fused_linear import linear, linear_module


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5), (5,)])
def test_gradients_equal_autograd_over_accumulated_micro_batches(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    fused = nn.Linear(5, 4).double()
    plain = copy.deepcopy(fused)
    for _ in range(3):   # three micro-batches accumulate
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        linear_module(x, fused).sin().sum().backward()
        plain(x2).sin().sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad)
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad)


def test_gradients_reach_weights_when_the_input_needs_none() -> None:
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)                    # data: no requires_grad
    linear_module(x, layer).sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(4, 2).t() @ x)
    torch.testing.assert_close(layer.bias.grad, torch.full((2,), 4.0))


def test_post_accumulate_hooks_run_once_per_backward() -> None:
    layer = nn.Linear(3, 2)
    seen: list[str] = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: seen.append("weight"))
    layer.bias.register_post_accumulate_grad_hook(lambda p: seen.append("bias"))
    for _ in range(2):
        linear_module(torch.randn(4, 3), layer).sum().backward()
    assert seen == ["weight", "bias", "weight", "bias"]


def test_without_a_bias_and_through_the_functional_form() -> None:
    weight = nn.Parameter(torch.randn(2, 3))
    x = torch.randn(4, 3)
    linear(x, weight).pow(2).sum().backward()
    expected = 2 * (x @ weight.detach().t()).t() @ x
    torch.testing.assert_close(weight.grad, expected)


def test_plain_linear_is_used_where_fusion_would_change_behaviour() -> None:
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert type(linear_module(x, layer).grad_fn).__name__ == "_LinearBackward"
    with torch.no_grad():
        assert linear_module(x, layer).grad_fn is None
    layer.weight.register_hook(lambda g: g * 2)          # a tensor hook must still run
    out = linear_module(x, layer)
    assert type(out.grad_fn).__name__ != "_LinearBackward"
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, 2 * torch.ones(4, 2).t() @ x)
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert linear_module(x, frozen).grad_fn is None


def test_an_in_place_change_of_the_weight_before_backward_is_caught() -> None:
    layer = nn.Linear(3, 2)
    out = linear_module(torch.randn(4, 3, requires_grad=True), layer)
    with torch.no_grad():
        layer.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
