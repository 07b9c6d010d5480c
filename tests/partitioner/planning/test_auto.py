"""Tests of partitioner/planning/auto.py (the search) and partitioner/planning/planner.py (plans
from it)."""

from __future__ import annotations

import copy
import doctest
import itertools
import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import partitioner.planning.auto
import partitioner.planning.planner
from partitioner import make_plan, partition
from partitioner.cost.devices import Cluster, DeviceSpec
from partitioner.cost.machine import local_cluster
from partitioner.cost.transformer_model import GPTShape, gpt_workload
from partitioner.errors import DeviceError, MemoryLimitError
from partitioner.planning.auto import (
    LOCAL_RUNTIME,
    RuntimeSupport,
    configurations,
    executable,
    search,
)
from partitioner.planning.predict import Config, predict
from partitioner.planning.simulate import predict_step
from partitioner.plans.explain import explain
from partitioner.plans.plan import Plan
from partitioner.runtime.schedule_registry import make_schedule

CPU = DeviceSpec("cpu", {"fp32": 200e9}, 16e9, 50e9, matmul_efficiency=1.0,
                 matmul_half_flops=2e3, memory_efficiency=1.0, op_overhead=3e-6,
                 pack_bandwidth=34e9, shared_speedup=(1.0, 1.3, 1.4, 1.4))
GPT = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=32)


def _local(n: int) -> Cluster:
    return Cluster(CPU, 1, n, local=("cpu",) * n)


def test_executable_names_what_the_runtime_lacks() -> None:
    here = _local(2)
    assert executable(Config(pp=2), here) is None
    # One process runs replicas (runtime/replicas.py) and tensor parallelism
    # (TensorParallelModule), the latter in every schedule without virtual stages.
    assert executable(Config(dp=2), here) is None
    assert "no data parallelism" in str(executable(Config(dp=2), here, RuntimeSupport("x")))
    assert executable(Config(tp=2), here) is None
    assert executable(Config(tp=2, pp=2, chunks=2, schedule="zero_bubble"), _local(4)) is None
    assert "tensor-parallel pipeline runs ['gpipe', '1f1b', 'zero_bubble']" in str(
        executable(Config(tp=2, pp=2, chunks=2, schedule="interleaved", virtual=2), _local(4)))
    assert "no tensor parallelism" in str(executable(Config(tp=2), here, RuntimeSupport("x")))
    assert "not this machine" in str(executable(Config(pp=2), Cluster.preset("A100-80GB")))
    wider = RuntimeSupport("a multi-process runtime", ("gpipe", "1f1b"), data_parallel=True)
    assert executable(Config(dp=2, schedule="gpipe"), here, wider) is None
    assert executable(Config(pp=2, schedule="1f1b"), here, wider) is None


def test_local_devices_only_get_executable_plans() -> None:
    result = search(GPT, _local(4))
    best = result.best.config
    assert best.devices == 4 and best.schedule in LOCAL_RUNTIME.schedules
    assert result.not_executable > 0
    assert all(executable(p.config, _local(4)) is None for p in result.ranked)


def test_clusters_get_any_mix() -> None:
    cluster = Cluster.preset("A100-80GB", nodes=2)
    result = search(GPT, cluster)
    assert result.not_executable == 0 and result.best.config.devices == 16
    assert len({(p.config.dp, p.config.tp, p.config.pp) for p in result.ranked}) > 1


def test_the_search_is_deterministic() -> None:
    cluster = Cluster.preset("A100-80GB")
    first, second = search(GPT, cluster, budget=None), search(GPT, cluster, budget=None)
    assert [p.config for p in first.ranked] == [p.config for p in second.ranked]


def test_branch_and_bound_finds_the_brute_force_optimum() -> None:
    cluster = Cluster.preset("A100-80GB")
    result = search(GPT, cluster, budget=None)
    every = [predict(GPT, cluster, c) for c in configurations(GPT, cluster)]
    fastest = min((p for p in every if p.fits), key=lambda p: p.step_time)
    # The closed forms rank the search; the candidates it keeps are ranked by the one
    # predictor (the simulation), whose step times the plan shows.
    assert fastest.config in [p.config for p in result.ranked]
    assert all(p.simulated for p in result.ranked)
    assert [p.step_time for p in result.ranked] == sorted(p.step_time for p in result.ranked)
    again = predict_step(predict(GPT, cluster, result.best.config), cluster)
    assert result.best.step_time == again.step_time
    assert result.gap == 0.0 and not result.timed_out
    assert result.lower_bound <= fastest.step_time


