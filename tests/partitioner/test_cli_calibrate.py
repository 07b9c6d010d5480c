"""Tests of partitioner/cli/calibrate.py: ``partitioner calibrate`` shows, re-measures and
clears this machine's calibration cache (a temporary one here, never the user's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import partitioner.cost.calibration_cache as cache
import partitioner.cost.measure as measure
from partitioner.cli import main
from partitioner.cost.calibration_cache import Run, read_runs, write_runs
from partitioner.cost.devices import REFERENCE_CPU
from partitioner.runtime.host_memory import cpu_host_memory_mode

TIMINGS = {**dict.fromkeys(measure.TIMING_KEYS, 1e-3),
           "few": 1e-4, "some": 8e-4, "many": 3.2e-3, "fresh": 2e-3}


@pytest.fixture
def path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PARTITIONER_CALIBRATION_CACHE", raising=False)
    found = measure.cache_file()
    assert found is not None
    return found


class Measuring:
    """Measuring made fast: each run returns TIMINGS and is counted; ``load`` is the share of
    the cores the load samples report."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs, self.load = 0, 0.03
        monkeypatch.setattr(measure, "_timings", self.timings)
        monkeypatch.setattr(cache, "foreign_share", lambda start, end=None: self.load)
        monkeypatch.setattr(cache, "_quiet_moment", lambda: False)

    def timings(self, progress: object) -> dict[str, float]:
        self.runs += 1
        return dict(TIMINGS)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> Measuring:
    return Measuring(monkeypatch)


def test_calibrate_shows_the_file_its_runs_and_the_spec(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_runs(path, [Run(TIMINGS, at=0.0, foreign=0.04), Run(TIMINGS, at=1.0, foreign=0.1)])
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert f"calibration cache: {path}" in out
    assert f"host memory: {cpu_host_memory_mode()} " in out
    assert "runs kept: 2" in out and "all quiet" in out and "at most 10% of the cores" in out
    spec = measure.median_spec([Run(TIMINGS, 0.0, 0.0)])
    assert f"{spec.flops('fp32') / 1e9:8.1f} GFLOP/s" in out
    for figure in ("memory bandwidth", "op overhead", "action overhead", "optimizer step",
                   "weight repacking", "first touch", "element-wise", "products of 17 MFLOP"):
        assert figure in out, figure


def test_calibrate_measure_appends_a_quiet_run(path: Path, measured: Measuring,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    write_runs(path, [Run(TIMINGS, at=0.0, foreign=0.0)])
    assert main(["calibrate", "--measure"]) == 0
    assert measured.runs == 1
    assert len(read_runs(path, measure.TIMING_KEYS).runs) == 2
    out = capsys.readouterr().out
    assert "runs kept: 2" in out and "not kept" not in out


def test_calibrate_measure_on_a_busy_machine_shows_the_run_but_keeps_nothing(
        path: Path, measured: Measuring, capsys: pytest.CaptureFixture[str]) -> None:
    measured.load = 0.7
    assert main(["calibrate", "--measure"]) == 0
    assert measured.runs == 1
    captured = capsys.readouterr()
    assert "measured now, not kept" in captured.out and "GFLOP/s" in captured.out
    assert "runs kept: none" in captured.out and "70%" in captured.err
    assert not path.exists()


def test_calibrate_clear_deletes_the_file(path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    write_runs(path, [Run(TIMINGS, at=0.0, foreign=0.0)])
    assert main(["calibrate", "--clear"]) == 0
    assert not path.exists()
    out = capsys.readouterr().out
    assert f"removed {path}" in out and "runs kept: none" in out
    assert main(["calibrate", "--clear"]) == 0
    assert "no calibration cache to remove" in capsys.readouterr().out


def test_calibrate_names_what_is_wrong_with_a_corrupt_file(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path.write_text(json.dumps({"format": cache.CACHE_FORMAT, "torch": "0.1", "runs": []}))
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "was measured with torch 0.1" in out and "measures again" in out


def test_calibrate_refuses_a_disabled_cache(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PARTITIONER_CALIBRATION_CACHE", "0")
    assert main(["calibrate"]) == 1
    err = capsys.readouterr().err
    assert "PARTITIONER_CALIBRATION_CACHE=0" in err and "unset it" in err


def test_calibrate_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = capsys.readouterr().out
    assert "partitioner calibrate --measure" in out and "--clear" in out


def test_spec_lines_give_units() -> None:
    from partitioner.cli.calibrate import spec_lines

    lines = spec_lines(REFERENCE_CPU)
    assert lines[0].split() == ["matmul", "rate", "(fp32)", "200.0", "GFLOP/s"]
    assert any(line.split()[:3] == ["memory", "bandwidth", "28.0"] for line in lines)
    assert any(line.split()[:3] == ["op", "overhead", "5.0"] for line in lines)
    assert lines[1].split()[-3:] == ["kFLOP", "per", "product"]
    assert lines[1].split()[3] == "2.2"
    assert ["element-wise", "1.00", "0.70", "0.60", "0.70"] in [line.split() for line in lines]


def test_the_table_says_products_gain_by_their_threads_part_when_a_lone_worker_was_timed(
        ) -> None:
    from dataclasses import replace

    from partitioner.cli.calibrate import spec_lines

    note = "the part of them the threads divide"
    assert not any(note in line for line in spec_lines(REFERENCE_CPU))  # the table counts
    assert any(note in line for line in spec_lines(replace(REFERENCE_CPU, worker_speed=0.5)))


def test_calibrate_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom partitioner.cli import main\ntry:\n    main(['calibrate', '--help'])"
            "\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
