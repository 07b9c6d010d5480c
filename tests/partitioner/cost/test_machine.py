"""Where "cpu" devices get their spec: pinned, the reference, the cache, or measured once."""

from __future__ import annotations

from pathlib import Path

import pytest

import partitioner.cost.machine as machine
import partitioner.cost.measure as measure
from partitioner.cost.calibration_cache import Run, write_runs
from partitioner.cost.devices import REFERENCE_CPU, DeviceSpec
from partitioner.errors import DeviceError, PartitionError


def test_tests_plan_with_the_reference_cpu() -> None:
    assert machine.cpu_spec() is REFERENCE_CPU
    assert machine.local_cluster(["cpu", "cpu"]).spec(1) is REFERENCE_CPU


def test_a_pinned_spec_wins_and_unpins() -> None:
    mine = DeviceSpec("mine", {"fp32": 1e9}, 2**30, 1e9)
    with machine.pinned_cpu_spec(mine):
        assert machine.cpu_spec() is mine
        assert machine.local_cluster(["cpu"]).device is mine
    assert machine.cpu_spec() is REFERENCE_CPU


def test_unknown_source_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITIONER_CPU_SPEC", "fastest")
    with pytest.raises(DeviceError, match="PARTITIONER_CPU_SPEC='fastest'") as info:
        machine.cpu_spec()
    assert isinstance(info.value, PartitionError) and "reference" in str(info.value)


def test_cached_runs_are_used_without_measuring(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("PARTITIONER_CPU_SPEC", "")
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    path = measure.cache_file()
    assert path is not None and path.parent == tmp_path
    timings = dict.fromkeys(measure.TIMING_KEYS, 1e-3)
    timings.update(few=1e-4, some=8e-4, many=3.2e-3, fresh=2e-3)
    write_runs(path, [Run(timings, at=0.0, foreign=0.01)] * 2)

    def no_measuring(progress: bool = False) -> DeviceSpec:
        raise AssertionError("measured although the cache has runs")
    monkeypatch.setattr(measure, "measure_cpu", no_measuring)
    monkeypatch.setattr(machine, "measure_cpu", no_measuring)
    spec = machine.cpu_spec()
    assert spec.name == "cpu (measured)" and spec.flops("fp32") > 0


def test_first_use_on_a_new_machine_says_what_it_does(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PARTITIONER_CPU_SPEC", "")
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(progress: bool = False) -> DeviceSpec:
        calls.append(progress)
        return REFERENCE_CPU
    monkeypatch.setattr(machine, "measure_cpu", fake_measure)
    machine._measure_announced.cache_clear()
    try:
        assert machine.cpu_spec() is REFERENCE_CPU
        assert machine.cpu_spec() is REFERENCE_CPU  # once per process
    finally:
        machine._measure_announced.cache_clear()
    err = capsys.readouterr().err
    assert calls == [True]
    assert "measuring this machine's CPU" in err and str(tmp_path) in err
