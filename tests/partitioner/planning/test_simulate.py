"""Tests of partitioner/planning/simulate.py: the discrete-event simulation of a training step."""

from __future__ import annotations

import doctest
import itertools
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

import partitioner.planning.simulate
from partitioner import make_plan
from partitioner.cost.devices import Cluster, DeviceSpec, LinkSpec
from partitioner.cost.memory import MemoryBreakdown
from partitioner.cost.transformer_model import GPTShape, gpt_workload
from partitioner.errors import DeviceError
from partitioner.planning.predict import Config, Prediction, StageProfile, predict
from partitioner.planning.simulate import SimulationError, loss_all_reduce_time, simulate
from partitioner.plans.plan import Plan
from partitioner.runtime.schedule import Action
from partitioner.runtime.schedule_registry import SCHEDULES, make_schedule

GPUS = Cluster.preset("A100-80GB", nodes=2)


def _equal_stages(config: Config, forward: float = 1.0, backward: float = 2.0,
                  send: float = 0.0, grads: float = 0.0) -> Prediction:
    n = config.stages
    where = SCHEDULES[config.schedule].place(config.pp, config.virtual)
    stages = tuple(StageProfile(k, k + 1, where[k], forward, backward, forward, send,
                                0.0, grads, 0.0, 0.0, 10.0, 1.0) for k in range(n))
    memory = tuple(MemoryBreakdown(0.0, 0.0, 0.0, 0.0) for _ in range(config.pp))
    return Prediction(config, stages, 0.0, 0.0, 0.0, memory, 1.0, (0.0,) * config.pp,
                      (0.0,) * config.pp, 0.0)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (3, 5), (8, 32), (5, 3)])
def test_gpipe_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(p: int, m: int) -> None:
    result = simulate(_equal_stages(Config(pp=p, chunks=m)), GPUS)
    assert Fraction(result.bubble).limit_denominator(10_000) == Fraction(p - 1, m + p - 1)
    assert result.pipeline_time == (m + p - 1) * 3.0


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2)])
def test_one_f_one_b_has_gpipe_s_bubble(p: int, m: int) -> None:
    result = simulate(_equal_stages(Config(pp=p, chunks=m, schedule="1f1b")), GPUS)
    assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 3, 6)])
def test_interleaving_divides_the_bubble_by_the_chunks(p: int, v: int, m: int) -> None:
    result = simulate(_equal_stages(Config(pp=p, chunks=m, schedule="interleaved",
                                           virtual=v)), GPUS)
    # Megatron: the fill and drain shrink to (p - 1) chunk times of 1/v of a stage each.
    assert result.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (3, 5)])
def test_simulated_peak_memory_holds_m_or_p_minus_j_micro_batches(p: int, m: int) -> None:
    # _equal_stages keeps 10 bytes of activations per micro-batch and nothing else.
    gpipe = simulate(_equal_stages(Config(pp=p, chunks=m)), GPUS)
    onef = simulate(_equal_stages(Config(pp=p, chunks=m, schedule="1f1b")), GPUS)
    assert gpipe.peak_memory == tuple(10.0 * m for _ in range(p))
    assert onef.peak_memory == tuple(10.0 * min(p - j, m) for j in range(p))


@pytest.mark.parametrize("schedule,p,m,v", [("interleaved", 4, 8, 2), ("interleaved", 4, 16, 3),
                                             ("v_shape", 4, 8, 2), ("1f1b", 4, 8, 1)])
