"""From an analysed model and its plan to the module the user holds, in one process.

:func:`build_pipeline` gives a :class:`~partitioner.runtime.module.PartitionedModule` (a
stage per device); :func:`build_tensor_parallel` a
:class:`~partitioner.runtime.tensor_parallel.module.TensorParallelModule` (a stage per group
of devices, each stage's graph rewritten once per rank); :func:`build_replicas` a
:class:`~partitioner.runtime.replicas.ReplicatedModule` (``mesh.dp`` data-parallel replicas,
each a copy of the model on its own group of devices). They hand the runtime a factory
that gives the stage graphs of either train/eval mode, captured again on first use when the
capture baked the mode in (``torch.export``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.analysis import Analysis, build_stage_graphs, output_rows, recapture
from partitioner.errors import DeviceError, PrecisionError, StrategyError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads, fusion_threshold
from partitioner.passes.place_graph import place_graph
from partitioner.passes.private_rng import route_module_randomness
from partitioner.passes.tensor_parallel.sequence_parallel import (
    sequence_parallel as apply_sequence_parallel,
)
from partitioner.passes.tensor_parallel.shard_graph import shard_graph
from partitioner.planning.tp_rules import ShardPlan
from partitioner.plans.plan import Plan
from partitioner.plans.plan_precision import check_master_weights
from partitioner.request import PlanRequest
from partitioner.runtime.checkpointing import checkpoint_stop
from partitioner.runtime.materialize import MaterializerFactory
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.replica_copy import GraphReplica
from partitioner.runtime.replicas import ReplicatedModule
from partitioner.runtime.tensor_parallel.module import ShardStore, Source, TensorParallelModule
from partitioner.runtime.tensor_parallel.sharding import Sharding
from partitioner.runtime.tensor_parallel.stage import TensorParallelStage

__all__ = ["build_pipeline", "build_replicas", "build_tensor_parallel", "TensorParallelSetup",
           "first_names", "attr_shardings"]


def build_pipeline(model: nn.Module, analysis: Analysis, plan: Plan,
                   request: PlanRequest, materializer: MaterializerFactory | None = None
                   ) -> PartitionedModule:
    """The one-process pipeline module running ``plan`` on ``request.devices``, in the
    plan's schedule over its virtual stages, in its precision (a meta-built model's stages
    materialized on their devices by ``materializer``)."""
    check_master_weights(model, plan.precision)
    cache = {analysis.training: _local_stage_graphs(analysis, plan, materializer)}

    def stage_factory(training: bool) -> list[fx.GraphModule]:
        if training not in cache:
            fresh = recapture(model, analysis, training, request.example_inputs,
                              request.kwargs)
            cache[training] = _local_stage_graphs(fresh, plan, materializer)
        return cache[training]

    captured = analysis.captured
    pm = PartitionedModule(model, plan, stage_factory, list(request.devices), plan.chunks,
                           plan.checkpoint, bind=captured.placeholder_values,
                           restructure=captured.restructure, schedule=plan.schedule,
                           virtual=getattr(plan, "virtual_stages", 1),
                           precision=plan.precision, loss_scale=request.loss_scale,
                           output_rows=output_rows(analysis))
    # What partitioner.viz draws: the captured graph, its shapes and layers.
    pm.analysis = analysis  # type: ignore[assignment]
    return pm


#: Given the training flag, the stage graphs of one replica (built once per mode).
GraphFactory = Callable[[bool], list[fx.GraphModule]]


def build_replicas(model: nn.Module, analysis: Analysis, plan: Plan, request: PlanRequest,
                   setup: TensorParallelSetup | None = None) -> ReplicatedModule:
    """The one-process module running ``plan`` with ``plan.mesh.dp`` replicas.

    ``request.devices`` holds ``dp`` groups of ``pp x tp`` consecutive devices: replica
    ``r`` runs on ``devices[r * pp * tp:(r + 1) * pp * tp]``, stage ``j`` on the group's
    ``j``-th device (with tensor parallelism, on its ``j``-th ``tp`` devices, one per rank).
    Replica 0 is the model itself (its parameters are what an optimizer steps); the others
    are deep copies whose graphs are copies of replica 0's, sharing the copy's tensors. A
    replica with one stage and one micro-batch runs its graph directly on its worker; any
    other is a one-process pipeline (``plan.chunks``, ``plan.checkpoint``), or a
    tensor-parallel module when ``mesh.tp > 1``.

    Args:
        model: the model (replica 0).
        analysis: the captured model the plan was made for.
        plan: the plan; ``plan.mesh`` says ``dp x pp x tp``.
        request: the request (its devices, and example inputs for capturing again).
        setup: with ``mesh.tp > 1``, the tensor-parallel planning (its analysis and shard
            plan are used; its devices are replaced by each replica's).

    Raises:
        DeviceError: the devices are not ``dp x pp x tp``.
        StrategyError: ``mesh.tp > 1`` without ``setup``.
    """
    mesh = plan.mesh
    assert mesh is not None  # Plan.__post_init__ sets it
    if plan.precision != "fp32":
        raise PrecisionError(f"the plan's precision={plan.precision!r} with dp={mesh.dp} "
                             "replicas: one-process replicas compute in fp32; use a pipeline "
                             "plan (dp = tp = 1) or partition_distributed for mixed precision")
    width = mesh.pp * mesh.tp
    devices = [torch.device(d) for d in request.devices]
    if len(devices) != mesh.dp * width:
        raise DeviceError(f"the plan's mesh dp={mesh.dp} x pp={mesh.pp} x tp={mesh.tp} needs "
                          f"{mesh.dp * width} devices but {len(devices)} were given; pass "
                          f"{mesh.dp * width} (replica r on devices[r*{width}:(r+1)*{width}])")
    groups = [devices[r * width:(r + 1) * width] for r in range(mesh.dp)]
    if mesh.tp > 1:
        if setup is None:
            raise StrategyError(f"the plan has mesh tp={mesh.tp} but no tensor-parallel setup "
                                "was given; pass setup= (partitioner.tensor_parallel."
                                "plan_tensor_parallel's result)")
        replicas = _tensor_parallel_replicas(model, setup, plan, groups, mesh.tp)
    else:
        replicas = _graph_replicas(model, analysis, plan, request, groups)
    module = ReplicatedModule(plan, replicas, [group[0] for group in groups],
                              check_call=analysis.captured.placeholder_values,
                              output_rows=output_rows(analysis))
    module.analysis = analysis  # type: ignore[assignment]
    return module


def _graph_replicas(model: nn.Module, analysis: Analysis, plan: Plan, request: PlanRequest,
                    groups: list[list[torch.device]]) -> list[nn.Module]:
    """One replica per device group: graphs called directly, or pipelines."""
    base = _mode_graphs(model, analysis, plan, request, groups[0])
    replicas = [_replica(model, base, analysis, plan, groups[0])]
    for group in groups[1:]:
        memo: dict[int, Any] = {}
        twin = copy.deepcopy(model, memo)
        if len(group) == 1:
            twin.to(group[0])
        graphs = _copied(base, memo, group, plan, groups[0])
        replicas.append(_replica(twin, graphs, analysis, plan, group))
    return replicas


def _tensor_parallel_replicas(model: nn.Module, setup: TensorParallelSetup, plan: Plan,
                              groups: list[list[torch.device]], tp: int) -> list[nn.Module]:
    """One tensor-parallel module per device group; replicas 1.. shard a copy of the model
    (the setup copied alike, so its captured graph holds the copy's tensors)."""
    replicas: list[nn.Module] = []
    for r, group in enumerate(groups):
        stages = [group[k:k + tp] for k in range(0, len(group), tp)]
        owner, own_setup = model, setup
        if r > 0:
            memo: dict[int, Any] = {}
            owner = copy.deepcopy(model, memo)
            own_setup = copy.deepcopy(setup, memo)
        replicas.append(build_tensor_parallel(
            owner, dataclasses.replace(own_setup, plan=plan, groups=stages)))
    return replicas


def _mode_graphs(model: nn.Module, analysis: Analysis, plan: Plan, request: PlanRequest,
                 group: list[torch.device]) -> GraphFactory:
    """Replica 0's stage graphs per train/eval mode, on ``group`` (captured again for the
    mode the analysis did not capture, on first use)."""
    cache: dict[bool, list[fx.GraphModule]] = {}

    def factory(training: bool) -> list[fx.GraphModule]:
        if training not in cache:
            current = analysis
            if training != analysis.training:
                current = recapture(model, analysis, training, request.example_inputs,
                                    request.kwargs)
            graphs = _local_stage_graphs(current, plan)
            for gm, device in zip(graphs, stage_devices(plan, group), strict=True):
                place_graph(gm, device)
            cache[training] = graphs
        return cache[training]
    return factory


def stage_devices(plan: Plan, group: list[torch.device]) -> list[torch.device]:
    """Per stage of ``plan`` (virtual stages too), its device in a replica's ``group``."""
    return [group[j] for j in plan.placement]


def _copied(base: GraphFactory, memo: dict[int, Any], group: list[torch.device],
            plan: Plan, base_group: list[torch.device]) -> GraphFactory:
    """A replica's stage graphs: copies of ``base``'s whose tensors and submodules are the
    model copy's (``memo``, from deep-copying the model), moved to ``group``."""
    cache: dict[bool, list[fx.GraphModule]] = {}

    def factory(training: bool) -> list[fx.GraphModule]:
        if training not in cache:
            graphs = copy.deepcopy(base(training), dict(memo))
            for gm, device, origin in zip(graphs, stage_devices(plan, group),
                                          stage_devices(plan, base_group), strict=True):
                place_graph(gm, device, origin)  # arguments naming replica 0's device too
            cache[training] = graphs
        return cache[training]
    return factory


def _replica(module: nn.Module, graphs: GraphFactory, analysis: Analysis, plan: Plan,
             group: list[torch.device]) -> nn.Module:
    """One replica: its graph called directly, or a pipeline when the plan has several
    stages, micro-batches or checkpointing."""
    captured = analysis.captured
    if len(group) == 1 and plan.chunks == 1 and checkpoint_stop(plan.checkpoint, 1) == 0:
        return GraphReplica(module, lambda training: graphs(training)[0],
                            captured.placeholder_values, captured.restructure)
    return PartitionedModule(module, plan, graphs, group, plan.chunks, plan.checkpoint,
                             bind=captured.placeholder_values, restructure=captured.restructure,
                             schedule=plan.schedule, virtual=plan.virtual_stages,
                             output_rows=output_rows(analysis))


def _local_stage_graphs(analysis: Analysis, plan: Plan,
                        materializer: MaterializerFactory | None = None
                        ) -> list[fx.GraphModule]:
    """Stage graphs for the one-process runtime: Linear weight gradients added in place
    where that pays (``passes/fuse_weight_grads.py``: small micro-batches make the separate
    gradient tensor and its accumulation a large share of a large Linear's backward, and a
    split backward queues them; with one micro-batch a step the fusion only costs)."""
    graphs = build_stage_graphs(analysis, plan, materializer)
    for graph, stage in zip(graphs, plan.stages):
        device_type = torch.device(stage.device).type
        fuse_weight_grads(graph, fusion_threshold(plan.chunks, plan.schedule, device_type))
        route_module_randomness(graph)
    return graphs


@dataclass(frozen=True)
class TensorParallelSetup:
    """What planning decided for a tensor-parallel run, before any runtime is built.

    Attributes:
        analysis: the captured model, its layers merged so no stage boundary cuts a
            Megatron region.
        plan: the plan (mesh, stages, shard specs of the split parameters).
        shard_plan: the sharding of every parameter (``partitioner.planning.tp_rules``).
        groups: per stage, one device per tensor-parallel rank.
        layer_names: per merged layer, the original layer names it holds.
        request: the request it was planned from (example inputs for a re-capture).
    """

    analysis: Analysis
    plan: Plan
    shard_plan: ShardPlan
    groups: list[list[torch.device]]
    layer_names: list[list[str]]
    request: PlanRequest


def build_tensor_parallel(model: nn.Module, setup: TensorParallelSetup, *,
                          sequence_parallel: bool | None = None) -> TensorParallelModule:
    """The one-process module running ``setup.plan``: a thread per tensor-parallel rank
    (with ``sequence_parallel``, default the plan's ``sequence_parallel``, each rank graph's
    replicated region on sequence shards:
    ``partitioner.passes.tensor_parallel.sequence_parallel``)."""
    analysis, plan, shard_plan = setup.analysis, setup.plan, setup.shard_plan
    if sequence_parallel is None:
        sequence_parallel = plan.sequence_parallel
    groups = setup.groups
    store = ShardStore(shard_plan.shardings)
    ids = first_names(model)

    def stage_factory(training: bool) -> list[TensorParallelStage]:
        current = analysis
        if training != analysis.training:
            current = recapture(model, analysis, training, setup.request.example_inputs,
                                setup.request.kwargs, merged=setup.layer_names)
        stages = []
        for j, gm in enumerate(build_stage_graphs(current, plan)):
            shardings = attr_shardings(gm, ids, shard_plan.shardings)
            ranks = [shard_graph(gm, shardings, r, check=r == 0,
                                 make_tensor=store.factory(r, groups[j][r], ids)).graph_module
                     for r in range(len(groups[j]))]
            # The stage graph names its plan device in its arguments; each rank, its own.
            origin = torch.device(plan.stages[j].device)
            for rank, device in zip(ranks, groups[j], strict=True):
                place_graph(rank, device, origin)
            for rank in ranks:
                if sequence_parallel:
                    apply_sequence_parallel(rank, gm, len(ranks))
                route_module_randomness(rank)
            stages.append(TensorParallelStage(ranks, groups[j]))
        return stages

    stages = stage_factory(analysis.training)
    sources, unused = _sources(model, store, stages)
    captured = analysis.captured
    return TensorParallelModule(plan, stages, analysis.training, stage_factory,
                                shard_plan.shardings, sources, unused, plan.chunks,
                                plan.checkpoint, bind=captured.placeholder_values,
                                restructure=captured.restructure, schedule=plan.schedule,
                                output_rows=output_rows(analysis),
                                originals={key: tensor for key, tensor
                                           in model.state_dict(keep_vars=True).items()
                                           if key in sources})


def first_names(model: nn.Module) -> dict[int, str]:
    """The first state-dict name of every tensor of ``model``, by tensor id."""
    names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def attr_shardings(gm: fx.GraphModule, ids: dict[int, str],
                    shardings: dict[str, Sharding]) -> dict[str, Sharding]:
    """The shardings by ``gm``'s own attribute paths (stage graphs keep the model's)."""
    out = {}
    for path, tensor in [*gm.named_parameters(remove_duplicate=False),
                         *gm.named_buffers(remove_duplicate=False)]:
        name = ids.get(id(tensor))
        if name is not None and name in shardings and shardings[name].is_split:
            out[path] = shardings[name]
    return out


def _sources(model: nn.Module, store: ShardStore, stages: list[TensorParallelStage]
             ) -> tuple[dict[str, Source], dict[str, torch.Tensor]]:
    """Where each original state-dict entry lives (stage, path in rank 0's graph)."""
    where: dict[int, Source] = {}
    for j, stage in enumerate(stages):
        rank0 = stage.ranks[0]
        for path, tensor in [*rank0.named_parameters(remove_duplicate=False),
                             *rank0.named_buffers(remove_duplicate=False)]:
            where.setdefault(id(tensor), (j, path))
    sources: dict[str, Source] = {}
    unused: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        made = store.made(tensor, 0)
        if made is not None and id(made) in where:
            sources[key] = where[id(made)]
        else:
            unused[key] = tensor
    return sources, unused
