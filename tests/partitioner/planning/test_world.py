"""The world's cluster and the multi-process search (``partitioner.planning.world``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from models import mlp

from partitioner.analysis import analyze
from partitioner.cost.comm import all_reduce_time
from partitioner.cost.device_names import ASSUMED_GPU
from partitioner.cost.devices import REFERENCE_CPU, Cluster, LinkSpec
from partitioner.cost.optimizer_steps import optimizer_copies, overlaps
from partitioner.errors import DeviceError, MeshError, ScheduleError, StrategyError
from partitioner.planning.auto import MULTI_PROCESS_RUNTIME, configurations, executable
from partitioner.planning.predict import Config, predict
from partitioner.planning.records import _cluster_dict, _cluster_from
from partitioner.planning.space import SearchSpace
from partitioner.planning.world import (
    ETHERNET,
    LOOPBACK,
    Degrees,
    capacity_of,
    cluster_option,
    nodes_of,
    search_world,
    world_cluster,
    world_plan,
)
from partitioner.runtime.schedule_registry import Runtime, schedule_names


@pytest.fixture(scope="module")
def workload() -> object:
    torch.manual_seed(0)
    model = mlp((8, 16, 16, 16, 16, 8)).double()
    return analyze(model, (torch.randn(16, 8, dtype=torch.float64),))


def test_one_host_is_one_node_of_this_machine() -> None:
    cluster = world_cluster(["box"] * 4, "cpu", cpu=REFERENCE_CPU)
    assert (cluster.nodes, cluster.devices_per_node, cluster.is_local) == (1, 4, True)
    assert cluster.intra_node == LOOPBACK and cluster.device == REFERENCE_CPU


def test_ranks_of_one_host_are_processes_not_threads(workload: object) -> None:
    """The same 4 CPU devices as threads of one process (``partition``) and as ranks of a
    world (``partition_distributed``): replicas of ranks all-reduce over the link, paying
    the latency every pair sees at once, not a sum of copies in memory; each rank steps
    its own optimizer at the same time as the others; pipeline hand-offs pay the latency
    of a lone pair."""
    link = LinkSpec("loopback", 2e9, 1e-4, busy_latency=2e-3)
    ranks = world_cluster(["box"] * 4, "cpu", cpu=REFERENCE_CPU, link=link)
    threads = replace(ranks, processes=False)
    assert ranks.processes and ranks.is_local and not threads.processes
    costs = workload.workload
    config = Config(dp=2, pp=2)
    as_ranks, as_threads = predict(costs, ranks, config), predict(costs, threads, config)
    grads = sum(s.grad_bytes for s in as_ranks.stages[:1])
    assert as_ranks.dp_times[0] == pytest.approx(all_reduce_time(grads, 2, link))
    assert as_ranks.dp_times[0] > 2 * 2e-3  # two ring steps at the busy latency
    assert as_threads.dp_times[0] < as_ranks.dp_times[0]
    assert optimizer_copies(2, 1, threads) == 1
    assert optimizer_copies(2, 1, ranks) == pytest.approx(2 / REFERENCE_CPU.speedup(4, 0.0))
    # A pipeline's hand-off pays the lone pair's latency.
    alone = predict(costs, ranks, Config(pp=4))
    assert alone.stages[0].send == pytest.approx(link.time(alone.stages[0].send_bytes))
    # What the plan records comes back as it was (the simulator and explain() read it).
    assert _cluster_from(_cluster_dict(ranks)) == ranks
    with pytest.raises(DeviceError, match="processes=1"):
        replace(ranks, processes=1)


def test_ranks_step_their_optimizers_as_the_probe_timed_them(workload: object) -> None:
    """Where the world's probe timed the ranks' optimizer steps at once
    (``LinkSpec.optimizer_gain``), the host spends ``dp x tp`` steps of each pipeline
    device's optimizer over that gain, not over the element-wise row; the predicted step
    falls by what the optimizer phase loses, and the figure survives the plan's record."""
    link = LinkSpec("loopback", 2e9, 1e-4, busy_latency=2e-3)
    unmeasured = world_cluster(["box"] * 4, "cpu", cpu=REFERENCE_CPU, link=link)
    probed = world_cluster(["box"] * 4, "cpu", cpu=REFERENCE_CPU,
                           link=replace(link, optimizer_gain=2.0))
    assert optimizer_copies(2, 1, probed) == pytest.approx(1.0)
    assert optimizer_copies(2, 1, unmeasured) == pytest.approx(
        2 / REFERENCE_CPU.speedup(4, 0.0))
    config = Config(dp=2, pp=2)
    slow, fast = (predict(workload.workload, c, config) for c in (unmeasured, probed))
    stepped = sum(slow.optimizer_times)
    assert slow.optimizer_times == fast.optimizer_times  # one rank's step is the same
    assert slow.step_time - fast.step_time == pytest.approx(
        stepped * (optimizer_copies(2, 1, unmeasured) - 1.0))
    assert _cluster_from(_cluster_dict(probed)) == probed
    with pytest.raises(DeviceError, match="optimizer_gain=-1"):
        replace(link, optimizer_gain=-1.0)


