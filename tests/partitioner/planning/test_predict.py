"""Tests of partitioner/planning/predict.py: one configuration's split, step time and memory."""

from __future__ import annotations

import doctest
from dataclasses import replace

import pytest

import partitioner.planning.predict
from partitioner.cost.cost import LayerCost, Op, Workload
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.cost.split_backward import FUSED_FORWARD_SHARE
from partitioner.cost.transformer_model import GPTShape, gpt_workload
from partitioner.planning.predict import Config, ConfigError, predict, replayed
from partitioner.planning.solver import BalanceError

CLUSTER = Cluster.preset("A100-80GB", nodes=2)
WORKLOAD = gpt_workload(GPTShape(16, 2048, 16, 1024, 50304), batch=64)


def test_config_validation_collects_problems() -> None:
    with pytest.raises(ConfigError, match="dp=0.*schedule='zigzag'.*checkpoint='maybe'"):
        Config(dp=0, schedule="zigzag", checkpoint="maybe")
    with pytest.raises(ConfigError, match="'interleaved' needs virtual >= 2"):
        Config(pp=2, schedule="interleaved")
    with pytest.raises(ConfigError, match="'gpipe' runs one virtual stage per stage"):
        Config(pp=2, schedule="gpipe", virtual=2)
    # The registry's rules, not only its names: interleaving goes in groups of pp.
    with pytest.raises(ConfigError, match="groups of the 4 stages, got 6 micro-batches"):
        Config(pp=4, chunks=6, schedule="interleaved", virtual=2)
    with pytest.raises(ConfigError, match="schedule='zigzag' is not a registered schedule; "
                                          "use one of 'gpipe', '1f1b', 'interleaved'"):
        Config(schedule="zigzag")
    with pytest.raises(ConfigError, match="optimizer='lion'") as info:
        Config(optimizer="lion")
    assert isinstance(info.value, ValueError)
    assert Config(dp=2, tp=4, pp=2, chunks=8).label() == "dp=2 tp=4 pp=2 m=8 gpipe ckpt=never"


def test_configurations_must_fit_cluster_and_workload() -> None:
    with pytest.raises(ConfigError, match="dp\\*tp\\*pp = 8 but the cluster has 16"):
        predict(WORKLOAD, CLUSTER, Config(dp=8))
    with pytest.raises(ConfigError, match="tp=16 exceeds the 8 devices of a node"):
        predict(WORKLOAD, CLUSTER, Config(tp=16))
    with pytest.raises(ConfigError, match="batch 8 does not split over dp=16"):
        predict(gpt_workload(GPTShape(2, 64, 4, 16, 100), batch=8), CLUSTER, Config(dp=16))


def test_replayed_micro_batches_follow_torchgpipe() -> None:
    assert (replayed("always", 4), replayed("except_last", 4), replayed("never", 4)) == (4, 3, 0)


def test_checkpointing_trades_time_for_memory() -> None:
    base = Config(dp=2, tp=2, pp=4, chunks=8, schedule="gpipe")
    never = predict(WORKLOAD, CLUSTER, base)
    always = predict(WORKLOAD, CLUSTER, Config(**{**base.__dict__, "checkpoint": "always"}))
    assert always.step_time > never.step_time
    assert always.peak_memory < never.peak_memory


def test_more_micro_batches_shrink_the_bubble() -> None:
    few = predict(WORKLOAD, CLUSTER, Config(dp=2, tp=2, pp=4, chunks=2))
    many = predict(WORKLOAD, CLUSTER, Config(dp=2, tp=2, pp=4, chunks=16))
    assert many.bubble < few.bubble


def test_one_f_one_b_holds_less_than_gpipe() -> None:
    gpipe = predict(WORKLOAD, CLUSTER, Config(dp=1, tp=2, pp=8, chunks=32))
    onef = predict(WORKLOAD, CLUSTER, Config(dp=1, tp=2, pp=8, chunks=32, schedule="1f1b"))
    assert onef.step_time == pytest.approx(gpipe.step_time, rel=1e-9)
    assert all(o.activations <= g.activations for o, g in zip(onef.memory, gpipe.memory))
    assert sum(m.activations for m in onef.memory) < sum(m.activations for m in gpipe.memory)


def test_interleaved_split_balances_the_devices() -> None:
    config = Config(dp=1, tp=4, pp=4, chunks=16, schedule="interleaved", virtual=2)
    prediction = predict(WORKLOAD, CLUSTER, config)
    loads = [sum(s.forward + s.backward for s in prediction.stages[j::4]) for j in range(4)]
    assert max(loads) / min(loads) < 1.6  # the head's chunk is the one unavoidable lump
    assert len(prediction.boundaries) == 9


def test_given_boundaries_are_checked() -> None:
    with pytest.raises(BalanceError, match="do not describe 2 non-empty stages"):
        predict(WORKLOAD, CLUSTER, Config(dp=4, tp=2, pp=2), boundaries=(0, 0, 18))


