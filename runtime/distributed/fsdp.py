"""Shard a stage's parameters, gradients and optimizer state over its replicas with FSDP2.

``partition_distributed(..., sharding="fsdp")`` hands each rank's stage module to torch's
own ``torch.distributed.fsdp.fully_shard`` on a one-dimensional ``DeviceMesh`` made from
the stage's data-parallel process group (the ranks holding the same stage and shard, see
``mesh``). At rest every parameter is a ``DTensor`` cut along its first dim over the
``dp`` replicas; the optimizer built over ``dpm.parameters()`` then holds exactly ``1/dp``
of the state, and so do the gradients after a step.

A pipeline stage may run several micro-batches per step, forwards and backwards
interleaved (1F1B); the second mode above is what torch's own pipelining does with FSDP
(``_PipelineStageBase.perform_reduce_grad`` in ``torch/distributed/pipelining/stage.py``).
:class:`FsdpGradients` stands where the pipeline's ``reducer`` stands (``arm``, ``finish``,
``close``).

Each layer is its own FSDP unit: ``passes/outline_layers.py`` (run by the front, which
hands the unit paths down) gives every layer of the stage graph a module call at the
layer's own path (a ``torch.export`` capture reads every parameter from the root and calls
no submodule), ``fully_shard`` is applied to each of those modules, then to the stage for
what is left (a weight tied between layers, loose
parameters). How long a layer stays gathered depends on the micro-batches a step runs:

* one micro-batch (``sync_each_backward``): as FSDP alone runs, ZeRO-3. A layer is gathered
  for its forward and freed after it, gathered again for its backward, and its gradients
  are reduce-scattered as soon as its backward is done; a rank never holds more than a few
  layers' whole parameters and gradients beside its shards.
* several: as torch's pipelining runs FSDP. Every backward of the step runs without
  gradient reduction, accumulating into the unsharded gradients, the layers stay gathered
  after their first forward, and :meth:`FsdpGradients.finish` reduce-scatters once the
  step's last backward is done: between the first forward and ``finish`` a rank holds its
  stage's whole parameters and gradients, as data parallelism does; what is sharded is what
  persists across steps (parameters, gradients, optimizer state). One reduce-scatter per
  step instead of one per micro-batch.

On gloo, FSDP's all-gather and reduce-scatter run in place (:class:`InPlaceAllGather`, one
broadcast per replica; :class:`InPlaceReduceScatter`, an all-reduce of FSDP's input
buffer): gloo's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` copy the whole
buffer, a transient the size of the stage's slice, and are slower (``docs/benchmarks.md``).

With tensor parallelism (``tp >= 2``) the stage is a tensor-parallel rank's graph, its
parameters that rank's slices as plain tensors; FSDP cuts each slice again over the ranks
holding the same stage and the same tp rank (the ``dp`` group), as torchtitan applies
``fully_shard`` over the dp axis after tensor parallelism. The graph's own tp collectives
run on the gathered slices, between FSDP's all-gather and its reduce-scatter. A checkpoint
records both cuts: :func:`tp_dp_device_mesh` is the stage's two-dimensional ``(tp, dp)``
mesh on which a slice's FSDP shard is one ``DTensor`` of the whole tensor (the tp cut
first, then FSDP's along dim 0 of the slice: placements ``[Shard(d), Shard(0)]``).

Example:
    >>> w = torch.nn.Parameter(torch.zeros(3, 4))
    >>> print(fsdp_problem([("w", w)], dp=4, stage=0))  # doctest: +ELLIPSIS
    sharding='fsdp' over dp=4 replicas: ... so replica 3 would hold nothing; pass dp <= 3, ...
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from partitioner.errors import CheckpointError, StrategyError
from partitioner.runtime.distributed.checkpoint_io import read_any, refuse_unexpected
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.stage import CALL_HOOKS_ATTR
from partitioner.runtime.tensor_parallel.shard_state import ShardState

__all__ = ["FsdpGradients", "shard_stage_fsdp", "release_replaced", "fsdp_problem",
           "axis_device_mesh", "load_whole_into_fsdp", "check_fsdp", "tp_dp_device_mesh",
           "cut_like", "cut_whole_entries", "local_shard", "InPlaceAllGather",
           "InPlaceReduceScatter"]


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


def check_fsdp(graphs: Sequence[nn.Module], held: nn.Module, *, dp: int, stage: int,
               virtual: int, split: bool, tied: bool) -> None:
    """Refuse what ``sharding="fsdp"`` cannot run (design 004, "Sharding by torch"), on
    every rank together: from every stage's graph, which all ranks know alike, and, when
    stages are split over tp ranks, from each rank's own slices (exchanged: a collective).

    Args:
        graphs: every stage's (unsplit) graph.
        held: this rank's stage (its tp slice when ``split``).
        dp: the data-parallel replicas.
        stage: this rank's stage.
        virtual: virtual stages per rank.
        split: whether stages are split over tp ranks.
        tied: whether weights are tied across stages.

    Raises:
        StrategyError: naming the values and a fix.
    """
    if dp < 2:
        raise StrategyError(f"sharding='fsdp' with dp={dp}: FSDP shards over the "
                            "data-parallel replicas, and one replica holds everything anyway; "
                            "pass dp=2 or more, or sharding=None")
    if virtual > 1:
        raise StrategyError(f"sharding='fsdp' with virtual_stages={virtual}: a rank's "
                            "virtual stages share one module, which FSDP cannot gather per "
                            "stage; pass virtual_stages=1, or sharding='optimizer'")
    if tied:
        raise StrategyError("sharding='fsdp' with weights tied across pipeline stages (a "
                            "shared embedding): their gradients are summed over whole "
                            "tensors, which FSDP has cut; pass sharding='optimizer', or a "
                            "split that keeps the tied layers in one stage")
    problems = [fsdp_problem(graph.named_parameters(), dp, j) for j, graph in enumerate(graphs)]
    if split:  # a slice has fewer rows than its tensor: every rank's own, exchanged
        import torch.distributed as dist

        mine = fsdp_problem(held.named_parameters(), dp, stage)
        everyone: list[str | None] = [None] * dist.get_world_size()
        with communicating("exchanging whether FSDP can cut every tensor-parallel slice"):
            dist.all_gather_object(everyone, mine)
        problems += everyone
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise StrategyError(problem)


def tp_dp_device_mesh(tp_group: Any, dp_group: Any, ranks: Sequence[Sequence[int]],
                      device_type: str) -> Any:
    """The two-dimensional ``(tp, dp)`` ``DeviceMesh`` of one stage over its existing
    groups: ``ranks[t][r]`` is the global rank of tp rank ``t`` in replica ``r``. A tensor
    cut by tensor parallelism along ``d`` and each slice again by FSDP along dim 0 is the
    ``DTensor`` of placements ``[Shard(d), Shard(0)]`` on it (cut left to right)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group([tp_group, dp_group], device_type, mesh=torch.tensor(ranks),
                                 mesh_dim_names=(f"tp_{tp_group.group_name}",
                                                 f"dp_{dp_group.group_name}"))


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


