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


def test_the_fusion_is_applied_only_where_it_pays() -> None:
    from partitioner.passes.fuse_weight_grads import CPU_MIN_WEIGHT, fusion_threshold
    # One micro-batch a step: the first gradient is taken, never added; fusing only costs.
    assert fusion_threshold(1, "gpipe", "cpu") is None
    assert fusion_threshold(1, "1f1b", "cuda") is None
    # A split backward queues the weight products for its W actions: every Linear.
    assert fusion_threshold(1, "zero_bubble", "cpu") == 0
    assert fusion_threshold(4, "zero_bubble", "cpu") == 0
    # Several micro-batches: on a CPU the large Linear layers only.
    assert fusion_threshold(4, "interleaved", "cpu") == CPU_MIN_WEIGHT
    assert fusion_threshold(4, "gpipe", "cuda") == 0


def test_a_weight_threshold_leaves_small_linears_and_functional_calls_to_autograd() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(512, 512))
    gm = fx.symbolic_trace(model)
    assert fuse_weight_grads(gm, min_weight=1 << 17).modified
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    assert targets[0] == "0" and targets[2] is fused_linear.linear_module
    functional = fx.symbolic_trace(_Functional())
    assert not fuse_weight_grads(functional, min_weight=1).modified
    untouched = fx.symbolic_trace(model)
    assert not fuse_weight_grads(untouched, min_weight=None).modified
    assert [n.op for n in untouched.graph.nodes].count("call_module") == 3


def test_one_process_replicas_and_single_micro_batch_pipelines_run_plain_linears() -> None:
    from partitioner import Mesh, partition
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(8, 8)

    def fused(graph: fx.GraphModule) -> bool:
        return any(n.target is fused_linear.linear_module for n in graph.graph.nodes)
    with partition(copy.deepcopy(model), ["cpu"] * 2, mesh=Mesh(dp=2),
                   example_inputs=(x,)) as replicas:
        graph = replicas.replicas[1]._graph_factory(True)
        assert not fused(graph)
    with partition(copy.deepcopy(model), ["cpu"] * 2, "pipeline", chunks=1,
                   example_inputs=(x,)) as pipe:
        assert not any(fused(r.graph_module) for r in pipe.pipeline().runners)
    with partition(copy.deepcopy(model), ["cpu"] * 2, "pipeline", chunks=2,
                   schedule="zero_bubble", example_inputs=(x,)) as split:
        assert all(fused(r.graph_module) for r in split.pipeline().runners)
