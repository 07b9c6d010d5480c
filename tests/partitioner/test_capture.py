from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models import BatchBranch, Counter, FixedBatch, Scaled, encoder_model, gpt2, mlp
from torch import nn

from partitioner import partition
from partitioner.analysis import analyze
from partitioner.capture import capture, example_error
from partitioner.errors import (
    ChunksError,
    ExampleInputsError,
    PlanMismatchError,
    StageExecutionError,
    TraceError,
)


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


def test_a_batch_branch_is_refused_for_micro_batches_it_does_not_hold_for() -> None:
    model, x = BatchBranch(), torch.randn(8, 8)
    with pytest.raises(ChunksError, match=r"models.py:\d+ \(if x.shape\[0\] > 4:\)"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=2)
    pm = partition(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=1)
    bigger = torch.randn(12, 8)
    torch.testing.assert_close(pm(bigger), model(bigger))  # 12 > 4: the traced branch
    with pytest.raises(StageExecutionError, match="input x has 3 rows") as info:
        pm(torch.randn(3, 8))
    assert isinstance(info.value.__cause__, PlanMismatchError)
    pm.close()


def test_auto_plans_keep_a_batch_branch_at_one_micro_batch() -> None:
    pm = partition(BatchBranch(), ["cpu"] * 2, "auto", example_inputs=(torch.randn(8, 8),))
    assert pm.plan.chunks == 1
    assert any("does not hold for micro-batches" in note for note in pm.plan.notes)
    pm.close()


def test_micro_batches_that_meet_the_guard_run_and_match() -> None:
    model, x = BatchBranch(), torch.randn(12, 8)
    pm = partition(model, ["cpu"] * 3, example_inputs=(x,), chunks=2)  # 6 > 4 rows each
    torch.testing.assert_close(pm(x), model(x))
    with pytest.raises(StageExecutionError, match="input x has 4 rows"):
        pm(torch.randn(8, 8))  # micro-batches of 4: the other branch
    pm.close()


def test_a_batch_fixed_by_export_is_refused_for_other_sizes() -> None:
    model, x = FixedBatch(), torch.randn(8, 8)
    with pytest.raises(ChunksError, match="fixed the batch of the captured graph to .* 8"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=2)
    pm = partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=1)
    torch.testing.assert_close(pm(x), model(x))
    with pytest.raises(StageExecutionError, match="fixed the batch"):
        pm(torch.randn(16, 8))
    pm.close()


def test_export_refuses_non_batch_shapes_and_values_it_baked_in() -> None:
    model, x = Scaled(traceable=False), torch.randn(8, 8)
    pm = partition(model, ["cpu"] * 3, example_inputs=(x,), chunks=2)
    assert pm.plan.capture == "export"
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x, 2.0, flag=True), model(x))
    for args, kwargs, match in (((x, 3.0), {}, "input scale is 3.0 but torch.export baked 2.0"),
                                ((x,), {"flag": False}, "input flag is False"),
                                ((torch.randn(8, 9),), {}, r"holds only for \(batch, 8\)")):
        with pytest.raises(StageExecutionError, match=match):
            pm(*args, **kwargs)
    pm.close()


def test_gpt2_captured_without_a_mask_refuses_one() -> None:
    model, ids = gpt2(), torch.randint(0, 64, (4, 8))
    pm = partition(model, ["cpu"] * 2, example_inputs=(ids,), chunks=2)
    with pytest.raises(StageExecutionError, match="attention_mask is a tensor .* baked None"):
        pm(ids, attention_mask=torch.ones(4, 8, dtype=torch.long))
    pm.close()


def test_buffer_updates_go_through_export_and_tracing_leaves_them_alone() -> None:
    model = Counter()
    cap = capture(model, (torch.randn(4, 8),))
    assert cap.method == "export" and cap.writes == ("steps",)
    assert int(model.steps) == 0  # symbolic tracing ran `steps += 1` once; it was undone
    with pytest.raises(ExampleInputsError, match="updates buffer steps in place"):
        capture(Counter(), None)


