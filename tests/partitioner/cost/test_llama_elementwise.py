"""Tests of partitioner/cost/llama_elementwise.py: element-wise bytes, fused or eager."""

from __future__ import annotations

import doctest

import pytest

import partitioner.cost.llama_elementwise
from partitioner.cost.cost import op_times
from partitioner.cost.devices import DEVICES
from partitioner.cost.llama_elementwise import llama_elementwise
from partitioner.cost.transformer_model import LlamaRun, LlamaShape, llama_workload

LLAMA3_8B = LlamaShape(32, 4096, 32, 8, 14336, 8192, 128256)


def test_fused_steps_read_and_write_once_in_the_activation_dtype() -> None:
    h, g, i, e = 64, 16, 176, 2
    step = llama_elementwise(h, g, i, e)
    assert (step.norm, step.rotary_q, step.rotary_k, step.swiglu, step.residual) == (
        2 * e * h, 3 * e * h, 3 * e * g, 4 * e * i, 3 * e * h)


def test_eager_steps_are_torchtitans_kernels_through_fp32() -> None:
    h, g, i, e = 64, 16, 176, 2
    step = llama_elementwise(h, g, i, e, fused=False)
    # x.float() 2+4, pow 4+4, mean 4, x * rsqrt 4+4, type_as 4+2, * weight 2+2 per value.
    assert step.norm == (6 + 8 + 4 + 8 + 6 + 4) * h
    # q.float() 2+4, complex multiply 4+4, type_as 4+2.
    assert (step.rotary_q, step.rotary_k) == (20 * h, 20 * g)
    assert step.swiglu == (2 + 3) * e * i  # silu, then the product
    assert step.residual == llama_elementwise(h, g, i, e).residual


def test_an_eager_layer_moves_more_bytes_and_the_same_flops() -> None:
    fused = llama_workload(LLAMA3_8B, 1, run=LlamaRun(True, "flash")).layers[1]
    eager = llama_workload(LLAMA3_8B, 1, run=LlamaRun(True, "flash", fused=False)).layers[1]
    assert eager.forward_flops == fused.forward_flops
    assert eager.signature != fused.signature
    moved = [sum(op.bytes for op in layer.ops if op.kind == "memory")
             for layer in (fused, eager)]
    s, h, g, i = LLAMA3_8B.seq, 4096, 1024, 14336
    assert moved[1] - moved[0] == pytest.approx(s * (2 * 32 * h + 14 * (h + g) + 2 * i))
    spec = DEVICES["H100-HBM2e-500W"]
    times = [sum(sum(op_times(op, spec, 2, dtype="bf16")) for op in layer.ops)
             for layer in (fused, eager)]
    assert times[1] > times[0]
    assert LlamaRun(fused=False).label() == "eager, none recompute, eager element-wise"


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.llama_elementwise).failed == 0