def test_predicted_activation_peak_is_the_simulated_one(schedule: str, p: int, m: int,
                                                         v: int) -> None:
    # The embedding and head chunks keep more than a block's: the prediction weighs each
    # chunk's micro-batches in flight by what it keeps, as the simulation tracks them.
    shape = GPTShape(p * v * 2 - 2, 256, 4, 128, 32000)
    config = Config(pp=p, chunks=m, schedule=schedule, virtual=v)
    gpus = Cluster.preset("A100-80GB", nodes=1, devices_per_node=p)
    prediction = predict(gpt_workload(shape, 2 * m), gpus, config)
    static = [mem.total - mem.activations for mem in prediction.memory]
    simulated = simulate(prediction, gpus).peak_memory
    acts = [s.activation_bytes for s in prediction.stages]
    assert max(acts) > 1.5 * min(acts)
    assert [mem.activations for mem in prediction.memory] == pytest.approx(
        [peak - fixed for peak, fixed in zip(simulated, static)], rel=1e-9)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (3, 6), (4, 8)])
def test_the_simulator_runs_every_registered_schedule_as_the_registry_builds_it(
        name: str, p: int, m: int) -> None:
    kind = SCHEDULES[name]
    v = 2 if kind.virtual else 1
    config = Config(pp=p, chunks=m, schedule=name, virtual=v)
    result = simulate(_equal_stages(config), GPUS)
    # Every action of the registry's schedule ran once, each device in its list's order.
    order = make_schedule(name, p, m, v)
    assert sorted(a for a, _, _ in result.timeline) == sorted(a for acts in order for a in acts)
    for j, actions in enumerate(order):
        ran = sorted((start, a) for a, start, _ in result.timeline
                     if kind.place(p, v)[a.stage] == j)
        assert tuple(a for _, a in ran) == actions
    # Peak memory: 10 bytes per (chunk-)micro-batch in flight, as the registry says.
    assert result.peak_memory == tuple(10.0 * kind.in_flight(p, m, j, v) for j in range(p))
    assert result.pipeline_time >= m * v * 3.0 - 1e-9


def test_timeline_is_actions_without_overlap_per_device() -> None:
    config = Config(pp=3, chunks=4, schedule="1f1b")
    result = simulate(_equal_stages(config, send=0.25), GPUS)
    assert all(isinstance(a, Action) for a, _, _ in result.timeline)
    assert len(result.timeline) == 3 * 4 * 2
    for j in range(3):
        spans = sorted((s, e) for a, s, e in result.timeline if a.stage == j)
        assert all(e1 <= s2 + 1e-12 for (_, e1), (s2, _) in itertools.pairwise(spans))
    assert [t for t in result.transfers if t[0].startswith("send 0->1 F0")]


def test_transfers_delay_the_pipeline() -> None:
    free = simulate(_equal_stages(Config(pp=4, chunks=8)), GPUS)
    slow = simulate(_equal_stages(Config(pp=4, chunks=8), send=0.5), GPUS)
    assert slow.pipeline_time > free.pipeline_time


def test_blocking_sends_cost_more_than_overlapped_ones() -> None:
    config = Config(pp=4, chunks=8, schedule="1f1b")
    overlapped = simulate(_equal_stages(config, send=0.3), GPUS)
    blocking = simulate(_equal_stages(replace(config, overlap_p2p=False), send=0.3), GPUS)
    assert blocking.pipeline_time > overlapped.pipeline_time


def test_gradient_all_reduce_overlaps_the_last_backward() -> None:
    shape = GPTShape(8, 2048, 16, 1024, 50304)
    workload = gpt_workload(shape, batch=64)
    base = Config(dp=4, tp=2, pp=2, chunks=8, schedule="1f1b", checkpoint="always")
    overlapped = simulate(predict(workload, GPUS, base), GPUS)
    serial = simulate(predict(workload, GPUS, replace(base, overlap_grad_reduce=False)), GPUS)
    assert overlapped.pipeline_time == pytest.approx(serial.pipeline_time)
    assert overlapped.step_time < serial.step_time
    assert any(label.startswith("all-reduce grads") for label, _, _ in overlapped.transfers)


