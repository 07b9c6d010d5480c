"""The one compile path: a model and a request in, its analysis and plan out.

``partition``, ``make_plan`` and the tensor-parallel front differ only in what they do
with the plan (run it here, return it); they make it here, the same way:

1. capture the model and run the analysis passes once (``partitioner.analysis.analyze``);
2. plan every strategy the request allows (``partitioner.planning.planner.plan_request``:
   the fixed split, or ``"auto"``'s search over pipelines, replicas and tensor
   parallelism);
3. when the plan splits layers over ``tp`` devices, merge the layers on the same capture so
   no stage boundary cuts a column/row pair (:func:`split_layers`: no callback into the
   capture, no second capture) and cut the merged layers into the chosen stages with the
   chosen micro-batches, schedule and checkpoint mode.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from partitioner.request import PlanRequest
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> request = PlanRequest.make(["cpu", "cpu"], "pipeline",
    ...                            example_inputs=(torch.randn(4, 8),))
    >>> analysis, plan, split = compile_model(model, request)
    >>> plan.balance, split is None
    ((2, 1), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from torch import nn

from partitioner.analysis import Analysis, analyze, regrouped
from partitioner.cost.cost import Workload
from partitioner.cost.machine import local_cluster
from partitioner.passes.group_layers import Layer
from partitioner.passes.tensor_parallel.shard_graph import merge_split_layers
from partitioner.planning.calibrated import calibrated, carried
from partitioner.planning.planner import (
    plan_request,
    record,
    shardable_plans,
    tensor_parallel_plan,
)
from partitioner.planning.records import built_first
from partitioner.planning.tp_costing import as_split
from partitioner.planning.tp_rules import ShardPlan, TensorParallelRules, resolve_shardings
from partitioner.plans.explain import explain
from partitioner.plans.plan import Mesh, Plan, PlannerInputs, ShardSpec
from partitioner.request import PlanRequest

__all__ = ["Compiled", "TensorParallelSplit", "compile_model", "split_layers", "split_plan",
           "tensor_parallel_record", "device_groups_of", "shard_specs", "SEARCH_NOTES",
           "as_built"]


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a tensor-parallel plan splits the model.

    Attributes:
        shard_plan: every parameter's split (``partitioner.planning.tp_rules``).
        layer_names: per merged layer, the original layers it holds (to merge a capture in
            the other train/eval mode alike).
        unmerged: the analysis before merging (what other candidates are planned from).
    """

    shard_plan: ShardPlan
    layer_names: list[list[str]]
    unmerged: Analysis


class Compiled(NamedTuple):
    """What :func:`compile_model` returns: the analysis the plan's layers come from (merged
    for a tensor-parallel plan), the recorded plan, and the split (``None`` unless the plan
    has ``tp > 1`` on this machine)."""

    analysis: Analysis
    plan: Plan
    split: TensorParallelSplit | None = None


def compile_model(model: nn.Module, request: PlanRequest) -> Compiled:
    """Capture ``model`` once and plan it as ``request`` asks.

    Raises:
        PartitionError: a subclass naming the offending value and a fix.
    """
    analysis = analyze(model, request.example_inputs, request.kwargs,
                       need_costs=not request.fixes_split)
    shardable = _shardable(model, analysis, request)
    searched, asked = analysis, request
    if shardable and analysis.workload is not None:
        # Ranked by what the pass splits (``tp_costing``), not by every weight halved; timed
        # here (not in the search) so that the layers merged for a tensor-parallel pick
        # take what their layers measured (``calibrated.carried``).
        first = next(iter(shardable.values()))
        work = as_split(analysis.workload, first.split(), first.pairs)
        if request.precision == "fp32":
            cluster = request.cluster or local_cluster(list(request.devices))
            work = calibrated(analysis, request, cluster, work)
            asked = request.with_changes(calibrate=False)
        searched = replace(analysis, workload=work, costs=list(work.layers))
    made = record(plan_request(searched, asked,
                               tp_degrees=None if shardable is None else tuple(shardable)),
                  model, analysis, request, request.strategy)
    if (made.mesh or Mesh()).tp == 1 or not _local(request):
        return Compiled(analysis, made)
    return split_plan(model, analysis, request, made, searched.workload)


def _local(request: PlanRequest) -> bool:
    return bool(request.devices) and (request.cluster is None or request.cluster.is_local)


def _shardable(model: nn.Module, analysis: Analysis, request: PlanRequest
               ) -> dict[int, ShardPlan] | None:
    """The tensor-parallel degrees ``"auto"`` may choose on this machine, with the pass's
    sharding at each (``None``: any degree)."""
    if request.strategy != "auto" or request.fixes_split or not _local(request):
        return None
    # A forward that updates buffers (counters) runs once per call in the pipeline
    # runtime; the tensor-parallel one does not write them back: keep auto off it.
    if analysis.captured.writes:
        return {}
    return shardable_plans(analysis, model, request.n_devices)


def split_layers(analysis: Analysis, model: nn.Module, tp: int,
                 rules: TensorParallelRules | None = None
                 ) -> tuple[Analysis, TensorParallelSplit]:
    """The splits for ``tp`` devices, and ``analysis`` with its layers merged so that no
    stage boundary cuts a column/row pair (costed again on the same capture, as the pass
    splits them: ``tp_costing.as_split``).

    Raises:
        TensorParallelError: the model's dimensions do not divide by ``tp``, or the rules
            do not fit it.
    """
    gm = analysis.captured.graph_module
    shard_plan = resolve_shardings(gm, model, tp, rules)
    assert shard_plan.choice is not None, "resolve_shardings records the pass's choice"
    merged = merge_split_layers(gm, analysis.layers, shard_plan.choice.propagation)
    names = _merged_names(analysis.layers, merged)
    regroup = regrouped(analysis, merged)
    if regroup.workload is not None:
        work = as_split(regroup.workload, shard_plan.split(), shard_plan.pairs, names)
        regroup = replace(regroup, workload=work, costs=list(work.layers))
    return regroup, TensorParallelSplit(shard_plan, names, analysis)


