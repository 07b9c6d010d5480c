"""The search reads what each runtime can run from the runtime's registry
(``partitioner.runtime.schedule_registry``), never a copy of its own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.planning.auto import (
    LOCAL_RUNTIME,
    MULTI_PROCESS_RUNTIME,
    RuntimeSupport,
    runtime_support,
)
from partitioner.runtime import schedule_registry
from partitioner.runtime.schedule_registry import CAPABILITIES, Runtime, schedule_names


@pytest.mark.parametrize(("runtime", "support"), [(Runtime.ONE_PROCESS, LOCAL_RUNTIME),
                                                  (Runtime.MULTI_PROCESS, MULTI_PROCESS_RUNTIME)])
def test_support_is_what_the_registry_publishes(runtime: Runtime, support: RuntimeSupport) -> None:
    can = CAPABILITIES[runtime]
    assert support == runtime_support(runtime)
    assert support.schedules == schedule_names([runtime])
    assert (support.data_parallel, support.tensor_parallel, support.optimizer_sharding) == (
        can.data_parallel, can.tensor_parallel, can.optimizer_sharding)
    assert support.tp_schedules == schedule_names([runtime], virtual=False)


def test_a_capability_the_runtime_gains_reaches_the_planner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gained = {**CAPABILITIES, Runtime.ONE_PROCESS: replace(
        CAPABILITIES[Runtime.ONE_PROCESS], optimizer_sharding=True, virtual_with_tp=True)}
    monkeypatch.setattr("partitioner.planning.auto.CAPABILITIES", gained)
    support = runtime_support(Runtime.ONE_PROCESS)
    assert support.optimizer_sharding and support.tp_schedules is None
    assert schedule_registry.CAPABILITIES[Runtime.ONE_PROCESS].optimizer_sharding is False
