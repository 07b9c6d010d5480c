"""Tests of partitioner/cost/cost.py: per-op roofline costs, per-layer costs from a graph."""

from __future__ import annotations

import doctest
from dataclasses import replace

import pytest
import torch
from torch import nn

import partitioner.cost.cost
from partitioner.analysis import analyze
from partitioner.cost.cost import (
    CostModelError,
    LayerCost,
    Op,
    Workload,
    layer_costs,
    op_times,
    phase_times,
)
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.planning.predict import Config, predict

# This machine's CPU as partitioner.cost.measure.measure_cpu() measured it on a quiet run
# (2 cores of an AMD EPYC, torch 2.13, 2 intra-op threads): fixed here so that tests of the
# model's predictions do not depend on the load of the machine running them.
CPU = DeviceSpec("cpu (this machine)", {"fp32": 220e9}, 16e9, 51e9, matmul_efficiency=1.0,
                 matmul_half_flops=2.2e3, memory_efficiency=1.0, op_overhead=3e-6,
                 pack_bandwidth=34e9, shared_speedup=(1.0, 0.7, 0.7, 0.7))
GPU = DeviceSpec("gpu", {"fp32": 100e12}, 80e9, 2e12, matmul_efficiency=0.8,
                 matmul_half_flops=1e9, memory_efficiency=0.5, op_overhead=1e-5)


def test_a_large_matmul_is_compute_bound() -> None:
    op = Op("matmul", flops=1e9, bytes=1e3)
    forward, backward = op_times(op, GPU, 1000)  # 1 TFLOP
    rate = 0.8 * 100e12 * 1e12 / (1e12 + 1e9)
    assert forward == pytest.approx(1e12 / rate + 1e-5)
    assert backward == pytest.approx(2 * forward)


def test_a_fused_attention_kernel_runs_at_the_attention_rate() -> None:
    # FlashAttention-2 reaches 35% of peak where products reach 80%; its backward does 2.5
    # times its forward's FLOPs (flash-attention's benchmark count).
    gpu = replace(GPU, attention_efficiency=0.35)
    op = Op("attention", flops=1e9, bytes=1e3)
    forward, backward = op_times(op, gpu, 1000)  # 1 TFLOP
    rate = 0.35 * 100e12 * 1e12 / (1e12 + 1e9)
    assert forward == pytest.approx(1e12 / rate + 1e-5)
    assert backward == pytest.approx(2.5 * 1e12 / rate + 1e-5)
    product = op_times(replace(op, kind="matmul"), gpu, 1000)[0]
    assert forward / product == pytest.approx(0.8 / 0.35, rel=1e-3)  # overheads aside
    assert op_times(op, GPU, 1000)[0] == pytest.approx(product)  # no figure: as a product


def test_a_replayed_forward_is_charged_to_the_backward() -> None:
    ops = (Op("matmul", flops=1e9), Op("memory", bytes=1e6))
    kept = LayerCost("l", ops)
    replayed = LayerCost("l", tuple(replace(op, replay=1.0) for op in ops))
    forward, backward = phase_times(kept, GPU, 100)
    assert phase_times(replayed, GPU, 100) == pytest.approx((forward, backward + forward))
    half = LayerCost("l", (replace(ops[0], replay=0.5), ops[1]))
    product = op_times(ops[0], GPU, 100)[0]
    assert phase_times(half, GPU, 100) == pytest.approx((forward, backward + product / 2))
    with pytest.raises(CostModelError, match="replay=-1"):
        Op("matmul", replay=-1)


def test_a_memory_bound_op_moves_its_bytes() -> None:
    forward, backward = op_times(Op("memory", bytes=1e6, backward=2.0), GPU, 1000)
    assert forward == pytest.approx(1e9 / 1e12 + 1e-5)
    assert backward == pytest.approx(2e9 / 1e12 + 1e-5)


