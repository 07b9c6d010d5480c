"""The V-shaped schedule in the search: its registry hooks (fill and drain, bound, in-flight
peak) as the predictor, the simulator and ``strategy="auto"`` read them
(runtime/schedule_registry.py, partitioner/planning/predict.py, auto.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.cost.devices import Cluster
from partitioner.cost.transformer_model import GPTShape, gpt_workload
from partitioner.planning.auto import (
    LOCAL_RUNTIME,
    MULTI_PROCESS_RUNTIME,
    _Bounds,
    configurations,
    search,
)
from partitioner.planning.predict import Config, predict
from partitioner.planning.simulate import simulate
from partitioner.runtime.schedule import clock_ticks
from partitioner.runtime.schedule_registry import V_SHAPE, make_schedule, schedule_kind

GPT = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=32)
DEEP = gpt_workload(GPTShape(24, 1024, 16, 1024, 50304), batch=64)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 1, 2), (2, 4, 3), (4, 8, 2), (4, 16, 3)])
def test_its_fill_is_counted_from_its_own_order(p: int, m: int, v: int) -> None:
    kind = schedule_kind(V_SHAPE)
    ticks = len(clock_ticks(make_schedule(V_SHAPE, p, m, v), 1.0, 2.0))
    assert kind.fill_drain(p, m, v) == ticks / 3 - m * v
    assert replace(kind, fill=None).fill_drain(p, m, v) == kind.fill_drain(p, m, v)
    # One micro-batch walks every chunk in turn: the fill is the rest of the devices' work.
    assert kind.fill_drain(p, 1, v) == (p - 1) * v


def test_its_bound_takes_the_fill_at_its_least() -> None:
    # Device P - 1 waits P - 1 forwards, and the gradients of its last backward go down
    # P - 1 stages; one micro-batch's path is every chunk: what v_bound assumes.
    forward, backward = [1.0] * 12, [2.0] * 12
    for p in (2, 3, 4, 6):
        for m in (1, 2, 3, 5, 8, 13):
            for v in (2, 3, 4):
                fill = schedule_kind(V_SHAPE).fill_drain(p, m, v)
                assert max(p - 1, v * (p - m)) <= fill, (p, m, v)
                even = (fill + m * v) * 36 / (p * v)  # the predictor's, equal stages
                bound = schedule_kind(V_SHAPE).bound(p, m, v, forward, backward, 0.5)
                assert bound <= even * (1 + 1e-12)


def test_the_predictor_reads_its_placement() -> None:
    cluster = Cluster.preset("A100-80GB", devices_per_node=4)
    prediction = predict(DEEP, cluster, Config(pp=4, chunks=8, schedule=V_SHAPE, virtual=2))
    assert [s.device for s in prediction.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert prediction.stages[3].send == 0.0   # the turn stays on device 3
    assert all(s.send > 0 for k, s in enumerate(prediction.stages[:-1]) if k != 3)
    held = [schedule_kind(V_SHAPE).in_flight(4, 8, j, 2) for j in range(4)]
    assert held[-1] == max(held) > held[0]    # the V's busiest device is the last
    assert prediction.memory[3].activations >= prediction.memory[0].activations


@pytest.mark.parametrize("devices", [2, 4])
def test_its_predictions_follow_the_simulation(devices: int) -> None:
    cluster = Cluster.preset("A100-80GB", devices_per_node=devices)
    for m in (1, 4, 16):
        for v in (2, 3):
            p = predict(DEEP, cluster, Config(pp=devices, chunks=m, schedule=V_SHAPE,
                                              virtual=v))
            simulated = simulate(p, cluster).pipeline_time
            assert p.pipeline_time == pytest.approx(simulated, rel=0.1), (m, v)


@pytest.mark.parametrize("per_node", [4, 8])
def test_bounds_never_exceed_predictions_nor_prune_what_fits(per_node: int) -> None:
    cluster = Cluster.preset("A100-80GB", devices_per_node=per_node)
    bounds = _Bounds(GPT, cluster, cluster.device.memory_bytes)
    found = list(configurations(GPT, cluster, schedules=(V_SHAPE,)))
    assert len(found) > 100
    for c in found:
        prediction = predict(GPT, cluster, c)
        assert bounds.step(c) <= prediction.step_time * (1 + 1e-9), c.label()
        assert bounds.may_fit(c) or not prediction.fits, c.label()


def test_the_quick_memory_check_counts_the_device_holding_fewest() -> None:
    # Some device holds at least an even share of the weights and of the activations of
    # the fewest micro-batches any device holds: in a V that is not the last device, which
    # holds the most (in a looped schedule, the fewest).
    c = Config(pp=4, chunks=8, schedule=V_SHAPE, virtual=2)
    held = [schedule_kind(V_SHAPE).in_flight(4, 8, j, 2) for j in range(4)]
    assert min(held) < held[-1]
    probe = _Bounds(GPT, Cluster.preset("A100-80GB"), 0.0)
    static, acts = probe._model_memory(c.tp, c.optimizer, c.optimizer_shards, 1)
    least = static / 4 + acts * GPT.batch / 8 * min(held) / (4 * 2)
    cluster = Cluster.preset("A100-80GB")
    assert _Bounds(GPT, cluster, least * (1 + 1e-9)).may_fit(c)
    assert not _Bounds(GPT, cluster, least * (1 - 1e-9)).may_fit(c)


def test_auto_tries_it_and_both_runtimes_may_run_it() -> None:
    assert V_SHAPE in LOCAL_RUNTIME.schedules and V_SHAPE in MULTI_PROCESS_RUNTIME.schedules
    assert V_SHAPE not in (MULTI_PROCESS_RUNTIME.tp_schedules or ())  # chunks run whole
    cluster = Cluster.preset("A100-80GB", devices_per_node=4)
    result = search(DEEP, cluster, budget=None, keep=1000)
    ranked = [p for p in result.ranked if p.config.schedule == V_SHAPE]
    assert ranked and all(p.fits and p.step_time > 0 for p in ranked)
    fastest = min(p.step_time for p in result.ranked)
    assert all(p.step_time >= fastest for p in ranked)
