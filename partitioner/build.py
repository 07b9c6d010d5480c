"""From an analysed model and its plan to the module the user holds, in one process.

:func:`build_pipeline` gives a :class:`~partitioner.runtime.module.PartitionedModule` (a
stage per device); :func:`build_tensor_parallel` a
:class:`~partitioner.runtime.tensor_parallel.module.TensorParallelModule` (a stage per group
of devices, each stage's graph rewritten once per rank). Both hand the runtime a factory
that gives the stage graphs of either train/eval mode, captured again on first use when the
capture baked the mode in (``torch.export``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.analysis import Analysis, build_stage_graphs, recapture
from partitioner.errors import PartitionError, ScheduleError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads
from partitioner.passes.group_layers import Layer
from partitioner.passes.private_rng import route_module_randomness
from partitioner.passes.tensor_parallel.shard_graph import shard_graph
from partitioner.planning.tp_rules import ShardPlan
from partitioner.plans.plan import Plan
from partitioner.request import PlanRequest
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.schedule_registry import GPIPE, Runtime, runtime_problem
from partitioner.runtime.tensor_parallel.module import ShardStore, Source, TensorParallelModule
from partitioner.runtime.tensor_parallel.sharding import Sharding
from partitioner.runtime.tensor_parallel.stage import TensorParallelStage

__all__ = ["build_pipeline", "build_tensor_parallel", "TensorParallelSetup", "first_names",
           "attr_shardings"]


def build_pipeline(model: nn.Module, analysis: Analysis, plan: Plan,
                   request: PlanRequest) -> PartitionedModule:
    """The one-process pipeline module running ``plan`` on ``request.devices``.

    Raises:
        ScheduleError: a schedule (or virtual stages) this runtime does not execute.
    """
    _check_schedule(plan)
    cache = {analysis.training: _local_stage_graphs(analysis, plan)}

    def stage_factory(training: bool) -> list[fx.GraphModule]:
        if training not in cache:
            fresh = recapture(model, analysis, training, request.example_inputs,
                              request.kwargs)
            cache[training] = _local_stage_graphs(fresh, plan)
        return cache[training]

    captured = analysis.captured
    pm = PartitionedModule(model, plan, stage_factory, list(request.devices), plan.chunks,
                           plan.checkpoint, bind=captured.placeholder_values,
                           restructure=captured.restructure)
    # What partitioner.viz draws: the captured graph, its shapes and layers.
    pm.analysis = analysis  # type: ignore[assignment]
    return pm


def _check_schedule(plan: Plan) -> None:
    """Refuse a plan whose schedule ``PartitionedModule`` would not run as planned.

    ``PartitionedModule`` drives ``LocalPipeline`` with GPipe; until it takes the plan's
    schedule and virtual stages (issue #13), any other plan would run as GPipe, not as
    planned, so it is refused rather than silently changed.
    """
    problem = runtime_problem(plan.schedule, Runtime.ONE_PROCESS)
    takes = "schedule" in inspect.signature(PartitionedModule.__init__).parameters
    if problem is None and (takes or (plan.schedule == GPIPE and plan.virtual_stages == 1)):
        return
    raise ScheduleError(problem or f"schedule={plan.schedule!r} (virtual_stages="
                        f"{plan.virtual_stages}) is not run by the one-process pipeline "
                        "module yet; pass schedule='gpipe', or plan it with make_plan")


def _local_stage_graphs(analysis: Analysis, plan: Plan) -> list[fx.GraphModule]:
    """Stage graphs for the one-process runtime: Linear weight gradients added in place
    (``passes/fuse_weight_grads.py``; small micro-batches make the separate gradient tensor
    and its accumulation a large share of a Linear's backward)."""
    graphs = build_stage_graphs(analysis, plan)
    for graph in graphs:
        fuse_weight_grads(graph)
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


def build_tensor_parallel(model: nn.Module, setup: TensorParallelSetup) -> TensorParallelModule:
    """The one-process module running ``setup.plan``: a thread per tensor-parallel rank."""
    analysis, plan, shard_plan = setup.analysis, setup.plan, setup.shard_plan
    groups = setup.groups
    store = ShardStore(shard_plan.shardings)
    ids = first_names(model)

    def stage_factory(training: bool) -> list[TensorParallelStage]:
        current = analysis
        if training != analysis.training:
            current = recapture(model, analysis, training, setup.request.example_inputs,
                                setup.request.kwargs, regroup=_merged_like(setup.layer_names))
        stages = []
        for j, gm in enumerate(build_stage_graphs(current, plan)):
            shardings = attr_shardings(gm, ids, shard_plan.shardings)
            ranks = [shard_graph(gm, shardings, r, check=r == 0,
                                 make_tensor=store.factory(r, groups[j][r], ids)).graph_module
                     for r in range(len(groups[j]))]
            for rank in ranks:
                route_module_randomness(rank)
            stages.append(TensorParallelStage(ranks, groups[j]))
        return stages

    stages = stage_factory(analysis.training)
    sources, unused = _sources(model, store, stages)
    captured = analysis.captured
    return TensorParallelModule(plan, stages, analysis.training, stage_factory,
                                shard_plan.shardings, sources, unused, plan.chunks,
                                plan.checkpoint, bind=captured.placeholder_values,
                                restructure=captured.restructure)


def _merged_like(names: list[list[str]]) -> Any:
    """A regroup that merges a fresh capture's layers as ``names`` says."""
    def regroup(gm: fx.GraphModule, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
        by_name = {layer.name: layer for layer in layers}
        if sorted(by_name) != sorted(n for group in names for n in group):
            raise PartitionError("capturing the model in the other train/eval mode gave other "
                                 "layers; partition the model again in the mode you will run "
                                 "it in")
        return tuple(Layer(group[0], by_name[group[0]].path,
                           tuple(n for name in group for n in by_name[name].nodes))
                     for group in names)
    return regroup


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