def test_too_little_memory_gives_a_reason() -> None:
    prediction = predict(WORKLOAD, CLUSTER, Config(dp=16, chunks=1), capacity=1e9)
    assert not prediction.fits and "fits" in prediction.reason


def test_host_sharing_does_not_count_as_bubble() -> None:
    # Regression: GPT-2-xl on 8 "cpu" devices reported an 89% bubble at 8 micro-batches,
    # because the slowdown of stages sharing the host's cores was counted as idle time.
    layers = tuple(LayerCost(f"l{k}", (Op("memory", bytes=1e6),)) for k in range(4))
    workload = Workload(layers, (0.0,) * 5, batch=8)
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, shared_speedup=(1.0, 0.8, 0.8, 0.8))
    shared = Cluster(cpu, devices_per_node=4, local=("cpu",) * 4)
    own = Cluster(replace(cpu, shared_speedup=()), devices_per_node=4)
    config = Config(pp=4, chunks=8)
    slowed, alone = predict(workload, shared, config), predict(workload, own, config)
    assert slowed.pipeline_time > 2 * alone.pipeline_time  # four stages on one core's worth
    assert slowed.bubble == pytest.approx(3 / 11, abs=1e-12) == alone.bubble


def _products(flops: float) -> Workload:
    layers = tuple(LayerCost(f"l{k}", (Op("matmul", flops=flops),)) for k in range(4))
    return Workload(layers, (0.0,) * 5, batch=8)


def test_small_products_gain_more_from_sharing_a_host_than_large_ones() -> None:
    # Two stage workers at once: 2x the work of one on products of 1e6 FLOPs, 1x on 1e9.
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, 1.0, 1.0, 1.0, 0.0,
                     shared_speedup=(1.0, 1.5),
                     shared_sizes=((1e6, 1.0, 2.0), (1e9, 1.0, 1.0)))
    host = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    own = Cluster(replace(cpu, shared_speedup=(), shared_sizes=()), devices_per_node=2)
    config = Config(pp=2, chunks=2)
    for flops, gain in ((1e6 / 4, 2.0), (1e9 / 4, 1.0)):  # per sample, 4 per micro-batch
        shared, alone = predict(_products(flops), host, config), predict(_products(flops), own,
                                                                         config)
        assert [s.sharing for s in shared.stages] == [(1.0, gain)] * 2
        steady = shared.pipeline_time - sum(s.forward + s.backward for s in shared.stages)
        assert steady == pytest.approx(2 * (alone.stages[0].forward
                                            + alone.stages[0].backward) / gain)
    # Without a table by size, the device's reference figure.
    plain = Cluster(replace(cpu, shared_sizes=()), devices_per_node=2, local=("cpu", "cpu"))
    assert predict(_products(1e3), plain, config).stages[0].sharing == ()


def test_devices_sharing_a_host_are_stepped_by_one_optimizer() -> None:
    # The runtime's stages share one process: its optimizer steps every device's parameters,
    # one after another, after the whole backward.
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, shared_speedup=(1.0, 1.0))
    host = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    own = Cluster(replace(cpu, shared_speedup=()), devices_per_node=2)
    workload = Workload(tuple(LayerCost(f"l{k}", (Op("matmul", flops=1e6),), param_bytes=4e8)
                              for k in range(4)), (0.0,) * 5, batch=8)
    shared, separate = (predict(workload, c, Config(pp=2, chunks=4)) for c in (host, own))
    assert shared.optimizer_times == separate.optimizer_times
    assert shared.step_time == pytest.approx(shared.pipeline_time
                                             + sum(shared.optimizer_times))
    assert separate.step_time == pytest.approx(separate.pipeline_time
                                               + separate.optimizer_times[0])


def test_adam_faults_in_its_temporaries_for_large_weights() -> None:
    # PyTorch's Adam allocates two weight-sized temporaries per tensor; above the allocator's
    # reuse threshold they are faulted in every step. SGD works in place.
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e10, 1e10, fresh_bandwidth=1e9,
                     fresh_threshold=32 * 2**20)
    layers = (LayerCost("embed", (Op("memory", bytes=8.0, weight_grad=100e6),),
                        param_bytes=100e6),
              LayerCost("fc", (Op("matmul", flops=1e3, weight_grad=4e6),), param_bytes=4e6))
    workload = Workload(layers, (0.0,) * 3, batch=8)
    no_faults = Cluster(replace(cpu, fresh_bandwidth=0.0))
    for optimizer, extra in (("adam", 2 * 100e6 / 1e9), ("momentum", 0.0)):
        config = Config(optimizer=optimizer)
        faulted = predict(workload, Cluster(cpu), config).optimizer_times[0]
        assert faulted - predict(workload, no_faults, config).optimizer_times[0] \
            == pytest.approx(extra)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.planning.predict).failed == 0


