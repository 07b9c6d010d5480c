"""The V-shaped schedule across processes: two gloo ranks, float64, against the whole model.

With ``pp=2, virtual_stages=2`` the V puts virtual stages 0 and 3 on rank 0 and 1 and 2
(its turn, handed over in memory) on rank 1: rank 0 sends forward to rank 1 and receives
the turn's outputs back from it, and computes the loss. Training must equal the whole model
and 1F1B, a V checkpoint must resume under the V and under 1F1B, and ``strategy="auto"``
asked for the V must choose and run one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from distributed_harness import launch, results

WORKER = Path(__file__).with_name("v_shape_worker.py")
TOLERANCE = 1e-12


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("v_shape")
    per_rank = results(launch(WORKER, 2, [json.dumps({"dir": str(folder)})], timeout=300))
    found: dict[str, list[dict[str, Any]]] = {}
    for rank_records in per_rank:
        for record in rank_records:
            found.setdefault(record["case"], []).append(record)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("model", ["longskip", "tied"])
def test_a_v_over_two_ranks_trains_like_the_model_and_1f1b(records: Any, model: str) -> None:
    ranks = sorted(records[f"train-{model}"], key=lambda r: r["rank"])
    assert [r["v_shape"]["stages"] for r in ranks] == [[0, 3], [1, 2]]
    assert [r["v_shape"]["last"] for r in ranks] == [True, False]  # rank 0 holds the loss
    keys: set[str] = set()
    for r in ranks:
        for schedule in ("v_shape", "1f1b"):
            run = r[schedule]
            assert run["diff"] < TOLERANCE, (r["rank"], schedule, run["diff"])
            assert run["losses"] == pytest.approx(r["ref_losses"], rel=TOLERANCE, abs=TOLERANCE)
        assert r["v_shape"]["losses"] == pytest.approx(r["1f1b"]["losses"], rel=TOLERANCE)
        keys |= set(r["v_shape"]["keys"])
    assert len(keys) == (8 if model == "tied" else 12)  # every weight was compared


@pytest.mark.slow
def test_a_v_checkpoint_resumes_under_the_v_and_under_1f1b(records: Any) -> None:
    for r in records["resume"]:
        for where in ("mid.pt", "mid"):  # one file, then a folder loaded by 1F1B
            assert r[where]["steps"] == 2
            assert r[where]["losses"] == pytest.approx(r["straight"], rel=TOLERANCE)
            if r["rank"] == 0:
                assert r[where]["diff"] < TOLERANCE, (where, r[where]["diff"])


@pytest.mark.slow
def test_auto_across_processes_chooses_and_runs_a_v(records: Any) -> None:
    for r in records["auto"]:
        assert r["schedule"] == "v_shape" and r["virtual"] >= 2
        assert all("v_shape" in label for label in r["labels"])  # every candidate a V
        assert r["grads"] and max(r["grads"].values()) < TOLERANCE
