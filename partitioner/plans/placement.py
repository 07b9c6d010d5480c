"""Where a plan with a mesh runs: ``dp x pp x tp`` devices from a plan that lists ``pp``.

A plan lists one device per pipeline stage of replica 0 (``plan.devices``, ``pp`` of them),
but runs on ``dp x pp x tp`` devices: replica ``r`` on the ``r``-th group of ``pp x tp``
consecutive devices, stage ``j`` of a group on its ``j``-th ``tp`` devices (one per rank).
So applying it:

- with ``devices=``: the call must give ``dp x pp x tp`` devices, and stage ``j`` of
  replica 0 must start on the plan's ``devices[j]`` (the other devices are not recorded);
- with ``devices=None``: when every device of the plan is ``"cpu"``, it runs on
  ``["cpu"] * (dp x pp x tp)``; otherwise the call must say which devices the other ranks
  and replicas use, and is refused until it does.

Example:
    >>> from partitioner.plans.plan import Mesh, Plan, Stage
    >>> plan = Plan("replicas", ("cpu",), (Stage(0, "cpu", ("0", "1")),), mesh=Mesh(dp=2))
    >>> mesh_devices(plan, [])
    ['cpu', 'cpu']
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from partitioner.plans.plan import Mesh, Plan

__all__ = ["mesh_devices", "mesh_device_problem"]


def _mesh(plan: Plan) -> Mesh:
    return plan.mesh or Mesh(1, len(plan.devices), 1)


def mesh_device_problem(plan: Plan, given: Sequence[torch.device],
                        stage_devices: Sequence[torch.device]) -> str | None:
    """Why ``given`` (the call's devices, empty for ``devices=None``) cannot run ``plan``,
    whose ``devices`` parse to ``stage_devices``; ``None`` when they can."""
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
    if firsts != list(stage_devices):
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
