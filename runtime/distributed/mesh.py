"""Roles of the ranks of a multi-process run: the (pp, dp, tp) mesh and one group per axis.

A run over ``world_size`` processes is a mesh of shape ``(pp, dp, tp)``: ``pp`` pipeline
stages, each stage held by ``dp`` data-parallel replicas, each replica split into ``tp``
tensor-parallel shards. Every rank derives its *coordinates* (stage, replica, shard) from
its rank alone, and every axis has one process group per line of the mesh along it:

- the ``pp`` group of a rank: the ranks of its replica and shard, one per stage (P2P);
- the ``dp`` group: the ranks holding the same stage and shard (gradient all-reduce);
- the ``tp`` group: the shards of one stage replica (tensor-parallel collectives).

On gloo each ``pp`` line has a second group, :meth:`ProcessMesh.reverse_group`, for the
messages going to a lower rank: a gloo pair carrying large messages both ways at once
stalls (two 512 KiB sends crossing between two ranks arrived 3.4-3.6 ms after they were
posted, against 0.13-0.19 ms with one group per direction: ``docs/benchmarks.md``,
"Messages crossing on one gloo pair"), and a pipeline's ranks send to each other at
the same time whenever their stages end together.

Ranks are laid out with ``tp`` fastest, then ``dp``, then ``pp``::

    rank = (stage * dp + replica) * tp + shard

    pp=2, dp=2, tp=1          replica 0   replica 1
                  stage 0     rank 0      rank 1
                  stage 1     rank 2      rank 3

so, with consecutive ranks on a node, the chattiest axis (tensor parallel) stays inside a
node, data parallel next, and pipeline stages, which exchange only boundary activations,
span nodes (Megatron-LM's order).

:func:`init_distributed` starts ``torch.distributed`` from ``env://`` (what torchrun sets:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or ``tcp://``
and, on GPUs, binds the process to ``cuda:LOCAL_RANK``.

Example:
    >>> shape = MeshValue(dp=2, pp=2)
    >>> shape.coords(3)
    Coords(pp=1, dp=1, tp=0)
    >>> shape.groups("dp"), shape.groups("pp")
    (((0, 1), (2, 3)), ((0, 2), (1, 3)))
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import DistributedInitError, MeshError
from partitioner.runtime import device as accelerators
from partitioner.runtime.distributed.agreement import check_same_settings
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.rendezvous import rendezvous_store
from partitioner.runtime.mesh import AXES, Coords, check_axis
from partitioner.runtime.mesh import Mesh as MeshValue

__all__ = ["AXES", "Coords", "MeshShape", "MeshValue", "Mesh", "ProcessMesh", "DistInfo",
           "MeshError", "DistributedInitError", "init_distributed", "dist_info"]

DEFAULT_TIMEOUT = timedelta(minutes=30)


class MeshShape(MeshValue):
    """:class:`partitioner.runtime.mesh.Mesh` with the older positional order
    ``(pp, dp, tp)``: kept for callers that build it so; equal to the ``Mesh`` of the same
    sizes. New code passes a ``Mesh``.

    Example:
        >>> MeshShape(2, 1, 1) == MeshValue(dp=1, pp=2, tp=1)
        True
    """

    def __init__(self, pp: int = 1, dp: int = 1, tp: int = 1) -> None:
        super().__init__(dp=dp, pp=pp, tp=tp)


@dataclass(frozen=True)
class DistInfo:
    """What this process knows about the run once ``torch.distributed`` is up."""

    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def dist_info() -> DistInfo:
    """The :class:`DistInfo` of the running process group.

    Raises:
        DistributedInitError: if ``torch.distributed`` is not initialized.
    """
    if not dist.is_initialized():
        raise DistributedInitError("torch.distributed is not initialized; call "
                                   "init_distributed() or launch with torchrun")
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = accelerators.collective_device(backend)
    return DistInfo(backend, dist.get_rank(), dist.get_world_size(), local_rank, device)


def _env_int(name: str, given: int | None, init_method: str) -> int:
    if given is not None:
        return given
    value = os.environ.get(name)
    if value is None:
        raise DistributedInitError(
            f"{name} is not set and was not passed; launch with torchrun "
            "(python -m partitioner.launch --nproc-per-node N script.py), or pass rank= and "
            f"world_size= with init_method='tcp://HOST:PORT' (init_method={init_method!r})")
    try:
        return int(value)
    except ValueError as error:
        raise DistributedInitError(f"{name}={value!r} is not an integer") from error


def init_distributed(backend: str | None = None, init_method: str = "env://", *,
                     rank: int | None = None, world_size: int | None = None,
                     local_rank: int | None = None,
                     timeout: timedelta = DEFAULT_TIMEOUT) -> DistInfo:
    """Start ``torch.distributed`` for this process (a no-op if it is already started).

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default ``nccl`` when CUDA is available, else gloo.
        init_method: ``"env://"`` (torchrun's variables) or ``"tcp://HOST:PORT"``.
        rank: this process's rank; default ``$RANK``.
        world_size: the number of processes; default ``$WORLD_SIZE``.
        local_rank: this process's index on its node; default ``$LOCAL_RANK`` or 0. With
            NCCL the process is bound to ``cuda:local_rank``.
        timeout: how long a collective may wait before torch.distributed gives up (failures
            are detected sooner by ``partitioner.runtime.distributed.failure``'s watchdog).

    Returns:
        The :class:`DistInfo` of the process.

    Raises:
        DistributedInitError: a missing or malformed variable, an unknown backend, or
            ranks launched with different world sizes (checked before the process group
            starts, which would otherwise wait for the missing ranks until ``timeout``).

    Example:
        >>> info = init_distributed("gloo", "tcp://127.0.0.1:29500", rank=0,
        ...                         world_size=1)  # doctest: +SKIP
    """
    if dist.is_initialized():
        return dist_info()
    if not init_method.startswith(("env://", "tcp://", "file://")):
        raise DistributedInitError(f"init_method={init_method!r}; use 'env://', "
                                   "'tcp://HOST:PORT' or 'file:///path'")
    rank = _env_int("RANK", rank, init_method)
    world_size = _env_int("WORLD_SIZE", world_size, init_method)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = accelerators.check_backend(backend or accelerators.default_backend())
    if init_method.startswith("env://"):
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise DistributedInitError(f"{' and '.join(missing)} not set for init_method="
                                       "'env://'; launch with torchrun or set them")
    options: dict[str, Any] = {}
    bound = accelerators.rank_device(backend, local_rank)
    if bound is not None:
        # Bound before the group starts, so NCCL's communicators land on this device.
        options["device_id"] = bound
    store = rendezvous_store(init_method, rank, world_size, timeout)
    if store is None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout, **options)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **options)
    # We started the group, so we end it: torch warns (NCCL) or can abort in a background
    # thread's destructor (gloo) when a process exits with its group still up.
    atexit.register(_destroy)
    return dist_info()


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessMesh:
    """The mesh of a running process group: this rank's coordinates and its axis groups.

    Creating a mesh is collective: every rank of the world must create the same shape at the
    same point of its program, since each axis group is made by ``dist.new_group``. The
    ranks first compare their shapes through the store (a bounded wait), so ranks asking
    for different shapes fail at once instead of waiting in each other's groups.

    Args:
        shape: the mesh shape; its ``world_size`` must equal the process group's.
        timeout: collective timeout of the axis groups.

    Raises:
        MeshError: if the shape does not match the world.
        PlanMismatchError: on every rank, if the ranks asked for different shapes.
        CommunicationError: if a rank does not arrive, or creating a group fails.

    Example:
        >>> mesh = ProcessMesh(MeshValue(dp=2, pp=2))    # doctest: +SKIP
        >>> mesh.stage, mesh.replica, mesh.ranks("dp")  # on rank 3   # doctest: +SKIP
        (1, 1, (2, 3))
    """

    def __init__(self, shape: MeshValue, *, timeout: timedelta | None = None) -> None:
        info = dist_info()
        check_same_settings({"pp": shape.pp, "dp": shape.dp, "tp": shape.tp},
                            what="mesh shapes")
        if shape.world_size != info.world_size:
            raise MeshError(f"mesh pp={shape.pp} x dp={shape.dp} x tp={shape.tp} needs "
                            f"{shape.world_size} ranks but {info.world_size} were launched; "
                            f"launch {shape.world_size} processes or change the sizes")
        self.shape = shape
        self.rank = info.rank
        self.device = info.device
        self.backend = info.backend
        self.coords = shape.coords(self.rank)
        self._groups: dict[str, Any] = {}
        for axis in AXES:
            # Every rank creates every group, in the same order (new_group is collective).
            for ranks in shape.groups(axis):
                with communicating(f"creating the {axis} process group of ranks {ranks}"):
                    group = dist.new_group(list(ranks), timeout=timeout)
                if self.rank in ranks:
                    self._groups[axis] = group
        self._reverse: Any = None
        if shape.pp > 1 and not accelerators.batches_sends(self.backend):
            for ranks in shape.groups("pp"):
                with communicating(f"creating the second pp process group of ranks {ranks}"):
                    group = dist.new_group(list(ranks), timeout=timeout)
                if self.rank in ranks:
                    self._reverse = group
        self._device_mesh: Any = None

    @property
    def stage(self) -> int:
        """The pipeline stage this rank runs."""
        return self.coords.pp

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.coords.dp

    @property
    def shard(self) -> int:
        """This rank's tensor-parallel shard."""
        return self.coords.tp

    def group(self, axis: str) -> Any:
        """The process group of this rank along ``axis``."""
        check_axis(axis)
        return self._groups[axis]

    def reverse_group(self) -> Any:
        """The group of this rank's ``pp`` line carrying messages to a lower rank (gloo),
        or None where one group carries both ways (NCCL batches them, or ``pp == 1``)."""
        return self._reverse

    def ranks(self, axis: str) -> tuple[int, ...]:
        """The global ranks of this rank's group along ``axis``, in axis order."""
        return self.shape.line(axis, self.rank)

    def neighbour(self, axis: str, offset: int) -> int | None:
        """The rank ``offset`` steps along ``axis`` from this one, or None past the ends."""
        line = self.ranks(axis)
        k = line.index(self.rank) + offset
        return line[k] if 0 <= k < len(line) else None

    def to_device_mesh(self) -> Any:
        """This mesh as a ``torch.distributed.device_mesh.DeviceMesh`` over the same groups.

        For code that speaks DTensor (tensor parallel): the dims are named ``"pp"``, ``"dp"``
        and ``"tp"``, and each dim uses the group this mesh already made for that axis.
        """
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            layout = torch.arange(self.shape.world_size).reshape(
                self.shape.pp, self.shape.dp, self.shape.tp)
            self._device_mesh = DeviceMesh.from_group(
                [self._groups[a] for a in AXES], self.device.type, mesh=layout,
                mesh_dim_names=AXES)
        return self._device_mesh

    def release(self) -> None:
        """Destroy this rank's axis groups (the world's group stays up).

        Each ``dist.new_group`` keeps a gloo context with its own threads and sockets until
        it is destroyed: a process that partitions many models in turn would pile them up.
        """
        for group in {*self._groups.values(), self._reverse}:
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self._groups.clear()
        self._reverse = None
        self._device_mesh = None

    def __repr__(self) -> str:
        return (f"Mesh(pp={self.shape.pp}, dp={self.shape.dp}, tp={self.shape.tp}; rank "
                f"{self.rank}: stage {self.stage}, replica {self.replica}, shard {self.shard})")


Mesh = ProcessMesh
"""The process groups' older name (``Mesh(shape)``); the mesh *value* is
:class:`partitioner.runtime.mesh.Mesh` (``MeshValue`` here)."""