def test_weights_are_read_per_call_not_per_sample() -> None:
    op = Op("matmul", flops=10.0, bytes=10.0, weight_read=1e8, weight_grad=1e8)
    one = sum(op_times(op, GPU, 64))
    eight = 8 * sum(op_times(op, GPU, 8))
    assert eight > 6 * one  # the weights are streamed eight times


def test_tensors_too_large_for_the_allocator_to_reuse_are_faulted_in() -> None:
    # A CPU whose malloc maps tensors of 32 MiB and more afresh, faulted in at 1 GB/s.
    cpu = replace(CPU, fresh_bandwidth=1e9, fresh_threshold=32 * 2**20)
    op = Op("memory", bytes=3e5, out_bytes=1e5, weight_grad=40 * 2**20)  # per sample
    small_f, small_b = op_times(op, CPU, 8)
    fresh_f, fresh_b = op_times(op, cpu, 8)
    assert fresh_f == small_f  # an 800 kB output is reused
    assert fresh_b - small_b == pytest.approx(40 * 2**20 / 1e9)  # the weight gradient is not
    big_f, big_b = op_times(op, cpu, 640)  # 64 MB out, 128 MB of inputs' gradients
    assert big_f - op_times(op, CPU, 640)[0] == pytest.approx(64e6 / 1e9)
    assert big_b - op_times(op, CPU, 640)[1] == pytest.approx((128e6 + 40 * 2**20) / 1e9)
    assert CPU.fresh_time(1e12) == 0.0


def test_tensors_below_the_threshold_are_faulted_in_in_part() -> None:
    # Measured on glibc (devices.FRESH_RAMP): Adam's temporaries for 4 MiB weights are
    # reused, for 8 and 16 MiB ones faulted in part of the time, from 32 MiB always.
    from partitioner.cost.devices import FRESH_RAMP
    cpu = replace(CPU, fresh_bandwidth=1e9, fresh_threshold=32 * 2**20)
    shares = [cpu.fresh_time(m * 2**20) * 1e9 / (m * 2**20) for m in (4, 8, 16, 32, 64)]
    assert shares[0] == 0.0 and shares[3] == shares[4] == pytest.approx(1.0)
    assert 0.0 < shares[1] < shares[2] < 1.0
    assert cpu.fresh_time(32 * 2**20 / FRESH_RAMP) == 0.0
    # No jump at the threshold: just below it nearly all of a tensor is faulted in.
    assert cpu.fresh_time(32 * 2**20 - 1) == pytest.approx(cpu.fresh_time(32 * 2**20), rel=1e-6)


def test_with_the_allocator_steady_no_tensor_below_the_threshold_is_faulted_in() -> None:
    # partitioner.runtime.host_memory's steady mode: measured specs get fresh_ramp=1.
    from partitioner.errors import DeviceError
    cpu = replace(CPU, fresh_bandwidth=1e9, fresh_threshold=32 * 2**20, fresh_ramp=1.0)
    assert cpu.fresh_time(16 * 2**20) == cpu.fresh_time(32 * 2**20 - 1) == 0.0
    assert cpu.fresh_time(32 * 2**20) == pytest.approx(32 * 2**20 / 1e9)
    with pytest.raises(DeviceError, match="fresh_ramp=0.5"):
        replace(CPU, fresh_ramp=0.5)


def test_accumulating_gradients_costs_three_more_passes() -> None:
    op = Op("memory", weight_grad=1e9)
    fresh = op_times(op, GPU, 1)[1]
    accumulating = op_times(op, GPU, 1, accumulate=1.0)[1]
    assert accumulating - fresh == pytest.approx(3 * 1e9 / 1e12)


def test_tensor_parallelism_divides_split_ops_only() -> None:
    layer = LayerCost("l", (Op("matmul", 1e9, 1e3, split=True), Op("memory", bytes=1e6)),
                      param_bytes=100, split_param_bytes=80, activation_bytes=10,
                      split_activation_bytes=6)
    f1, _ = phase_times(layer, GPU, 100, tp=1)
    f4, _ = phase_times(layer, GPU, 100, tp=4)
    memory = op_times(Op("memory", bytes=1e6), GPU, 100)[0]
    assert f4 - memory < (f1 - memory) / 3
    assert layer.params_on(4) == 20 + 20 and layer.activations_on(2) == 4 + 3