@pytest.mark.parametrize("config", [
    Config(dp=2, tp=2, pp=4, chunks=8, schedule="gpipe", checkpoint="never"),
    Config(dp=2, tp=2, pp=4, chunks=8, schedule="1f1b", checkpoint="always"),
    Config(dp=1, tp=4, pp=4, chunks=16, schedule="interleaved", virtual=2,
           checkpoint="except_last"),
    Config(dp=4, tp=4, pp=1, chunks=4, checkpoint="always", overlap_grad_reduce=False),
])
def test_simulation_agrees_with_the_analytic_prediction(config: Config) -> None:
    workload = gpt_workload(GPTShape(16, 2048, 16, 1024, 50304), batch=64)
    prediction = predict(workload, GPUS, config)
    result = simulate(prediction, GPUS)
    assert result.step_time == pytest.approx(prediction.step_time, rel=0.03)
    assert result.bubble == pytest.approx(prediction.bubble, abs=0.02)
    for simulated, predicted in zip(result.peak_memory, prediction.memory):
        assert simulated <= predicted.total * 1.001


def test_devices_sharing_a_host_share_its_compute() -> None:
    cpu = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 1.0, 1.0))
    alone = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    owned = Cluster(replace(cpu, shared_speedup=()), devices_per_node=2)
    prediction = _equal_stages(Config(pp=2, chunks=8))
    shared = simulate(prediction, alone)
    separate = simulate(prediction, owned)
    assert separate.pipeline_time == pytest.approx(9 * 3.0)
    # One core's worth of compute for both stages: the work of both, one after the other.
    assert shared.pipeline_time == pytest.approx(2 * 8 * 3.0, rel=0.05)


def test_simulating_a_plan_and_its_saved_copy(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    plan = make_plan(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 16),), chunks=4)
    result = simulate(plan)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = simulate(Plan.load(path))
    assert again.step_time == pytest.approx(result.step_time)
    assert again.timeline == result.timeline
    # "cpu" devices share this machine's cores: the analytic share is an approximation.
    assert result.step_time == pytest.approx(plan.predicted_step_time, rel=0.35)


def test_a_plan_without_costs_cannot_be_simulated() -> None:
    plan = make_plan(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), ["cpu"] * 2, balance=[1, 1])
    with pytest.raises(SimulationError, match="no cost record") as info:
        simulate(plan)
    assert isinstance(info.value, ValueError)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.planning.simulate).failed == 0


def test_each_stage_gains_what_its_kind_of_work_gains_from_sharing() -> None:
    # Two stages of 1 s + 2 s per micro-batch on one host: stage 0 runs work that two busy
    # devices do 2x as fast (small products), stage 1 work that gains nothing (1x).
    cpu = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 1.5))
    host = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    base = _equal_stages(Config(pp=2, chunks=8))
    gains = replace(base, stages=(replace(base.stages[0], sharing=(1.0, 2.0)),
                                  replace(base.stages[1], sharing=(1.0, 1.0))))
    both_two = replace(base, stages=tuple(replace(s, sharing=(1.0, 2.0)) for s in base.stages))
    reference = simulate(base, host).pipeline_time  # the device's own 1.5x for both
    mixed = simulate(gains, host).pipeline_time
    fast = simulate(both_two, host).pipeline_time
    assert fast == pytest.approx(9 * 3.0)  # 2x on two devices: as if each had its own core
    assert fast < mixed < 2 * 8 * 3.0
    # 1.5x for both: all 48 s of work at 1.5x, but for the fill and drain (one stage alone).
    assert 2 * 8 * 3.0 / 1.5 < reference < 2 * 8 * 3.0 / 1.5 + 2 * 3.0


def test_devices_sharing_a_host_are_stepped_one_after_another_at_the_end() -> None:
    # One process's optimizer steps every "cpu" device's parameters once backward returns;
    # devices with their own compute step their own, each as soon as its backward is done.
    cpu = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 2.0))
    host = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    own = Cluster(replace(cpu, shared_speedup=()), devices_per_node=2)
    prediction = replace(_equal_stages(Config(pp=2, chunks=4)), optimizer_times=(0.5, 0.25))
    shared, separate = simulate(prediction, host), simulate(prediction, own)
    assert shared.pipeline_time == separate.pipeline_time == pytest.approx(5 * 3.0)
    assert shared.step_time == pytest.approx(5 * 3.0 + 0.75)
    assert separate.step_time == pytest.approx(5 * 3.0 + 0.5)  # device 0's backward ends last
    steps = [(start, end) for label, start, end in shared.transfers if "optimizer" in label]
    assert steps == [pytest.approx((15.0, 15.5)), pytest.approx((15.5, 15.75))]


