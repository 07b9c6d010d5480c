"""The one-process pipeline runtime: errors, determinism, pytrees, module behaviour."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
from models import gpt2, mlp
from torch import nn

from partitioner import partition
from partitioner.errors import (
    BackwardError,
    ChunksError,
    PartitionError,
    ScheduleError,
    StageExecutionError,
)
from partitioner.runtime.action import Schedule
from partitioner.runtime.local import LocalPipeline, split_phases
from partitioner.runtime.schedule_generators import gpipe, one_f_one_b


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x.abs().sum() > -1, x @ torch.ones(3, 3), x)


def test_exception_names_stage_microbatch_and_node_and_no_worker_hangs() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Boom(), nn.Linear(4, 4))
    x = torch.randn(6, 4)
    before = threading.active_count()
    pm = partition(model, devices=["cpu"] * 3, balance=[1, 1, 2], chunks=3)
    start = time.perf_counter()
    with pytest.raises(StageExecutionError) as info:
        pm(x)
    assert time.perf_counter() - start < 30
    error = info.value
    assert (error.stage, error.microbatch) == (2, 0)
    assert error.node is not None and "matmul" in error.node
    assert "stage 2 (micro-batch 0, node matmul" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    pm.close()
    assert threading.active_count() <= before + 0


def test_dropout_replayed_exactly_under_checkpointing() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.3),
                          nn.Linear(32, 4))
    x = torch.randn(8, 16)
    grads = {}
    for mode in ("never", "always"):
        copy_ = copy.deepcopy(model)
        # A fixed split: the planner may split differently per mode, and each stage draws
        # its own masks.
        pm = partition(copy_, devices=["cpu"] * 2, example_inputs=(x,), chunks=4,
                       checkpoint=mode, balance=[2, 3])
        assert pm.plan.checkpoint == mode
        torch.manual_seed(123)
        out = pm(x)
        out.pow(2).sum().backward()
        grads[mode] = (out.detach(), [p.grad.clone() for p in copy_.parameters()])
    torch.testing.assert_close(grads["never"][0], grads["always"][0])
    for a, b in zip(grads["never"][1], grads["always"][1]):
        torch.testing.assert_close(a, b)
    # and dropout did drop something: output differs from eval mode
    assert not torch.allclose(grads["never"][0], model.eval()(x))


def test_same_seed_same_result_across_runs() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(6, 8)
    pm = partition(model, devices=["cpu"] * 2, example_inputs=(x,), chunks=3)
    torch.manual_seed(7)
    a = pm(x)
    torch.manual_seed(7)
    b = pm(x)
    torch.testing.assert_close(a, b)


def test_state_dict_has_original_keys_and_round_trips() -> None:
    model = mlp()
    pm = partition(model, devices=["cpu"] * 2, strategy="pipeline",
                   example_inputs=(torch.randn(4, 12),))
    assert list(pm.state_dict()) == list(model.state_dict())
    fresh = mlp()
    fresh.load_state_dict(pm.state_dict())
    other = {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}
    pm.load_state_dict(other)
    assert all(bool((p == 0).all()) for p in model.parameters())
    assert pm.module is model


def test_parameters_train_eval_and_optimizer_step() -> None:
    model = mlp()
    x, y = torch.randn(8, 12), torch.randn(8, 6)
    reference = copy.deepcopy(model)
    pm = partition(model, devices=["cpu"] * 3, example_inputs=(x,), chunks=2)
    assert len(list(pm.parameters())) == len(list(model.parameters()))
    pm.eval()
    assert not model.training
    pm.train()
    assert model.training
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(pm(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, batch: dict[str, torch.Tensor], scale: float = 1.0,
                mode: str = "sum") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.a(batch["x"]) * scale
        out = self.b(h) + batch["y"]
        return out, {"hidden": h}


def test_pytree_inputs_outputs_and_non_tensor_arguments() -> None:
    model = _DictModel()
    batch = {"x": torch.randn(6, 4), "y": torch.randn(6, 4)}
    pm = partition(model, devices=["cpu"] * 2, balance=[1, 1], chunks=3)
    out, extra = pm(batch, 2.0)
    ref_out, ref_extra = model(batch, 2.0)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(extra["hidden"], ref_extra["hidden"])


def test_input_gradient_flows_back() -> None:
    model = mlp()
    x = torch.randn(6, 12, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    pm = partition(model, devices=["cpu"] * 2, example_inputs=(x,), chunks=3)
    pm(x).sum().backward()
    model(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_uneven_last_chunk() -> None:
    model = mlp()
    x = torch.randn(7, 12)
    pm = partition(model, devices=["cpu"] * 2, example_inputs=(x,), chunks=3)
    torch.testing.assert_close(pm(x), model(x))


def test_output_object_of_transformers_is_rebuilt() -> None:
    model = gpt2()
    x = torch.randint(0, 64, (4, 8))
    pm = partition(model, devices=["cpu"] * 2, example_inputs=(x,), chunks=2)
    out = pm(x)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (4, 8, 64)


def test_inplace_op_at_stage_start() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    ref = copy.deepcopy(model)
    pm = partition(model, devices=["cpu"] * 2, balance=[1, 2], chunks=2)
    pm(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_timeline_records_busy_time_after_inputs_arrive() -> None:
    # Regression: actions were stamped before waiting for their inputs, so every stage's
    # first forward appeared to start at once.
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(16, 64)
    pm = partition(model, devices=["cpu"] * 2, strategy="pipeline", example_inputs=(x,),
                   chunks=4)
    pm(x).sum().backward()
    spans = {str(action): (start, end) for action, start, end in pm.pipeline().timeline}
    assert len(spans) == 2 * 2 * 4
    for i in range(4):
        assert spans[f"1F{i}"][0] >= spans[f"0F{i}"][1]
        assert spans[f"0B{i}"][0] >= spans[f"1B{i}"][1]


def _two_stage() -> tuple[nn.Module, nn.Module, Any]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    pm = partition(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 4),), chunks=2,
                   balance=[2, 1])
    return model, reference, pm


def test_backward_twice_is_refused_with_a_reason() -> None:
    _, _, pm = _two_stage()
    y = pm(torch.randn(8, 4)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(BackwardError, match="its backward already ran") as info:
        y.backward()
    assert isinstance(info.value, PartitionError) and isinstance(info.value, RuntimeError)
    pm.close()


def test_backward_of_a_replaced_forward_is_refused_not_wrong() -> None:
    _, _, pm = _two_stage()
    first = pm(torch.randn(8, 4)).sum()
    second = pm(torch.randn(8, 4)).sum()
    with pytest.raises(BackwardError, match="a later forward"):
        (first + second).backward()
    pm.close()


def test_a_no_grad_forward_between_forward_and_backward_keeps_the_gradients() -> None:
    model, reference, pm = _two_stage()
    x, other = torch.randn(8, 4), torch.randn(8, 4)
    out = pm(x).pow(2).sum()
    with torch.no_grad():
        pm(other)
    out.backward()
    reference(x).pow(2).sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)
    pm.close()


def _text_of(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule]


def _stages(n: int) -> list[torch.fx.GraphModule]:
    class Stage(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x * 2,)

    return [torch.fx.symbolic_trace(Stage()) for _ in range(n)]


def test_the_pipeline_runs_the_schedules_the_registry_gives_it() -> None:
    pipe = LocalPipeline(_stages(2), [torch.device("cpu")] * 2, chunks=3)
    try:
        forwards, backwards = pipe.schedule(3)
        assert _text_of(forwards) == ["0F0 0F1 0F2", "1F0 1F1 1F2"]
        assert _text_of(backwards) == ["0B2 0B1 0B0", "1B2 1B1 1B0"]
        assert pipe.schedule_kind.name == "gpipe"
    finally:
        pipe.close()


@pytest.mark.parametrize(("schedule", "virtual", "expected"), [
    ("zb", 1, "schedule='zb' is not a registered schedule; use one of 'gpipe', '1f1b', "
              "'interleaved', 'zero_bubble'"),
    ("interleaved", 1, "'interleaved' needs virtual >= 2"),
    ("1f1b", 2, "'1f1b' runs one virtual stage per stage, got virtual=2"),
])
def test_the_pipeline_refuses_schedules_that_do_not_fit(schedule: str, virtual: int,
                                                        expected: str) -> None:
    with pytest.raises(ScheduleError, match=expected):
        LocalPipeline(_stages(2), [torch.device("cpu")] * (2 // virtual), chunks=2,
                      schedule=schedule, virtual=virtual)


def test_the_pipeline_refuses_stages_that_do_not_fill_the_virtual_stages() -> None:
    with pytest.raises(ScheduleError, match="3 stages do not split into 2 virtual stages per "
                                            "device; pass a multiple of 2 stages"):
        LocalPipeline(_stages(3), [torch.device("cpu")], chunks=2, schedule="interleaved",
                      virtual=2)
    with pytest.raises(ScheduleError, match="4 stages with virtual=2 need 2 devices"):
        LocalPipeline(_stages(4), [torch.device("cpu")] * 3, chunks=2, schedule="interleaved",
                      virtual=2)


def test_the_pipeline_refuses_unknown_checkpoint_modes() -> None:
    with pytest.raises(ChunksError, match="checkpoint='sometimes' is not a checkpoint mode; "
                                          "use one of 'always', 'except_last', 'never'"):
        LocalPipeline(_stages(1), [torch.device("cpu")], checkpoint="sometimes")


def test_split_phases_separates_gpipe() -> None:
    forwards, backwards = split_phases(gpipe(2, 3))
    assert _text_of(forwards) == ["0F0 0F1 0F2", "1F0 1F1 1F2"]
    assert _text_of(backwards) == ["0B2 0B1 0B0", "1B2 1B1 1B0"]


def test_split_phases_rejects_one_f_one_b_naming_each_stage() -> None:
    with pytest.raises(ScheduleError, match="cannot split") as caught:
        split_phases(one_f_one_b(3, 4))
    message = str(caught.value)
    assert "stage 0 runs 0F3 after 0B0" in message
    assert "stage 1 runs 1F2 after 1B0" in message
    assert "stage 2 runs 2F1 after 2B0" in message
    assert "use a fill-drain schedule such as 'gpipe'" in message


def test_split_phases_accepts_one_f_one_b_with_one_microbatch() -> None:
    # With m=1 there is no later forward, so 1F1B degenerates to fill-drain.
    forwards, backwards = split_phases(one_f_one_b(2, 1))
    assert _text_of(forwards) == ["0F0", "1F0"]
    assert _text_of(backwards) == ["0B0", "1B0"]


def test_attention_dropout_inside_a_whole_module_is_replayed_exactly() -> None:
    """Regression: nn.TransformerEncoderLayer is one call_module to capture; its attention
    dropout drew from torch's global generator, so a checkpointed replay drew other masks
    and the gradients silently differed from the forward's."""
    model = nn.Sequential(nn.Linear(16, 16),
                          nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True),
                          nn.Linear(16, 16),
                          nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True),
                          nn.Linear(16, 4))
    x = torch.randn(8, 5, 16)
    grads = {}
    for mode in ("never", "always"):
        copy_ = copy.deepcopy(model)
        pm = partition(copy_, devices=["cpu"] * 2, example_inputs=(x,), chunks=4,
                       checkpoint=mode, balance=[2, 3])
        torch.manual_seed(123)
        out = pm(x)
        out.pow(2).sum().backward()
        grads[mode] = (out.detach(), [p.grad.clone() for p in copy_.parameters()])
        pm.close()
    torch.testing.assert_close(grads["never"][0], grads["always"][0])
    for a, b in zip(grads["never"][1], grads["always"][1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_checkpointed_replay_leaves_batch_norm_statistics_alone(capture: str) -> None:
    """Regression: the replay of a checkpointed stage updated running statistics again."""
    class Branchy(nn.Module):  # a branch on a size: symbolic tracing fails, export captures
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(),
                                      nn.Linear(6, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) if x.shape[1] == 4 else x[:, :2]
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)) \
        if capture == "fx" else Branchy()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    pm = partition(model, ["cpu"], example_inputs=(x,), chunks=1, checkpoint="always")
    pm(x).sum().backward()
    reference(x).sum().backward()
    for (name, mine), theirs in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(mine, theirs, msg=name)
    pm.close()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_batch_norm_trains_in_1f1b_with_the_default_checkpointing(capture: str) -> None:
    """Regression: putting the statistics back after a replay bumped their version
    counters, and the last micro-batch (whose forward 1F1B runs before that replay's
    backward) failed its backward with "modified by an inplace operation"."""
    class Branchy(nn.Module):  # a branch on a size: symbolic tracing fails, export captures
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(),
                                      nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) if x.shape[1] == 4 else x[:, :2]
    torch.manual_seed(0)
    model = Branchy() if capture == "export" else Branchy().body
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    runs = {}
    for schedule, mode in (("1f1b", "except_last"), ("gpipe", "never")):
        copy_ = copy.deepcopy(model)
        pm = partition(copy_, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=4,
                       schedule=schedule, checkpoint=mode)
        loss = pm.step(x, y, nn.functional.mse_loss)
        runs[schedule] = (loss, [p.grad for p in copy_.parameters()], list(copy_.buffers()))
        pm.close()
    assert runs["1f1b"][0] == pytest.approx(runs["gpipe"][0])
    for mine, theirs in zip(runs["1f1b"][1] + runs["1f1b"][2],
                            runs["gpipe"][1] + runs["gpipe"][2]):
        torch.testing.assert_close(mine, theirs)


