"""``mesh=``: plan exactly the data x pipeline x tensor mesh a caller gives, beside auto's best.

``make_plan(model, cluster, mesh=Mesh(dp=64, pp=16, tp=8))`` answers "what would this
configuration cost?": the search (``partitioner.planning.auto``) runs restricted to that
mesh -- the split, micro-batches, schedule and checkpoint mode are still optimised unless
given -- and, within the planning budget, once more with nothing fixed. The plan is the
mesh's; its first candidate record keeps the mesh asked for and auto's best, so
``Plan.explain()`` (``partitioner.plans.explain``) says how far the mesh is from it.

This module holds the pieces the request and the planner share: :func:`mesh_problems`
(checked when the request is made), :func:`mesh_refusal` (why no configuration of the mesh
exists for the model) and :func:`compared` (the plan with auto's best recorded).

Example:
    >>> problem, = mesh_problems(Mesh(dp=2, pp=2, tp=1), n_devices=8, devices_per_node=8)
    >>> problem.split("; ")[1]
    'pass degrees whose product is 8, e.g. Mesh(dp=4, pp=2, tp=1)'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from partitioner.cost.cost import Workload
from partitioner.cost.devices import Cluster
from partitioner.errors import MeshError
from partitioner.planning.auto import (
    LOCAL_RUNTIME,
    configurations,
    executable,
    workload_tp_degrees,
)
from partitioner.planning.space import SearchSpace
from partitioner.plans.explain import format_seconds, given_mesh_line
from partitioner.plans.plan import Mesh, Plan

__all__ = ["mesh_problems", "mesh_refusal", "compared", "unfit_mesh_message", "mesh_degrees",
           "FIXED_BY_CALLER", "auto_best_space"]

FIXED_BY_CALLER = ("chunks", "checkpoint", "schedules", "virtual")
"""The search options a caller may fix beside the mesh; auto's best searches them too."""


def mesh_problems(mesh: object, n_devices: int, devices_per_node: int | None) -> list[str]:
    """What is wrong with ``mesh=`` for ``n_devices`` devices (empty: nothing).

    Args:
        mesh: the value given (a :class:`~partitioner.plans.plan.Mesh` is expected).
        n_devices: the devices planned for (0: not known yet, e.g. a plan file names them).
        devices_per_node: devices sharing a node's fast links (``None``: one node).
    """
    if not isinstance(mesh, Mesh):
        return [f"mesh={mesh!r} is a {type(mesh).__name__}; pass "
                "partitioner.Mesh(dp=..., pp=..., tp=...)"]
    found = []
    size = mesh.dp * mesh.pp * mesh.tp
    if n_devices and size != n_devices:
        fix = f"pass degrees whose product is {n_devices}"
        if n_devices % (mesh.pp * mesh.tp) == 0:
            fix += f", e.g. {replace(mesh, dp=n_devices // (mesh.pp * mesh.tp))}"
        found.append(f"mesh={mesh} spans {size} devices (dp x pp x tp) but there are "
                     f"{n_devices}; {fix}")
    if devices_per_node and mesh.tp > 1 and devices_per_node % mesh.tp:
        found.append(f"mesh tp={mesh.tp} does not divide a node's {devices_per_node} "
                     "devices: tensor parallelism stays inside a node; pass tp dividing "
                     f"{devices_per_node}")
    return found


def mesh_degrees(mesh: Mesh | None, **degrees: int | None) -> tuple[int | None, ...]:
    """``(pp, dp, tp)`` from ``mesh=`` and ``pp=``/``dp=``/``tp=`` given beside it
    (``partition_distributed``'s sugar): the mesh's, when the others agree or are absent.

    Example:
        >>> mesh_degrees(Mesh(dp=2, pp=4), pp=4, dp=None, tp=None)
        (4, 2, 1)

    Raises:
        MeshError: ``mesh`` is not a Mesh, or a degree given beside it disagrees.
    """
    if mesh is None:
        return tuple(degrees.get(k) for k in ("pp", "dp", "tp"))
    if not isinstance(mesh, Mesh):
        raise MeshError(mesh_problems(mesh, 0, None)[0])
    clash = [f"{k}={v}" for k, v in degrees.items() if v is not None and v != getattr(mesh, k)]
    if clash:
        raise MeshError(f"mesh={mesh} but {', '.join(clash)} given; pass the degrees once, "
                        "in mesh= or as pp=/dp=/tp=")
    return mesh.pp, mesh.dp, mesh.tp


