"""The cost model and the search know the sharded optimizer (ZeRO-1, ``optimizer_sharding``)."""

from __future__ import annotations

import pytest

from partitioner.cost.devices import REFERENCE_CPU, Cluster
from partitioner.cost.memory import device_memory
from partitioner.cost.transformer_model import GPTShape, gpt_workload, megatron_boundaries
from partitioner.errors import ConfigError, MemoryLimitError
from partitioner.planning.auto import (
    LOCAL_RUNTIME,
    MULTI_PROCESS_RUNTIME,
    configurations,
    executable,
    search,
)
from partitioner.planning.predict import Config, predict
from partitioner.planning.simulate import simulate
from partitioner.planning.space import SearchSpace
from partitioner.planning.world import Degrees, search_world, world_plan
from partitioner.plans.plan import Plan

# Megatron-LM's 1T model (SC'21, Table 1's last row) on tp 8 x pp 16 x dp 8 A100-80GB.
SHAPE = GPTShape(128, 25600, 160, 2048, 51200)
CLUSTER = Cluster.preset("A100-80GB", nodes=128, devices_per_node=8)
BATCH = 512


def _config(sharding: bool) -> Config:
    return Config(8, 8, 16, BATCH // 8, "interleaved", 2, "always", "fused_adam",
                  overlap_grad_reduce=False, overlap_p2p=False, optimizer_sharding=sharding)


def _predict(sharding: bool):  # type: ignore[no-untyped-def]
    config = _config(sharding)
    return predict(gpt_workload(SHAPE, BATCH), CLUSTER, config,
                   megatron_boundaries(SHAPE, config.stages))


def test_sharding_divides_the_optimizer_state_and_master_weights_only() -> None:
    plain = device_memory(800.0, 0.0, 10.0, optimizer="adam", element=2, mixed_precision=True)
    sharded = device_memory(800.0, 0.0, 10.0, optimizer="adam", element=2,
                            mixed_precision=True, shards=8)
    assert sharded.optimizer == pytest.approx(plain.optimizer / 8)
    assert (sharded.params, sharded.grads, sharded.activations) == \
        (plain.params, plain.grads, plain.activations)


def test_a_1t_model_on_tp8_pp16_fits_only_with_the_sharded_optimizer() -> None:
    plain, sharded = _predict(False), _predict(True)
    assert not plain.fits and sharded.fits
    assert max(m.optimizer for m in sharded.memory) == pytest.approx(
        max(m.optimizer for m in plain.memory) / 8)
    # Reduce-scatter plus all-gather move a ring all-reduce's bytes: same replica time.
    assert sharded.dp_times == pytest.approx(plain.dp_times)
    assert "zero1" in sharded.config.label() and "zero1" not in plain.config.label()


def test_the_search_chooses_sharding_when_only_it_fits() -> None:
    options = dict(chunks=BATCH // 8, checkpoint="always", schedules=("1f1b",), tp=8, pp=16,
                   optimizer="fused_adam", executable_only=False, budget=None)
    with pytest.raises(MemoryLimitError):
        search(gpt_workload(SHAPE, BATCH), CLUSTER, **options)  # type: ignore[arg-type]
    best = search(gpt_workload(SHAPE, BATCH), CLUSTER, optimizer_sharding=None,
                  **options).best  # type: ignore[arg-type]
    assert best.config.optimizer_sharding and best.config.dp == 8 and best.fits


def test_configurations_try_sharding_only_with_replicas() -> None:
    here = Cluster.local_devices(["cpu"] * 4, [REFERENCE_CPU] * 4)
    workload = gpt_workload(GPTShape(4, 64, 4, 16, 100), 8)
    configs = list(configurations(workload, here, chunks=1, checkpoint="never",
                                  schedules=("gpipe",), optimizer_sharding=None))
    sharded = [c for c in configs if c.optimizer_sharding]
    assert sharded and all(c.dp > 1 for c in sharded)
    assert {(c.dp, c.tp, c.pp) for c in sharded} == {(c.dp, c.tp, c.pp) for c in configs
                                                      if c.dp > 1}
    assert not any(c.optimizer_sharding for c in configurations(
        workload, here, chunks=1, checkpoint="never", schedules=("gpipe",)))


