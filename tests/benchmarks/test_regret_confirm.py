"""The regret benchmark's head-to-head confirmation (``benchmarks/regret.py``): the fastest
of many noisy contenders is optimistic, so a pick that screened slower is timed again
against it alone, alternating which goes first, and the regret from those bursts is
reported beside the screening's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class FakePool:
    """Bursts of fixed seconds per contender, in a log; ``busy`` marks bursts that other
    processes disturbed (by their position in the log)."""

    def __init__(self, seconds: dict[int, list[float]], busy: set[int] = frozenset()
                 ) -> None:
        self.seconds = {i: list(v) for i, v in seconds.items()}
        self.busy = busy
        self.log: list[int] = []

    @property
    def built(self) -> list[int]:
        return sorted(self.seconds)

    def step(self, i: int, burst: float = 0.0) -> tuple[float, float]:
        self.log.append(i)
        return self.seconds[i].pop(0), 1.0 if len(self.log) - 1 in self.busy else 0.0


@pytest.fixture
def regret(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the benchmark adds to it: undone
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import regret
    return regret


def _runs(regret: Any, screened: list[list[float]]) -> list[Any]:
    return [regret.Run(f"c{i}", "pipeline", 1.0, None, list(t))
            for i, t in enumerate(screened)]


def test_a_pick_screened_slow_is_timed_head_to_head_alternating_and_regret_confirmed(
        regret: Any) -> None:
    runs = _runs(regret, [[1.0], [1.3]])
    pool = FakePool({0: [1.0, 1.0, 1.0, 1.0], 1: [1.05, 1.05, 1.05, 1.05]})
    regret.head_to_head(pool, runs, 1, 0, bursts=4, burst=0.0, max_foreign=0.15,
                        attempts=10)
    assert pool.log == [1, 0, 0, 1, 1, 0, 0, 1]  # who goes first alternates
    assert runs[1].duel == ([1.05] * 4, [1.0] * 4)
    assert runs[1].confirmed_regret(runs[0]) == pytest.approx(0.05)
    assert runs[0].confirmed_regret(runs[0]) == 0.0  # the fastest itself
    # A pick that is faster head to head has no regret; one never timed so has no figure.
    runs[1].duel = ([0.9], [1.0])
    assert runs[1].confirmed_regret(runs[0]) == 0.0
    assert _runs(regret, [[1.0], [1.3]])[1].confirmed_regret(runs[0]) is None


def test_disturbed_bursts_do_not_count_and_attempts_bound_the_duel(regret: Any) -> None:
    runs = _runs(regret, [[1.0], [1.3]])
    pool = FakePool({0: [9.0, 1.0, 1.0, 1.0], 1: [1.1, 1.1, 1.1, 1.1]}, busy={1})
    regret.head_to_head(pool, runs, 1, 0, bursts=2, burst=0.0, max_foreign=0.15,
                        attempts=10)
    assert runs[1].duel == ([1.1, 1.1], [1.0, 1.0])  # the 9 s burst was disturbed
    assert pool.log == [1, 0, 0, 1, 0]  # then only the side still short is timed
    runs = _runs(regret, [[1.0], [1.3]])
    pool = FakePool({0: [1.0] * 20, 1: [1.2] * 20}, busy=set(range(40)))
    regret.head_to_head(pool, runs, 1, 0, bursts=3, burst=0.0, max_foreign=0.15,
                        attempts=5)
    assert len(pool.log) == 10 and runs[1].duel == ([], [])
    assert runs[1].confirmed_regret(runs[0]) is None


def test_the_summary_reports_both_the_screened_and_the_confirmed_regret(
        regret: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"case": "a x2", "auto_regret": 0.21, "tune_regret": 0.0, "auto_confirmed": 0.04,
             "tune_confirmed": None, "vs_1f1b": 0.9, "vs_one_device": 1.1, "best": "c0",
             "ratios": [("pipeline", 1.1)]}]
    regret.summary(rows)
    out = capsys.readouterr().out
    assert "| a x2 | +21.0% (+4.0%) | +0.0% (+0.0%) |" in out
    assert "auto_regret: median +21.0%, max +21.0%" in out
    assert "auto_regret confirmed: median +4.0%, max +4.0%" in out
