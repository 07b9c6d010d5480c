"""The pass routing Linear layers through ``partitioner.runtime.fused_linear``."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from partitioner.passes.fuse_weight_grads import fuse_weight_grads
from partitioner.runtime import fused_linear


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(x), self.w)


def test_linear_modules_and_functional_calls_are_rewritten() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _Functional(), nn.Linear(4, 2))
    gm = fx.symbolic_trace(model)
    assert fuse_weight_grads(gm).modified
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(fused_linear.linear_module) == 2
    assert targets.count(fused_linear.linear) == 1
    assert not any(n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                         nn.Linear) for n in gm.graph.nodes)


def test_rewritten_graph_gives_the_same_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), _Functional()).double()
    reference = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    fuse_weight_grads(gm)
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(gm(x), reference(x))
    gm(x).square().sum().backward()
    reference(x).square().sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_graph_without_linear_layers_is_unchanged() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Tanh()))
    code = gm.code
    assert not fuse_weight_grads(gm).modified
    assert gm.code == code


def test_a_linear_with_hooks_stays_a_module_call_so_its_hooks_run() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    seen: list[str] = []
    model[1].register_forward_pre_hook(lambda module, args: seen.append("pre"))
    gm = fx.symbolic_trace(model)
    fuse_weight_grads(gm)
    kinds = [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_module",
                                                                   "call_function")]
    assert kinds == [("call_function", fused_linear.linear_module), ("call_module", "1")]
    gm(torch.randn(3, 4))
    assert seen == ["pre"]
