"""Shard a stage's parameters, gradients and optimizer state over its replicas with FSDP2.

``partition_distributed(..., sharding="fsdp")`` hands each rank's stage module to torch's
own ``torch.distributed.fsdp.fully_shard`` on a one-dimensional ``DeviceMesh`` made from
the stage's data-parallel process group (the ranks holding the same stage and shard, see
``mesh``). At rest every parameter is a ``DTensor`` cut along its first dim over the
``dp`` replicas; the optimizer built over ``dpm.parameters()`` then holds exactly ``1/dp``
of the state, and so do the gradients after a step.

A pipeline stage runs several micro-batches per step, forwards and backwards interleaved
(1F1B). As torch's own pipelining does with FSDP (``_PipelineStageBase.perform_reduce_grad``
in ``torch/distributed/pipelining/stage.py``), every backward of the step runs without
gradient reduction, accumulating into the unsharded gradients, and :meth:`FsdpGradients.finish`
runs FSDP's post-backward once the step's last backward is done: one reduce-scatter of
each gradient, then the parameters are resharded. :class:`FsdpGradients` stands where the
pipeline's ``reducer`` stands (``arm``, ``finish``, ``close``).

Between the first forward and ``finish`` a rank holds its stage's whole parameters and
gradients, as data parallelism does; what is sharded is what persists across steps
(parameters, gradients, optimizer state). The stage is one FSDP unit: its graph calls no
submodules whose hooks could gather layer by layer (``docs/design/004-distributed.md``).

Example:
    >>> w = torch.nn.Parameter(torch.zeros(3, 4))
    >>> print(fsdp_problem([("w", w)], dp=4, stage=0))  # doctest: +ELLIPSIS
    sharding='fsdp' over dp=4 replicas: ... so replica 3 would hold nothing; pass dp <= 3, ...
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from partitioner.errors import CheckpointError
from partitioner.runtime.distributed.checkpoint_io import read_any, refuse_unexpected
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.stage import CALL_HOOKS_ATTR

__all__ = ["FsdpGradients", "shard_stage_fsdp", "fsdp_problem", "axis_device_mesh",
           "load_whole_into_fsdp"]


def fsdp_problem(named: Iterable[tuple[str, nn.Parameter]], dp: int, stage: int) -> str | None:
    """Why FSDP cannot shard a stage holding ``named`` over ``dp`` replicas, else ``None``.

    FSDP2 cuts each parameter into ``dp`` chunks of ``ceil(rows / dp)`` rows along dim 0:
    when no parameter has enough rows, the last replicas hold nothing at all (a model too
    small for the mesh).
    """
    params = [(name, p) for name, p in named if p.requires_grad]
    if dp < 2 or not params:
        return None
    name, widest = max(params, key=lambda item: item[1].shape[0] if item[1].dim() else 1)
    rows = widest.shape[0] if widest.dim() else 1
    empty = [r for r in range(dp) if r * math.ceil(rows / dp) >= rows]
    if not empty:
        return None
    return (f"sharding='fsdp' over dp={dp} replicas: FSDP cuts each parameter along its "
            f"first dim, and stage {stage}'s largest first dim is {rows} ({name}, shape "
            f"{tuple(widest.shape)}), so replica {empty[0]} would hold nothing; pass dp <= "
            f"{_most_replicas(rows)}, or sharding='optimizer' or None")


def _most_replicas(rows: int) -> int:
    """The most replicas that each get some of ``rows`` rows cut into equal chunks."""
    return max(d for d in range(1, rows + 1) if (d - 1) * math.ceil(rows / d) < rows)


def axis_device_mesh(group: Any, ranks: Sequence[int], device_type: str, axis: str) -> Any:
    """A one-dimensional ``DeviceMesh`` over an existing process group of a mesh axis, its
    dim named ``<axis>_<group name>``: meshes of equal ranks and names compare equal, and
    DTensor's caches would hand a later run (a model partitioned again in this process) one
    whose group was destroyed."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type, mesh=list(ranks),
                                 mesh_dim_names=(f"{axis}_{group.group_name}",))