def test_bounds_never_exceed_predictions() -> None:
    cluster = Cluster.preset("A100-80GB")
    bounds = partitioner.planning.auto._Bounds(GPT, cluster, cluster.device.memory_bytes)
    for c in itertools.islice(configurations(GPT, cluster), 0, None, 7):
        assert bounds.step(c) <= predict(GPT, cluster, c).step_time * (1 + 1e-9)


def test_an_exhausted_budget_returns_the_best_found_with_its_gap() -> None:
    result = search(GPT, Cluster.preset("A100-80GB", nodes=2), budget=0.0)
    assert result.timed_out and result.evaluated >= 1 and result.gap >= 0.0
    assert result.best.fits


def test_fixed_chunks_and_checkpoint_are_respected() -> None:
    result = search(GPT, Cluster.preset("A100-80GB"), chunks=4, checkpoint="always")
    assert {(p.config.chunks, p.config.checkpoint) for p in result.ranked} == {(4, "always")}


def test_batch_norm_models_stay_at_one_micro_batch() -> None:
    unsafe = replace(GPT, microbatch_safe=False)
    assert {c.chunks for c in configurations(unsafe, Cluster.preset("A100-80GB"))} == {1}
    assert {c.chunks for c in configurations(unsafe, Cluster.preset("A100-80GB"),
                                             chunks=4)} == {4}


def test_nothing_fitting_says_how_many_devices_would() -> None:
    with pytest.raises(MemoryLimitError, match=r"[3-9] devices of that size would fit"):
        search(GPT, _local(2), capacity=1.2e9)


def test_explain_ranks_candidates_and_says_why() -> None:
    from partitioner.planning.auto import records
    cluster = Cluster.preset("A100-80GB")
    result = search(GPT, cluster)
    made = records(result, cluster)
    text = explain(made)
    lines = text.splitlines()
    assert lines[0].startswith("searched") and "exhaustive" in lines[0]
    assert lines[1].split() == ["rank", "configuration", "step", "samples/s", "bubble",
                                "memory/device"]
    assert lines[3].startswith("1 *") and result.best.config.label() in lines[3]
    assert lines[-1].startswith(f"chosen: {result.best.config.label()}")
    assert "runner-up" in lines[-1] and "slower" in lines[-1]
    assert json.loads(json.dumps(made)) == list(made)


def test_make_plan_on_a_cluster_plans_beyond_this_machine() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)])
    x = torch.empty(64, 4096, device="meta")
    plan = make_plan(model, Cluster.preset("A100-80GB", nodes=2), example_inputs=(x,))
    assert plan.mesh is not None and plan.mesh.dp * plan.mesh.tp * plan.mesh.pp == 16
    assert plan.candidates and plan.candidates[0]["chosen"]
    assert plan.devices[0].startswith("A100-80GB#")
    assert "chosen:" in plan.explain()


def test_partition_refuses_a_cluster_that_is_not_this_machine() -> None:
    with pytest.raises(DeviceError, match="plan for it with make_plan"):
        partition(nn.Linear(4, 4), Cluster.preset("A100-80GB"),
                  example_inputs=(torch.randn(2, 4),))


def test_partition_auto_chooses_chunks_and_explains(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 8))
    x = torch.randn(16, 32)
    pm = partition(model, ["cpu", "cpu"], example_inputs=(x,))
    mesh = pm.plan.mesh
    # Whatever runs here and is predicted fastest: a pipeline, tensor parallelism, replicas.
    assert mesh is not None and mesh.dp * mesh.pp * mesh.tp == 2
    assert pm.plan.strategy == ("replicas" if mesh.dp > 1 else "pipeline" if mesh.tp == 1
                                else "tensor_parallel")
    assert pm.plan.schedule in LOCAL_RUNTIME.schedules
    assert 16 % pm.plan.chunks == 0
    torch.testing.assert_close(pm(x), model(x))
    assert "chosen:" in pm.plan.explain() and "not executable here" in pm.plan.explain()
    path = tmp_path / "plan.json"
    pm.plan.save(path)
    assert Plan.load(path).explain() == pm.plan.explain()


