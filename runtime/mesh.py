"""The one device mesh: data-parallel replicas x pipeline stages x tensor-parallel shards.

A :class:`Mesh` is a value: three sizes, validated once. The same value is the plan's
``mesh`` (``partitioner.plans.plan``, the plan file's ``"mesh"``), the option callers pass
(``mesh=Mesh(dp=2, pp=4)``, ``partitioner.planning.options``) and the shape of a
multi-process run, whose process groups (``partitioner.runtime.distributed.mesh``) are
made from its rank lists. It imports nothing heavier than the errors, so reading a plan
file does not import torch.

Ranks are laid out with ``tp`` fastest, then ``dp``, then ``pp``::

    rank = (stage * dp + replica) * tp + shard

    pp=2, dp=2, tp=1          replica 0   replica 1
                  stage 0     rank 0      rank 1
                  stage 1     rank 2      rank 3

so, with consecutive ranks on a node, the chattiest axis (tensor parallel) stays inside a
node, data parallel next, and pipeline stages span nodes (Megatron-LM's order).

Example:
    >>> mesh = Mesh(dp=2, pp=2)
    >>> mesh.world_size, mesh.coords(3)
    (4, Coords(pp=1, dp=1, tp=0))
    >>> mesh.groups("dp"), mesh.groups("pp")
    (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    >>> Mesh.infer(8, pp=2, tp=2)
    Mesh(dp=2, pp=2, tp=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from partitioner.errors import MeshError

__all__ = ["AXES", "Coords", "Mesh", "check_axis"]

AXES = ("pp", "dp", "tp")
"""Mesh axes, outermost first: pipeline, data parallel, tensor parallel."""


@dataclass(frozen=True)
class Coords:
    """Where a rank sits in the mesh: its stage (``pp``), replica (``dp``) and shard (``tp``)."""

    pp: int
    dp: int
    tp: int

    @property
    def stage(self) -> int:
        """The pipeline stage ``j`` this rank runs."""
        return self.pp

    @property
    def replica(self) -> int:
        """Which data-parallel replica of its stage this rank is."""
        return self.dp

    @property
    def shard(self) -> int:
        """Which tensor-parallel shard of its stage replica this rank holds."""
        return self.tp


@dataclass(frozen=True, eq=False)
class Mesh:
    """The device mesh: ``dp`` replicas x ``pp`` pipeline stages x ``tp`` shards.

    Two meshes are equal when their sizes are (whatever alias built them).

    Raises:
        MeshError: a size is not an int >= 1.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        bad = [f"{axis}={getattr(self, axis)!r}" for axis in ("dp", "pp", "tp")
               if isinstance(getattr(self, axis), bool)
               or not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1]
        if bad:
            raise MeshError(f"mesh {', '.join(bad)}; every mesh axis is an int >= 1")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (self.dp, self.pp, self.tp) == (other.dp, other.pp, other.tp)

    def __hash__(self) -> int:
        return hash((self.dp, self.pp, self.tp))

    @classmethod
    def infer(cls, world_size: int, *, pp: int | None = None, dp: int | None = None,
              tp: int = 1) -> Self:
        """The mesh over ``world_size`` ranks with one of ``pp`` / ``dp`` left to fill the
        rest (``pp`` when neither is given).

        Raises:
            MeshError: if the sizes do not multiply to ``world_size``.
        """
        if pp is None and dp is None:
            dp = 1
        known = (pp or 1) * (dp or 1) * tp
        if world_size % known:
            raise MeshError(f"pp={pp}, dp={dp}, tp={tp} do not divide the world of "
                            f"{world_size} ranks; pick sizes whose product is {world_size}")
        rest = world_size // known
        mesh = cls(dp=dp if dp is not None else rest, pp=pp if pp is not None else rest,
                   tp=tp)
        if mesh.world_size != world_size:
            raise MeshError(f"pp={mesh.pp} x dp={mesh.dp} x tp={mesh.tp} = "
                            f"{mesh.world_size} ranks, but the world has {world_size}; "
                            f"launch {mesh.world_size} processes or change the sizes")
        return mesh

    @property
    def world_size(self) -> int:
        """Devices (ranks) the mesh needs."""
        return self.pp * self.dp * self.tp

    def size(self, axis: str) -> int:
        """The size of ``axis`` (``"pp"``, ``"dp"`` or ``"tp"``)."""
        check_axis(axis)
        return int(getattr(self, axis))

    def coords(self, rank: int) -> Coords:
        """The coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        return Coords(rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp)

    def rank_of(self, coords: Coords) -> int:
        """The rank at ``coords``."""
        return (coords.pp * self.dp + coords.dp) * self.tp + coords.tp

    def line(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``rank`` except ``axis``, in order."""
        check_axis(axis)
        c = self.coords(rank)
        return tuple(self.rank_of(Coords(**{**c.__dict__, axis: k}))
                     for k in range(self.size(axis)))

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every line of the mesh along ``axis`` (the rank lists of its process groups)."""
        check_axis(axis)
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.line(axis, rank))
        return tuple(seen)


def check_axis(axis: str) -> None:
    """Refuse an axis name other than ``"pp"``, ``"dp"``, ``"tp"``.

    Raises:
        MeshError: naming the axis and the known ones.
    """
    if axis not in AXES:
        raise MeshError(f"unknown mesh axis {axis!r}; use one of {AXES}")