def test_a_buffer_update_runs_once_per_call_or_is_refused() -> None:
    model, reference, x = Counter(), Counter(), torch.randn(8, 8)
    with pytest.raises(ChunksError, match="updates buffer steps .* 4 times per call"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=4, checkpoint="never")
    with pytest.raises(ChunksError, match="updates buffer steps"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=1, checkpoint="always")
    pm = partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=1, checkpoint="never")
    for _ in range(3):
        pm(x).sum().backward()
        reference(x)
    assert int(model.steps) == int(reference.steps) == 3
    pm.close()


def test_export_writes_batch_norm_statistics_back() -> None:
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.a(x))
            return self.b(h * 2 if x.shape[0] > 1 else h)

    model, x = Normed(), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    pm = partition(model, ["cpu"] * 2, example_inputs=(x,), chunks=1, balance=[2, 1])
    assert pm.plan.capture == "export" and capture(model, (x,)).writes == ()
    torch.testing.assert_close(pm(x), reference(x))
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean)
    assert int(model.norm.num_batches_tracked) == int(reference.norm.num_batches_tracked) == 1
    pm.close()


def test_forward_returning_none_is_refused() -> None:
    class Silent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> None:
            self.a(x)

    with pytest.raises(TraceError, match="Silent.forward returns None, no tensor"):
        partition(Silent(), ["cpu"] * 2, example_inputs=(torch.randn(4, 4),))


@pytest.mark.parametrize("make", [mlp, BatchBranch], ids=["fx", "export"])
def test_example_inputs_of_the_wrong_shape_are_named(make: Any) -> None:
    wrong = r"(input|x): \(8, 5\) float32 raises RuntimeError"
    with pytest.raises(ExampleInputsError, match=wrong):
        partition(make(), ["cpu"] * 2, example_inputs=(torch.randn(8, 5),))


@pytest.mark.slow
def test_transformer_encoder_layers_are_units() -> None:
    model = encoder_model(layers=4)
    cap = capture(model, (torch.randn(4, 5, 6),))
    layers = analyze(model, (torch.randn(4, 5, 6),)).layer_names
    assert cap.method == "export"
    assert layers == ["embed", *[f"encoder.layers.{k}" for k in range(4)], "head"]


def test_a_data_dependent_branch_in_torch_nn_is_named() -> None:
    model = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with pytest.raises(TraceError, match="transformer.py:[0-9]+ in _detect_is_causal_mask"):
        capture(model, (torch.randn(4, 6, 16), torch.randn(4, 5, 16)), {"tgt_mask": causal})


def test_keyword_arguments_through_kwargs_are_held_to_the_example() -> None:
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            h = self.a(x)
            if kwargs.get("double", False) and x.shape[0] > 0:
                h = h * 2
            return self.b(h)

    model, x = Keywords(), torch.randn(8, 4)
    pm = partition(model, ["cpu"] * 2, example_inputs=(x,), example_kwargs={"double": True})
    torch.testing.assert_close(pm(x, double=True), model(x, double=True))
    with pytest.raises(PlanMismatchError, match=r"lacks \['double'\]"):
        pm(x)
    with pytest.raises(PlanMismatchError, match=r"passes \['other'\]"):
        pm(x, double=True, other=1)
    with pytest.raises(StageExecutionError, match="input double is False"):
        pm(x, double=False)
    with pytest.raises(StageExecutionError, match="fixed the batch"):
        pm(torch.randn(4, 4), double=True)  # **kwargs: torch.export keeps the batch static
    pm.close()


def _gpt2_with_cache() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    assert config.use_cache  # the default: forward returns a DynamicCache
    return transformers.GPT2LMHeadModel(config).eval()


