"""bf16 on two gloo ranks (pp=2, 1F1B) tracks fp32 training within bf16's tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_harness import launch, results

WORKER = Path(__file__).with_name("precision_worker.py")


@pytest.mark.slow
def test_bf16_tracks_fp32_on_gloo() -> None:
    records = [r[0] for r in results(launch(WORKER, 2, [], timeout=300))]
    for record in records:
        assert record["fp32_plan"] == "fp32" and record["bf16_plan"] == "bf16"
        assert record["bf16_grads"] == ["torch.float32"]  # fp32 master weights
        fp32, bf16 = record["fp32"], record["bf16"]
        assert bf16 != fp32 and bf16[-1] < bf16[0]
        torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=0.0)
    assert records[0]["bf16"] == records[1]["bf16"]  # every rank returns the step's loss
