"""unbake_dtypes: an fp32 export capture runs under a bf16/fp16 autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.passes.unbake_dtypes import unbake_dtypes
from partitioner.runtime.precision import masked_fill_saturated


class _Masked(nn.Module):
    """What DeBERTa-v2's attention and Mixtral's router do: a mask filled with the dtype's
    lowest value, and an explicit cast (export asserts the dtype it saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            router = h.to(torch.float32).softmax(-1)
            h = h.masked_fill(x < 0, torch.finfo(h.dtype).min).softmax(-1)
            x = x + h * router.to(h.dtype)
        return x


def test_fills_with_an_fp32_extreme_saturate_and_dtype_asserts_go() -> None:
    gm = torch.export.export(_Masked(), (torch.randn(4, 8),), strict=False).module()
    result = unbake_dtypes(gm)
    assert result.modified
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.masked_fill.Scalar not in targets
    assert targets.count(masked_fill_saturated) == 4
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            assert node.kwargs.get("dtype") is None and "device" in node.kwargs


def test_a_graph_without_baked_dtypes_is_left_alone() -> None:
    program = torch.export.export(nn.Linear(2, 2), (torch.randn(3, 2),), strict=False)
    assert not unbake_dtypes(program.module()).modified


def test_same_values_in_fp32() -> None:
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(4, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    expected = gm(x)
    unbake_dtypes(gm)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_export_captured_model_runs_in_low_precision(precision: str) -> None:
    """Regression: "value cannot be converted to type BFloat16 without overflow" in the
    masked_fill, "Tensor dtype mismatch! Expected: Float" in the capture's assertion."""
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(8, 8)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autocast("cpu", dtype=dtype):
        expected = model(x)
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2,
                   precision=precision, loss_scale="dynamic" if precision == "fp16" else None,
                   calibrate=False)
    out = pm(x)  # micro-batches of 4 rows: bf16 sums in another order
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    pm.close()


class _NoGradCast(nn.Module):
    """The fp32 cast inside a ``torch.no_grad()`` block: export keeps the block as a graph
    of its own (``wrap_with_set_grad_enabled``), with its own dtype assertions."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        with torch.no_grad():
            gate = h.to(torch.float32).sigmoid()
        return self.second(h * gate.to(h.dtype))


def test_a_no_grad_blocks_dtype_assertions_go_too() -> None:
    """Regression: the pass rewrote the top graph only, so a cast in a ``no_grad`` block
    kept ``_assert_tensor_metadata(dtype=float32)`` and failed under bf16 autocast."""
    torch.manual_seed(0)
    model, x = _NoGradCast(), torch.randn(8, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    inner = [m for name, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert inner, "export no longer makes a no_grad block a graph of its own"
    assert unbake_dtypes(gm).modified
    asserts = [n for graph in gm.modules() if isinstance(graph, torch.fx.GraphModule)
               for n in graph.graph.nodes
               if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert asserts and all(n.kwargs.get("dtype") is None for n in asserts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2,
                   precision="bf16", calibrate=False)
    torch.testing.assert_close(pm(x).float(), expected.float(), atol=2e-2, rtol=2e-2)