SEARCH_NOTES = ("chosen:", "tuned:")
"""The prefixes of the search's and tuning's notes: a plan rebuilt from a candidate keeps
them from the plan that chose it, once (the stages cut for a tensor-parallel pick lost
tuning's; tuning replaces both with its own)."""


def as_built(searched: Plan, built: Plan, notes: Sequence[str]) -> Plan:
    """``built``, the plan cut for the configuration ``searched`` chose, holding the
    search's candidates behind its own record (:func:`~partitioner.planning.records.
    built_first`: with ``ranked_step_time``, what the search ranked it by), ``notes``, and
    the search's and tuning's notes (:data:`SEARCH_NOTES`) told again from those records:
    the plan built may predict another step time, and run under another label (one
    micro-batch's GPipe is 1F1B)."""
    records = searched.candidates
    if records and built.candidates:
        own = built.candidates[0]
        records = built_first(records, 0, own, tuple(k for k in records[0] if k not in own))
    told = {line.split(":")[0] + ":": line for line in explain(records).splitlines()
            if line.startswith(SEARCH_NOTES)} if records else {}
    kept = (told.get(n.split(":")[0] + ":", n) for n in searched.notes
            if n.startswith(SEARCH_NOTES))
    return replace(built, candidates=records, notes=(*notes, *kept))


def device_groups_of(request: PlanRequest, mesh: Mesh) -> list[list[Any]]:
    """The first replica's devices, one group of ``tp`` per pipeline stage."""
    devices = list(request.devices)[:mesh.pp * mesh.tp]
    return [devices[k:k + mesh.tp] for k in range(0, len(devices), mesh.tp)]


def split_plan(model: nn.Module, analysis: Analysis, request: PlanRequest, plan: Plan,
               scaled: Workload | None = None) -> Compiled:
    """A plan with ``tp > 1`` chosen for this machine, its stages cut from the merged layers
    (the micro-batches, checkpoint mode and schedule it chose kept), its shard specs filled
    in, the search's candidates kept for ``explain()`` behind the record of the plan built
    (:func:`~partitioner.planning.records.built_first`: with ``ranked_step_time``, what the
    search ranked it by). ``scaled``: the workload the search ranked, whose calibration the
    merged layers take (:func:`~partitioner.planning.calibrated.carried`)."""
    mesh = plan.mesh or Mesh()
    merged, split = split_layers(analysis, model, mesh.tp)
    groups = device_groups_of(request, mesh)
    if scaled is not None and merged.workload is not None:
        work = carried(scaled, merged.workload, split.layer_names,
                       local_cluster([groups[0][0]]).spec(0))
        merged = replace(merged, workload=work, costs=list(work.layers))
    limit = min(request.memory_limit) if request.memory_limit else None
    stages = request.with_changes(
        devices=tuple(g[0] for g in groups), strategy="auto", chunks=plan.chunks,
        checkpoint=plan.checkpoint, schedule=plan.schedule, balance=None, split_points=None,
        memory_limit=None if limit is None else (limit,) * len(groups), mesh=None,
        cluster=None, virtual_stages=None, calibrate=False)
    made = tensor_parallel_record(tensor_parallel_plan(merged, stages, groups), model, merged,
                                  stages, split.shard_plan, groups)
    chosen = replace(as_built(plan, made, [n for n in made.notes
                                           if not n.startswith(SEARCH_NOTES)]),
                     planner=replace(made.planner or PlannerInputs(),
                                     strategy=request.strategy, mesh=request.mesh))
    if mesh.dp > 1:
        pp = chosen.mesh.pp if chosen.mesh else mesh.pp
        chosen = replace(chosen, mesh=Mesh(dp=mesh.dp, pp=pp, tp=mesh.tp))
    return Compiled(merged, chosen, split)


def tensor_parallel_record(plan: Plan, model: nn.Module, analysis: Analysis,
                           request: PlanRequest, shard_plan: ShardPlan,
                           groups: Sequence[Sequence[Any]]) -> Plan:
    """``plan`` recorded (``record``) with the tensor-parallel mesh, the shard spec of
    every split parameter and which devices each stage's ranks run on."""
    plan = record(plan, model, analysis, request, request.strategy)
    specs = shard_specs(shard_plan)
    notes = [*shard_plan.notes(),
             *(f"stage {j}: tensor-parallel devices {[str(d) for d in g]}"
               for j, g in enumerate(groups))]
    return replace(plan, mesh=Mesh(dp=1, pp=len(groups), tp=shard_plan.tp), shard_specs=specs,
                   notes=(*plan.notes, *notes))


def shard_specs(shard_plan: ShardPlan) -> dict[str, ShardSpec]:
    """The plan's shard spec of every split parameter."""
    return {name: ShardSpec(int(s.dim or 0), s.kind) for name, s in shard_plan.split().items()}


def _merged_names(layers: tuple[Layer, ...], merged: tuple[Layer, ...]) -> list[list[str]]:
    """The original layer names inside each merged layer."""
    of_node = {n: layer.name for layer in layers for n in layer.nodes}
    return [list(dict.fromkeys(of_node[n] for n in layer.nodes)) for layer in merged]