def test_a_replayed_forward_all_reduces_again() -> None:
    """Full per-layer checkpointing replays the forward's tensor-parallel all-reduces in the
    backward (torchtitan's and Megatron's full activation checkpointing do)."""
    from partitioner.cost.comm import all_reduce_time
    from partitioner.planning.predict import layer_profile

    layer = LayerCost("l", (Op("matmul", flops=1e9, split=True),), param_bytes=8.0,
                      split_param_bytes=8.0, output_bytes=1e6, tp_all_reduces=2)
    cluster = Cluster.preset("H100-SXM")
    kept = layer_profile(Workload((layer,), (0.0, 0.0), 8), cluster, 8, 8)[0]
    replayed_layer = replace(layer, ops=(replace(layer.ops[0], replay=1.0),),
                             replayed_all_reduces=2.0, signature="replayed")
    again = layer_profile(Workload((replayed_layer,), (0.0, 0.0), 8), cluster, 8, 8)[0]
    comm = 2 * all_reduce_time(8e6, 8, cluster.group_link(range(8)))
    forward_ops = kept[0] - comm
    assert comm > 0 and again[0] == pytest.approx(kept[0])
    assert again[1] == pytest.approx(kept[1] + forward_ops + comm)  # the forward, again


def test_replicas_in_one_process_pay_per_parameter_tensor() -> None:
    # Each replica past the first checks and sums every parameter tensor (runtime/
    # replica_copy.py): measured per tensor, charged per tensor and replica.
    layer = LayerCost("fc", (Op("matmul", flops=1e6, weight_read=4096),), param_bytes=4096,
                      param_tensors=2)
    work = Workload((layer,) * 10, (1e3,) * 11, batch=8)
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, shared_speedup=(1.0, 1.5))
    host = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    costly = Cluster(replace(cpu, replica_tensor_overhead=1e-3), devices_per_node=2,
                     local=("cpu", "cpu"))
    config = Config(dp=2, pp=1)
    extra = predict(work, costly, config).dp_times[0] - predict(work, host, config).dp_times[0]
    assert extra == pytest.approx(20 * 1e-3)  # 10 layers x 2 tensors x 1 replica past one
    assert predict(work, costly, Config(dp=1, pp=2)).dp_times == (0.0, 0.0)


def test_a_lone_workers_speed_slows_the_fill_and_drain_of_a_shared_host() -> None:
    work = _products(1e6)
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, shared_speedup=(1.0, 2.0))
    whole = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    share = Cluster(replace(cpu, worker_speed=0.5), devices_per_node=2, local=("cpu", "cpu"))
    config = Config(pp=2, chunks=2)
    assert predict(work, share, config).pipeline_time > predict(work, whole, config).pipeline_time
    # A device of its own (no sharing) is not slowed.
    own = Cluster(replace(cpu, shared_speedup=(), worker_speed=0.5), devices_per_node=2)
    plain = Cluster(replace(cpu, shared_speedup=()), devices_per_node=2)
    assert predict(work, own, config).pipeline_time == predict(work, plain, config).pipeline_time


def test_a_split_backward_pays_its_w_action_and_the_queued_products() -> None:
    # zero_bubble runs I and W actions, and queues every weight product through
    # fused_linear (a Python autograd function): both measured, both charged per stage and
    # micro-batch; schedules with one backward action pay neither.
    work = _products(1e6)
    cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, action_overhead=1e-4)
    costly = Cluster(replace(cpu, fused_linear_overhead=1e-3), devices_per_node=2)
    plain = Cluster(cpu, devices_per_node=2)
    split, whole = Config(pp=2, chunks=2, schedule="zero_bubble"), Config(pp=2, chunks=2)
    extra = [c.backward - p.backward for c, p in zip(predict(work, costly, split).stages,
                                                     predict(work, plain, split).stages)]
    assert extra == [pytest.approx(0.0)] * 2  # _products' ops have no weight gradient
    weighted = Workload(tuple(LayerCost(f"l{k}", (Op("matmul", flops=1e6, weight_grad=64),))
                              for k in range(4)), (0.0,) * 5, batch=8)
    split_stage = predict(weighted, costly, split).stages[0]
    one_action = predict(weighted, costly, whole).stages[0]
    # W + 2 layers' products, their autograd function's forward share in the forward (a
    # trace of `mlp` on 2 gloo ranks: each stage's forward 0.10 ms slower under zero_bubble).
    share = FUSED_FORWARD_SHARE
    assert split_stage.backward - one_action.backward == pytest.approx(
        1e-4 + (1 - share) * 2 * 1e-3)
    assert split_stage.forward - one_action.forward == pytest.approx(share * 2 * 1e-3)
    assert 0.5 < share < 0.8
