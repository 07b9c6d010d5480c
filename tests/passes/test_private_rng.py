"""Tests of passes/private_rng.py: dropout draws its masks from the stage's own generator."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import partitioner.passes.private_rng
from partitioner.passes.private_rng import route_dropout
from partitioner.runtime import rng


class Functional(nn.Module):
    """Every functional spelling of dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.25)
        x = F.dropout(x, p=0.5, training=True)
        x = F.dropout(x, 0.3, training=False)
        return torch.dropout(x, 0.4, True)


def routed(model: nn.Module) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    assert route_dropout(gm).modified
    return gm


def with_seed(gm: fx.GraphModule, x: torch.Tensor, seed: int) -> torch.Tensor:
    with rng.use_generator(torch.Generator().manual_seed(seed)):
        return gm(x)


def calls(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_module")]


def test_dropout_modules_are_rewritten_to_read_their_module() -> None:
    gm = routed(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    assert calls(gm) == ["0", rng.dropout_module]
    node = next(n for n in gm.graph.nodes if n.target is rng.dropout_module)
    x, module = node.args
    assert x.name == "_0"
    assert module.op == "get_attr" and module.target == "1"


def test_functional_dropouts_are_rewritten_with_their_arguments() -> None:
    gm = routed(Functional())
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in nodes] == [rng.dropout] * 4
    assert [n.args[1:] for n in nodes] == [(0.25, True), (0.5, True), (0.3, False), (0.4, True)]
    assert all(n.kwargs == {} for n in nodes)


def test_aten_dropout_is_rewritten() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.dropout.default, (x, 0.5, True)))
    gm = fx.GraphModule(nn.Module(), graph)
    assert route_dropout(gm).modified
    (node,) = graph.find_nodes(op="call_function", target=rng.dropout)
    assert node.args == (x, 0.5, True)


def test_the_same_generator_state_gives_the_same_masks() -> None:
    gm = routed(nn.Sequential(nn.Dropout(0.5), nn.Linear(64, 64), nn.Dropout(0.5)))
    x = torch.randn(8, 64)
    generator = torch.Generator().manual_seed(7)
    with rng.use_generator(rng.fork(generator)):
        first = gm(x)
    torch.manual_seed(123)  # the global generator plays no part
    with rng.use_generator(rng.fork(generator)):
        second = gm(x)
    assert torch.equal(first, second)


def test_the_masks_follow_the_installed_generator() -> None:
    gm = routed(nn.Sequential(nn.Dropout(0.5)))
    x = torch.ones(1000)
    assert not torch.equal(with_seed(gm, x, 1), with_seed(gm, x, 2))
    mask = torch.empty(1000).bernoulli_(0.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(with_seed(gm, x, 1), x * mask / 0.5)


def test_routed_dropout_leaves_the_global_generator_alone() -> None:
    gm = routed(Functional())
    x = torch.randn(100)
    state = torch.get_rng_state()
    with_seed(gm, x, 0)
    assert torch.equal(torch.get_rng_state(), state)


def test_routed_dropout_passes_through_in_eval_mode() -> None:
    gm = routed(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9)))
    gm.eval()
    x = torch.randn(16, 4)
    assert torch.equal(with_seed(gm, x, 0), gm.get_submodule("0")(x))


def test_routed_dropout_with_p_zero_passes_through() -> None:
    class Zero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x, 0.0) + torch.dropout(x, 0.0, True)

    x = torch.randn(16)
    assert torch.equal(with_seed(routed(Zero()), x, 0), x + x)
    assert torch.equal(with_seed(routed(nn.Sequential(nn.Dropout(0.0))), x, 0), x)


def test_routed_dropout_with_training_false_passes_through() -> None:
    class Off(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x, 0.9, training=False)

    x = torch.randn(16)
    assert torch.equal(with_seed(routed(Off()), x, 0), x)


def test_channel_dropout_modules_are_left_alone() -> None:
    model = nn.Sequential(nn.Dropout1d(0.5), nn.Dropout2d(0.5), nn.Dropout3d(0.5),
                          nn.AlphaDropout(0.5))
    gm = fx.symbolic_trace(model)
    code = gm.code
    result = route_dropout(gm)
    assert not result.modified
    assert calls(gm) == ["0", "1", "2", "3"]
    assert gm.code == code


def test_route_dropout_rewrites_in_place_and_keeps_other_nodes() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Dropout2d(0.5)))
    result = route_dropout(gm)
    assert result.graph_module is gm
    assert calls(gm) == ["0", rng.dropout_module, "2"]
    assert "dropout_module" in gm.code  # recompiled


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.private_rng).failed == 0


def test_modules_drawing_inside_run_under_the_stage_generator() -> None:
    from partitioner.passes.private_rng import route_module_randomness
    from partitioner.runtime import rng

    model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2, dropout=0.2),
                          nn.Dropout2d(0.1), nn.Dropout(0.5),
                          nn.MultiheadAttention(8, 2, dropout=0.0))

    class Uses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.m[0](x)
            h = self.m[1](h, h, h)[0] + self.m[4](h, h, h)[0]
            return self.m[3](self.m[2](h))
    gm = torch.fx.symbolic_trace(Uses())
    route_dropout(gm)
    assert route_module_randomness(gm).modified
    seeded = [n for n in gm.graph.nodes if n.target is rng.seeded_call]
    # The dropping attention and Dropout2d; not nn.Dropout (route_dropout's) nor p=0 attention.
    assert [str(n.args[0].target) for n in seeded] == ["m.1", "m.2"]
    x = torch.randn(3, 4, 8)
    generator = torch.Generator().manual_seed(7)
    with rng.use_generator(generator):
        first = gm(x)
    with rng.use_generator(torch.Generator().manual_seed(7)):
        again = gm(x)
    torch.testing.assert_close(first, again)