def test_time_scale_scales_both_phases() -> None:
    layer = LayerCost("l", (Op("memory", bytes=1e6),))
    doubled = LayerCost("l", layer.ops, time_scale=2.0)
    assert phase_times(doubled, GPU, 10) == pytest.approx(
        tuple(2 * t for t in phase_times(layer, GPU, 10)))


def test_validation_names_the_bad_values() -> None:
    with pytest.raises(CostModelError, match="flops=-1.*kind='conv'"):
        Op("conv", flops=-1)
    with pytest.raises(CostModelError, match="split_param_bytes=5 > param_bytes"):
        LayerCost("l", param_bytes=1, split_param_bytes=5)
    with pytest.raises(CostModelError, match="2 boundaries for 2 layers.*batch=0") as info:
        Workload((LayerCost("a"), LayerCost("b")), (0.0, 0.0), 0)
    assert isinstance(info.value, ValueError)


def _mlp(width: int = 1024, blocks: int = 16) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width),
                                                              nn.ReLU())])


def test_small_micro_batches_are_predicted_about_three_times_slower() -> None:
    # On this CPU 8 micro-batches of 8 rows take about 3x one batch of 64
    # (benchmarks/predicted_vs_measured.py measures it); the model must predict that,
    # from weight traffic and per-op costs alone.
    workload = analyze(_mlp(), (torch.randn(64, 1024),)).workload
    assert workload is not None
    cluster = Cluster(CPU, local=("cpu",))
    one = predict(workload, cluster, Config(chunks=1, checkpoint="never", optimizer="sgd"))
    eight = predict(workload, cluster, Config(chunks=8, checkpoint="never", optimizer="sgd"))
    assert 2.4 < eight.step_time / one.step_time < 4.0


def test_layer_costs_of_a_graph_are_per_sample() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Flatten(), nn.Linear(32, 4))
    small = analyze(model, (torch.randn(2, 16),)).workload
    large = analyze(model, (torch.randn(8, 16),)).workload
    assert small is not None and large is not None
    for a, b in zip(small.layers, large.layers):
        assert a.forward_flops == pytest.approx(b.forward_flops)
        assert a.param_bytes == b.param_bytes
    first = large.layers[0]
    assert first.forward_flops == 2 * 16 * 32
    assert first.ops[0].weight_read == (16 * 32 + 32) * 4
    assert first.splittable and not large.layers[1].splittable
    assert large.boundaries[1] == 32 * 4  # one row of the first layer's output
    assert large.batch == 8


def test_views_move_no_data() -> None:
    class Reshape(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(x.shape[0], 4, 4).transpose(1, 2)

    workload = analyze(nn.Sequential(Reshape()), (torch.randn(8, 16),)).workload
    assert workload is not None
    assert all(op.bytes == 0 for layer in workload.layers for op in layer.ops)


def test_tied_weights_are_charged_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    workload = analyze(Tied(), (torch.randn(4, 8),)).workload
    assert workload is not None
    assert workload.param_bytes == 8 * 8 * 4


def test_batch_norm_makes_a_workload_unsafe_to_micro_batch() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    workload = analyze(model, (torch.randn(4, 8),)).workload
    assert workload is not None and not workload.microbatch_safe
    assert "batch norm" in workload.notes[0]


def test_layer_costs_infers_the_batch() -> None:
    analysis = analyze(_mlp(8, 2), (torch.randn(5, 8),))
    costs = layer_costs(analysis.captured.graph_module, analysis.layers)
    assert costs[0].forward_flops == 2 * 8 * 8


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.cost).failed == 0


