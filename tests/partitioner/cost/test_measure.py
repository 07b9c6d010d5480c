"""Tests of partitioner/cost/measure.py: the CPU spec, and layers scaled to their times."""

from __future__ import annotations

import doctest
import platform
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import partitioner.cost.measure
from partitioner import partition
from partitioner.analysis import analyze
from partitioner.cost.adam_timing import adam_update
from partitioner.cost.calibration_cache import Run
from partitioner.cost.cost import LayerCost, Op, phase_times
from partitioner.cost.devices import FRESH_RAMP, DeviceSpec
from partitioner.cost.layer_timing import Timed
from partitioner.cost.measure import (
    TIMING_KEYS,
    CalibrationError,
    Progress,
    calibrate_layers,
    measure_cpu,
)
from partitioner.errors import CostModelError, TuneError
from partitioner.plans.plan import Mesh
from partitioner.runtime.host_memory import cpu_host_memory_mode

SPEC = DeviceSpec("cpu", {"fp32": 100e9}, 16e9, 20e9, matmul_efficiency=1.0,
                  matmul_half_flops=1e3, memory_efficiency=1.0, op_overhead=3e-6)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.relu(self.fc(x)))


class Repeated(nn.Module):
    """An embedding, six identical blocks and a head: three distinct layer signatures."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(Block(32) for _ in range(6))
        self.head = nn.Linear(32, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.bn(self.head(x))


@pytest.mark.slow  # a whole calibration: seconds
def test_measured_cpu_spec_is_valid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))  # empty: this process measures
    runs: list[dict[str, float]] = []
    timings = partitioner.cost.measure._timings
    monkeypatch.setattr(partitioner.cost.measure, "_timings",
                        lambda progress: runs.append(timings(progress)) or runs[-1])
    measure_cpu.cache_clear()
    spec = measure_cpu()
    # A real run times what the cache checks a kept run for (else every kept run would read
    # as corrupt, and every process would measure again).
    assert runs and all(sorted(run) == sorted(TIMING_KEYS) for run in runs)
    assert spec.flops("fp32") > 1e8 and spec.memory_bandwidth > 1e8
    assert spec.flops("bf16") > 0 and spec.flops("fp16") > 0  # timed, not assumed
    assert spec.shared_speedup[0] == 1.0 and len(spec.shared_speedup) == 4
    assert all(1 / n <= s <= n for n, s in enumerate(spec.shared_speedup, start=1))
    assert measure_cpu() is spec  # once per process
    # Sharing by kind of work: element-wise streams, then products of 8 to 1024 rows.
    assert [row[0] for row in spec.shared_sizes] == [0.0] + [2 * n * 2**20
                                                            for n in (8, 64, 256, 1024)]
    assert spec.shared_sizes[2][1:] == spec.shared_speedup  # the reference work
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        # glibc maps tensors of 32 MiB and more afresh: first touch costs, measured.
        assert spec.fresh_threshold == 32 * 2**20 and spec.fresh_bandwidth > 1e8
        # Measured with glibc's thresholds fixed (host_memory's steady mode, which measuring
        # applies): nothing below the mmap threshold is faulted in.
        assert spec.fresh_ramp == (1.0 if cpu_host_memory_mode() != "system" else FRESH_RAMP)
    assert spec.action_overhead >= 0.0
    # A lone stage worker keeps its share of the threads: timed, at most the whole's speed.
    assert 0.0 < spec.worker_speed <= 1.0 and spec.replica_tensor_overhead > 0.0
    for row in spec.shared_sizes:
        assert row[1] == 1.0 and all(1 / n <= s <= n for n, s in enumerate(row[1:], start=1))


def test_repeated_blocks_share_the_median_of_their_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = Repeated()
    x = torch.randn(16, 8)
    analysis = analyze(model, (x,))
    assert analysis.workload is not None and analysis.inputs is not None
    costs = analysis.workload.layers
    # Each layer timed in context at 1, 2, 3, ... ms (forward), twice that (backward).
    given = [(1e-3 * (k + 1), 2e-3 * (k + 1)) for k in range(len(costs))]

    def timed(gm, layers, inputs, **kw):  # type: ignore[no-untyped-def]
        if inputs[0].shape[0] != 16:  # a graph whose shapes were fixed at capture
            raise RuntimeError("shape mismatch")
        return Timed(given)

    monkeypatch.setattr(partitioner.cost.measure, "time_layers", timed)
    scaled = calibrate_layers(analysis.captured.graph_module, analysis.layers, costs,
                              analysis.inputs, SPEC, 16, progress=False, repeats=2)
    signatures = {c.signature for c in costs}
    assert len(analysis.layers) > len(signatures)  # repeated blocks share one
    for cost, new in zip(costs, scaled):
        same = [sum(given[k]) for k, c in enumerate(costs) if c.signature == cost.signature]
        forward, backward = phase_times(cost, SPEC, 16)
        assert new.time_scale == pytest.approx(statistics.median(same) / (forward + backward))
        assert new.time_scale == scaled[costs.index(cost)].time_scale


def test_a_smaller_batch_fits_what_each_call_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed at the example batch and at an eighth of it, each layer's time is fitted as
    ``time_scale x predicted + call_seconds`` at both (repeated blocks: their medians), so a
    small micro-batch pays its calls in full where one scale shrank them with the rows."""
    model = Repeated()
    x = torch.randn(16, 8)
    analysis = analyze(model, (x,))
    assert analysis.workload is not None and analysis.inputs is not None
    costs = analysis.workload.layers
    # Products at full rate and no fixed cost per op: each layer's predicted time grows with
    # its rows (2 samples under half of 16's), as a fit needs (``MAX_SMALL_SHARE``).
    spec = replace(SPEC, op_overhead=0.0, matmul_half_flops=1.0)

    def truth(samples: int) -> list[tuple[float, float]]:  # twice the model, 0.1 + 0.3 ms a call
        return [(2 * f + 1e-4, 2 * b + 3e-4)
                for f, b in (phase_times(c, spec, samples) for c in costs)]
    batches: list[int] = []

    def timed(gm, layers, inputs, **kw):  # type: ignore[no-untyped-def]
        batches.append(inputs[0].shape[0])
        return Timed(truth(inputs[0].shape[0]))

    monkeypatch.setattr(partitioner.cost.measure, "time_layers", timed)
    scaled = calibrate_layers(analysis.captured.graph_module, analysis.layers, costs,
                              analysis.inputs, spec, 16, progress=False, repeats=2)
    assert batches == [16, 2]
    for cost, new in zip(costs, scaled):
        assert new.time_scale == pytest.approx(2.0)
        assert new.call_seconds == pytest.approx((1e-4, 3e-4))
        for samples in (16, 2, 1):  # and any micro-batch between or below
            want = sum(truth(samples)[costs.index(cost)])
            assert sum(phase_times(new, spec, samples)) == pytest.approx(want)
    # Each call's part is its own: no share of it shrinks with the samples.
    one = scaled[0]
    per_sample = [sum(phase_times(one, spec, n)) / n for n in (1, 2, 16)]
    assert per_sample[0] > per_sample[1] > per_sample[2]


