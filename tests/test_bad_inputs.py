"""The mistakes people make: each raises a PartitionError (also a ValueError or TypeError)
whose message names the offending value, never a raw exception or a silent result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import Mesh, PartitionError, Plan, load_plan, make_plan, partition
from partitioner.cli import main
from partitioner.distributed import partition_distributed
from partitioner.errors import (
    BalanceError,
    CallError,
    CheckpointError,
    ChunksError,
    DeviceError,
    ExampleInputsError,
    LossError,
    MemoryLimitError,
    MeshError,
    ModelError,
    PlanFormatError,
    PlanMismatchError,
    PlanWriteError,
    PrecisionError,
    ScheduleError,
    SpecError,
    StageCountError,
    StageExecutionError,
    StrategyError,
    TensorParallelError,
    TraceError,
    TuneError,
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
    ("distributed sequence parallel tp one", lambda: partition_distributed(
        _model(), (X,), tp=1, sequence_parallel=True), StrategyError, "with tp=1"),
    ("sequence parallel tensor parallel one", lambda: partition(
        _model(), ["cpu"], tensor_parallel=1, example_inputs=(X,), sequence_parallel=True),
     StrategyError, "pass tensor_parallel=2 (or more)"),
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
    ("plan saved to a number", lambda: make_plan(_model(), ["cpu"], balance=[5])
     .save(42), PlanWriteError, "Plan.save(42): int is not a file path"),  # type: ignore[arg-type]
    # As a new user tries them (issue #19): devices written the wrong way,
    ("devices one string", lambda: partition(_model(), "cpu,cpu", example_inputs=(X,)),
     DeviceError, "'cpu,cpu'"),
    ("device index not a number", lambda: partition(_model(), ["cpu:x"], example_inputs=(X,)),
     DeviceError, "'cpu:x'"),
    ("device upper case", lambda: partition(_model(), ["CUDA"], example_inputs=(X,)),
     DeviceError, "'CUDA'"),
    ("devices negative", lambda: partition(_model(), -2, example_inputs=(X,)), DeviceError,
     "devices=-2"),
    ("devices a dict", lambda: partition(_model(), {"cpu": 2}, example_inputs=(X,)),  # type: ignore[arg-type]
     DeviceError, "devices={'cpu': 2}"),
    # options of the wrong type or value,
    ("chunks a string", lambda: partition(_model(), CPU2, example_inputs=(X,), chunks="2"),  # type: ignore[arg-type]
     ChunksError, "chunks='2'"),
    ("balance with a zero", lambda: partition(_model(), CPU2, balance=[0, 5]), BalanceError,
     "balance=[0, 5]"),
    ("balance negative", lambda: partition(_model(), CPU2, balance=[-1, 6]), BalanceError,
     "balance=[-1, 6]"),
    ("balance floats", lambda: partition(_model(), CPU2, balance=[2.5, 2.5]),  # type: ignore[list-item]
     BalanceError, "balance=[2.5, 2.5]"),
    ("balance a dict", lambda: partition(_model(), CPU2, balance={"a": 1}),  # type: ignore[arg-type]
     BalanceError, "balance={'a': 1}"),
    ("split points numbers", lambda: partition(_model(), CPU2, split_points=[2]),  # type: ignore[list-item]
     BalanceError, "split_points=[2]"),
    ("schedule unknown", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                           schedule="pipedream"),
     ScheduleError, "'pipedream'"),
    ("schedule a number", lambda: partition(_model(), CPU2, example_inputs=(X,), schedule=1),  # type: ignore[arg-type]
     ScheduleError, "schedule=1"),
    ("virtual stages zero", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                              virtual_stages=0),
     ScheduleError, "virtual_stages=0"),
    ("checkpoint a bool", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                            checkpoint=True),  # type: ignore[arg-type]
     StrategyError, "checkpoint=True"),
    ("memory limit strings", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                               memory_limit=["1G", "1G"]),  # type: ignore[arg-type]
     MemoryLimitError, "['1G', '1G']"),
    ("strategy a number", lambda: partition(_model(), CPU2, 3, example_inputs=(X,)),  # type: ignore[arg-type]
     StrategyError, "strategy=3"),
    ("tensor parallel a string", lambda: partition(_model(), CPU2, tensor_parallel="2",
                                                   example_inputs=(X,)),
     TensorParallelError, "tensor_parallel='2'"),
    ("tensor parallel a float", lambda: partition(_model(), CPU2, tensor_parallel=2.0,  # type: ignore[arg-type]
                                                  example_inputs=(X,)),
     TensorParallelError, "tensor_parallel=2.0"),
    ("precision unknown", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                            precision="fp8"),
     PrecisionError, "'fp8'"),
    ("precision a number", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                             precision=16),  # type: ignore[arg-type]
     PrecisionError, "precision=16"),
    ("tune a string", lambda: partition(_model(), CPU2, example_inputs=(X,), tune="yes"),  # type: ignore[arg-type]
     TuneError, "tune='yes'"),
    ("tune negative", lambda: partition(_model(), CPU2, example_inputs=(X,), tune=-1),
     TuneError, "tune=-1"),
    # inputs and models that do not fit,
    ("inputs of the wrong width", lambda: partition(_model(), CPU2,
                                                    example_inputs=(torch.randn(8, 5),)),
     ExampleInputsError, "(8, 5) float32"),
    ("example kwargs forward lacks", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                                       example_kwargs={"mask": X}),
     CallError, "'mask'"),
    ("data-dependent control flow", lambda: partition(DataDependent(), CPU2,
                                                      example_inputs=(X,)),
     TraceError, "if h.sum() > 0"),
    ("a model already partitioned", lambda: partition(_pm(), CPU2, example_inputs=(X,)),
     ModelError, "already partitioned"),
    ("a plan for another model", lambda: partition(_model(), CPU2, plan=_other_plan()),
     PlanMismatchError, "another model"),
    ("spec stages a string", lambda: load_plan({"stages": "0-2"}), SpecError, "'0-2'"),
    ("spec layers a number", lambda: load_plan({"stages": [{"layers": 3}]}), SpecError,
     "layers: 3"),
    ("mesh larger than the devices", lambda: partition(_model(), CPU2, example_inputs=(X,),
                                                       mesh=Mesh(dp=2, pp=2)),
     MeshError, "spans 4 devices"),
    ("mesh a tuple", lambda: partition(_model(), CPU2, example_inputs=(X,), mesh=(2, 1, 1)),  # type: ignore[arg-type]
     MeshError, "mesh=(2, 1, 1)"),
    # calls that differ from the planned ones,
    ("call with fewer inputs than planned", lambda: _two_inputs()(X), CallError, "'y'"),
    ("call with a numpy array", lambda: _pm()(X.numpy()), ChunksError, "ndarray"),
    ("call with None", lambda: _pm()(None), ChunksError, "NoneType"),
    ("step with a loss name", lambda: _pm().step(X, torch.randn(8, 2), "mse"),  # type: ignore[arg-type]
     LossError, "loss_fn='mse'"),
    ("step with a loss class", lambda: _pm().step(X, torch.randn(8, 2), nn.MSELoss),  # type: ignore[arg-type]
     LossError, "MSELoss"),
    ("step targets of another batch", lambda: _pm().step(X, torch.randn(7, 2),
                                                         nn.functional.mse_loss),
     ChunksError, "batch size 7"),
    ("step loss not reduced", lambda: _pm().step(X, torch.randn(8, 2),
                                                 lambda o, t: (o - t) ** 2),
     LossError, "(4, 2)"),
]


class DataDependent(nn.Module):
    """Branches on a value computed from the input: no one graph holds both paths."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + y)


