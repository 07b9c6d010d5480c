"""What ``partition`` returns keeps its contract on a GPU: every one-process runtime on
``cuda`` devices gives the whole model's outputs, gradients and losses.

Marked ``gpu``: skipped without CUDA (``tests/conftest.py``), run by
``python benchmarks/gpu_check.py``. ``PARTITIONER_GPU_TEST_DEVICE=cpu python -m pytest -m gpu
tests/runtime/test_cuda.py`` runs the same checks on "cpu" devices, to try their logic on a
machine without one. Every case compares with the model on one device in fp32 (TF32 off),
so differences are the order of sums only; bf16 against the model under autocast.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tp_models import TinyGPT, gpt2

from partitioner import Mesh, partition
from partitioner.errors import PartitionError

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("PARTITIONER_GPU_TEST_DEVICE", "cuda:0")
ON_GPU = DEVICE.startswith("cuda")
LR = 0.5  # large enough that a wrong gradient moves a weight past the tolerance


@pytest.fixture(autouse=True)
def _exact_fp32() -> Iterator[None]:
    """TF32 off: fp32 products exact enough to compare at 1e-4."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _lm_loss(logits: Any, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 64, (8, 16), generator=g),
            torch.randint(0, 64, (8, 16), generator=g))


def _reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               precision: str | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and state after one SGD step of ``model`` on one device over the whole batch."""
    model = copy.deepcopy(model).to(DEVICE)
    dtype = torch.device(DEVICE).type
    with torch.autocast(dtype, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = _lm_loss(model(x.to(DEVICE)), y.to(DEVICE))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.item(), {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _check(pm: Any, x: torch.Tensor, y: torch.Tensor,
           expected: tuple[float, dict[str, torch.Tensor]], tol: float) -> None:
    """One step of ``pm`` and an SGD step over its parameters give the loss and the state."""
    loss = pm.step(x, y, _lm_loss)
    torch.optim.SGD(pm.parameters(), lr=LR).step()
    assert loss == pytest.approx(expected[0], rel=tol, abs=tol)
    state = {k: v.detach().cpu() for k, v in pm.state_dict().items()}
    assert state.keys() == expected[1].keys()
    for key, value in state.items():
        torch.testing.assert_close(value, expected[1][key], rtol=tol, atol=tol, msg=key)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_a_pipeline_on_gpu_stages_trains_as_the_model(schedule: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    x, y = _batch()
    expected = _reference(model, x, y)
    with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline", chunks=4,
                   schedule=schedule) as pm:
        _check(pm, x, y, expected, 1e-4)
        assert all(str(p.device) == DEVICE or p.device.type == torch.device(DEVICE).type
                   for p in model.parameters())


@pytest.mark.parametrize("first", ["cpu", "gpu"])
def test_a_pipeline_between_the_cpu_and_the_gpu(first: str) -> None:
    """Stages on different devices: the boundary crosses from host to GPU and back (or from
    GPU to host first: a CPU stage must not read a copy still in flight)."""
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4, n_embd=128, seq=64)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (16, 64), generator=g) for _ in range(2))
    expected = _reference(model, x, y)
    devices = ["cpu", DEVICE] if first == "cpu" else [DEVICE, "cpu"]
    with partition(model, devices, example_inputs=(x,), strategy="pipeline", chunks=4,
                   schedule="1f1b") as pm:
        _check(pm, x, y, expected, 1e-4)
        out = pm(x)
        assert out.device == torch.device(devices[-1])


def test_bf16_pipeline_on_gpu_matches_autocast() -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    x, y = _batch()
    expected = _reference(model, x, y, precision="bf16")
    with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline", chunks=2,
                   precision="bf16") as pm:
        _check(pm, x, y, expected, 3e-2)


@pytest.mark.parametrize("mesh", [Mesh(dp=2, pp=1, tp=1), Mesh(dp=2, pp=2, tp=1)], ids=str)
def test_replicas_on_one_gpu_train_as_the_model(mesh: Mesh) -> None:
    """Replicas (and replicas of pipelines, whose interleaved virtual stages once stayed on
    the CPU) on one GPU."""
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    x, y = _batch()
    expected = _reference(model, x, y)
    with partition(model, [DEVICE] * (mesh.dp * mesh.pp), example_inputs=(x,), mesh=mesh,
                   chunks=2) as pm:
        _check(pm, x, y, expected, 1e-4)


def _gpus(n: int) -> list[str]:
    if not ON_GPU:
        return [DEVICE] * n
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism in one process needs a GPU per rank")
    return [f"cuda:{k % torch.cuda.device_count()}" for k in range(n)]


@pytest.mark.parametrize("mesh", [Mesh(dp=1, pp=1, tp=2), Mesh(dp=1, pp=2, tp=2)], ids=str)
def test_tensor_parallel_on_gpus_trains_as_the_model(mesh: Mesh) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    x, y = _batch()
    expected = _reference(model, x, y)
    with partition(model, _gpus(mesh.pp * mesh.tp), example_inputs=(x,), mesh=mesh,
                   chunks=2) as pm:
        _check(pm, x, y, expected, 1e-4)


@pytest.mark.skipif(not ON_GPU, reason="ranks on one CPU run")
def test_tensor_parallel_ranks_on_one_gpu_are_refused() -> None:
    """Seen on an H200: they hung in the first backward (one autograd thread per GPU)."""
    model = TinyGPT(n_layer=2)
    x, _ = _batch()
    # MeshError from the planner (the mesh cannot run here), or TensorParallelError from
    # the runtime: both name the shared GPU.
    with pytest.raises(PartitionError, match="ranks share cuda"):
        partition(model, [DEVICE] * 2, example_inputs=(x,), mesh=Mesh(dp=1, pp=1, tp=2))
    with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="auto") as pm:
        assert pm.plan.mesh is None or pm.plan.mesh.tp == 1


def test_transformers_gpt2_pipeline_on_gpu() -> None:
    torch.manual_seed(0)
    model = gpt2(n_layer=2)
    x, y = _batch()
    expected = _reference(model, x, y)
    with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline",
                   chunks=2) as pm:
        _check(pm, x, y, expected, 1e-4)


@pytest.mark.skipif(not ON_GPU, reason="measures CUDA memory")
def test_checkpointing_on_gpu_keeps_fewer_activations() -> None:
    """Peak GPU memory of one step: checkpoint="always" must hold less than "never"."""
    peaks = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        model = TinyGPT(n_layer=4, n_embd=256, n_head=4, seq=256)
        x = torch.randint(0, 64, (16, 256))
        with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline",
                       chunks=2, checkpoint=mode) as pm:
            pm.step(x, x, _lm_loss)  # warm: allocator and gradients in place
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            pm.step(x, x, _lm_loss)
            torch.cuda.synchronize()
            peaks[mode] = torch.cuda.max_memory_allocated() - base
        del model, pm
        torch.cuda.empty_cache()
    assert peaks["always"] < 0.8 * peaks["never"], peaks


@pytest.mark.parametrize("schedule, virtual", [("interleaved", 2), ("v_shape", 2)])
def test_virtual_stage_schedules_on_gpu_train_as_the_model(schedule: str, virtual: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=6)
    x, y = _batch()
    expected = _reference(model, x, y)
    with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline", chunks=4,
                   schedule=schedule, virtual_stages=virtual) as pm:
        _check(pm, x, y, expected, 1e-4)


def test_checkpoint_replay_on_gpu_redraws_the_same_dropout_masks() -> None:
    """A checkpointed stage replays its forward with the generator state saved before it
    (on the GPU's generator): its gradients equal those of the same run without
    checkpointing, and a run repeats under the same seed."""
    def grads(mode: str, seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TinyGPT(n_layer=4, dropout=0.2)
        x, y = _batch()
        with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline",
                       chunks=2, checkpoint=mode) as pm:
            torch.manual_seed(seed)
            pm.step(x, y, _lm_loss)
            return {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()
                    if p.grad is not None}
    never, always, again = grads("never", 7), grads("always", 7), grads("never", 7)
    other = grads("never", 8)
    for key in never:
        torch.testing.assert_close(always[key], never[key], rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(again[key], never[key]), key
    assert any(not torch.equal(other[k], never[k]) for k in never), "dropout drew nothing"


def test_fp16_pipeline_on_gpu_scales_the_loss_and_trains_as_autocast() -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    x, y = _batch()
    reference = copy.deepcopy(model).to(DEVICE)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.float16):
        out = reference(x.to(DEVICE))
    want = _lm_loss(out, y.to(DEVICE)).item()
    # A fixed scale: a dynamic one starts at 2**16 and may skip the first step.
    with partition(model, [DEVICE] * 2, example_inputs=(x,), strategy="pipeline", chunks=2,
                   precision="fp16", loss_scale=1024.0) as pm:
        assert pm.scaler is not None
        optimizer = torch.optim.SGD(pm.parameters(), lr=LR)
        loss = pm.step(x, y, _lm_loss)
        assert loss == pytest.approx(want, rel=2e-2)
        grad = next(p.grad for p in pm.parameters() if p.grad is not None)
        assert torch.isfinite(grad).all()
        before = [p.detach().clone() for p in pm.parameters()]
        pm.scaler.step(optimizer)
        pm.scaler.update()
        assert any(not torch.equal(b, p) for b, p in zip(before, pm.parameters()))


@pytest.mark.parametrize("built_on", ["cpu", "meta"])
def test_transformers_llama_on_gpu_stages(built_on: str) -> None:
    """transformers' Llama (rotary inv_freq, GQA) as a bf16 pipeline on GPU stages, built
    on the CPU (its captured positions and devices must follow the stage) or on meta
    (materialized on the GPU by its own initialization): its logits are the whole model's
    with the same weights under autocast."""
    from hf_models import batches, build

    torch.manual_seed(0)
    if built_on == "meta":
        with torch.device("meta"):
            model = build("llama")
        options: dict[str, Any] = dict(init_fn=model._init_weights)
    else:
        model, options = build("llama"), {}
    ids = batches(1)[0][0]
    with partition(model, [DEVICE] * 2, "pipeline", example_inputs=(ids,), chunks=2,
                   precision="bf16", **options) as pm:
        whole = build("llama").to(DEVICE)
        whole.load_state_dict(pm.state_dict())
        with torch.no_grad():
            got = pm(ids).logits.float()
            with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
                want = whole(ids.to(DEVICE)).logits.float()
        assert got.device.type == torch.device(DEVICE).type
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_transformers_llama_tensor_parallel_on_gpus() -> None:
    """Llama built on the CPU, split over a GPU per rank: each rank's graph names its own
    GPU where the capture baked the CPU (positions, masks)."""
    from hf_models import batches, build

    torch.manual_seed(0)
    model = build("llama")
    ids = batches(1)[0][0]
    whole = copy.deepcopy(model).to(DEVICE)
    with partition(model, _gpus(2), example_inputs=(ids,), mesh=Mesh(dp=1, pp=1, tp=2)) as pm:
        with torch.no_grad():
            got = pm(ids).logits
            want = whole(ids.to(DEVICE)).logits
        torch.testing.assert_close(got.to(want.device), want, rtol=1e-4, atol=1e-4)
