"""The mistakes people make: each raises a PartitionError (also a ValueError or TypeError)
whose message names the offending value, never a raw exception or a silent result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import PartitionError, Plan, load_plan, make_plan, partition
from partitioner.cli import main
from partitioner.distributed import partition_distributed
from partitioner.errors import (
    BalanceError,
    CallError,
    CheckpointError,
    ChunksError,
    DeviceError,
    ExampleInputsError,
    MemoryLimitError,
    ModelError,
    PlanFormatError,
    PlanMismatchError,
    PlanWriteError,
    SpecError,
    StageCountError,
    StageExecutionError,
    StrategyError,
    TraceError,
)
from partitioner.request import PlanRequest
from partitioner.runtime.distributed.checkpoint_io import load_checkpoint, read_checkpoint


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


X = torch.randn(8, 4)
CPU2 = ["cpu", "cpu"]

# (case id, call, error class, text the message must contain)
CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("devices None", lambda: partition(_model(), None, example_inputs=(X,)), DeviceError,
     "devices=None"),
    ("devices float", lambda: partition(_model(), 3.5, example_inputs=(X,)), DeviceError,
     "devices=3.5"),
    ("devices empty", lambda: partition(_model(), [], example_inputs=(X,)), DeviceError,
     "devices=[]"),
    ("devices zero", lambda: partition(_model(), 0, example_inputs=(X,)), DeviceError,
     "devices=0"),
    ("devices bool", lambda: partition(_model(), True, example_inputs=(X,)), DeviceError,
     "devices=True"),
    ("device name", lambda: partition(_model(), ["cpu", "gpu0"], example_inputs=(X,)),
     DeviceError, "'gpu0'"),
    ("missing cuda", lambda: partition(_model(), ["cuda:7"], example_inputs=(X,)),
     DeviceError, "'cuda:7'"),
    ("meta devices", lambda: partition(_model(), ["meta"], example_inputs=(X,)), DeviceError,
     "'meta'"),
    ("model None", lambda: partition(None, CPU2, example_inputs=(X,)),  # type: ignore[arg-type]
     ModelError, "model=None"),
    ("model function", lambda: partition(torch.relu, CPU2, example_inputs=(X,)),  # type: ignore[arg-type]
     ModelError, "not an nn.Module"),
    ("model class", lambda: make_plan(nn.Linear, CPU2, example_inputs=(X,)),  # type: ignore[arg-type]
     ModelError, "pass an instance"),
    ("inputs empty", lambda: partition(_model(), CPU2, example_inputs=()), ExampleInputsError,
     "example_inputs=()"),
    ("inputs a tensor", lambda: partition(_model(), CPU2, example_inputs=X),  # type: ignore[arg-type]
     ExampleInputsError, "Tensor"),
    ("inputs missing", lambda: partition(_model(), CPU2), ExampleInputsError,
     "example_inputs"),
    ("inputs int64 into Linear", lambda: partition(_model(), CPU2, example_inputs=(X.long(),)),
     ExampleInputsError, "(8, 4) int64"),
    ("kwargs a string", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                          example_kwargs="x"),  # type: ignore[arg-type]
     ExampleInputsError, "example_kwargs='x'"),
    ("kwargs not str keys", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                              example_kwargs={1: X}),  # type: ignore[dict-item]
     ExampleInputsError, "example_kwargs="),
    ("strategy", lambda: partition(_model(), CPU2, "magic", example_inputs=(X,)), StrategyError,
     "'magic'"),
    ("strategy with plan", lambda: partition(_model(), CPU2, "magic", plan={"stages": []}),
     StrategyError, "'magic'"),
    ("chunks zero", lambda: partition(_model(), CPU2, example_inputs=(X,), chunks=0),
     ChunksError, "chunks=0"),
    ("chunks float", lambda: partition(_model(), CPU2, example_inputs=(X,), chunks=2.5),  # type: ignore[arg-type]
     ChunksError, "chunks=2.5"),
    ("chunks bool", lambda: partition(_model(), CPU2, example_inputs=(X,), chunks=True),
     ChunksError, "chunks=True"),
    ("chunks over batch", lambda: partition(_model(), CPU2, example_inputs=(X,), chunks=16),
     ChunksError, "chunks=16"),
    ("checkpoint", lambda: partition(_model(), CPU2, example_inputs=(X,), checkpoint="some"),
     StrategyError, "'some'"),
    ("calibrate string", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                           calibrate="no"),  # type: ignore[arg-type]
     StrategyError, "calibrate='no'"),
    ("balance and split", lambda: partition(_model(), CPU2, balance=[3, 2],
                                            split_points=["2"]),
     BalanceError, "not both"),
    ("balance wrong sum", lambda: partition(_model(), CPU2, balance=[3, 3]), BalanceError,
     "balance"),
    ("balance wrong length", lambda: partition(_model(), CPU2, balance=[1, 1, 3]),
     BalanceError, "balance"),
    ("balance a string", lambda: partition(_model(), CPU2, balance="32"),  # type: ignore[arg-type]
     BalanceError, "balance='32'"),
    ("split points a string", lambda: partition(_model(), CPU2, split_points="4"),  # type: ignore[arg-type]
     BalanceError, "split_points='4'"),
    ("split points count", lambda: partition(_model(), CPU2, split_points=["2", "4"]),
     BalanceError, "2 split points"),
    ("split point unknown", lambda: partition(_model(), CPU2, split_points=["nope"]),
     BalanceError, "nope"),
    ("memory limit string", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                              memory_limit="1GB"),  # type: ignore[arg-type]
     MemoryLimitError, "memory_limit='1GB'"),
    ("memory limit negative", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                                memory_limit=-1),
     MemoryLimitError, "memory_limit=-1"),
    ("memory limit count", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                             memory_limit=[1e9, 1e9, 1e9]),
     MemoryLimitError, "3 entries for 2 devices"),
    ("memory too small", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                           memory_limit=16),
     MemoryLimitError, ""),
    ("more devices than layers", lambda: partition(_model(), ["cpu"] * 9, "pipeline",
                                                   example_inputs=(X,)),
     StageCountError, "9 devices"),
    ("tensor parallel and plan", lambda: partition(_model(), CPU2, tensor_parallel=2,
                                                   plan={"stages": []}),
     StrategyError, "plan="),
    ("tensor parallel degree", lambda: partition(_model(), CPU2, tensor_parallel=0,
                                                 example_inputs=(X,)),
     PartitionError, "tensor_parallel=0"),
    ("tensor parallel devices", lambda: partition(_model(), ["cpu"] * 3, tensor_parallel=2,
                                                  example_inputs=(X,)),
     DeviceError, "tensor_parallel=2"),
    ("make_plan devices None", lambda: make_plan(_model(), None, example_inputs=(X,)),
     DeviceError, "devices=None"),
    ("request chunks", lambda: PlanRequest.make(CPU2, chunks=-2), ChunksError, "chunks=-2"),
    ("plan a number", lambda: partition(_model(), CPU2, plan=42), PlanFormatError, "42"),
    ("plan missing file", lambda: partition(_model(), CPU2, plan="no/such/plan.json"),
     SpecError, "no/such/plan.json"),
    ("call extra keyword", lambda: _pm()(X, extra=1), CallError, "'extra'"),
    ("call nothing", lambda: _pm()(), CallError, "'input'"),
    ("call too many", lambda: _pm()(X, X), CallError, "too many positional"),
    ("distributed tp zero", lambda: partition_distributed(_model(), (X,), tp=0),
     StrategyError, "tp=0"),
    ("distributed rules without tp", lambda: partition_distributed(
        _model(), (X,), tensor_parallel={"0": "colwise"}), StrategyError, "tp=1"),
    ("distributed plan missing", lambda: partition_distributed(
        _model(), (X,), plan="no/such/plan.json"), PlanFormatError, "no/such/plan.json"),
    ("plan file strategy", lambda: Plan.from_dict({**_plan_dict(), "strategy": 123}),
     PlanFormatError, "123"),
    ("plan file capture", lambda: Plan.from_dict({**_plan_dict(), "capture": "pickle"}),
     PlanFormatError, "pickle"),
    ("plan file notes", lambda: Plan.from_dict({**_plan_dict(), "notes": "a string"}),
     PlanFormatError, "notes"),
    ("plan file device", lambda: Plan.from_dict({**_plan_dict(), "devices": ["cuda:0"]}),
     PlanFormatError, "cuda:0"),
    ("spec chunks", lambda: load_plan({"chunks": 0, "stages": [{"layers": "0"}]}), SpecError,
     "chunks"),
    ("spec unknown key", lambda: load_plan({"stagez": []}), SpecError, "stagez"),
    ("spec not a mapping", lambda: load_plan(["a", "b"]), PartitionError, "list"),
    ("inputs an empty batch", lambda: partition(_model(), CPU2, example_inputs=(X[:0],),
                                                chunks=2),
     ExampleInputsError, "empty batch"),
    ("call an empty batch", lambda: _pm()(X[:0]), ChunksError, "the batch is empty"),
    ("spec one stage for three devices", lambda: partition(
        _model(), ["cpu"] * 3, plan={"stages": [{"layers": "*"}]}), SpecError,
     "1 stage but there are 3 devices"),
    ("plan stages swapped", lambda: partition(_model(), CPU2, plan=_swapped()),
     PlanMismatchError, "stage 0 holds ['3', '4']; stage 1 holds ['0', '1', '2']"),
    ("plan saved into a missing folder", lambda: make_plan(_model(), ["cpu"], balance=[5])
     .save("no/such/folder/plan.json"), PlanWriteError, "'no/such/folder'"),
]


def _plan_dict() -> dict[str, Any]:
    return make_plan(_model(), ["cpu"], balance=[5]).to_dict()


def _swapped() -> dict[str, Any]:
    """A plan whose two stages' layers were exchanged by hand."""
    plan = make_plan(_model(), CPU2, balance=[3, 2]).to_dict()
    first, second = plan["stages"]
    return {**plan, "stages": [{**first, "layers": second["layers"]},
                               {**second, "layers": first["layers"]}]}