class _FP32DropoutBlock(nn.Module):
    """A product, then dropout inside ``torch.autocast(enabled=False)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = F.dropout(h.float(), 0.5, self.training)
        return self.b(h)


class _FP32Dropout(nn.Module):
    """Four such blocks, in a forward torch.fx cannot trace (``int`` of a size): torch.export
    captures it and keeps each autocast block as a graph of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_FP32DropoutBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int(x.shape[0])
        for block in self.blocks:
            x = block(x).reshape(rows, -1)
        return x


def test_a_dropout_in_an_autocast_blocks_graph_is_routed_and_replayed() -> None:
    """Regression: the pass rewrote the top graph only, so a dropout in an autocast block
    drew from torch's global generator and a checkpointed replay drew another mask: the
    gradients of ``checkpoint="always"`` differed from ``"never"``'s (0.065), silently."""
    from partitioner import partition
    from partitioner.passes.base import graph_modules

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    gm = torch.export.export(_FP32Dropout().train(), (x,), strict=False).module()
    inner = [m for name, m in gm.named_children() if isinstance(m, fx.GraphModule)]
    assert inner, "export no longer makes an autocast block a graph of its own"
    assert route_dropout(gm).modified
    left = [n.name for g in graph_modules(gm) for n in g.graph.nodes
            if n.target is torch.ops.aten.dropout.default]
    assert left == []

    def gradients(checkpoint: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        pm = partition(_FP32Dropout().train(), ["cpu", "cpu"], "pipeline", example_inputs=(x,),
                       checkpoint=checkpoint, calibrate=False)
        pm.step(x, y, F.mse_loss)
        return [p.grad for p in pm.parameters()]
    for kept, replayed in zip(gradients("never"), gradients("always")):
        torch.testing.assert_close(replayed, kept, rtol=0, atol=0)


class _Reparameterised(nn.Module):
    """A VAE's reparameterisation: ``mu + eps * std`` with ``eps = torch.randn_like(mu)``."""

    def __init__(self) -> None:
        super().__init__()
        self.mu, self.logvar = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = self.mu(x)
        return mu + torch.randn_like(mu) * torch.exp(0.5 * self.logvar(x))


class _ReparameterisedExported(nn.Module):
    """Four of them in a forward only torch.export captures (``int`` of a size)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Reparameterised() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int(x.shape[0])
        for block in self.blocks:
            x = block(x).reshape(rows, -1)
        return x


@pytest.mark.parametrize("captured", ["fx", "export"])
def test_random_ops_are_replayed_as_drawn(captured: str) -> None:
    """Regression: ``torch.randn_like`` in forward drew from torch's global generator, so a
    checkpointed replay drew another ``eps`` and the draws depended on thread timing: the
    same plan's losses and gradients differed between ``checkpoint="never"``, ``"always"``
    and ``"except_last"`` (0.83 apart in loss), silently. Random ops now run seeded from the
    stage's generator (``rng.seeded_op``); all three agree exactly."""
    from partitioner import partition

    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def run(checkpoint: str) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = (nn.Sequential(*[_Reparameterised() for _ in range(4)]) if captured == "fx"
                 else _ReparameterisedExported())
        pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,),
                       chunks=2 if captured == "fx" else 1, balance=(2, 2),
                       checkpoint=checkpoint, calibrate=False)
        names = [n.target for r in pm.pipeline().runners for n in r.graph_module.graph.nodes]
        assert rng.seeded_op in names
        loss = pm.step(x, y, F.mse_loss)
        return loss, [p.grad for p in pm.parameters()]
    loss, grads = run("never")
    for checkpoint in ("always", "except_last"):
        other, others = run(checkpoint)
        assert other == loss
        for got, want in zip(others, grads):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_every_spelling_of_a_random_op_is_routed() -> None:
    """Functions, methods and (from torch.export) ATen ops tagged nondeterministic."""

    class Draws(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            noise = torch.rand_like(x) + torch.randn(x.shape) + torch.bernoulli(x.sigmoid())
            return x + noise + x.clone().normal_() + x.clone().uniform_()
    gm = fx.symbolic_trace(Draws())
    assert route_dropout(gm).modified
    ops = [n.args[0] for n in gm.graph.nodes if n.target is rng.seeded_op]
    assert ops == ["torch.rand_like", "torch.randn", "torch.bernoulli", ".normal_",
                   ".uniform_"]
    exported = torch.export.export(Draws(), (torch.ones(2, 3),), strict=False).module()
    route_dropout(exported)
    left = [n.name for n in exported.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags]
    assert left == []
    g = torch.Generator().manual_seed(0)
    with rng.use_generator(rng.fork(g)):
        a = gm(torch.ones(2, 3))
    with rng.use_generator(rng.fork(g)):
        b = gm(torch.ones(2, 3))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_native_dropout_is_seeded_too() -> None:
    """``aten.native_dropout`` (a post-dispatch graph's dropout, tagged nondeterministic but
    not one of the spellings ``rng.dropout`` takes) runs through ``rng.seeded_op``."""

    class Native(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.native_dropout.default(x, 0.5, True)[0]
    gm = fx.symbolic_trace(Native())
    assert route_dropout(gm).modified
    assert [n.args[0] for n in gm.graph.nodes if n.target is rng.seeded_op] == [
        "aten.native_dropout.default"]
    g = torch.Generator().manual_seed(0)
    with rng.use_generator(rng.fork(g)):
        a = gm(torch.ones(4, 8))
    with rng.use_generator(rng.fork(g)):
        b = gm(torch.ones(4, 8))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