def test_a_lone_stage_computes_at_its_workers_share_of_the_threads() -> None:
    # Workers keep a fixed share of the threads (runtime/local.py): a stage alone in the
    # fill or drain computes at the spec's worker_speed, not at the whole machine's speed.
    cpu = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 2.0))
    whole = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    share = Cluster(replace(cpu, worker_speed=0.5), devices_per_node=2, local=("cpu", "cpu"))
    prediction = _equal_stages(Config(pp=2, chunks=1))  # 1 s + 2 s a stage, never together
    assert simulate(prediction, whole).pipeline_time == pytest.approx(2 * 3.0)
    assert simulate(prediction, share).pipeline_time == pytest.approx(2 * 3.0 / 0.5)
    # 8 micro-batches: the steady state (both busy) keeps the calibrated 2x of two workers;
    # only the fill and drain, where one stage computes alone, take longer.
    steady = _equal_stages(Config(pp=2, chunks=8))
    fast, slow = simulate(steady, whole).pipeline_time, simulate(steady, share).pipeline_time
    assert fast == pytest.approx(9 * 3.0)
    assert fast + 3.0 <= slow <= fast + 2 * 3.0 / 0.5 < 2 * 8 * 3.0


def test_replicas_and_shards_in_one_process_share_the_hosts_compute() -> None:
    # dp=2 replicas of one stage are two busy workers on one host: on cores two workers
    # share without gain, each progresses at half speed (they used to be simulated at the
    # whole machine's speed each).
    cpu = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 1.0))
    host = Cluster(cpu, devices_per_node=2, local=("cpu", "cpu"))
    own = Cluster(replace(cpu, shared_speedup=()), devices_per_node=2)
    for config in (Config(dp=2, pp=1, chunks=1), Config(tp=2, pp=1, chunks=1)):
        prediction = _equal_stages(config)
        assert simulate(prediction, own).pipeline_time == pytest.approx(3.0)
        assert simulate(prediction, host).pipeline_time == pytest.approx(2 * 3.0)
    # Two replicas of a 2-stage pipeline: 4 workers, 2 busy per replica in the steady state.
    cpu4 = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 1.0, 1.0, 1.0))
    host4 = Cluster(cpu4, devices_per_node=4, local=("cpu",) * 4)
    alone = simulate(_equal_stages(Config(pp=2, chunks=8)), host4).pipeline_time
    assert simulate(_equal_stages(Config(dp=2, pp=2, chunks=8)), host4).pipeline_time \
        == pytest.approx(2 * alone, rel=0.05)


def test_ranks_that_waited_for_a_message_start_on_a_cold_core() -> None:
    """Across processes an action that waited for its message pays the link's ``wake``
    (``LinkSpec.wake_time`` of the wait), one that found it there nothing; threads of one
    process pay none (their hand-off is in the spec's ``action_overhead``)."""
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)  # no sharing: times stay exact
    link = LinkSpec("loopback", 1e9, 0.0, wake=0.4)
    threads = Cluster(own, devices_per_node=2, intra_node=link)
    ranks = replace(threads, processes=True)
    prediction = _equal_stages(Config(pp=2, chunks=1))  # F 1 s, B 2 s, nothing overlaps
    plain = simulate(prediction, threads)
    assert plain.pipeline_time == pytest.approx(2 * 3.0)
    cold = simulate(prediction, ranks)
    starts = {str(action): (start, end) for action, start, end in cold.timeline}
    # 1F0 waited 1 s for 0F0 (above WAKE_GAP): the whole wake.
    assert starts["1F0"] == pytest.approx((1.0, 2.0 + 0.4))
    # 1B0 follows 1F0 on the same rank: its input is there, no wake.
    assert starts["1B0"] == pytest.approx((2.4, 4.4))
    # 0B0 waited from 1.0 to 4.4 for the gradient: the full wake again.
    assert starts["0B0"] == pytest.approx((4.4, 6.4 + 0.4))
    assert cold.pipeline_time == pytest.approx(6.0 + 2 * 0.4)