def test_the_fixed_launch_costs_gain_nothing_from_sharing_a_host() -> None:
    # Workers of one process take turns at each op's launch (Python, the dispatcher): only
    # the op's work gains what the host's cores share.
    from partitioner.cost.sharing import shared_work
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, op_overhead=1e-3,
                     shared_speedup=(1.0, 2.0))
    tiny = LayerCost("tiny", (Op("memory", bytes=1.0),))  # nearly all launch cost
    big = LayerCost("big", (Op("memory", bytes=1e9),))  # nearly all work
    alone, two = shared_work(tiny, cpu, 1)
    assert alone / two == pytest.approx(1.0, abs=1e-3)
    alone, two = shared_work(big, cpu, 1)
    assert alone / two == pytest.approx(2.0, rel=0.02)  # 0.2 s of work, 2 ms of launches


def test_a_lone_worker_loses_its_share_of_threads_on_kernels_not_on_launches() -> None:
    # A stage worker alone on a host it shares runs with its share of the intra-op threads
    # (worker_speed of all of them); the ops' launches (Python, the dispatcher) take as long
    # on one thread as on all, so a pipeline of small layers runs about as fast as one
    # device, and one of large products at worker_speed.
    from partitioner.cost.devices import REFERENCE_CPU
    from partitioner.cost.sharing import lone_work, shared_work
    spec = replace(REFERENCE_CPU, worker_speed=0.5)
    tiny = LayerCost("tiny", (Op("matmul", flops=10.0),))
    big = LayerCost("big", (Op("matmul", flops=1e9),))
    for layer, gain in ((tiny, 1.0), (big, 0.5)):
        alone = shared_work(layer, spec, 1)[0]
        assert alone / lone_work(layer, spec, 1) == pytest.approx(gain, rel=0.02)
    cluster = Cluster.local_devices(["cpu"] * 2, [spec] * 2)
    for width, batch, low, high in ((8, 8, 0.9, 1.0), (1024, 256, 0.5, 0.6)):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        workload = analyze(model, (torch.randn(batch, width),)).workload
        assert workload is not None
        stages = predict(workload, cluster, Config(pp=2)).stages
        assert all(low <= s.lone <= high for s in stages), [s.lone for s in stages]
        assert stages[0].speedup(spec, 1) == stages[0].lone
    # Without the stage's own figure, the device's.
    assert replace(stages[0], lone=0.0).speedup(spec, 1) == 0.5


def test_the_first_product_on_the_batch_has_no_input_gradient_to_compute() -> None:
    """Autograd skips the gradient of an input no parameter is upstream of: the first
    Linear's backward is its weight gradient alone (one product), where the same Linear
    deeper in the model runs two; the two are costed apart (their signatures differ, so a
    calibration scales each by its own time), and an input that requires a gradient
    brings the second product back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256))
    x = torch.randn(32, 256)
    layers = analyze(model, (x,)).workload.layers
    products = [[op for op in layer.ops if op.kind == "matmul"] for layer in layers]
    firsts = [ops[0] for ops in products if ops]
    assert [op.input_grad for op in firsts] == [False, True, True]
    spec = DeviceSpec("cpu", {"fp32": 1e11}, 8e9, 1e10, 0.9, 5e7, 1.0, 1e-5)
    first, deeper = (op_times(op, spec, 32) for op in firsts[:2])
    assert first[0] == pytest.approx(deeper[0])  # the same forward
    assert first[1] < 0.75 * deeper[1]  # one product of two, plus the same gradient write
    owners = [layer for layer, ops in zip(layers, products) if ops]
    assert owners[0].signature != owners[1].signature
    tracked = analyze(model, (x.clone().requires_grad_(),)).workload.layers
    assert all(op.input_grad for layer in tracked for op in layer.ops)
    relu_first = analyze(nn.Sequential(nn.ReLU(), nn.Linear(256, 256)), (x,)).workload
    memory = [op for layer in relu_first.layers for op in layer.ops if op.kind == "memory"]
    assert memory and all(not op.input_grad and op_times(op, spec, 32)[1] == 0.0
                          for op in memory)  # a ReLU on the batch has no backward at all