def test_two_hosts_are_two_nodes() -> None:
    cluster = world_cluster(["a", "a", "b", "b"], "cpu", cpu=REFERENCE_CPU)
    assert (cluster.nodes, cluster.devices_per_node, cluster.inter_node) == (2, 2, ETHERNET)
    assert not cluster.is_local


def test_cpu_spec_defaults_to_the_pinned_reference() -> None:
    assert world_cluster(["box"] * 2, "cpu").device == REFERENCE_CPU  # conftest's spec


def test_nodes_with_different_rank_counts_are_refused() -> None:
    with pytest.raises(DeviceError, match=r"different numbers of ranks.*'a': 3, 'b': 1"):
        nodes_of(["a", "a", "a", "b"])


def test_interleaved_hosts_are_refused() -> None:
    with pytest.raises(DeviceError, match="not consecutive.*torchrun"):
        nodes_of(["a", "b", "a", "b"])


def test_gpu_preset_from_its_name() -> None:
    cluster = world_cluster(["a"] * 8 + ["b"] * 8, "cuda", gpu_name="NVIDIA H100 80GB HBM3",
                            gpu_memory=80 * 2**30)
    assert cluster.device.name == "H100-SXM" and cluster.nodes == 2


def test_gpu_ranks_of_one_node_all_reduce_beside_the_backward(workload: object) -> None:
    # One node's GPU ranks are processes (NCCL all-reduce over NVLink, not one process's
    # copies), and their reduction hides behind the last backward; CPU ranks' does not.
    gpu = world_cluster(["a"] * 2, "cuda", gpu_name="NVIDIA H100 80GB HBM3",
                        gpu_memory=80 * 2**30)
    assert gpu.processes and gpu.is_local and overlaps(gpu)
    assert optimizer_copies(2, 1, gpu) == 1.0  # each GPU steps its own optimizer, once
    cpu = world_cluster(["a"] * 2, "cpu", cpu=REFERENCE_CPU)
    assert cpu.processes and not overlaps(cpu)
    config = Config(dp=2)
    grads = sum(s.grad_bytes for s in predict(workload.workload, gpu, config).stages)
    reduce = predict(workload.workload, gpu, config).dp_times[0]
    assert reduce == pytest.approx(all_reduce_time(grads, 2, gpu.group_link([0, 1])))


