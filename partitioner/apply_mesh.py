"""Applying a saved plan whose mesh has replicas or tensor-parallel shards (``dp`` or ``tp > 1``).

A plan lists one device per pipeline stage of replica 0 (``plan.devices``, ``pp`` of them),
but runs on ``dp x pp x tp`` devices: replica ``r`` on the ``r``-th group of ``pp x tp``
consecutive devices, stage ``j`` of a group on its ``j``-th ``tp`` devices (one per rank).
So applying it:

- with ``devices=``: the call must give ``dp x pp x tp`` devices, and stage ``j`` of
  replica 0 must start on the plan's ``devices[j]`` (the other devices are not recorded);
- with ``devices=None``: when every device of the plan is ``"cpu"``, it runs on
  ``["cpu"] * (dp x pp x tp)``; otherwise the call must say which devices the other ranks
  and replicas use, and is refused until it does.

A tensor-parallel plan's stages list *merged* layers (the tensor-parallel front merges each
column/row pair, ``('3', '4')``, so that no stage boundary cuts one; the merged layer takes
its first member's name). Rather than trusting the file's shard specs, the plan is made again
by the tensor-parallel front with the saved plan's fixed settings (degree, split, chunks,
checkpoint mode, schedule) and the result must equal the saved plan; a difference (another
torch, other sizes, a hand edit) is refused naming the first one. The saved plan is then
run as written.

Example:
    >>> from partitioner.plans.plan import Mesh, Plan, Stage
    >>> plan = Plan("replicas", ("cpu",), (Stage(0, "cpu", ("0", "1")),), mesh=Mesh(dp=2))
    >>> mesh_devices(plan, ())
    ['cpu', 'cpu']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from partitioner.build import TensorParallelSetup
from partitioner.cost.devices import parse_devices
from partitioner.errors import ExampleInputsError, PartitionError, PlanMismatchError
from partitioner.plans.plan import Mesh, Plan
from partitioner.tensor_parallel import plan_tensor_parallel

__all__ = ["mesh_devices", "mesh_device_problem", "replan_tensor_parallel",
           "first_difference"]


def _mesh(plan: Plan) -> Mesh:
    return plan.mesh or Mesh(1, len(plan.devices), 1)


def mesh_device_problem(plan: Plan, given: Sequence[torch.device]) -> str | None:
    """Why ``given`` (the call's devices, empty for ``devices=None``) cannot run ``plan``."""
    mesh = _mesh(plan)
    need = mesh.dp * mesh.pp * mesh.tp
    layout = (f"mesh dp={mesh.dp} x pp={mesh.pp} x tp={mesh.tp} = {need} devices (replica r "
              f"on devices[r*{mesh.pp * mesh.tp}:(r+1)*{mesh.pp * mesh.tp}], stage j of it "
              f"on its j-th {mesh.tp})")
    if not given:
        if all(d == "cpu" for d in plan.devices):
            return None
        return (f"devices=None but the plan lists only replica 0's stage devices "
                f"{list(plan.devices)} and its {layout}; pass devices= with all {need}")
    if len(given) != need:
        return (f"devices= gives {len(given)} devices but the plan's {layout}; pass {need} "
                "devices, or devices=None on CPUs")
    firsts = [given[j * mesh.tp] for j in range(mesh.pp)]
    if firsts != parse_devices(list(plan.devices)):
        return (f"devices= starts replica 0's stages on {[str(d) for d in firsts]} but the "
                f"plan runs them on {list(plan.devices)}; pass devices whose entries "
                f"0, {mesh.tp}, ... are the plan's, or edit the plan's devices")
    return None


def mesh_devices(plan: Plan, given: Sequence[torch.device]) -> list[str]:
    """The ``dp x pp x tp`` devices ``plan`` runs on in this call (``given``, or every one
    ``"cpu"`` when ``given`` is empty; check :func:`mesh_device_problem` first)."""
    if given:
        return [str(d) for d in given]
    mesh = _mesh(plan)
    return ["cpu"] * (mesh.dp * mesh.pp * mesh.tp)


def replan_tensor_parallel(model: nn.Module, plan: Plan, devices: Sequence[str],
                           example_inputs: tuple[Any, ...] | None,
                           example_kwargs: dict[str, Any] | None) -> TensorParallelSetup:
    """The tensor-parallel setup running the saved ``plan`` (``mesh.tp > 1``) on replica 0's
    ``devices`` (``pp x tp`` of them): planned again with the plan's fixed settings and
    checked to equal it.

    Raises:
        ExampleInputsError: no inputs (the shapes decide what splits).
        PlanMismatchError: the model planned with the plan's settings gives another plan,
            or cannot be planned with them.
    """
    mesh = _mesh(plan)
    if plan.virtual_stages != 1:
        raise PlanMismatchError(f"the plan has tp={mesh.tp} and virtual_stages="
                                f"{plan.virtual_stages}; the tensor-parallel pipeline runs one "
                                "model chunk per stage: re-plan the model")
    try:
        setup = plan_tensor_parallel(model, list(devices), mesh.tp, strategy="pipeline",
                                     example_inputs=example_inputs,
                                     example_kwargs=example_kwargs, chunks=plan.chunks,
                                     checkpoint=plan.checkpoint, balance=plan.balance,
                                     schedule=plan.schedule)
    except ExampleInputsError:
        raise
    except PartitionError as error:
        raise PlanMismatchError(f"the tensor-parallel plan (tp={mesh.tp}, balance "
                                f"{list(plan.balance)}) does not fit this model: {error}; "
                                "re-plan the model and save the new plan") from error
    found = first_difference(setup.plan, plan)
    if found is not None:
        raise PlanMismatchError(f"planning this model again with the tensor-parallel plan's "
                                f"settings gives another plan: {found}; re-plan the model "
                                "(partition or make_plan without plan=) and save the new "
                                "plan")
    return dataclasses.replace(setup, plan=plan)


def first_difference(made: Plan, saved: Plan) -> str | None:
    """The first way ``made`` (planned here) differs from ``saved`` where it decides what
    runs: stages' layers, shard specs, chunks, checkpoint mode, schedule, ``pp x tp``."""
    made_mesh, saved_mesh = _mesh(made), _mesh(saved)
    if (made_mesh.pp, made_mesh.tp) != (saved_mesh.pp, saved_mesh.tp):
        return (f"mesh pp={made_mesh.pp} tp={made_mesh.tp} here, pp={saved_mesh.pp} "
                f"tp={saved_mesh.tp} in the plan")
    for here, there in zip(made.stages, saved.stages):
        if here.layers != there.layers:
            return (f"stage {here.index} holds layers {list(here.layers)} here, "
                    f"{list(there.layers)} in the plan")
    for name in sorted(set(made.shard_specs) | set(saved.shard_specs)):
        here_spec, there_spec = made.shard_specs.get(name), saved.shard_specs.get(name)
        if here_spec != there_spec:
            return f"shard_specs[{name!r}] is {here_spec} here, {there_spec} in the plan"
    for key in ("chunks", "checkpoint", "schedule", "capture"):
        if getattr(made, key) != getattr(saved, key):
            return f"{key}={getattr(made, key)!r} here, {getattr(saved, key)!r} in the plan"
    return None
