"""The regret benchmark's contenders each in a process of their own
(``benchmarks/isolated.py``): built from a description, stepped in turn, a contender that
cannot be built reported with its error instead of stopping the others."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_contenders_run_in_their_own_processes_and_failures_are_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On the path while the children start: they unpickle their entry point by name.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from isolated import Isolated, Spec
    pool = Isolated([Spec("regret", "unpartitioned", ("mlp",)),
                     Spec("regret", "unpartitioned", ("no such case",)),
                     Spec("regret", "plain_1f1b", ("mlp", 2, 2))], warmup=1, settle=0.0)
    try:
        assert pool.built == [0, 2]
        assert "StopIteration" in pool.errors[1]
        # The plain pipeline says what it predicts; the unpartitioned model predicts nothing.
        assert pool.predicted[0] is None and pool.predicted[2] > 0
        for i in pool.built:
            seconds, foreign = pool.step(i)
            assert seconds > 0 and 0.0 <= foreign
    finally:
        pool.close()
    assert pool.built == []