class _CalledTwice(nn.Module):
    """One Linear called in the first stage and in the last: a weight tied across stages."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(64, 64)
        self.mid = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.mid(torch.tanh(self.shared(x))))


@pytest.mark.parametrize("schedule", ["zero_bubble", "1f1b", "gpipe"])
def test_a_weight_shared_by_two_stages_gets_every_gradient(schedule: str) -> None:
    """Issue #19: under zero-bubble the W actions of both stages raced on one ``.grad``
    (in-place accumulation) and lost updates in most steps."""
    torch.manual_seed(0)
    model = _CalledTwice()
    reference = copy.deepcopy(model)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    nn.functional.mse_loss(reference(x), y).backward()
    pm = partition(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=8,
                   schedule=schedule, split_points=["mid.2"])
    assert [s.layers[0] for s in pm.plan.stages] == ["shared", "mid.2"]
    for _ in range(10):  # a race shows in some steps only
        model.zero_grad()
        pm.step(x, y, nn.functional.mse_loss)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    pm.close()



def _linear_stages(n: int) -> list[torch.fx.GraphModule]:
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.linear(x),)

    return [torch.fx.symbolic_trace(Stage()) for _ in range(n)]


def _threads_of(pipe: LocalPipeline) -> set[int]:
    """Record the thread every stage forward of ``pipe`` runs on."""
    seen: set[int] = set()
    for runner in pipe.runners:
        def forward(*args: Any, _run: Any = runner.forward, **kwargs: Any) -> Any:
            seen.add(threading.get_ident())
            return _run(*args, **kwargs)
        runner.forward = forward  # type: ignore[method-assign]
    return seen


def test_one_cpu_device_steps_on_the_callers_thread() -> None:
    """No worker thread, so no second OpenMP team in the process (docs/benchmarks.md,
    "What one process pays"); its forward's backward through autograd still works."""
    pipe = LocalPipeline(_linear_stages(1), [torch.device("cpu")], chunks=2, schedule="1f1b")
    seen = _threads_of(pipe)
    try:
        x = torch.randn(4, 4)
        pipe.step([x], torch.zeros(4, 4), lambda out, y: nn.functional.mse_loss(out[0], y))
        out = pipe.run([x.requires_grad_()])
        out[0].sum().backward()  # the backward phase runs on the worker (autograd calls it)
        assert x.grad is not None and pipe.runners[0].graph_module.linear.weight.grad is not None
        assert seen == {threading.get_ident()}
    finally:
        pipe.close()


def test_several_devices_and_a_fixed_thread_count_keep_their_workers() -> None:
    for n, threads in ((2, None), (1, 1)):
        pipe = LocalPipeline(_linear_stages(n), [torch.device("cpu")] * n, chunks=2,
                             threads=threads)
        seen = _threads_of(pipe)
        try:
            pipe.step([torch.randn(4, 4)], torch.zeros(4, 4),
                      lambda out, y: nn.functional.mse_loss(out[0], y))
            assert seen and threading.get_ident() not in seen
        finally:
            pipe.close()
