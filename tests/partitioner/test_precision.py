"""``precision=``: bf16 tracks fp32 training, fp16 with loss scaling trains, the plan keeps
the precision, the cost model costs it, bad input is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import make_plan, partition
from partitioner.cost.devices import Cluster
from partitioner.errors import PlanMismatchError, PrecisionError
from partitioner.plans.plan import Plan

VOCAB = 50


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, 32),
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        nn.Linear(32, VOCAB))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (8, 12), generator=g),
            torch.randint(0, VOCAB, (8, 12), generator=g))


def train(precision: str, steps: int = 4, **options: object) -> tuple[list[float], nn.Module]:
    x, y = batch()
    pm = partition(transformer(), ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2,
                   schedule="1f1b", precision=precision, **options)  # type: ignore[arg-type]
    opt = torch.optim.Adam(pm.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.step(x, y, loss_fn))
        if pm.scaler is not None:
            pm.scaler.step(opt)
            pm.scaler.update()
        else:
            opt.step()
    return losses, pm


def test_bf16_tracks_fp32_training() -> None:
    fp32, _ = train("fp32")
    bf16, pm = train("bf16")
    assert pm.plan.precision == "bf16"
    assert pm(batch()[0]).dtype == torch.bfloat16  # the stages ran under autocast
    assert {p.dtype for p in pm.parameters()} == {torch.float32}  # fp32 master weights
    assert bf16 != fp32  # not the fp32 computation
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=0.0)


def test_fp16_with_dynamic_loss_scale_trains() -> None:
    fp32, _ = train("fp32")
    fp16, pm = train("fp16", loss_scale="dynamic")
    assert pm.scaler is not None and pm.scaler.scale == 2.0**16
    assert fp16[-1] < fp16[0]
    torch.testing.assert_close(torch.tensor(fp16), torch.tensor(fp32), rtol=2e-2, atol=0.0)


def test_fp16_gradients_are_scaled_by_the_scaler() -> None:
    x, y = batch()
    pm = partition(transformer(), ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2,
                   precision="fp16", loss_scale=1024.0)
    pm.step(x, y, loss_fn)
    scaled = [p.grad.clone() for p in pm.parameters()]
    opt = torch.optim.SGD(pm.parameters(), lr=0.0)
    pm.scaler.unscale_(opt)
    for before, p in zip(scaled, pm.parameters()):
        torch.testing.assert_close(p.grad * 1024.0, before)
    reference = transformer()
    loss_fn(reference(x), y).backward()
    first = next(iter(reference.parameters())).grad
    torch.testing.assert_close(next(iter(pm.parameters())).grad, first, rtol=5e-2, atol=1e-3)


def test_plan_round_trip_keeps_precision(tmp_path: object) -> None:
    x, _ = batch()
    plan = make_plan(transformer(), ["cpu", "cpu"], "pipeline", example_inputs=(x,),
                     precision="bf16")
    assert plan.precision == "bf16"
    assert Plan.from_dict(plan.to_dict()).precision == "bf16"
    old = plan.to_dict()
    del old["precision"]
    assert Plan.from_dict(old).precision == "fp32"  # plans written before it
    pm = partition(transformer(), None, plan=plan)
    assert pm.plan.precision == "bf16" and pm(x).dtype == torch.bfloat16
    with pytest.raises(PlanMismatchError, match="precision='fp32' but the plan says 'bf16'"):
        partition(transformer(), None, plan=plan, precision="fp32")


def test_bf16_is_costed_faster_than_fp32_on_a100() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0,
                                                           batch_first=True)
                                for _ in range(2)])
    x = torch.randn(16, 256, 1024, device="meta")
    cluster = Cluster.preset("A100-80GB", nodes=1)
    fp32 = make_plan(model, cluster, example_inputs=(x,))
    bf16 = make_plan(model, cluster, example_inputs=(x,), precision="bf16")
    assert fp32.predicted_step_time is not None and bf16.predicted_step_time is not None
    assert bf16.precision == "bf16"
    assert bf16.predicted_step_time < 0.5 * fp32.predicted_step_time


def test_auto_with_bf16_plans_a_pipeline() -> None:
    x, _ = batch()
    plan = make_plan(transformer(), ["cpu", "cpu"], "auto", example_inputs=(x,),
                     precision="bf16")
    assert plan.precision == "bf16" and plan.mesh is not None
    assert (plan.mesh.dp, plan.mesh.tp) == (1, 1)


@pytest.mark.parametrize(("options", "match"), [
    ({"precision": "fp8"}, "precision='fp8' is unknown"),
    ({"precision": "fp16"}, "needs loss scaling"),
    ({"precision": "bf16", "loss_scale": 8.0}, "only fp16 scales the loss"),
    ({"precision": "bf16", "tensor_parallel": 2}, "with tensor_parallel="),
])
def test_bad_precision_is_refused(options: dict[str, object], match: str) -> None:
    x, _ = batch()
    with pytest.raises(PrecisionError, match=match):
        partition(transformer(), ["cpu", "cpu"], "pipeline", example_inputs=(x,),
                  **options)  # type: ignore[arg-type]


def test_bf16_model_is_refused_as_master_weights() -> None:
    x, _ = batch()
    with pytest.raises(PrecisionError, match="fp32 master weights.*model.float"):
        partition(transformer().bfloat16(), ["cpu", "cpu"], "pipeline", balance=[2, 2],
                  precision="bf16")
    with pytest.raises(PrecisionError, match="fp32 master weights"):
        make_plan(transformer().bfloat16(), ["cpu", "cpu"], "pipeline", example_inputs=(x,),
                  precision="bf16")
