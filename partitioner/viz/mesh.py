"""The plan's device mesh, for drawing: which device runs what, and how each layer is split.

A plan names one device per pipeline position (``plan.devices``); the mesh multiplies them:
``dp`` replicas of ``pp`` stages of ``tp`` ranks, device ``d = r * pp * tp + j * tp + t``
(replica ``r``, pipeline position ``j``, rank ``t``: the order ``partitioner.build`` lays
the devices out in). :func:`device_rows` lists them, one timeline row each;
:func:`split_modules` and :func:`layer_splits` say how tensor parallelism splits each module
and layer (column, row, vocab, or replicated on every rank).

Example:
    >>> from partitioner.plans.plan import Mesh, Plan, ShardSpec, Stage
    >>> plan = Plan("auto", ("cpu",), (Stage(0, "cpu", ("fc", "head")),), mesh=Mesh(tp=2),
    ...             shard_specs={"fc.weight": ShardSpec(0, "colwise")})
    >>> [row.name for row in device_rows(plan)]
    ['device 0: cpu (rank 0)', 'device 1: cpu (rank 1)']
    >>> layer_splits(plan)
    {'fc': 'column', 'head': 'replicated'}
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.plans.plan import Plan

__all__ = ["DeviceRow", "device_rows", "mesh_shape", "split_modules", "layer_splits",
           "SPLIT_NAMES", "mesh_heading", "stage_devices", "short_splits"]

#: How each split kind is said in a picture.
SPLIT_NAMES = {"colwise": "column", "rowwise": "row", "vocab": "vocab"}


@dataclass(frozen=True)
class DeviceRow:
    """One device of the mesh: its number, where it sits (replica ``r``, pipeline position
    ``j``, rank ``t``), its device string and the mesh's sizes."""

    index: int
    replica: int
    stage: int
    rank: int
    device: str
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def name(self) -> str:
        """``"device 3: cpu (replica 1, stage 1)"``: what the row is, for people."""
        where = [f"replica {self.replica}"] if self.dp > 1 else []
        where += [f"stage {self.stage}"] if self.pp > 1 else []
        where += [f"rank {self.rank}"] if self.tp > 1 else []
        return f"device {self.index}: {self.device}" + (f" ({', '.join(where)})" if where
                                                          else "")


def mesh_shape(plan: Plan) -> tuple[int, int, int]:
    """``(dp, pp, tp)``: ``pp`` is the plan's pipeline devices."""
    dp, tp = (plan.mesh.dp, plan.mesh.tp) if plan.mesh is not None else (1, 1)
    return dp, len(plan.devices), tp


def device_rows(plan: Plan) -> list[DeviceRow]:
    """Every device of the plan's mesh, in device order (see the module docstring)."""
    dp, pp, tp = mesh_shape(plan)
    return [DeviceRow(r * pp * tp + j * tp + t, r, j, t, plan.devices[j], dp, pp, tp)
            for r in range(dp) for j in range(pp) for t in range(tp)]


def mesh_heading(plan: Plan) -> str:
    """``"mesh dp=2 x pp=2 x tp=1: 4 devices"``."""
    dp, pp, tp = mesh_shape(plan)
    return f"mesh dp={dp} x pp={pp} x tp={tp}: {dp * pp * tp} devices"


def split_modules(plan: Plan) -> dict[str, str]:
    """Per module with split parameters, how it is split (``"column"``, ``"row"``,
    ``"vocab"``; by its weight, else its first split parameter)."""
    found: dict[str, str] = {}
    for name, spec in sorted(plan.shard_specs.items(),
                             key=lambda item: not item[0].endswith(".weight")):
        module = name.rpartition(".")[0]
        found.setdefault(module, SPLIT_NAMES.get(spec.kind, spec.kind))
    return found


def layer_splits(plan: Plan) -> dict[str, str]:
    """Per layer of a tensor-parallel plan, its split modules and their kinds
    (``"attn.c_attn: column, attn.c_proj: row"``; just the kind when the layer is the split
    module), or ``"replicated"`` when every rank holds all of it; empty without tensor
    parallelism."""
    if mesh_shape(plan)[2] == 1:
        return {}
    modules = split_modules(plan)
    out = {}
    for layer in plan.layers:
        inside = [(m, kind) for m, kind in modules.items()
                  if m == layer or m.startswith(layer + ".")]
        parts = [f"{m.removeprefix(layer + '.')}: {kind}" if m != layer else kind
                 for m, kind in inside]
        out[layer] = ", ".join(parts) if parts else "replicated"
    return out


def stage_devices(plan: Plan, j: int) -> str:
    """Where pipeline position ``j`` runs: ``"cpu"`` alone, else its devices by number,
    ``"devices 0+1, 4+5 (cpu; tp=2 in each of 2 replicas)"``."""
    dp, pp, tp = mesh_shape(plan)
    position = j % pp
    if dp * tp == 1:
        return plan.devices[position]
    rows = [r for r in device_rows(plan) if r.stage == position]
    groups = ["+".join(str(r.index) for r in rows if r.replica == k) for k in range(dp)]
    how = ([f"tp={tp}"] if tp > 1 else []) + ([f"{dp} replicas"] if dp > 1 else [])
    return f"devices {', '.join(groups)} ({plan.devices[position]}; {', '.join(how)})"


def short_splits(summary: str) -> str:
    """A layer's split summary (:func:`layer_splits`) for a box: ``"tp: replicated"``, or
    its split modules two a line (``"attn.c_attn column, attn.c_proj row"``)."""
    if summary == "replicated":
        return "tp: replicated"
    parts = [f"{m} {kind}" if kind else f"{m} split" for m, _, kind in
             (p.partition(": ") for p in summary.split(", "))]
    return "\n".join(", ".join(parts[k:k + 2]) for k in range(0, len(parts), 2))
