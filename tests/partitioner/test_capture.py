from __future__ import annotations

import torch
from models import gpt2, mlp

from partitioner.capture import capture


def test_symbolic_trace_first_and_parameters_shared() -> None:
    model = mlp()
    cap = capture(model, None)
    assert cap.method == "fx"
    assert cap.graph_module.get_parameter("0.weight") is model[0].weight


def test_export_fallback_for_gpt2_shares_parameters_and_rebuilds_output() -> None:
    model = gpt2()
    x = torch.randint(0, 64, (4, 8))
    cap = capture(model, (x,))
    assert cap.method == "export"
    assert cap.graph_module.get_parameter("transformer.h.0.attn.c_attn.weight") is \
        model.transformer.h[0].attn.c_attn.weight
    values = cap.placeholder_values((x,), {})
    out = cap.restructure(cap.graph_module(*values))
    torch.testing.assert_close(out.logits, model(x).logits)


def test_export_capture_has_dynamic_batch() -> None:
    model = gpt2()
    cap = capture(model, (torch.randint(0, 64, (4, 8)),))
    y = torch.randint(0, 64, (3, 8))
    out = cap.restructure(cap.graph_module(*cap.placeholder_values((y,), {})))
    assert out.logits.shape == (3, 8, 64)
