"""fold_attention: every nn.MultiheadAttention call torch.export inlined is one node again."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.capture import capture
from partitioner.passes.fold_attention import (
    ROOT_ATTENTION,
    ModuleCall,
    attention_paths,
    fold_attention,
    module_calls,
)


def run(cap: Any, *args: Any, **kwargs: Any) -> Any:
    return cap.restructure(cap.graph_module(*cap.placeholder_values(args, kwargs)))


def call_modules(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]


def inlined(gm: fx.GraphModule, path: str) -> list[str]:
    """Call nodes (other than the folded call and its results) inside module ``path``."""
    out = []
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        inside = any(isinstance(e, tuple) and e[0] == path for e in stack.values())
        if inside and node.op == "call_function" and node.target is not operator.getitem:
            out.append(node.name)
    return out


def test_encoder_layer_keeps_its_attention_one_call() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    cap = capture(layer, (x,))
    assert cap.method == "export"
    assert call_modules(cap.graph_module) == ["self_attn"]
    assert inlined(cap.graph_module, "self_attn") == []
    assert cap.graph_module.get_submodule("self_attn") is layer.self_attn
    torch.testing.assert_close(run(cap, x), layer(x))
    y = torch.randn(3, 5, 16)  # the batch stays dynamic
    torch.testing.assert_close(run(cap, y), layer(y))


def test_masks_and_flags_reach_the_call() -> None:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0), 2, enable_nested_tensor=False)
    x = torch.randn(5, 2, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    kwargs = {"mask": mask, "src_key_padding_mask": padding, "is_causal": False}
    cap = capture(encoder, (x,), kwargs)
    assert call_modules(cap.graph_module) == ["layers.0.self_attn", "layers.1.self_attn"]
    node = next(n for n in cap.graph_module.graph.nodes if n.op == "call_module")
    assert node.kwargs["need_weights"] is False
    assert isinstance(node.kwargs["attn_mask"], fx.Node)
    torch.testing.assert_close(run(cap, x, **kwargs), encoder(x, **kwargs))


def test_an_attention_model_is_one_call_of_itself() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, -1] = True
    cap = capture(mha, (x, x, x), {"key_padding_mask": padding})
    assert call_modules(cap.graph_module) == [ROOT_ATTENTION]
    assert cap.graph_module.get_submodule(ROOT_ATTENTION) is mha
    assert [n for n, _ in cap.graph_module.named_parameters()] == [
        f"{ROOT_ATTENTION}.{n}" for n, _ in mha.named_parameters()]
    assert [n.op for n in cap.graph_module.graph.nodes
            if n.op not in ("placeholder", "output")] == ["call_module", "call_function",
                                                          "call_function"]
    out, weights = run(cap, x, x, x, key_padding_mask=padding)
    expected, expected_weights = mha(x, x, x, key_padding_mask=padding)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, expected_weights)


def test_two_calls_of_one_attention_are_two_calls() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] > 1:  # symbolic tracing cannot branch on a size: export runs
                x = x * 2
            y = self.attn(x, x, x)[0]
            return self.attn(y, x, x)[0]

    model = Twice()
    x = torch.randn(4, 2, 8)
    cap = capture(model, (x,))
    assert cap.method == "export"
    assert call_modules(cap.graph_module) == ["attn", "attn"]
    assert inlined(cap.graph_module, "attn") == []
    torch.testing.assert_close(run(cap, x), model(x))


def test_calls_export_cannot_keep_stay_inlined_and_correct() -> None:
    """Two calls with different keyword structures have no one signature: export inlines."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] > 1:  # symbolic tracing cannot branch on a size: export runs
                x = x * 2
            y = self.attn(x, x, x)[0]
            return self.attn(y, x, x, need_weights=False)[0]

    model = Mixed()
    x = torch.randn(4, 2, 8)
    cap = capture(model, (x,))
    assert cap.method == "export"
    assert call_modules(cap.graph_module) == []
    assert inlined(cap.graph_module, "attn")
    torch.testing.assert_close(run(cap, x), model(x))


def test_other_modules_and_incomplete_calls_are_left_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    gm = torch.export.export(model, (torch.randn(2, 4),), strict=False).module()
    before = [n.name for n in gm.graph.nodes]
    calls = [ModuleCall("0", (None,), {}, None), ModuleCall("", (None,), {}, (None,))]
    assert not fold_attention(gm, model, calls).modified
    assert [n.name for n in gm.graph.nodes] == before
    assert attention_paths(model) == ()


def test_module_calls_skip_values_the_graph_lacks() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    program = torch.export.export(layer, (torch.randn(3, 2, 8),), strict=False,
                                  preserve_module_call_signature=attention_paths(layer))
    assert attention_paths(layer) == ("self_attn",)
    names = {n.name: n for n in program.graph.nodes}
    assert [c.path for c in module_calls(program, names)] == ["", "self_attn"]
    assert module_calls(program, {}) == []
    call = module_calls(program, names)[1]
    assert call.outputs[1] is None  # need_weights=False: no weights
    del names[call.outputs[0].name]
    assert module_calls(program, names)[1].outputs == (None, None)