def test_the_fit_keeps_what_it_can_of_noisy_times() -> None:
    from partitioner.cost.call_fit import MAX_SMALL_SHARE, MIN_SCALE, fit_calls
    spec = replace(SPEC, op_overhead=0.0, matmul_half_flops=1.0)
    layer = LayerCost("fc", (Op("matmul", flops=1e6),))
    f, b = phase_times(layer, spec, 16)
    # The small batch read faster per sample than the large: no call to fit, one scale.
    [flat] = fit_calls([layer], spec, 16, [(2 * f, 2 * b)], 2, [(2 * f / 16, 2 * b / 16)])
    assert flat.call_seconds == (0.0, 0.0)
    assert flat.time_scale == pytest.approx(2.0)
    # The small batch as slow as the large one (noise, or a layer that does not grow with
    # its rows): all per call, the smallest scale; never a negative part.
    [fixed] = fit_calls([layer], spec, 16, [(f, b)], 2, [(2 * f, 2 * b)])
    assert fixed.time_scale == MIN_SCALE and min(fixed.call_seconds) >= 0
    assert sum(phase_times(fixed, spec, 16)) == pytest.approx(f + b)
    # A layer the model says costs about as much at 2 samples as at 16 (its weights): the
    # two times cannot tell a call's cost from noise; one scale, as before the fit.
    heavy = LayerCost("fc", (Op("matmul", flops=1e6, weight_read=1e9),))
    hf, hb = phase_times(heavy, spec, 16)
    assert sum(phase_times(heavy, spec, 2)) > MAX_SMALL_SHARE * (hf + hb)
    [kept] = fit_calls([heavy], spec, 16, [(2 * hf, 2 * hb)], 2, [(3 * hf, 3 * hb)])
    assert kept.call_seconds == (0.0, 0.0) and kept.time_scale == pytest.approx(2.0)
    with pytest.raises(CostModelError, match="call_seconds"):
        replace(layer, call_seconds=(-1e-3, 0.0))


def test_calibration_leaves_gradients_and_buffers_alone() -> None:
    model = Repeated()
    model.train()
    x = torch.randn(16, 8)
    model(x).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    analysis = analyze(model, (x,))
    assert analysis.workload is not None and analysis.inputs is not None
    calibrate_layers(analysis.captured.graph_module, analysis.layers, analysis.workload.layers,
                     analysis.inputs, SPEC, 16, progress=False, repeats=1)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name])
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name])


def test_meta_models_cannot_be_timed() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.empty(2, 4, device="meta")
    analysis = analyze(model, (x,))
    assert analysis.workload is not None
    with pytest.raises(CalibrationError, match="meta device.*calibrate=False") as info:
        calibrate_layers(analysis.captured.graph_module, analysis.layers,
                         analysis.workload.layers, analysis.inputs or [], SPEC, 2,
                         progress=False)
    assert isinstance(info.value, ValueError)


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress("calibrating layers", 2)
    bar.step("a")
    bar.step("b")
    err = capsys.readouterr().err
    assert "calibrating layers 1/2" in err and "calibrating layers 2/2" in err
    assert err.endswith("\n")
    silent = Progress("x", 1, enabled=False)
    silent.step()
    assert capsys.readouterr().err == ""