def test_explicit_chunks_are_kept_by_auto() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    pm = partition(model, ["cpu", "cpu"], example_inputs=(torch.randn(6, 8),), chunks=3,
                   checkpoint="never")
    assert (pm.plan.chunks, pm.plan.checkpoint) == (3, "never")


def test_planning_budget_defaults_to_five_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float | None] = []

    def recording(*args: object, **kwargs: object) -> partitioner.planning.auto.SearchResult:
        seen.append(kwargs["budget"])  # type: ignore[arg-type]
        return search(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(partitioner.planning.planner, "search", recording)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    make_plan(model, ["cpu", "cpu"], example_inputs=(torch.randn(4, 8),))
    # A tensor-parallel choice is searched again on its merged layers: each search 5 s.
    assert seen and set(seen) == {5.0}


def test_the_gap_bounds_the_true_optimum() -> None:
    cluster = Cluster.preset("A100-80GB")
    result = search(GPT, cluster, budget=0.0)
    assert result.timed_out and result.gap > 0
    every = [predict(GPT, cluster, c) for c in configurations(GPT, cluster)]
    optimum = min(p.step_time for p in every if p.fits)
    assert result.best.step_time / (1 + result.gap) <= optimum * (1 + 1e-9)
    assert optimum <= predict(GPT, cluster, result.best.config).step_time


def test_the_fastest_configuration_that_fits_wins() -> None:
    cluster = Cluster.preset("A100-80GB")
    free = search(GPT, cluster, budget=None).best
    capacity = 0.9 * free.peak_memory
    result = search(GPT, cluster, budget=None, capacity=capacity)
    assert result.best.peak_memory <= capacity < free.peak_memory
    fitting = [p for p in (predict(GPT, cluster, c, capacity=capacity)
                           for c in configurations(GPT, cluster)) if p.fits]
    fastest = min(fitting, key=lambda p: p.step_time)
    assert fastest.config in [p.config for p in result.ranked]
    assert result.best.step_time == min(p.step_time for p in result.ranked)
    assert result.best.step_time > free.step_time


def test_tensor_parallelism_only_where_layers_split() -> None:
    cluster = Cluster.preset("A100-80GB")
    assert {c.tp for c in configurations(GPT, cluster)} == {1, 2, 4, 8}
    whole = replace(GPT, layers=tuple(replace(layer, split_param_bytes=0.0)
                                      for layer in GPT.layers))
    assert {c.tp for c in configurations(whole, cluster)} == {1}


def test_except_last_with_one_micro_batch_is_not_a_separate_candidate() -> None:
    # Regression: it replays nothing, so it tied with "never" and showed up as a runner-up
    # "0.0% slower".
    for cluster in (Cluster.preset("A100-80GB"), _local(4)):
        configs = list(configurations(GPT, cluster))
        assert not [c for c in configs if c.chunks == 1 and c.checkpoint == "except_last"]
        assert [c for c in configs if c.chunks == 1 and c.checkpoint == "never"]
    fixed = configurations(GPT, _local(4), chunks=1, checkpoint="except_last")
    assert {c.checkpoint for c in fixed} == {"except_last"}


def test_explain_says_when_the_runner_up_ties() -> None:
    from partitioner.planning.records import to_record
    cluster = Cluster.preset("A100-80GB")
    winner = dict(to_record(search(GPT, cluster).best, cluster), rank=1, chosen=True)
    rival = dict(winner, label="a twin", rank=2, chosen=False)
    why = explain([winner, rival]).splitlines()[-1]
    assert "a twin, is predicted as fast" in why and "slower" not in why


def test_explain_says_cpu_devices_share_the_cores() -> None:
    from partitioner.planning.auto import records
    here, there = _local(4), Cluster.preset("A100-80GB")
    assert "share this machine's cores" in explain(records(search(GPT, here, pp=4), here))
    assert "share this machine's cores" not in explain(records(search(GPT, there, pp=4), there))


def test_cpu_stages_needing_more_than_the_machine_are_noted_and_warned() -> None:
    # Each "cpu" device may use the whole machine, but its stages share it: a plan whose
    # stages together need more (GPT-2-xl's 25 GB of weights, gradients and Adam state on
    # 8 "cpu" devices of a 25 GB VM) is kept, with a note and a warning saying so.
    host = local_cluster(["cpu"]).device.memory_bytes
    width = int((1.3 * host / 16 / 8) ** 0.5)  # 8 Linears: 1.3x the host with Adam state
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
    x = torch.empty(2, width, device="meta")
    with pytest.warns(UserWarning, match="share this machine's .* GiB but need"):
        plan = make_plan(model, ["cpu", "cpu"], example_inputs=(x,))
    assert any("runs out of memory here" in note for note in plan.notes)
    assert sum(s.predicted_memory or 0 for s in plan.stages) > host
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*share this machine")  # fits: none
        small = make_plan(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), ["cpu", "cpu"],
                          example_inputs=(torch.randn(2, 8),))
    assert not any("out of memory" in note for note in small.notes)