def test_only_the_multi_process_runtime_runs_sharding() -> None:
    here = Cluster.local_devices(["cpu"] * 2, [REFERENCE_CPU] * 2)
    config = Config(dp=2, optimizer_sharding=True)
    why = executable(config, here, LOCAL_RUNTIME)
    assert why is not None and "does not shard the optimizer state" in why
    assert executable(config, here, MULTI_PROCESS_RUNTIME) is None


def test_sharding_one_replica_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"optimizer_sharding=True with dp=1.*dp >= 2"):
        Config(dp=1, optimizer_sharding=True)


def test_a_plan_carries_the_sharding_the_search_chose() -> None:
    workload = gpt_workload(SHAPE, BATCH)
    # The searched schedule, sharded: its peak fits, the plain optimizer's does not.
    config = Config(8, 8, 16, BATCH // 8, "1f1b", 1, "always", optimizer_sharding=True)
    prediction = predict(workload, CLUSTER, config, megatron_boundaries(SHAPE, config.stages))
    capacity = max(m.total for m in prediction.memory) * 1.01
    asked = SearchSpace(chunks=BATCH // 8, checkpoint="always", schedules=("1f1b",),
                        optimizer_sharding=None)
    result = search_world(workload, CLUSTER, Degrees(dp=8, tp=8, pp=16), asked,
                          capacity=capacity, budget=None)
    assert result.best.config.optimizer_sharding
    plan = world_plan(result, [lay.name for lay in workload.layers], CLUSTER)
    assert plan.optimizer_sharding
    assert Plan.from_dict(plan.to_dict()).optimizer_sharding
    with pytest.raises(ValueError, match="optimizer_sharding is true but the mesh has dp=1"):
        Plan.from_dict({**plan.to_dict(), "mesh": {"dp": 1, "pp": 16, "tp": 8}})


def test_overlap_param_gather_needs_the_sharded_optimizer_and_overlapped_reduction() -> None:
    with pytest.raises(ConfigError, match="overlap_param_gather=True without optimizer_shard"):
        Config(dp=2, overlap_param_gather=True)
    with pytest.raises(ConfigError, match="overlap_param_gather=True without"):
        Config(dp=2, optimizer_sharding=True, overlap_grad_reduce=False,
               overlap_param_gather=True)
    config = Config(dp=2, optimizer_sharding=True, overlap_param_gather=True)
    assert config.label().endswith("zero1 overlapped") and config.reduces_in_backward
    assert not Config(dp=2, optimizer_sharding=True).reduces_in_backward
    # No runtime here overlaps the all-gather with the next forward.
    here = Cluster.local_devices(["cpu"] * 2, [REFERENCE_CPU] * 2)
    why = executable(config, here, MULTI_PROCESS_RUNTIME)
    assert why is not None and "overlap_param_gather" in why


def test_megatron_s_overlapped_distributed_optimizer_hides_what_the_runtime_s_does_not() -> None:
    workload = gpt_workload(SHAPE, BATCH)
    base = dict(dp=8, tp=8, pp=16, chunks=BATCH // 8, schedule="1f1b", checkpoint="always",
                optimizer="fused_adam")
    after = Config(**base, optimizer_sharding=True)  # type: ignore[arg-type]
    overlapped = Config(**base, optimizer_sharding=True,  # type: ignore[arg-type]
                        overlap_param_gather=True)
    plain = Config(**base)  # type: ignore[arg-type]
    bounds = megatron_boundaries(SHAPE, plain.stages)
    p_after, p_over, p_plain = (predict(workload, CLUSTER, c, bounds, capacity=1e15)
                                for c in (after, overlapped, plain))
    # The same state sharded; the reduce-scatter in the backward, the all-gather behind the
    # next forward: no more time than the plain all-reduce, less than after the backward.
    assert p_over.memory == p_after.memory
    assert max(p_over.dp_times) <= max(p_plain.dp_times)
    assert p_over.step_time < p_after.step_time
    assert p_over.step_time <= p_plain.step_time
    # The simulation overlaps what the prediction overlaps.
    for prediction in (p_after, p_over, p_plain):
        assert simulate(prediction, CLUSTER).step_time == pytest.approx(
            prediction.step_time, rel=1e-3)