def mesh_refusal(workload: Workload, cluster: Cluster, mesh: Mesh,
                 space: SearchSpace | None = None) -> str | None:
    """Why the search has no configuration of ``mesh`` (``None``: it has some).

    Args:
        workload: the model's costs (``workload.batch`` is the whole step's batch).
        cluster: the devices.
        mesh: the mesh asked for.
        space: the other choices the caller fixed (:data:`FIXED_BY_CALLER`) and the
            tensor-parallel degrees the model's layers divide by.
    """
    space = space or SearchSpace()
    found = list(configurations(workload, cluster, space.fixing(dp=mesh.dp, tp=mesh.tp,
                                                                pp=mesh.pp)))
    if found and not cluster.is_local:
        return None
    runnable = [c for c in found if executable(c, cluster, LOCAL_RUNTIME) is None]
    if runnable:
        return None
    if found:
        why = executable(found[0], cluster, LOCAL_RUNTIME)
        return f"mesh={mesh} cannot run in this process: {why}; pass another mesh"
    return f"mesh={mesh}: {_no_configuration(workload, cluster, mesh, space)}"


def auto_best_space(space: SearchSpace) -> SearchSpace:
    """What auto's best beside a given mesh searches: everything the caller fixed beside
    the mesh (:data:`FIXED_BY_CALLER`) and the mesh itself set free again."""
    return space.without_mesh().fixing(**dict.fromkeys(FIXED_BY_CALLER))


def _no_configuration(workload: Workload, cluster: Cluster, mesh: Mesh,
                      space: SearchSpace) -> str:
    """The first reason no configuration of ``mesh`` is enumerated."""
    layers, batch = len(workload.layers), workload.batch
    if mesh.pp > layers:
        return f"pp={mesh.pp} stages but the model has {layers} layers; pass pp <= {layers}"
    if batch % mesh.dp:
        return (f"dp={mesh.dp} replicas do not divide the batch of {batch} samples "
                "(example_inputs is the whole step's batch, split over the replicas); pass "
                "a dp dividing it")
    if mesh.dp > 1 and not workload.microbatch_safe:
        return (f"dp={mesh.dp} splits the batch, but the model is not micro-batch safe "
                "(batch norm or another operation across the batch, or a buffer its forward "
                "updates: the workload's notes say which); pass dp=1")
    allowed = _tp_degrees(workload, cluster, space.tp_degrees)
    if mesh.tp > 1 and mesh.tp not in allowed:
        return (f"tp={mesh.tp} but the model's layers split only {allowed[1:] or 'no'} ways "
                "here (powers of two inside a node that the split dimensions divide by); pass "
                f"tp in {allowed}")
    per_replica = batch // mesh.dp
    chunks = space.chunks
    if chunks is not None and chunks > per_replica:
        return (f"chunks={chunks} micro-batches but each of the {mesh.dp} replicas gets "
                f"{per_replica} samples; pass chunks <= {per_replica}")
    given = {k: getattr(space, k) for k in FIXED_BY_CALLER if getattr(space, k) is not None}
    return (f"no micro-batch count, schedule and virtual stages suit it with {given}; drop "
            "some of those or pass another mesh")


def _tp_degrees(workload: Workload, cluster: Cluster,
                tp_degrees: Sequence[int] | None) -> list[int]:
    """The tensor-parallel degrees the search enumerates for this model and cluster."""
    inside = min(cluster.size, cluster.devices_per_node)
    return [1] + [t for t in workload_tp_degrees(workload, cluster)
                  if t > 1 and workload.max_tp != 1 and inside % t == 0
                  and (tp_degrees is None or t in tp_degrees)]


def compared(given: Plan, best: Plan | None, mesh: Mesh) -> Plan:
    """``given`` (the mesh's plan) with the mesh and auto's best in its first record.

    Args:
        given: the plan of the search restricted to ``mesh``.
        best: the plan of the unrestricted search (``None``: it found nothing).
        mesh: the mesh asked for.
    """
    if not given.candidates:
        return given
    first = dict(given.candidates[0], given_mesh=asdict(mesh),
                 auto_best=_summary(best) if best is not None else None)
    line = given_mesh_line(first)
    notes = (*given.notes, line) if line else given.notes
    return replace(given, candidates=(first, *given.candidates[1:]), notes=notes)


def unfit_mesh_message(mesh: Mesh, reason: str, best: Plan | None) -> str:
    """Why ``mesh`` does not fit memory (the search's ``reason``), and what auto found that
    does (``best``), as the fix."""
    text = f"mesh={mesh} does not fit memory: {reason}"
    record = best.candidates[0] if best is not None and best.candidates else None
    if record is None:
        return text + "; no other mesh fits either: use more or larger devices"
    return (text + f"; auto's best that fits is {record['label']}, predicted "
            f"{format_seconds(record['step_time'])} per step: pass "
            f"mesh=Mesh(dp={record['config']['dp']}, pp={record['config']['pp']}, "
            f"tp={record['config']['tp']}), or a smaller memory_reserve=")


def _summary(best: Plan) -> dict[str, Any] | None:
    """Auto's best as the comparison needs it (label, step time, whether it was exhaustive)."""
    if not best.candidates:
        return None
    record = best.candidates[0]
    search = record.get("search") or {}
    return {"label": record["label"], "step_time": record["step_time"],
            "samples_per_second": record["samples_per_second"],
            "peak_memory": record["peak_memory"], "config": record["config"],
            "timed_out": bool(search.get("timed_out")), "gap": search.get("gap", 0.0)}