def test_explain_without_candidates() -> None:
    assert "no candidates" in explain(())


def test_doctests() -> None:
    assert doctest.testmod(partitioner.planning.auto).failed == 0
    assert doctest.testmod(partitioner.planning.planner).failed == 0


def test_auto_never_ranks_a_tensor_parallel_plan_that_splits_nothing() -> None:
    # nn.TransformerEncoderLayer captured for training: the tensor-parallel pass finds no
    # column/row pair in it, so tp=2 would run the whole model on both ranks. It used to be
    # ranked first for a stack of them (costed as if every weight were halved).
    from partitioner import make_plan
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    model, x = nn.Sequential(layer, copy.deepcopy(layer)), torch.randn(4, 8, 32)
    plan = make_plan(model, ["cpu"] * 2, example_inputs=(x,))
    assert all(r["config"]["tp"] == 1 for r in plan.candidates)


def test_layers_the_pass_leaves_whole_are_costed_whole() -> None:
    from examples.models import classifier
    from partitioner.analysis import analyze
    from partitioner.planning.tp_costing import as_split
    from partitioner.planning.tp_rules import resolve_shardings
    # The demo's residual MLP: the pass splits each block's pair, not the input projection.
    model = classifier(32, width=64, depth=2, classes=8)
    analysis = analyze(model, (torch.randn(4, 32),), None)
    assert analysis.workload is not None
    split = resolve_shardings(analysis.captured.graph_module, model, 2).split()
    costed = as_split(analysis.workload, split)
    by_name = {layer.name: layer.splittable for layer in costed.layers}
    assert any(by_name.values()) and not all(
        layer.splittable for layer in costed.layers if layer.param_bytes)
    for layer in costed.layers:
        assert layer.splittable == any(n.startswith(layer.name + ".") for n in split)


def test_schedules_that_run_the_same_actions_are_one_candidate() -> None:
    # With one micro-batch GPipe and 1F1B make the same action lists: one candidate, not
    # two places in the ranked list (and in what tune= times).
    assert make_schedule("gpipe", 2, 1) == make_schedule("1f1b", 2, 1)
    cluster = Cluster.preset("A100-80GB")
    distinct = partitioner.planning.auto._distinct_programs

    def kept(chunks: int) -> list[Config]:
        queue = [(0.0, (), c) for c in configurations(GPT, cluster, chunks=chunks, pp=2)]
        return [c for _, _, c in distinct(queue)]
    one, four = kept(1), kept(4)
    programs = [(replace(c, schedule="gpipe") if c.virtual == 1 else c,
                 make_schedule(c.schedule, c.pp, c.chunks, c.virtual)) for c in one]
    assert len(programs) == len(set(programs))
    assert {c.schedule for c in one} & {"gpipe", "1f1b"} == {"gpipe"}
    assert len(one) < len(list(configurations(GPT, cluster, chunks=1, pp=2)))
    # With more micro-batches than one they differ: both stay.
    assert {"gpipe", "1f1b"} <= {c.schedule for c in four}
    assert len(four) == len(list(configurations(GPT, cluster, chunks=4, pp=2)))
    # The search ranks what is left.
    result = search(GPT, cluster, chunks=1, pp=2, budget=None)
    assert {p.config.schedule for p in result.ranked} & {"gpipe", "1f1b"} != {"gpipe", "1f1b"}