def _pm() -> Any:
    return partition(_model(), CPU2, example_inputs=(X,), chunks=2)


@pytest.mark.parametrize(("call", "kind", "names"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_mistake_raises_a_partition_error_naming_the_value(call: Callable[[], Any],
                                                           kind: type[Exception],
                                                           names: str) -> None:
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, PartitionError)
    assert isinstance(info.value, (ValueError, TypeError))
    assert names in str(info.value)
    fixes = ("pass", "use", "drop", "call", "check", "write", "set", "keep", "give", "make",
             "did you mean")
    assert any(word in str(info.value) for word in fixes), f"no fix in: {info.value}"


def test_every_problem_of_a_request_is_listed_at_once() -> None:
    with pytest.raises(PartitionError) as info:
        PlanRequest(strategy="magic", chunks=0, checkpoint="some")
    message = str(info.value)
    assert "'magic'" in message and "chunks=0" in message and "'some'" in message


@pytest.mark.parametrize(("argv", "names"), [
    (["plan", "mlp", "--devices", "two"], "two"),
    (["plan", "mlp", "--devices", "2", "--chunks", "zero"], "zero"),
    (["plan", "mlp", "--devices", "2", "--input", "64x5"], "(64, 5)"),
    (["plan", "nosuchmodel", "--devices", "2"], "nosuchmodel"),
    (["show", "no/such/plan.json"], "no/such/plan.json"),
    (["simulate", "mlp"], "--devices"),
    (["run", "--nproc-per-node", "x", __file__], "'x'"),
])
def test_command_line_mistake_is_one_line_naming_the_value(
        argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals exit with status 2
        code = exit_.code
    assert code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert names in err


def test_a_transformers_cache_asked_for_is_refused_naming_use_cache() -> None:
    """Regression: the refusal blamed data-dependent control flow."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 50, (4, 8))
    with pytest.raises(TraceError) as info:
        partition(transformers.GPT2LMHeadModel(config), CPU2, "pipeline", example_inputs=(ids,),
                  example_kwargs={"use_cache": True}, chunks=2, calibrate=False)
    assert "DynamicCache" in str(info.value)
    assert "pass use_cache=False" in str(info.value)


def _half_written(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save(nn.Linear(64, 64).state_dict(), path)
    path.write_bytes(path.read_bytes()[:8000])  # the mmap read fails with an OSError here
    return path


@pytest.mark.parametrize("kind", ["truncated", "folder"])
def test_an_unreadable_checkpoint_is_refused_naming_it(kind: str, tmp_path: Path) -> None:
    """Regression: a truncated file raised a raw OSError, a folder IsADirectoryError."""
    path = _half_written(tmp_path) if kind == "truncated" else tmp_path
    for read in (lambda: load_checkpoint(path, nn.Linear(64, 64)),
                 lambda: read_checkpoint(path)):
        with pytest.raises(CheckpointError) as info:
            read()
        assert str(path) in str(info.value) and "; pass " in str(info.value)


def test_a_plan_that_cannot_be_written_is_still_an_os_error(tmp_path: Path) -> None:
    plan = make_plan(_model(), ["cpu"], balance=[5])
    with pytest.raises(OSError, match="cannot save the plan"):
        plan.save(tmp_path)  # a folder


def test_a_call_in_another_float_dtype_than_the_model_says_what_to_pass() -> None:
    """Regression: float64 inputs to a float32 model gave torch's message and no fix."""
    with pytest.raises(StageExecutionError) as info:
        _pm()(X.double())
    assert "the inputs are float64 but the model's parameters are float32" in str(info.value)
    assert "pass float32 inputs (x.to(torch.float32))" in str(info.value)
