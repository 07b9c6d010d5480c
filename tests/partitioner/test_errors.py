"""Every user mistake raises a PartitionError subclass naming the value and a fix."""

from __future__ import annotations

import pytest
import torch
from models import mlp
from torch import nn

from partitioner import PartitionError, partition
from partitioner.errors import (
    BalanceError,
    ChunksError,
    DeviceError,
    ExampleInputsError,
    MemoryLimitError,
    StageCountError,
    StageExecutionError,
    StrategyError,
    TraceError,
)


def _x() -> torch.Tensor:
    return torch.randn(8, 12)


def test_empty_devices() -> None:
    with pytest.raises(DeviceError, match=r"devices=\[\] is empty") as info:
        partition(mlp(), devices=[], example_inputs=(_x(),))
    assert isinstance(info.value, ValueError)


def test_unknown_device_string() -> None:
    with pytest.raises(DeviceError, match="'gpu7'"):
        partition(mlp(), devices=["cpu", "gpu7"], example_inputs=(_x(),))


def test_missing_cuda_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="'cuda:0' is not on this machine"):
        partition(mlp(), devices=["cuda:0"], example_inputs=(_x(),))


def test_unknown_strategy() -> None:
    with pytest.raises(StrategyError, match="strategy='zigzag'.*'pipeline'"):
        partition(mlp(), devices=["cpu"], strategy="zigzag", example_inputs=(_x(),))


def test_more_stages_than_layers() -> None:
    with pytest.raises(StageCountError, match="8 devices but the model has only 7 layers"):
        partition(mlp(), ["cpu"] * 8, "pipeline", example_inputs=(_x(),))


def test_balance_wrong_length() -> None:
    with pytest.raises(BalanceError, match="balance has 3 entries but there are 2 devices"):
        partition(mlp(), devices=["cpu"] * 2, balance=[3, 2, 2])


def test_balance_non_positive() -> None:
    with pytest.raises(BalanceError, match=r"positive integers, got \[0\]"):
        partition(mlp(), devices=["cpu"] * 2, balance=[7, 0])


def test_balance_wrong_sum() -> None:
    with pytest.raises(BalanceError, match="balance sums to 9 but the model has 7 layers; "
                                           "pass balance summing to 7"):
        partition(mlp(), devices=["cpu"] * 2, balance=[4, 5])


def test_unknown_split_point() -> None:
    with pytest.raises(BalanceError, match="split point 'nope' names no layer"):
        partition(mlp(), devices=["cpu"] * 2, split_points=["nope"])


@pytest.mark.parametrize("chunks", [0, -1, 1.5])
def test_chunks_below_one(chunks: object) -> None:
    with pytest.raises(ChunksError, match=f"chunks={chunks}"):
        partition(mlp(), devices=["cpu"], example_inputs=(_x(),), chunks=chunks)  # type: ignore[arg-type]


def test_chunks_above_batch_at_run_time() -> None:
    pm = partition(mlp(), devices=["cpu"] * 2, strategy="pipeline", example_inputs=(_x(),),
                   chunks=4)
    with pytest.raises(ChunksError, match="chunks=4 is larger than the batch size 2"):
        pm(torch.randn(2, 12))


def test_plan_that_cannot_fit_memory_says_how_many_devices_would() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    x = torch.randn(4, 64)
    # Each layer needs ~33 KB of parameters+gradients (+ activations): 2 devices of 70 KB
    # cannot hold 8 of them, and the message says how many would.
    with pytest.raises(MemoryLimitError, match=r"\d+ devices of that size would fit") as info:
        partition(model, devices=["cpu"] * 2, example_inputs=(x,), memory_limit=70_000,
                  memory_reserve=0.0)
    assert isinstance(info.value, ValueError)


def test_missing_example_inputs_for_planning() -> None:
    with pytest.raises(ExampleInputsError, match="example_inputs=\\(x,\\)"):
        partition(mlp(), devices=["cpu"] * 2)


def test_untraceable_model_without_inputs_asks_for_them() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return self.fc(x)
            return x

    with pytest.raises(ExampleInputsError, match="needs example inputs"):
        partition(Branchy(), devices=["cpu"], balance=[1])


def test_trace_error_names_module_line_and_both_causes() -> None:
    class Hopeless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = int(x.sum().item() > 0) + len(str(x.tolist()))
            return self.fc(x).repeat(1, n)[:, : int(x.abs().sum().item())]

    with pytest.raises(TraceError) as info:
        partition(Hopeless(), devices=["cpu"], example_inputs=(torch.randn(2, 4),))
    message = str(info.value)
    assert "Hopeless" in message and "symbolic_trace" in message and "torch.export" in message
    assert "test_errors.py" in message


def test_every_error_is_a_partition_error() -> None:
    for cls in (DeviceError, StrategyError, BalanceError, ChunksError, MemoryLimitError,
                ExampleInputsError, StageCountError, TraceError, StageExecutionError):
        assert issubclass(cls, PartitionError)
        assert issubclass(cls, (ValueError, TypeError, RuntimeError))