def test_a_transformers_model_with_caching_on_is_captured_without_its_cache() -> None:
    """Regression: GPT-2's default config returned a DynamicCache export could not return,
    and the refusal talked about data-dependent control flow."""
    model = _gpt2_with_cache()
    ids = torch.randint(0, 100, (4, 8))
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(ids,), chunks=2,
                   calibrate=False)
    assert model.config.use_cache  # the user's config is put back
    torch.testing.assert_close(pm(ids).logits, model(ids, use_cache=False).logits)
    pm.close()



def test_a_meta_built_model_is_not_blamed_on_its_example_inputs() -> None:
    """Called on real inputs, a meta-built model fails on its own meta tensors whatever the
    inputs are ("Cannot copy out of meta tensor"): that is no verdict on the inputs (an
    H200 run reported transformers' Llama's right inputs as not fitting)."""
    with torch.device("meta"):
        model = mlp()
    assert example_error(model, (torch.ones(2, 12),), {}) is None
    assert example_error(mlp(), (torch.ones(2, 5),), {}) is not None


class _NoGradScale(nn.Module):
    """Normalises by a scale computed under ``torch.no_grad()``: no gradient through it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            scale = h.norm(dim=-1, keepdim=True)
        return self.b(h / scale)


class _FP32Block(nn.Module):
    """A product kept in fp32 under any autocast (``autocast(enabled=False)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            h = self.a(x.float())
        return self.b(h) + h.dtype.itemsize  # 4 in fp32: the block's dtype shows


def test_a_no_grad_block_keeps_its_gradients_out() -> None:
    """Regression: symbolic tracing ran the ``with torch.no_grad():`` block and recorded its
    ops as ordinary ones, so the partitioned model back-propagated through the scale: its
    gradients differed from the model's by 0.024, silently. Such a forward is captured with
    torch.export (which keeps the block), and without example inputs it is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_NoGradScale() for _ in range(4)])
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), calibrate=False)
    pm.step(x, y, nn.functional.mse_loss)
    for got, want in zip([p.grad for p in pm.parameters()], expected):
        torch.testing.assert_close(got, want)
    with pytest.raises(ExampleInputsError, match="no_grad"):
        capture(model, None)


def test_an_autocast_block_keeps_its_precision_under_bf16() -> None:
    """``autocast(enabled=False)`` inside forward stays fp32 when the plan runs in bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_FP32Block() for _ in range(2)])
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), precision="bf16",
                   calibrate=False)
    torch.testing.assert_close(pm(x).float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert capture(model, (x,)).method == "export"


class _HalvedGradient(nn.Module):
    """Halves the gradient flowing back through its product (a tensor hook in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        return torch.relu(h)


class _HookedAlways(_HalvedGradient):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g * 0.5)
        return torch.relu(h)


@pytest.mark.parametrize("block", [_HalvedGradient, _HookedAlways])
def test_a_tensor_hook_in_forward_is_refused(block: type) -> None:
    """Regression: neither capture keeps ``Tensor.register_hook`` (symbolic tracing records
    an unused node the dead-code pass drops; torch.export hooks a tensor of its trace), and
    the partitioned model's gradients were 0.034 off the model's, silently."""
    model = nn.Sequential(*[block() for _ in range(4)])
    with pytest.raises(TraceError, match="register_hook"):
        partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(torch.randn(8, 16),),
                  calibrate=False)


def test_a_hook_another_thread_registers_during_a_capture_is_not_the_models() -> None:
    """Only the capturing thread's ``register_hook`` calls count (a training loop's own hooks
    on another thread are not the captured model's)."""
    import threading

    from partitioner.passes.tensor_hooks import hooks_registered

    with hooks_registered() as calls:
        worker = threading.Thread(
            target=lambda: torch.ones(2, requires_grad=True).register_hook(lambda g: g))
        worker.start()
        worker.join()
        assert calls == []
        torch.ones(2, requires_grad=True).register_hook(lambda g: g)
        assert calls == ["register_hook"]
