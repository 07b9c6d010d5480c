"""``partition_distributed(model, x, strategy="auto")`` on worlds of 2 and 4 gloo processes.

Each rank is a process with one thread (``tests/partitioner/auto_worker.py``). The search
runs on rank 0 and every rank runs the plan it broadcasts; every case trains a float64
model for a few SGD steps from the whole batch of each step (each replica on its slice)
and compares every weight and loss with full-batch training in one process: in float64
only the order of sums differs, so 1e-12 leaves room for that and nothing else. The worlds
start once per module (every case runs in them one after another).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from distributed_harness import launch, results

from partitioner.planning.tune import KEEP_WITHIN, REFINE
from partitioner.runtime.schedule_registry import Runtime, schedule_names

WORKER = Path(__file__).with_name("auto_worker.py")
TOLERANCE = 1e-12

TWO = [
    dict(model="mlp", batch=16),
    dict(model="gpt", batch=8),
    dict(model="mlp", batch=16, fixed=dict(pp=2)),
    dict(model="gpt", batch=8, fixed=dict(pp=2, schedule="1f1b", chunks=2)),
    dict(model="mlp", batch=16, tune=2),  # tuned: the measured fastest of 2, weights restored
    # Tuning overrules the ranking (its clock reads the pick slowest): the plan that runs is
    # the second-ranked, and its step is what simulate(plan) replays.
    dict(model="mlp", batch=16, tune=2, overrule=True),
    # Rank 0 times the model before planning; its weights and generator are left as they were.
    dict(model="gpt", batch=8, calibrate=True),
    # Sizes given, no search: the step still predicted as these processes run it.
    dict(model="mlp", batch=16, given=dict(pp=2, chunks=2)),
]
FOUR = [
    dict(model="mlp", batch=16),
    dict(model="gpt", batch=8),
    dict(model="mlp", batch=16, fixed=dict(pp=2)),
    dict(model="mlp", batch=16, fixed=dict(tp=2, dp=1)),
    dict(model="gpt", batch=8, fixed=dict(pp=4, checkpoint="always")),
    dict(model="gpt", batch=8, fixed=dict(tp=2)),
    dict(model="mlp", batch=16, given=dict(dp=2, pp=2)),
    dict(model="gpt", batch=8, given=dict(dp=2, tp=2)),
]


@pytest.fixture(scope="module")
def world_of_two() -> list[list[dict[str, Any]]]:
    return results(launch(WORKER, 2, ["auto", json.dumps(TWO)], timeout=300))


@pytest.fixture(scope="module")
def world_of_four() -> list[list[dict[str, Any]]]:
    return results(launch(WORKER, 4, ["auto", json.dumps(FOUR)], timeout=420))


def _check(per_rank: list[list[dict[str, Any]]], index: int, world: int) -> None:
    records = [rank[index] for rank in per_rank]
    case = records[0]["case"]
    # Every rank runs rank 0's plan: the same mesh, split, schedule and candidates.
    assert len({r["plan_hash"] for r in records}) == 1, [r["plan_hash"] for r in records]
    dp, pp, tp = records[0]["mesh"]
    assert dp * pp * tp == world
    # One predictor: the plan's step is its simulation on the world's ranks (processes),
    # for the mesh that runs (a plan of given sizes once recorded one process's dp=1).
    assert records[0]["simulated"] == pytest.approx(records[0]["step"], rel=1e-12)
    chosen_label = records[0]["labels"][records[0]["chosen"].index(True)]
    assert chosen_label.startswith(f"dp={dp} tp={tp} pp={pp} "), chosen_label
    assert records[0]["processes"][records[0]["chosen"].index(True)] is True
    for axis, size in {**case.get("fixed", {}), **case.get("given", {})}.items():
        value = {"dp": dp, "pp": pp, "tp": tp}.get(axis, records[0].get(axis))
        assert value == size, (axis, value, size)
    assert records[0]["schedule"] in schedule_names([Runtime.MULTI_PROCESS])
    assert case["batch"] % (dp * records[0]["chunks"]) == 0
    if case.get("tune"):
        # Every rank times the same candidates and agrees on the measured fastest (or a
        # better-ranked one within KEEP_WITHIN of it, a tie the timing cannot break).
        # The tune= count, and at most REFINE more: variants of the mesh measured fastest.
        measured = records[0]["measured"]
        timed = sum(m is not None for m in measured)
        assert case["tune"] <= timed <= case["tune"] + REFINE, measured
        chosen = records[0]["chosen"].index(True)
        assert measured[chosen] <= min(m for m in measured if m is not None) * (1 + KEEP_WITHIN)
        assert records[0]["explain"].startswith(f"tuned: timed {timed} candidates")
        # The plan's first record is the one that runs (what simulate replays, above).
        assert records[0]["chosen"][0] is True
        if case.get("overrule"):
            assert records[0]["ranks"][chosen] > 1, records[0]["ranks"]
    else:
        assert records[0]["explain"].startswith("chosen: ")
    # Only rank 0 plans, so only rank 0 times the model (when asked).
    assert [r["timed"] for r in records] == [bool(case.get("calibrate"))] + [False] * (world - 1)
    for r in records:
        assert r["max_diff"] < TOLERANCE, (r["rank"], r["max_diff"])
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=TOLERANCE, abs=TOLERANCE)
    losses = records[0]["losses"]  # the same batch every step: training lowers its loss
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TWO)), ids=[json.dumps(c) for c in TWO])
def test_auto_on_two_ranks_trains_like_one_process(world_of_two: Any, index: int) -> None:
    _check(world_of_two, index, 2)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FOUR)), ids=[json.dumps(c) for c in FOUR])
def test_auto_on_four_ranks_trains_like_one_process(world_of_four: Any, index: int) -> None:
    _check(world_of_four, index, 4)


@pytest.mark.slow
def test_auto_without_sizes_searches_the_mesh(world_of_four: Any) -> None:
    """Nothing fixed: the search fills the 4 ranks and runs the candidate it predicts
    fastest. Which mesh that is for these tiny models is the cost model's call, not asserted
    here: measured on the 2-core CI machine (4 ranks, 2026-12-03, under load) the MLP ran
    dp=2 x pp=2 1F1B in 8.8 ms, pp=4 in 9.6-15.6 ms and dp=4 in 19.5 ms a step (the test
    expected dp=4 before; docs/benchmarks.md, "auto's regret")."""
    for index, case in enumerate(FOUR):
        if "fixed" not in case and "given" not in case:
            record = world_of_four[0][index]
            assert math.prod(record["mesh"]) == 4, record
            chosen = record["chosen"].index(True)
            predicted = [t for t in record["predicted"] if t is not None]
            assert record["predicted"][chosen] == min(predicted), record
            assert all(n >= 1 for n in record["balance"]), record


@pytest.mark.slow
def test_user_mistakes_under_auto_are_refused_on_every_rank() -> None:
    per_rank = results(launch(WORKER, 2, ["errors", "{}"], timeout=240))
    expected = {
        "product": ("MeshError", "pp=3 need 3 ranks per mesh, but the world has 2; pass sizes "
                                 "whose product divides 2"),
        "all_three": ("MeshError", "pp=2, dp=2, tp=1 need 4 ranks per mesh, but the world "
                                   "has 2; pass sizes whose product is 2"),
        "balance": ("StrategyError", "drop balance= or strategy='auto'"),
        "cluster_size": ("DeviceError", "cluster= has 8 devices"),
        "no_fit": ("MemoryLimitError", "stage memory limit"),
        "cluster_without_auto": ("StrategyError", "pass strategy='auto' or drop them"),
        "strategy": ("StrategyError", "strategy='fastest' is unknown"),
    }
    for rank, records in enumerate(per_rank):
        by_case = {r["case"]: r for r in records}
        assert set(by_case) == set(expected), rank
        for case, (kind, text) in expected.items():
            record = by_case[case]
            assert record["partition_error"] and record["type"] == kind, (rank, record)
            assert text in record["message"], (rank, record)
    # Only rank 0 plans; the others raise its error, saying where it came from.
    assert per_rank[1][[r["case"] for r in per_rank[1]].index("no_fit")]["message"] \
        .startswith("(on rank 0, which plans)")


@pytest.fixture(scope="module")
def enumerated() -> list[list[dict[str, Any]]]:
    """Per rank: the space, then one record per executable configuration. Each mesh runs
    in a world of its own (a long run of many meshes in one world once hung: see the
    closing note of issue 13)."""
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(4)]
    for mesh in ([4, 1, 1], [2, 2, 1], [1, 4, 1], [2, 1, 2], [1, 2, 2], [1, 1, 4]):
        args = json.dumps({"model": "mlp", "batch": 4, "mesh": mesh})
        for rank, records in enumerate(results(launch(WORKER, 4, ["enumerate", args],
                                                      timeout=600))):
            per_rank[rank] += records if not per_rank[rank] else records[1:]
    return per_rank


@pytest.mark.slow
def test_every_executable_configuration_runs(enumerated: Any) -> None:
    """The multi-process search space of a small MLP on 4 ranks: every configuration the
    search may choose (what ``executable`` lets through) runs a step through
    ``strategy="auto"`` with all its sizes fixed, and trains like one process."""
    space = enumerated[0][0]
    assert space["kind"] == "space" and len(space["executable"]) > 10
    runs = schedule_names([Runtime.MULTI_PROCESS])
    # What is skipped: schedules the runtime lacks (tensor parallelism splits this MLP
    # 2 and 4 ways, so its check refuses nothing here).
    assert all(why.endswith(f"runs {list(runs)}") or "tensor-parallel pipeline runs" in why
               for _, why in space["skipped"])
    assert any(" tp=4 " in label for label in space["executable"])
    failed = []
    for rank, records in enumerate(enumerated):
        assert [r["label"] for r in records[1:]] == space["executable"] or \
            sorted(r["label"] for r in records[1:]) == space["executable"], rank
        for r in records[1:]:
            if "error" in r:
                failed.append((rank, r["label"], r["error"]))
            elif r["max_diff"] >= TOLERANCE or \
                    abs(r["losses"][0] - r["ref_losses"][0]) > TOLERANCE:
                failed.append((rank, r["label"], r["max_diff"]))
    assert not failed, failed[:8]