def test_partition_with_calibrate_runs_and_stays_transparent(
        capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 2))
    x = torch.randn(8, 8)
    pm = partition(model, ["cpu", "cpu"], example_inputs=(x,), chunks=2, calibrate=True)
    assert "timed 5 layers in training passes of the whole model (4 distinct, " \
        in capsys.readouterr().err
    torch.testing.assert_close(pm(x), model(x))
    assert pm.plan.predicted_step_time is not None and pm.plan.predicted_step_time > 0


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.measure).failed == 0


def test_the_calibration_s_adam_step_is_torch_s_op_for_op() -> None:
    # measure_cpu times Adam's element-wise ops without torch.optim (whose first step imports
    # ~800 modules); they must stay the same update, bit for bit.
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(64, 32)) for _ in range(3)]
    theirs = [nn.Parameter(w.detach().clone()) for w in ours]
    state = [(torch.zeros_like(w), torch.zeros_like(w)) for w in ours]
    adam = torch.optim.Adam(theirs, lr=1e-3)
    for step in range(1, 4):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        adam_update(ours, state, step, lr=1e-3)
        adam.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_low_precision_rates_are_fp32_s_scaled_by_the_timed_products() -> None:
    """precision="bf16" runs bf16 products, which a CPU with bf16 instructions runs several
    times faster than fp32 (3x on this VM's EPYC), and fp16 ones, which it may run 16x
    slower: each rate comes from its own timed product, not from fp32's."""
    timings = {**dict.fromkeys(TIMING_KEYS, 1e-3), "few": 1e-4, "some": 8e-4,
               "many": 3.2e-3, "fresh": 2e-3, "bf16_some": 8e-4 / 3, "fp16_few": 1e-4 * 16}
    spec = partitioner.cost.measure.median_spec([Run(timings, 0.0, 0.0)])
    assert spec.flops("bf16") == pytest.approx(3 * spec.flops("fp32"))
    assert spec.flops("fp16") == pytest.approx(spec.flops("fp32") / 16)


def test_timing_the_optimizer_keeps_weights_a_non_finite_gradient_would_spoil() -> None:
    # Adam at lr=0 leaves weights alone only while the gradients are finite: an inf
    # gradient makes them NaN, and the calibration must still hand the model back unchanged.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
        model[2].weight.fill_(3e38)  # the first layer's weight gradient overflows to inf
    x = torch.full((4, 4), 100.0)
    analysis = analyze(model, (x,))
    assert analysis.workload is not None and analysis.inputs is not None
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    partitioner.cost.measure.calibrate(
        analysis.captured.graph_module, analysis.layers, analysis.workload.layers,
        analysis.inputs, SPEC, 4, progress=False, repeats=1, optimizer=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0, msg=name)


def test_timing_the_optimizer_never_writes_the_model_s_weights() -> None:
    # The timed Adam steps stand-ins: the weights keep their values and their versions.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 4)
    analysis = analyze(model, (x,))
    assert analysis.workload is not None and analysis.inputs is not None
    versions = {name: p._version for name, p in model.named_parameters()}
    _, adam = partitioner.cost.measure.calibrate(
        analysis.captured.graph_module, analysis.layers, analysis.workload.layers,
        analysis.inputs, SPEC, 4, progress=False, repeats=1, optimizer=True)
    assert adam is not None and adam > 0
    assert {name: p._version for name, p in model.named_parameters()} == versions


def test_a_model_partitioned_with_tensor_parallelism_can_be_partitioned_again() -> None:
    # The calibration of the second plan used to step an Adam over the model's own weights,
    # which the live tensor-parallel module refuses ("this optimizer steps the original
    # model's parameters"); and its writes would have made that module refuse to run.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 8)
    first = partition(model, ["cpu", "cpu"], example_inputs=(x,), mesh=Mesh(tp=2))
    second = partition(model, ["cpu", "cpu"], example_inputs=(x,), mesh=Mesh(pp=2),
                       calibrate=True)
    torch.testing.assert_close(first(x), model(x))
    torch.testing.assert_close(second(x), model(x))
    # Tuning trains the model's own weights: refused while the first module guards them.
    with pytest.raises(TuneError, match=r"live TensorParallelModule.*close\(\) that"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), tune=2)
    first.close()
    tuned = partition(model, ["cpu", "cpu"], example_inputs=(x,), tune=2)
    torch.testing.assert_close(tuned(x), model(x))


def test_calibration_leaves_the_random_generator_where_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    analysis = analyze(model, (x,))
    assert analysis.workload is not None and analysis.inputs is not None
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    partitioner.cost.measure.calibrate(
        analysis.captured.graph_module, analysis.layers, analysis.workload.layers,
        analysis.inputs, SPEC, 8, progress=False, repeats=1, optimizer=True)
    torch.testing.assert_close(torch.rand(3), expected)