def shard_stage_fsdp(stage: nn.Module, device_mesh: Any, *, units: Sequence[str] = (),
                     sync_each_backward: bool = False) -> FsdpGradients:
    """Apply ``fully_shard`` to each layer of ``stage`` and to ``stage``, in place, and
    return its gradient reducer.

    Args:
        stage: the stage's graph module.
        device_mesh: the data-parallel group's one-dimensional mesh.
        units: the paths of its layers' modules, each called once per forward
            (``passes/outline_layers.py``, run by the front); ``()``: the stage is one unit.
        sync_each_backward: the step runs one backward (one micro-batch, no split
            backward): free each layer after its forward and reduce-scatter its gradients
            in its backward (see the module docstring).

    The stage's gradients are averaged by the pipeline's loss weights (``1/dp`` each), so
    FSDP's reduce-scatter sums them (divide factor 1, as a plain ``SUM``).
    """
    from torch.distributed.fsdp import fully_shard

    modules: list[Any] = []
    with communicating("sharding the stage's parameters over the data-parallel group (FSDP)"):
        for path in units:
            modules.append(fully_shard(stage.get_submodule(path), mesh=device_mesh,
                                       reshard_after_forward=sync_each_backward))
        modules.append(fully_shard(stage, mesh=device_mesh, reshard_after_forward=False))
    setattr(stage, CALL_HOOKS_ATTR, True)
    gloo = device_mesh.get_group().name() == "gloo"
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no PREMUL_SUM
        if gloo and module._get_fsdp_state()._fsdp_param_groups:
            module.set_custom_all_gather(InPlaceAllGather())
            module.set_custom_reduce_scatter(InPlaceReduceScatter())
    return FsdpGradients(modules[-1], units=tuple(modules[:-1]),
                         sync_each_backward=sync_each_backward)


def release_replaced(model: nn.Module, originals: Sequence[nn.Parameter],
                     stage: nn.Module) -> int:
    """Move to the meta device the parameters of ``model`` that FSDP replaced in ``stage``
    by their shards, so their storage is freed: the stage shared them with the model, and
    the model (which the caller and the runtime keep) would otherwise hold every one whole.
    The model's parameters then stand as a meta-built model's do (shapes only); the
    trained weights are the stage's (``dpm.state_dict()``, ``dpm.save``). A tensor tied in
    the model stays one tensor.

    Returns:
        How many tensors were released.
    """
    now = {id(p) for p in stage.parameters()}
    replaced = {id(p) for p in originals if id(p) not in now}
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                   requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
    return len(made)