def shard_stage_fsdp(stage: nn.Module, device_mesh: Any) -> FsdpGradients:
    """Apply ``fully_shard`` to ``stage`` in place and return its gradient reducer.

    The stage's gradients are averaged by the pipeline's loss weights (``1/dp`` each), so
    FSDP's reduce-scatter sums them (divide factor 1, as a plain ``SUM``).
    """
    from torch.distributed.fsdp import fully_shard

    with communicating("sharding the stage's parameters over the data-parallel group (FSDP)"):
        fully_shard(stage, mesh=device_mesh, reshard_after_forward=False)
    setattr(stage, CALL_HOOKS_ATTR, True)
    module: Any = stage
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no PREMUL_SUM
    return FsdpGradients(module)


class FsdpGradients:
    """Reduce-scatters an FSDP stage's gradients once per step, after its last backward.

    Args:
        module: the stage after ``fully_shard``.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self._accumulate()

    def _accumulate(self) -> None:
        """Backwards keep adding into the unsharded gradients, parameters stay gathered."""
        self.module.set_is_last_backward(False)
        self.module.set_reshard_after_backward(False)
        self.module.set_requires_gradient_sync(False)

    def arm(self) -> None:
        """Nothing to start early: the reduce-scatter runs after the last backward."""

    def finish(self) -> None:
        """Reduce-scatter the step's gradients into the sharded ``.grad``; reshard.

        Raises:
            CommunicationError: if a collective fails (a replica died).
        """
        from torch.distributed.fsdp import fully_shard

        self.module.set_is_last_backward(True)
        self.module.set_reshard_after_backward(True)
        self.module.set_requires_gradient_sync(True)
        state: Any = fully_shard.state(self.module)  # type: ignore[attr-defined]
        with communicating("reduce-scatter of the gradients over the data-parallel group "
                           "(FSDP)"):
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        self._accumulate()

    def reshard(self) -> None:
        """Free the gathered parameters (after an evaluation's forwards)."""
        self.module.reshard()

    def local_grads(self) -> list[torch.Tensor]:
        """This replica's shards of the gradients (each element on one replica)."""
        return [_local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def close(self) -> None:
        """Nothing to remove: FSDP's hooks stay with the module."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def load_whole_into_fsdp(path: str | os.PathLike[str], stage: nn.Module, *,
                         optimizer: Any = None, model_keys: Collection[str] | None = None,
                         strict: bool = True) -> dict[str, Any]:
    """Fill an FSDP stage from a whole-model file (a ``state_dict()`` saved with
    ``torch.save`` or as safetensors, or a one-file checkpoint): every replica cuts its
    shard out of each whole tensor, one tensor at a time.

    Returns:
        The file's ``extra`` values (a checkpoint's step count).

    Raises:
        CheckpointError: a key of this stage missing or of another shape, with ``strict``
            keys the model lacks, or an optimizer state to restore (FSDP's is resumed from
            a checkpoint folder).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if optimizer is not None:
        raise CheckpointError(f"{path} is one file; with sharding='fsdp' the optimizer state "
                              "is resumed from a checkpoint folder (dpm.save(folder, "
                              "optimizer)); load the weights alone with dpm.load(path)")
    data = read_any(path)
    if strict and model_keys is not None:
        refuse_unexpected(path, data["model"], model_keys)
    own = stage.state_dict()
    missing = [k for k in own if k not in data["model"]]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} keys of this stage: "
                              f"{', '.join(missing[:8])}; it was saved from another model")
    with torch.no_grad():
        for key, value in own.items():
            whole = data["model"][key]
            if tuple(whole.shape) != tuple(value.shape):
                raise CheckpointError(f"{path} holds {key} of shape {tuple(whole.shape)} but "
                                      f"this stage's is {tuple(value.shape)}")
            if isinstance(value, DTensor):
                mine = distribute_tensor(whole.to(value.dtype), value.device_mesh,
                                         value.placements, src_data_rank=None)
                value.to_local().copy_(mine.to_local())
            else:
                value.copy_(whole)
    return dict(data.get("extra") or {})
