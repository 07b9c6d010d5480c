"""From costs to a :class:`~partitioner.plans.plan.Plan`: the pipeline planner and ``"auto"``.

``partition()`` hands over the model's :class:`~partitioner.cost.cost.Workload`, its layer names
and the devices as a :class:`~partitioner.cost.devices.Cluster`; this module asks
``partitioner.planning.predict`` (one configuration: ``strategy="pipeline"``, ``balance=``,
``split_points=``) or ``partitioner.planning.auto`` (the search) and writes the answer as a plan:
one
stage per pipeline device with its layers, the predicted times and memory, the mesh, and the
candidates with their costs (``Plan.candidates``, read by ``Plan.explain()`` and
``partitioner.planning.simulate``).

Example:
    >>> from partitioner.cost.devices import Cluster
    >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
    >>> w = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=64)
    >>> names = [layer.name for layer in w.layers]
    >>> plan = auto_plan(w, names, Cluster.preset("A100-80GB"))
    >>> plan.strategy, plan.mesh.dp * plan.mesh.tp * plan.mesh.pp
    ('hybrid', 8)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from partitioner.analysis import Analysis
from partitioner.cost.cost import Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.machine import local_cluster
from partitioner.errors import ChunksError, MemoryLimitError, StageCountError
from partitioner.planning.auto import records, search
from partitioner.planning.manual import boundaries_from_balance, boundaries_from_split_points
from partitioner.planning.predict import Config, Prediction, predict, replayed
from partitioner.planning.records import to_record
from partitioner.planning.simulate import refine
from partitioner.plans.explain import explain
from partitioner.plans.fingerprint import fingerprint
from partitioner.plans.plan import Mesh, Plan, PlannerInputs, Stage
from partitioner.plans.signature import describe
from partitioner.plans.spec import Spec
from partitioner.request import PlanRequest
from partitioner.runtime.checkpointing import EXCEPT_LAST
from partitioner.runtime.schedule_registry import GPIPE

__all__ = ["pipeline_plan", "auto_plan", "plan_from", "plan_request", "record"]


def plan_request(analysis: Analysis, request: PlanRequest) -> Plan:
    """The plan for an analysed model: the split ``request`` fixes, or the planner's.

    Without costs (no example inputs) the split must be fixed (``balance=`` or
    ``split_points=``) and the plan carries no predictions.

    Raises:
        StageCountError: more devices than layers.
        PartitionError: a subclass, when no plan fits or the fixed split is malformed.
    """
    names = analysis.layer_names
    n_stages = request.n_devices
    if n_stages > len(names) and request.devices:
        raise StageCountError(f"{n_stages} devices but the model has only {len(names)} layers "
                              f"({names[:8]}{' ...' if len(names) > 8 else ''}); pass at most "
                              f"{len(names)} devices")
    cuts: tuple[int, ...] | None = None
    strategy = "pipeline"
    if request.balance is not None:
        cuts = boundaries_from_balance(request.balance, len(names), n_stages)
        strategy = "balance"
    elif request.split_points is not None:
        cuts = boundaries_from_split_points(request.split_points, names)
        strategy = "split_points"
    batch = analysis.workload.batch if analysis.workload is not None else None
    if request.chunks is not None and batch is not None and request.chunks > batch:
        raise ChunksError(f"chunks={request.chunks} but the example batch has {batch} samples; "
                          f"pass chunks <= {batch} (each micro-batch needs at least one sample)")
    if analysis.workload is None:
        assert cuts is not None, "analysis without costs for a split the planner chooses"
        return _uncosted_plan(analysis, request, strategy, cuts)
    return _costed_plan(analysis, request, strategy, cuts)


def _costed_plan(analysis: Analysis, request: PlanRequest, strategy: str,
                 cuts: tuple[int, ...] | None) -> Plan:
    from partitioner.cost.measure import calibrate_layers
    cluster = request.cluster or local_cluster(list(request.devices))
    workload = analysis.workload
    assert workload is not None
    if request.calibrate:
        layers = calibrate_layers(analysis.captured.graph_module, analysis.layers,
                                  workload.layers, analysis.inputs or [], cluster.spec(0),
                                  workload.batch)
        workload = replace(workload, layers=tuple(layers))
    capacity = min(request.memory_limit) if request.memory_limit else None
    method = analysis.captured.method
    if cuts is None and request.strategy == "auto":
        plan = auto_plan(workload, analysis.layer_names, cluster, chunks=request.chunks,
                         checkpoint=request.checkpoint, capacity=capacity, capture=method)
    else:
        plan = pipeline_plan(workload, analysis.layer_names, cluster, strategy=strategy,
                             chunks=request.chunks or 1,
                             checkpoint=request.checkpoint or EXCEPT_LAST, boundaries=cuts,
                             capacity=capacity, capture=method)
    return _check_host_memory(plan, cluster)


def _check_host_memory(plan: Plan, cluster: Cluster) -> Plan:
    """Note (and warn) when stages on ``"cpu"`` devices need more than the machine has.

    Each ``"cpu"`` device may use all of the machine's memory (``memory_limit=`` lowers
    that), but its stages share it: a plan whose stages together need more would run out
    of memory here, though it is a valid plan for a machine per stage.
    """
    on_host = [s for s in plan.stages
               if str(s.device).startswith("cpu") and s.predicted_memory is not None]
    if len(on_host) < 2 or not cluster.is_local:
        return plan
    total = sum(int(s.predicted_memory or 0) for s in on_host)
    machine = cluster.spec(0).memory_bytes
    if total <= machine:
        return plan
    note = (f"the {len(on_host)} 'cpu' stages share this machine's {machine / 2**30:.1f} GiB "
            f"but need {total / 2**30:.1f} GiB together: this plan runs out of memory here "
            f"(pass memory_limit={int(machine // len(on_host))} to plan within the machine)")
    warnings.warn(note, UserWarning, stacklevel=5)
    return replace(plan, notes=(*plan.notes, note))


def _uncosted_plan(analysis: Analysis, request: PlanRequest, strategy: str,
                   cuts: Sequence[int]) -> Plan:
    """A plan without predictions (the split is fixed and no example inputs were given)."""
    names = analysis.layer_names
    stages = [Stage(j, str(device), tuple(names[cuts[j]:cuts[j + 1]]))
              for j, device in enumerate(request.devices)]
    return Plan(strategy, tuple(str(d) for d in request.devices), tuple(stages),
                request.chunks or 1, request.checkpoint or EXCEPT_LAST, GPIPE,
                analysis.captured.method)


def record(plan: Plan, model: nn.Module, analysis: Analysis, request: PlanRequest,
           asked_strategy: str, spec: Spec | None = None) -> Plan:
    """``plan`` with the fingerprint, planner inputs and per-stage send bytes filled in.

    The planner inputs include the example batch's input signature, so the plan can be
    applied again to a model that only ``torch.export`` captures without example inputs.
    """
    stages = plan.stages
    if analysis.boundaries is not None:
        cut, sends = 0, []
        for stage in stages:
            cut += len(stage.layers)
            sends.append(replace(stage, send_bytes=analysis.boundaries[cut] // plan.chunks))
        stages = tuple(sends)
    inputs = PlannerInputs(asked_strategy, request.balance, request.split_points,
                           request.memory_limit, _describe(request.example_inputs),
                           spec.source if spec is not None else None,
                           describe(request.example_inputs, request.example_kwargs))
    return replace(plan, stages=stages, planner=inputs, fingerprint=fingerprint(model))


def _describe(example_inputs: Sequence[Any] | None) -> tuple[str, ...]:
    if example_inputs is None:
        return ()
    return tuple(f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
                 if hasattr(x, "dtype") and hasattr(x, "shape") else type(x).__name__
                 for x in example_inputs)


def _labels(cluster: Cluster, config: Config) -> tuple[str, ...]:
    if cluster.is_local and config.dp == config.tp == 1:
        return tuple(cluster.local[:config.pp])
    stride = config.dp * config.tp  # rank = (stage * dp + replica) * tp + shard
    return tuple(f"{cluster.spec(j * stride).name}#{j * stride}" for j in range(config.pp))


def plan_from(prediction: Prediction, names: Sequence[str], cluster: Cluster, *,
              strategy: str, capture: str = "fx", candidates: tuple[dict, ...] = (),
              notes: tuple[str, ...] = ()) -> Plan:
    """The plan of one prediction: a stage per pipeline device, its chunks' layers in order.

    Args:
        prediction: the chosen configuration's prediction.
        names: the layers' names.
        cluster: the devices it was made for.
        strategy: recorded as ``Plan.strategy``.
        capture: how the model was captured.
        candidates: the records for ``Plan.candidates`` (default: this prediction's).
        notes: remarks for ``Plan.notes``.
    """
    c = prediction.config
    share = replayed(c.checkpoint, c.chunks) / c.chunks
    labels = _labels(cluster, c)
    stages = []
    for j in range(c.pp):
        mine = prediction.stages[j::c.pp]
        layers = tuple(name for s in mine for name in names[s.first:s.last])
        time = sum(s.forward + s.backward + share * s.replay for s in mine)
        stages.append(Stage(j, labels[j], layers, time, int(prediction.memory[j].total),
                            int(sum(s.param_bytes for s in mine))))
    own = candidates or (dict(to_record(prediction, cluster), rank=1, chosen=True),)
    return Plan(strategy, labels, tuple(stages), c.chunks, c.checkpoint, c.schedule, capture,
                prediction.step_time, prediction.bubble, notes, Mesh(c.dp, c.pp, c.tp),
                candidates=own)


def pipeline_plan(workload: Workload, names: Sequence[str], cluster: Cluster, *,
                  strategy: str = "pipeline", chunks: int = 1, checkpoint: str = "except_last",
                  boundaries: Sequence[int] | None = None, capacity: float | None = None,
                  optimizer: str = "adam", capture: str = "fx") -> Plan:
    """A GPipe plan over every device: the optimal split, or ``boundaries`` as given.

    Raises:
        MemoryLimitError: no split fits (only when the split is the planner's to choose).
    """
    config = Config(1, 1, cluster.size, chunks, GPIPE, 1, checkpoint, optimizer)
    prediction = predict(workload, cluster, config, boundaries, capacity)
    if prediction.reason:
        raise MemoryLimitError(prediction.reason)
    if cluster.is_local and cluster.spec(0).shared_speedup:
        prediction = refine(prediction, cluster)
    return plan_from(prediction, names, cluster, strategy=strategy, capture=capture,
                     notes=workload.notes)


def auto_plan(workload: Workload, names: Sequence[str], cluster: Cluster, *,
              chunks: int | None = None, checkpoint: str | None = None,
              capacity: float | None = None, optimizer: str = "adam",
              budget: float | None = 5.0, capture: str = "fx") -> Plan:
    """The fastest fitting configuration :func:`partitioner.planning.auto.search` finds, as a plan.

    On this machine's devices only configurations the runtime can execute are chosen.
    ``Plan.strategy`` says what was chosen: ``"pipeline"`` (``dp = tp = 1``) or ``"hybrid"``.
    """
    result = search(workload, cluster, chunks=chunks, checkpoint=checkpoint,
                    optimizer=optimizer, budget=budget, capacity=capacity)
    made = records(result, cluster)
    why = explain(made).splitlines()[-1]
    notes = (*workload.notes, why)
    c = result.best.config
    kind = "pipeline" if c.dp == c.tp == 1 else "hybrid"
    return plan_from(result.best, names, cluster, strategy=kind, capture=capture,
                     candidates=made, notes=notes)