def test_unknown_gpu_is_planned_as_the_assumed_mid_range_one() -> None:
    # One behaviour for a GPU no preset names, here and in cost.machine.spec_for: the
    # assumed spec with the GPU's own memory, its name saying so (design 011).
    cluster = world_cluster(["a"] * 2 + ["b"] * 2, "cuda", gpu_name="Tesla T4",
                            gpu_memory=16e9)
    assert cluster.device.name == "Tesla T4 (assumed mid-range)"
    assert cluster.device.memory_bytes == 16e9
    assert cluster.device.peak_flops == ASSUMED_GPU.peak_flops
    assert (cluster.nodes, cluster.devices_per_node, cluster.inter_node) == (2, 2, ETHERNET)


def test_cluster_option_preset_name_and_size() -> None:
    assert cluster_option("A100-80GB", 16, 2, 8).describe().startswith("2 x 8 A100-80GB")
    with pytest.raises(DeviceError, match=r"has 8 devices .* world has 4 ranks"):
        cluster_option(Cluster.preset("A100-80GB"), 4, 1, 4)
    with pytest.raises(DeviceError, match="pass a Cluster or a preset name"):
        cluster_option(4, 4, 1, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("sizes, world", [(dict(pp=3), 4), (dict(pp=2, dp=2, tp=2), 4),
                                          (dict(pp=1, dp=2, tp=1), 4)])
def test_sizes_that_do_not_make_the_world(sizes: dict[str, int], world: int) -> None:
    with pytest.raises(MeshError, match=rf"world has {world}; pass sizes whose product"):
        Degrees(**sizes).check(world)


def test_sizes_that_divide_the_world_leave_the_rest_to_search() -> None:
    Degrees(dp=3, tp=1).check(12)
    Degrees(pp=2).check(4)


def test_bad_sizes_name_the_value() -> None:
    with pytest.raises(MeshError, match=r"pp=0"):
        Degrees(pp=0)
    with pytest.raises(MeshError, match=r"tp=True"):
        Degrees(tp=True)


def test_capacity_shares_a_cpu_node_and_keeps_the_reserve() -> None:
    cpu = world_cluster(["box"] * 4, "cpu", cpu=REFERENCE_CPU)
    assert capacity_of(cpu, 0.1) == pytest.approx(REFERENCE_CPU.memory_bytes * 0.9 / 4)
    gpu = Cluster.preset("A100-80GB")
    assert capacity_of(gpu, 0.1) == pytest.approx(gpu.device.memory_bytes * 0.9)
    assert capacity_of(gpu, 0.1, 1e9) == 1e9
    with pytest.raises(StrategyError, match=r"memory_reserve=1.5"):
        capacity_of(gpu, 1.5)


def test_search_keeps_to_what_the_multi_process_runtime_runs(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    result = search_world(workload.workload, cluster)
    runs = schedule_names([Runtime.MULTI_PROCESS])
    for prediction in result.ranked:
        assert prediction.config.schedule in runs
        assert prediction.config.devices == 4
    # Interleaving holds whole stages: not with tensor parallelism.
    others = [c for c in configurations(workload.workload, cluster)
              if c.schedule not in runs or (c.tp > 1 and c.virtual > 1)]
    assert result.not_executable == len(others)
    for _, why, _ in result.excluded:
        assert "multi-process runtime" in why or "tensor-parallel pipeline runs" in why


def test_search_away_from_this_machine_uses_the_runtime_schedules(workload: object) -> None:
    cluster = world_cluster(["a", "a", "b", "b"], "cpu")
    result = search_world(workload.workload, cluster)
    runs = schedule_names([Runtime.MULTI_PROCESS])
    assert all(p.config.schedule in runs for p in result.ranked)


@pytest.mark.parametrize("sizes", [dict(pp=2), dict(dp=4), dict(pp=2, tp=2), dict(tp=4)])
def test_fixed_sizes_are_kept(workload: object, sizes: dict[str, int]) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    result = search_world(workload.workload, cluster, Degrees(**sizes))
    for prediction in result.ranked:
        assert all(getattr(prediction.config, k) == v for k, v in sizes.items())
        assert executable(prediction.config, cluster, MULTI_PROCESS_RUNTIME) is None


def test_fixed_schedule_chunks_checkpoint(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    result = search_world(workload.workload, cluster, Degrees(pp=4),
                          SearchSpace(chunks=4, checkpoint="always", schedules=("1f1b",)))
    assert result.best.config.label() == "dp=1 tp=1 pp=4 m=4 1f1b ckpt=always"


def test_schedule_the_runtime_lacks_is_refused(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    missing = [n for n in ("interleaved", "zero_bubble", "no_such")
               if n not in schedule_names([Runtime.MULTI_PROCESS])]
    with pytest.raises(ScheduleError, match=rf"schedule={missing[-1]!r}"):
        search_world(workload.workload, cluster, space=SearchSpace(schedules=(missing[-1],)))


def test_impossible_fixed_sizes_say_why(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    with pytest.raises(StrategyError, match=r"dp=3 does not divide the example batch of 16"):
        search_world(workload.workload, world_cluster(["box"] * 3, "cpu"), Degrees(dp=3))
    layers = len(workload.workload.layers)
    big = world_cluster(["box"] * 16, "cpu")
    with pytest.raises(StrategyError, match=rf"pp=16 but the model has {layers} layers"):
        search_world(workload.workload, big, Degrees(pp=16))
    assert cluster.size == 4


def test_world_plan_records_the_choice(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    result = search_world(workload.workload, cluster, Degrees(pp=2))
    plan = world_plan(result, workload.layer_names, cluster)
    c = result.best.config
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.tp) == (c.dp, c.pp, c.tp)
    assert (plan.schedule, plan.chunks, plan.checkpoint) == (c.schedule, c.chunks, c.checkpoint)
    assert sum(len(s.layers) for s in plan.stages) == len(workload.layer_names)
    text = plan.explain()
    assert "chosen: " + c.label() in text


def test_check_refuses_ranked_candidates(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    free = search_world(workload.workload, cluster)
    first = free.best.config
    result = search_world(workload.workload, cluster,
                          check=lambda c: "refused" if c == first else None)
    assert result.best.config != first and first not in [p.config for p in result.ranked]
    assert (first.label(), "refused") in [(label, why) for label, why, _ in result.excluded]
    assert result.not_executable == free.not_executable + 1


@pytest.mark.slow
def test_check_refusing_every_candidate_falls_back_to_tp_1(workload: object) -> None:
    cluster = world_cluster(["box"] * 4, "cpu")
    ranked = {p.config for p in search_world(workload.workload, cluster).ranked}
    result = search_world(workload.workload, cluster,
                          check=lambda c: "refused" if c in ranked else None)
    assert result.best.config not in ranked and result.best.config.tp == 1


def test_auto_shards_the_optimizer_only_when_nothing_fits_without_it() -> None:
    # A sharded model needs dpm.make_optimizer, so auto keeps plain data parallelism while
    # it fits, and shards the optimizer state when only that fits (memory_limit between).
    from partitioner.distributed_plan import AutoOptions, _search
    from partitioner.planning.predict import predict
    from partitioner.planning.world import Degrees

    model, x = mlp(), torch.randn(16, 12)
    cluster = world_cluster(["box"] * 2, "cpu", cpu=REFERENCE_CPU)
    work = analyze(model, (x,)).workload
    assert work is not None
    least = {s: min(max(m.total for m in predict(work, cluster, c).memory)
                    for c in configurations(work, cluster, optimizer_sharding=s)
                    if c.dp == 2)
             for s in (False, True)}
    assert least[True] < least[False]
    options = AutoOptions(Degrees(dp=2), memory_reserve=0.0)
    plain = _search(model, (x,), None, options, cluster, torch.device("cpu"))
    assert not plain.optimizer_sharding
    tight = AutoOptions(Degrees(dp=2), memory_reserve=0.0,
                        memory_limit=(least[True] + least[False]) / 2)
    assert _search(model, (x,), None, tight, cluster, torch.device("cpu")).optimizer_sharding
