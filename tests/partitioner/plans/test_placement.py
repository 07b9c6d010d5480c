"""Tests of partitioner/plans/placement.py: the devices a plan with a mesh runs on."""

from __future__ import annotations

import torch

from partitioner.plans.placement import mesh_device_problem, mesh_devices
from partitioner.plans.plan import Mesh, Plan, Stage

CPU = torch.device("cpu")


def _plan(devices: tuple[str, ...], mesh: Mesh) -> Plan:
    stages = tuple(Stage(j, d, (str(j),)) for j, d in enumerate(devices))
    return Plan("x", devices, stages, mesh=mesh)


def test_devices_none_on_cpus_repeats_cpu_for_every_rank_and_replica() -> None:
    plan = _plan(("cpu", "cpu"), Mesh(2, 2, 2))
    assert mesh_device_problem(plan, [], [CPU, CPU]) is None
    assert mesh_devices(plan, []) == ["cpu"] * 8


def test_devices_none_elsewhere_asks_for_devices() -> None:
    plan = _plan(("cuda:0",), Mesh(2, 1, 1))
    problem = mesh_device_problem(plan, [], [torch.device("cuda:0")])
    assert problem is not None and "pass devices= with all 2" in problem


def test_the_count_and_replica_zeros_stage_devices_are_checked() -> None:
    plan = _plan(("cpu:0", "cpu:1"), Mesh(1, 2, 2))
    firsts = [torch.device("cpu:0"), torch.device("cpu:1")]
    assert "gives 3 devices" in (mesh_device_problem(plan, [CPU] * 3, firsts) or "")
    given = [torch.device("cpu:0"), CPU, torch.device("cpu:1"), CPU]
    assert mesh_device_problem(plan, given, firsts) is None
    assert mesh_devices(plan, given) == ["cpu:0", "cpu", "cpu:1", "cpu"]
    swapped = [torch.device("cpu:1"), CPU, torch.device("cpu:0"), CPU]
    assert "starts replica 0's stages on ['cpu:1', 'cpu:0']" in (
        mesh_device_problem(plan, swapped, firsts) or "")
