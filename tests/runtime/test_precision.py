"""Mixed-precision helpers: autocast per precision, fp32 loss, the loss scaler, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner.errors import PartitionError, PrecisionError
from partitioner.runtime.loss_head import LossHead
from partitioner.runtime.precision import (
    LossScaler,
    autocast,
    check_precision,
    make_scaler,
    upcast,
)
from partitioner.runtime.stage import StageRunner


def test_stage_forward_and_replay_run_under_autocast() -> None:
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    runner = StageRunner(0, gm, torch.device("cpu"), precision="bf16")
    x = torch.randn(3, 4, requires_grad=True)
    out = runner.forward(0, [x], grad=True, checkpoint=True)
    assert out.dtype == torch.bfloat16
    (grad,) = runner.backward(0, [torch.ones(3, 4, dtype=torch.bfloat16)])
    assert grad is not None and grad.dtype == torch.float32  # the input's own dtype
    assert gm.weight.grad is not None and gm.weight.grad.dtype == torch.float32


def test_fp32_runs_without_autocast() -> None:
    with autocast("fp32", "cpu"):
        assert nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32


def test_loss_head_upcasts_and_returns_low_precision_grads() -> None:
    seen = []

    def loss_fn(out: torch.Tensor, _: object) -> torch.Tensor:
        seen.append(out.dtype)
        return out.sum()

    head = LossHead(loss_fn, [None], [1.0], upcast=True, grad_scale=8.0)
    (g,) = head(0, torch.ones(2, dtype=torch.bfloat16), stage=0)
    assert seen == [torch.float32]
    assert g is not None and g.dtype == torch.bfloat16 and torch.equal(g.float(), 8 * torch.ones(2))
    assert head.loss == 2.0  # the scale is on the gradients only


def test_upcast_leaves_other_values() -> None:
    out = upcast({"a": torch.ones(1, dtype=torch.float16), "b": torch.ones(1, dtype=torch.int64),
                  "c": 3})
    assert out["a"].dtype == torch.float32 and out["b"].dtype == torch.int64 and out["c"] == 3


def test_scaler_unscales_steps_and_skips_overflow() -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScaler("dynamic")
    start = scaler.scale
    p.grad = torch.full((1,), 2.0 * start)
    scaler.step(opt)
    scaler.update()
    assert p.item() == -2.0 and scaler.scale == start
    p.grad = torch.full((1,), float("inf"))
    assert scaler.step(opt) is None
    scaler.update()
    assert p.item() == -2.0 and scaler.scale == start / 2


def test_scaler_grows_after_clean_steps_and_fixed_scale_stays() -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    dynamic, fixed = LossScaler("dynamic", growth_interval=2), LossScaler(128.0)
    for scaler in (dynamic, fixed):
        for _ in range(2):
            p.grad = torch.ones(1)
            scaler.step(opt)
            scaler.update()
    assert dynamic.scale == 2 * 2.0**16 and fixed.scale == 128.0


def test_scaler_agree_skips_on_every_process() -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScaler(1.0, agree=lambda found: True)  # another rank overflowed
    p.grad = torch.ones(1)
    assert scaler.step(opt) is None and p.item() == 0.0


def test_unscale_twice_is_refused() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scaler = LossScaler(2.0)
    scaler.unscale_(opt)
    with pytest.raises(PrecisionError, match="once per step"):
        scaler.unscale_(opt)


@pytest.mark.parametrize(("precision", "loss_scale", "match"), [
    ("fp8", None, "precision='fp8' is unknown; pass one of"),
    ("fp16", None, "needs loss scaling.*loss_scale='dynamic'"),
    ("bf16", 1024.0, "only fp16 scales the loss"),
    ("fp16", -1.0, "positive finite float"),
    ("fp16", "auto", "pass 'dynamic'"),
])
def test_bad_precision_settings(precision: str, loss_scale: object, match: str) -> None:
    with pytest.raises(PrecisionError, match=match) as info:
        check_precision(precision, loss_scale)
    assert isinstance(info.value, PartitionError) and isinstance(info.value, ValueError)


def test_make_scaler_only_for_fp16() -> None:
    assert make_scaler("bf16", None) is None
    scaler = make_scaler("fp16", 512.0)
    assert scaler is not None and scaler.scale == 512.0