def test_ranks_all_reduce_the_loss_before_any_optimizer_steps() -> None:
    """Every rank of a world all-reduces the step's loss (a one-number ring of lone
    hand-offs), so no rank's optimizer starts before the last backward plus that."""
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)
    link = LinkSpec("loopback", 1e9, 0.01, busy_latency=5.0)  # a collective's busy latency
    ranks = Cluster(own, devices_per_node=2, intra_node=link, processes=True)
    prediction = replace(_equal_stages(Config(pp=2, chunks=1)), optimizer_times=(0.5, 0.25))
    result = simulate(prediction, ranks)
    loss = 2 * 0.01  # 2 (n - 1) lone hand-offs of 8 bytes over 2 ranks, not the busy 5 s
    steps = {j: (start, end) for j, kind, start, end in result.updates if kind == "optimizer"}
    assert steps[1] == pytest.approx((6.0 + loss, 6.0 + loss + 0.25))  # rank 1 done at 4 s
    assert steps[0] == pytest.approx((6.0 + loss, 6.0 + loss + 0.5))
    alone = simulate(prediction, replace(ranks, processes=False))
    assert {j: s for j, k, s, _ in alone.updates if k == "optimizer"} == pytest.approx(
        {0: 6.0, 1: 4.0})


def test_the_loss_all_reduce_timed_in_the_world_is_what_the_ranks_wait_for() -> None:
    """The link probe times a one-number all-reduce over every rank
    (``LinkSpec.scalar_all_reduce``): with more ranks than cores it is no ring of lone
    hand-offs (0.5-1.2 ms on 4 ranks of the 2-core CI VM, against 0.25 ms for six)."""
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)
    link = LinkSpec("loopback", 1e9, 0.01, scalar_all_reduce=0.3)
    ranks = Cluster(own, devices_per_node=2, intra_node=link, processes=True)
    prediction = replace(_equal_stages(Config(pp=2, chunks=1)), optimizer_times=(0.5, 0.25))
    steps = {j: (start, end) for j, kind, start, end in simulate(prediction, ranks).updates
             if kind == "optimizer"}
    assert steps[0] == pytest.approx((6.0 + 0.3, 6.0 + 0.3 + 0.5))
    assert loss_all_reduce_time(ranks, 2) == 0.3
    # Timed over this world only: a sub-group pays the ring of hand-offs.
    four = replace(ranks, devices_per_node=4)
    assert loss_all_reduce_time(four, 2) == pytest.approx(2 * 0.01)
    with pytest.raises(DeviceError, match="scalar_all_reduce=-1"):
        LinkSpec("bad", 1e9, 0.0, scalar_all_reduce=-1.0)