class InPlaceAllGather:
    """FSDP's all-gather as one ``broadcast`` per replica into the output's rows: gloo's
    ``all_gather_into_tensor`` copies the whole buffer (a transient the size of the
    gathered stage), a broadcast does not. FSDP has copied each replica's shard into its
    row of the output already."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        import torch.distributed as dist

        rows = output_tensor.view(group.size(), -1)
        mine = rows[group.rank()]
        if input_tensor.data_ptr() != mine.data_ptr():
            mine.copy_(input_tensor)
        for r in range(group.size()):
            dist.broadcast(rows[r], src=dist.get_global_rank(group, r), group=group)


class InPlaceReduceScatter:
    """FSDP's reduce-scatter as an in-place ``all_reduce`` of its input and a copy of this
    replica's row: gloo's ``reduce_scatter_tensor`` copies the whole buffer, and is slower
    than its all-reduce (``docs/benchmarks.md``, "Data-parallel sharding")."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> None:
        import torch.distributed as dist

        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


class FsdpGradients:
    """Reduce-scatters an FSDP stage's gradients once per step, after its last backward.

    Args:
        module: the stage after ``fully_shard``.
        units: its layers' FSDP modules (``fully_shard`` before the stage's).
        sync_each_backward: the step runs one backward, which FSDP's own hooks reduce
            layer by layer (``finish`` has nothing left to do).
    """

    def __init__(self, module: Any, *, units: tuple[Any, ...] = (),
                 sync_each_backward: bool = False) -> None:
        self.module = module
        self.units = units
        self.sync_each_backward = sync_each_backward
        self._accumulate()

    def _accumulate(self) -> None:
        """Backwards keep adding into the unsharded gradients, parameters stay gathered;
        with ``sync_each_backward``, every backward is the last (FSDP alone)."""
        last = self.sync_each_backward
        self.module.set_is_last_backward(last)
        self.module.set_reshard_after_backward(last)
        self.module.set_requires_gradient_sync(last)

    def arm(self) -> None:
        """Nothing to start early: the reduce-scatter runs after the last backward."""

    def finish(self) -> None:
        """Reduce-scatter the step's gradients into the sharded ``.grad``; reshard.

        Raises:
            CommunicationError: if a collective fails (a replica died).
        """
        from torch.distributed.fsdp import fully_shard

        if self.sync_each_backward:
            return  # reduce-scattered layer by layer in the backward, resharded
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
        for module in (*self.units, self.module):
            module.reshard()

    def local_grads(self) -> list[torch.Tensor]:
        """This replica's shards of the gradients (each element on one replica)."""
        return [local_shard(p.grad) for p in self.module.parameters() if p.grad is not None]

    def close(self) -> None:
        """Nothing to remove: FSDP's hooks stay with the module."""


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (FSDP's), a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def cut_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (shaped like ``like``) as ``like`` holds it: FSDP's
    shard of it when ``like`` is a DTensor (no communication: every rank has ``tensor``),
    else ``tensor`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return tensor
    return distribute_tensor(tensor.to(like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def cut_whole_entries(state_dict: dict[str, Any], held: Mapping[str, torch.Tensor],
                      prefix: str) -> None:
    """Replace, in ``state_dict`` (a ``load_state_dict`` argument, keys ``prefix + key``),
    each whole tensor of an entry ``held`` as FSDP's DTensor by this replica's shard: FSDP
    loads DTensors only."""
    for key, like in held.items():
        value = state_dict.get(prefix + key)
        if isinstance(value, torch.Tensor) and not hasattr(value, "to_local"):
            state_dict[prefix + key] = cut_like(value, like)


def load_whole_into_fsdp(path: str | os.PathLike[str], stage: nn.Module, *,
                         optimizer: Any = None, model_keys: Collection[str] | None = None,
                         strict: bool = True, shards: ShardState | None = None
                         ) -> dict[str, Any]:
    """Fill an FSDP stage from a whole-model file (a ``state_dict()`` saved with
    ``torch.save`` or as safetensors, or a one-file checkpoint): every replica cuts its
    shard out of each whole tensor, one tensor at a time (of a stage split over tp ranks,
    ``shards``, out of its tp slice).

    Returns:
        The file's ``extra`` values (a checkpoint's step count).

    Raises:
        CheckpointError: a key of this stage missing or of another shape, with ``strict``
            keys the model lacks, or an optimizer state to restore (FSDP's is resumed from
            a checkpoint folder).
    """
    from torch.distributed.tensor import DTensor

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
            if shards is not None and key in shards.shardings:
                whole = shards.split({key: whole})[key]
            if tuple(whole.shape) != tuple(value.shape):
                raise CheckpointError(f"{path} holds {key} of shape {tuple(whole.shape)} but "
                                      f"this stage's is {tuple(value.shape)}")
            if isinstance(value, DTensor):
                value.to_local().copy_(local_shard(cut_like(whole, value)))
            else:
                value.copy_(whole)
    return dict(data.get("extra") or {})
