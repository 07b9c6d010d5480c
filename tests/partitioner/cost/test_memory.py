"""Tests of partitioner/cost/memory.py: parameters, gradients, optimizer state, activations."""

from __future__ import annotations

import doctest

import pytest

import partitioner.cost.memory
from partitioner.cost.memory import (
    MemoryModelError,
    activation_memory,
    device_memory,
    in_flight,
    optimizer_traffic,
    per_parameter_bytes,
)
from partitioner.runtime.schedule import Phase
from partitioner.runtime.schedule import in_flight as schedule_in_flight
from partitioner.runtime.schedule_generators import gpipe, interleaved, one_f_one_b


@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 8), (4, 2), (8, 3)])
def test_in_flight_matches_the_runtime_schedules(p: int, m: int) -> None:
    assert tuple(in_flight("gpipe", p, m, j) for j in range(p)) == schedule_in_flight(gpipe(p, m))
    assert tuple(in_flight("1f1b", p, m, j) for j in range(p)) == schedule_in_flight(
        one_f_one_b(p, m))
    assert [in_flight("1f1b", p, m, j) for j in range(p)] == [min(p - j, m) for j in range(p)]


def _peak_chunks(actions: tuple) -> int:
    live = peak = 0
    for a in actions:
        live += 1 if a.phase is Phase.FORWARD else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 4, 6), (8, 2, 16)])
def test_interleaved_in_flight_matches_the_schedule(p: int, v: int, m: int) -> None:
    schedule = interleaved(p, m, v)
    for j in range(p):
        assert in_flight("interleaved", p, m, j, v) == _peak_chunks(schedule[j])


def test_optimizer_state_by_optimizer() -> None:
    assert per_parameter_bytes("sgd", 4, False) == 8  # weight + gradient
    assert per_parameter_bytes("momentum", 4, False) == 12
    assert per_parameter_bytes("adam", 4, False) == 16
    assert per_parameter_bytes("adamw", 2, True) == 2 + 2 + 8 + 4  # bf16 w, g; fp32 m, v, master
    assert optimizer_traffic("adam", 4, False) > optimizer_traffic("momentum", 4, False) \
        > optimizer_traffic("sgd", 4, False)


def test_checkpointing_keeps_inputs_and_one_micro_batch() -> None:
    assert activation_memory("never", 8, 100.0, 5.0) == 800.0
    assert activation_memory("always", 8, 100.0, 5.0) == 8 * 5.0 + 100.0
    assert activation_memory("except_last", 8, 100.0, 5.0) == 7 * 5.0 + 100.0
    assert activation_memory("always", 0, 100.0, 5.0) == 0.0


def test_device_memory_adds_the_parts() -> None:
    parts = device_memory(4000.0, 10.0, 500.0, optimizer="adam", element=4,
                          mixed_precision=False)
    assert (parts.params, parts.grads, parts.optimizer, parts.activations, parts.buffers) == (
        4000.0, 4000.0, 8000.0, 500.0, 10.0)
    assert parts.total == 16510.0
    mixed = device_memory(2000.0, 0.0, 0.0, optimizer="adam", element=2, mixed_precision=True)
    assert mixed.optimizer == 1000 * (8 + 4)  # fp32 moments and master weights


def test_unknown_names_are_refused() -> None:
    with pytest.raises(MemoryModelError, match="optimizer='lamb' is unknown"):
        per_parameter_bytes("lamb", 4, False)
    with pytest.raises(MemoryModelError, match="schedule='zb'"):
        in_flight("zb", 2, 2)
    with pytest.raises(MemoryModelError, match="checkpoint='sometimes'") as info:
        activation_memory("sometimes", 1, 1.0, 1.0)
    assert isinstance(info.value, ValueError)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.memory).failed == 0