def test_a_pipeline_s_ranks_wait_for_the_staggered_loss_all_reduce() -> None:
    """A pipeline's ranks reach the loss all-reduce one by one (the first stage's backward
    ends last) and the late ones come out later than ranks entering together: the probe's
    ``staggered_all_reduce`` is what a pipeline's ranks wait for; ranks of one stage (no
    pipeline) keep ``scalar_all_reduce``; a negative figure is refused by name."""
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)
    link = LinkSpec("loopback", 1e9, 0.01, scalar_all_reduce=0.3,
                    staggered_all_reduce=((0.1, 0.6), (1.0, 0.9)))
    ranks = Cluster(own, devices_per_node=2, intra_node=link, processes=True)
    prediction = replace(_equal_stages(Config(pp=2, chunks=1)), optimizer_times=(0.5, 0.25))
    steps = {j: (start, end) for j, kind, start, end in simulate(prediction, ranks).updates
             if kind == "optimizer"}
    # The longest optimizer step (0.5 s) follows: 0.6 + 0.3 x (0.5 - 0.1) / 0.9.
    reduced = 6.0 + 0.6 + 0.3 * 0.4 / 0.9
    assert steps[0] == pytest.approx((reduced, reduced + 0.5))
    assert loss_all_reduce_time(ranks, 2, staggered=True, after=0.0) == 0.6
    assert loss_all_reduce_time(ranks, 2, staggered=True, after=5.0) == 0.9
    assert loss_all_reduce_time(ranks, 2) == 0.3
    unmeasured = replace(ranks, intra_node=replace(link, staggered_all_reduce=()))
    assert loss_all_reduce_time(unmeasured, 2, staggered=True) == 0.3
    for bad in (((0.1, -1.0),), ((1.0, 0.5), (0.1, 0.6)), ((0.1,),)):
        with pytest.raises(DeviceError, match="staggered_all_reduce="):
            LinkSpec("bad", 1e9, 0.0, staggered_all_reduce=bad)  # type: ignore[arg-type]


def test_a_rank_starts_its_optimizer_cold_after_waiting_in_the_loss_all_reduce() -> None:
    """The loss all-reduce is a wait like any other: each rank's optimizer step loses
    ``LinkSpec.wake_time`` of the time it waited there (processes only)."""
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)
    link = LinkSpec("loopback", 1e9, 0.01, scalar_all_reduce=0.3, wake=0.4)
    ranks = Cluster(own, devices_per_node=2, intra_node=link, processes=True)
    prediction = replace(_equal_stages(Config(pp=2, chunks=1)), optimizer_times=(0.5, 0.25))
    result = simulate(prediction, ranks)
    ended = {a.stage: end for a, _, end in result.timeline if a.phase.name == "BACKWARD"}
    steps = {j: (start, end) for j, kind, start, end in result.updates if kind == "optimizer"}
    reduced = result.pipeline_time + 0.3
    for j, own_time in ((0, 0.5), (1, 0.25)):
        waited = reduced - ended[j]
        assert waited > 0
        assert steps[j] == pytest.approx((reduced, reduced + own_time + link.wake_time(waited)))
    # One process's devices wait for no loss all-reduce: no wake on their optimizers.
    alone = simulate(prediction, replace(ranks, processes=False))
    assert {j: e - s for j, k, s, e in alone.updates if k == "optimizer"} == pytest.approx(
        {0: 0.5, 1: 0.25})


def test_the_caller_s_spinning_helpers_are_one_more_busy_worker_as_a_step_starts() -> None:
    # Two replicas in one process, 1 s forward and 2 s backward each; two workers gain 2x
    # and three 2x (two cores): without the spin each replica computes at full speed (3 s).
    # The caller's helpers, spinning for the first 1.5 s after its optimizer step, make the
    # workers three: each at 2/3 then, so the forward ends at 1.5 s and the backward 2 s
    # later. A spin ending inside an action re-times it (0.75 s: half the forward done).
    cpu = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10, shared_speedup=(1.0, 2.0, 2.0))
    prediction = _equal_stages(Config(dp=2, pp=1, chunks=1))
    for spin, expected in ((0.0, 3.0), (1.5, 3.5), (0.75, 3.25), (10.0, 4.5)):
        host = Cluster(replace(cpu, caller_spin=spin), devices_per_node=2, local=("cpu",) * 2)
        assert simulate(prediction, host).pipeline_time == pytest.approx(expected), spin
    # Ranks of a world have no caller handing them the step: no spin.
    ranks = Cluster(replace(cpu, caller_spin=1.5), devices_per_node=2, local=("cpu",) * 2,
                    processes=True)
    plain = Cluster(cpu, devices_per_node=2, local=("cpu",) * 2, processes=True)
    assert simulate(prediction, ranks).step_time == simulate(prediction, plain).step_time
    with pytest.raises(DeviceError, match="caller_spin"):
        replace(cpu, caller_spin=-1.0)