def _two_inputs() -> Any:
    return partition(TwoInputs(), CPU2, "pipeline", example_inputs=(X, torch.randn(8, 4)),
                     chunks=2)


def _other_plan() -> dict[str, Any]:
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                          nn.Linear(8, 2))
    return make_plan(other, CPU2, balance=[3, 2]).to_dict()


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
             "re-plan", "load", "return", "did you mean")
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


def test_a_plan_file_that_is_not_json_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{stages: [")   # YAML-ish, hand-written
    with pytest.raises(SpecError) as info:
        load_plan(path)
    assert str(path) in str(info.value) and "not valid JSON" in str(info.value)


@pytest.mark.parametrize(("call", "names"), [
    (lambda pm: pm(torch.randn(8, 5)), "input is (B, 5) float32 where the model was "
                                       "partitioned with (B, 4) float32"),
    (lambda pm: pm(X.long()), "input is (B, 4) int64 where the model was partitioned with "
                              "(B, 4) float32"),
    (lambda pm: pm([X]), "input is a list where the model was partitioned with a (B, 4) "
                         "float32 tensor"),
    (lambda pm: pm({"x": X}), "input is a dict where"),
], ids=["wider", "int64", "a list", "a dict"])
def test_a_call_unlike_the_example_names_the_input_and_the_fix(
        call: Callable[[Any], Any], names: str) -> None:
    """Regression: torch's message ("mat1 and mat2 shapes cannot be multiplied", "'list'
    object has no attribute 'requires_grad'") about a graph node, and no fix."""
    with pytest.raises(StageExecutionError) as info:
        call(_pm())
    assert names in str(info.value)
    assert "pass inputs like the example inputs" in str(info.value)