def test_a_split_backward_gives_w_the_linear_weight_products_and_i_the_rest() -> None:
    """A zero-bubble ``W`` runs a stage's Linear weight products (``StageProfile.weight``,
    ``cost.weight_time``) and ``I`` the rest of its backward: traced on 4 gloo ranks, an
    MLP stage of 128-wide Linears and norms took 0.65-0.72 of its backward in ``I``, and a
    first stage, which computes no input gradient, 0.09. Convolutions compute their weight
    gradients in ``I``: a stage of them gives ``W`` its own action cost alone."""
    from partitioner.analysis import analyze
    from partitioner.cost.split_backward import split_backward_overhead

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.LayerNorm(256),
                        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)
    cluster = Cluster(own, devices_per_node=2)
    workload = analyze(mlp, (torch.randn(64, 256),)).workload
    split = predict(workload, cluster, Config(pp=2, chunks=1, schedule="zero_bubble"))
    first, second = split.stages
    assert 0 < second.weight < second.backward and 0 < first.weight < first.backward
    # The first stage's first product on the batch computes its weight gradient alone.
    assert first.weight / first.backward > second.weight / second.backward
    spans = {(a.stage, a.phase.name): end - start
             for a, start, end in simulate(split, cluster).timeline}
    assert spans[(1, "WEIGHT")] == pytest.approx(second.weight)
    assert spans[(1, "INPUT")] == pytest.approx(second.backward - second.weight)
    plain = predict(workload, cluster, Config(pp=2, chunks=1, schedule="1f1b"))
    assert all(s.weight == 0.0 for s in plain.stages)  # nothing split, nothing queued
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                        nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1))
    costs = analyze(cnn, (torch.randn(4, 3, 16, 16),)).workload
    convs = predict(costs, cluster, Config(pp=2, chunks=1, schedule="zero_bubble"))
    for stage in convs.stages:
        layers = costs.layers[stage.first:stage.last]
        assert stage.weight == pytest.approx(split_backward_overhead(layers, own))


def test_a_rank_posts_its_message_before_it_computes_again() -> None:
    """Across processes the sending rank spends ``LinkSpec.post_time`` of its boundary's
    bytes in the ``isend`` call (gloo writes into the socket in the caller's thread: 0.04
    ms for 4 KiB, 0.39 ms for 2 MiB on the 2-core CI VM); the step of one micro-batch over
    two ranks waits for two postings, the activation's and the gradient's."""
    own = DeviceSpec("cpu", {"fp32": 1e10}, 1e9, 1e10)
    link = LinkSpec("loopback", 1e9, 0.0, post_latency=0.1, post_bandwidth=1e7)
    ranks = Cluster(own, devices_per_node=2, intra_node=link, processes=True)
    plain = _equal_stages(Config(pp=2, chunks=1))
    prediction = replace(plain, stages=tuple(replace(s, send_bytes=1e6)
                                             for s in plain.stages))
    post = 0.1 + 1e6 / 1e7
    posted = simulate(prediction, ranks)
    assert posted.pipeline_time == pytest.approx(6.0 + 2 * post)
    spans = {str(a): (start, end) for a, start, end in posted.timeline}
    assert spans["0F0"] == pytest.approx((0.0, 1.0 + post))
    assert simulate(prediction, replace(ranks, processes=False)).pipeline_time == 6.0
    halved = replace(prediction, config=replace(prediction.config, tp=2))
    assert simulate(halved, ranks).pipeline_time == pytest.approx(
        6.0 + 2 * (0.1 + 0.5e6 / 1e7))  # each tensor-parallel rank posts its share
