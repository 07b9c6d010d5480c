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
from partitioner.cost.precision_cost import precision_workload
from partitioner.errors import (
    BalanceError,
    ChunksError,
    MemoryLimitError,
    MeshError,
    PartitionError,
    PrecisionError,
    ScheduleError,
    StageCountError,
    StrategyError,
    TensorParallelError,
)
from partitioner.planning.auto import LOCAL_RUNTIME, records, search
from partitioner.planning.calibrated import calibrated
from partitioner.planning.given_mesh import (
    auto_best_space,
    compared,
    mesh_refusal,
    unfit_mesh_message,
)
from partitioner.planning.llama_plan import first_fitting, workload_variants
from partitioner.planning.manual import boundaries_from_balance, boundaries_from_split_points
from partitioner.planning.predict import Config, Prediction, predict, replayed
from partitioner.planning.records import to_record
from partitioner.planning.reserve import MEMORY_RESERVE, describe_reserve, usable_memory
from partitioner.planning.simulate import predict_step
from partitioner.planning.space import SearchSpace, space_of
from partitioner.planning.tp_rules import ShardPlan, resolve_shardings
from partitioner.plans.explain import explain
from partitioner.plans.fingerprint import fingerprint
from partitioner.plans.plan import Mesh, Plan, PlannerInputs, Stage
from partitioner.plans.signature import describe
from partitioner.plans.spec import Spec
from partitioner.request import PlanRequest
from partitioner.runtime.checkpointing import EXCEPT_LAST, SELECTIVE
from partitioner.runtime.schedule_registry import GPIPE, schedule_kind

__all__ = ["pipeline_plan", "auto_plan", "given_mesh_plan", "plan_from", "plan_request", "record",
           "default_virtual", "VIRTUAL_CHOICES", "tensor_parallel_plan", "shardable_degrees",
           "shardable_plans",
           "candidate_plan", "one_device_record"]

VIRTUAL_CHOICES = (4, 3, 2)
"""Model chunks per device ``schedule="interleaved"`` tries, most first, when not given."""


def plan_request(analysis: Analysis, request: PlanRequest, *,
                 tp_degrees: Sequence[int] | None = None,
                 groups: Sequence[Sequence[Any]] | None = None) -> Plan:
    """The plan for an analysed model: the split ``request`` fixes, or the planner's.

    Without costs (no example inputs) the split must be fixed (``balance=`` or
    ``split_points=``) and the plan carries no predictions. ``tp_degrees`` limits the
    tensor-parallel degrees ``"auto"`` may choose (:func:`shardable_degrees`). ``groups``
    (one list of devices per stage, one device per tensor-parallel rank; ``request`` names
    each group's first) costs a fixed pipeline's stages split over their groups.

    Raises:
        StageCountError: more devices than layers.
        PartitionError: a subclass, when no plan fits or the fixed split is malformed.
    """
    names = analysis.layer_names
    n_stages = request.n_devices
    if n_stages > len(names) and request.devices and not _fewer_stages(analysis, request):
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
    _check_virtual(request, len(names), cuts is not None)
    if analysis.workload is None:
        assert cuts is not None, "analysis without costs for a split the planner chooses"
        return _uncosted_plan(analysis, request, strategy, cuts)
    return _costed_plan(analysis, request, strategy, cuts, tp_degrees, groups)


def _costed_plan(analysis: Analysis, request: PlanRequest, strategy: str,
                 cuts: tuple[int, ...] | None, tp_degrees: Sequence[int] | None,
                 groups: Sequence[Sequence[Any]] | None = None) -> Plan:
    cluster = request.cluster or local_cluster(
        list(request.devices) if groups is None else [d for g in groups for d in g])
    assert analysis.workload is not None
    workload = calibrated(analysis, request, cluster,
                          precision_workload(analysis.workload, request.precision))
    limit = min(request.memory_limit) if request.memory_limit else None
    method = analysis.captured.method
    reserve = request.memory_reserve
    if cuts is None and request.strategy == "auto":
        if request.schedule is not None and cluster.is_local:
            _check_local_schedule(request.schedule)
        pipeline_only = _precision_limits(request, cluster)
        space = SearchSpace.of_request(request, tp_degrees)
        where: dict[str, Any] = dict(capacity=limit, capture=method, reserve=reserve)
        mesh = request.mesh
        if mesh is None and pipeline_only:
            space = space.fixing(pp=pipeline_only, tp=1)
        if mesh is not None and pipeline_only and (mesh.dp, mesh.tp) != (1, 1):
            raise PrecisionError(
                f"precision={request.precision!r} with mesh={mesh}: mixed "
                "precision runs on this machine's pipeline runtime only; pass a mesh "
                "with dp=1 and tp=1, or precision='fp32'")

        def plan_for(w: Workload, checkpoint: str | None) -> Plan:
            chosen = space.fixing(checkpoint=checkpoint)
            if mesh is None:
                return auto_plan(w, analysis.layer_names, cluster, chosen, **where)
            return given_mesh_plan(w, analysis.layer_names, cluster, mesh, chosen, **where)
        # A Llama model planned for a cluster: costed as such runs train it (llama_plan).
        plan = first_fitting(workload_variants(analysis, request, cluster, workload),
                             plan_for)
    else:
        if request.checkpoint == SELECTIVE:
            raise StrategyError("checkpoint='selective' is the Llama workload's recomputation, "
                                "which strategy='auto' plans; with a fixed split or strategy="
                                "'pipeline' pass 'always', 'except_last' or 'never'")
        schedule = request.schedule or GPIPE
        virtual = request.virtual_stages or default_virtual(schedule, cluster.size,
                                                            len(analysis.layer_names))
        chunks = request.chunks or (cluster.size if schedule_kind(schedule).grouped else 1)
        plan = pipeline_plan(workload, analysis.layer_names, cluster, strategy=strategy,
                             chunks=chunks, checkpoint=request.checkpoint or EXCEPT_LAST,
                             boundaries=cuts, capacity=limit, capture=method,
                             schedule=schedule, virtual=virtual, reserve=reserve,
                             tp=len(groups[0]) if groups else 1)
    return _check_host_memory(replace(plan, precision=request.precision), cluster)


def _precision_limits(request: PlanRequest, cluster: Cluster) -> int | None:
    """Mixed precision runs on this machine's pipeline runtime only (not its tensor-parallel
    or replica runtimes): ``"auto"`` then searches pipelines over every device (their count,
    else ``None``)."""
    if request.precision == "fp32" or not cluster.is_local:
        return None
    return cluster.size


def given_mesh_plan(workload: Workload, names: Sequence[str], cluster: Cluster, mesh: Mesh,
                    space: SearchSpace | None = None, *, capacity: float | None = None,
                    reserve: float = MEMORY_RESERVE, budget: float | None = 5.0,
                    capture: str = "fx", **fixed: Any) -> Plan:
    """The plan of exactly ``mesh`` (the rest still searched), with auto's best recorded
    beside it (``partitioner.planning.given_mesh``).

    Args:
        space: the other choices (``fixed`` is sugar for ``space.fixing(...)``); the
            micro-batches, checkpoint mode, schedules and virtual stages it fixes hold for
            the mesh only: auto's best searches them.
        capacity, reserve, budget, capture: as :func:`auto_plan`.

    Raises:
        MeshError: no configuration of the mesh exists for the model (or runs here).
    """
    space = space_of(space, fixed)
    where: dict[str, Any] = dict(capacity=capacity, reserve=reserve, budget=budget,
                                 capture=capture)
    why = mesh_refusal(workload, cluster, mesh, space)
    if why is not None:
        raise MeshError(why)
    free = auto_best_space(space)
    try:
        given = auto_plan(workload, names, cluster, space.fixing(dp=mesh.dp, tp=mesh.tp,
                                                                  pp=mesh.pp), **where)
    except MemoryLimitError as error:
        raise MemoryLimitError(unfit_mesh_message(mesh, str(error),
                                                  _best_or_none(workload, names, cluster,
                                                                free, where))) from error
    return compared(given, _best_or_none(workload, names, cluster, free, where), mesh)


def _best_or_none(workload: Workload, names: Sequence[str], cluster: Cluster,
                  space: SearchSpace, where: dict[str, Any]) -> Plan | None:
    """Auto's best plan, or ``None`` when nothing fits (the comparison then says so)."""
    try:
        return auto_plan(workload, names, cluster, space, **where)
    except PartitionError:
        return None


def shardable_degrees(analysis: Analysis, model: nn.Module, n_devices: int) -> tuple[int, ...]:
    """The tensor-parallel degrees (powers of two up to ``n_devices``) whose splits the
    model's dimensions divide by: what ``"auto"`` may choose on this machine (a degree the
    tensor-parallel pass refuses is not executable, and one at which it splits no parameter
    would run the whole model on every rank: ``nn.TransformerEncoderLayer`` captured for
    training, whose layers the pass finds no Megatron pair in)."""
    return tuple(shardable_plans(analysis, model, n_devices))


def shardable_plans(analysis: Analysis, model: nn.Module, n_devices: int
                    ) -> dict[int, ShardPlan]:
    """:func:`shardable_degrees` with the pass's sharding at each degree."""
    plans = {}
    t = 2
    while t <= n_devices:
        try:
            plan = resolve_shardings(analysis.captured.graph_module, model, t)
        except TensorParallelError:
            pass
        else:
            if plan.split():
                plans[t] = plan
        t *= 2
    return plans


def _fewer_stages(analysis: Analysis, request: PlanRequest) -> bool:
    """Whether ``"auto"`` may use fewer pipeline stages than devices here: tensor
    parallelism splits a layer, or replicas run (the search then keeps ``pp <= layers``)."""
    if request.strategy != "auto" or request.fixes_split or analysis.workload is None:
        return False
    return analysis.workload.max_tp != 1 or LOCAL_RUNTIME.data_parallel


def default_virtual(schedule: str, n_devices: int, n_layers: int) -> int:
    """Model chunks per device when ``virtual_stages=`` is not given: 1 for schedules
    without chunks, else the most of :data:`VIRTUAL_CHOICES` (4, 3, 2) that leaves every
    virtual stage a layer (``P * v <= layers``); 2 when none does (then refused by
    :func:`plan_request`, naming the fix).

    Example:
        >>> default_virtual("interleaved", 4, 10), default_virtual("gpipe", 4, 10)
        (2, 1)
    """
    if not schedule_kind(schedule).virtual:
        return 1
    return next((v for v in VIRTUAL_CHOICES if n_devices * v <= n_layers), 2)


def _check_virtual(request: PlanRequest, n_layers: int, fixed_split: bool) -> None:
    """Refuse virtual stages the layers cannot fill, or a fixed split with chunks."""
    schedule = request.schedule
    if schedule is None or not schedule_kind(schedule).virtual:
        return
    p = request.n_devices
    if fixed_split:
        raise BalanceError(f"balance= or split_points= gives one stage per device, but "
                           f"schedule={schedule!r} runs several model chunks per device; "
                           "drop balance=/split_points= and let the planner split, or use a "
                           "schedule without chunks such as 'gpipe'")
    if request.strategy == "auto":
        p = 2  # the search tries every pipeline depth; the shallowest with chunks is 2
    v = request.virtual_stages or default_virtual(schedule, p, n_layers)
    if p * v > n_layers:
        most = n_layers // p
        fix = (f"pass virtual_stages <= {most}" if most >= 2 else
               f"use fewer devices (at most {n_layers // 2}) or a schedule without chunks "
               "such as 'gpipe'")
        raise StageCountError(f"virtual_stages={v} on {p} devices makes {p * v} virtual "
                              f"stages but the model has only {n_layers} layers; {fix}")


def tensor_parallel_plan(analysis: Analysis, request: PlanRequest,
                         groups: Sequence[Sequence[Any]]) -> Plan:
    """``strategy="auto"`` for fixed device groups: ``tp`` = a group's size, a pipeline stage
    per group; the search chooses the micro-batches, checkpoint mode and split (with the
    schedules the one-process tensor-parallel pipeline runs).

    Raises:
        StageCountError: more groups than layers.
        ScheduleError: a schedule the tensor-parallel pipeline does not run.
        MemoryLimitError: nothing fits.
    """
    names = analysis.layer_names
    if len(groups) > len(names):
        raise StageCountError(f"{len(groups)} tensor-parallel groups (pipeline stages) but the "
                              f"model has only {len(names)} layers once its split layers are "
                              f"merged; pass at most {len(names) * len(groups[0])} devices")
    tp_schedules = LOCAL_RUNTIME.tp_schedules or LOCAL_RUNTIME.schedules
    if request.schedule is not None and request.schedule not in tp_schedules:
        raise ScheduleError(f"schedule={request.schedule!r} with tensor parallelism: the "
                            f"one-process tensor-parallel pipeline runs {list(tp_schedules)}; "
                            "pass one of those or omit schedule=")
    cluster = local_cluster([d for g in groups for d in g])
    workload = analysis.workload
    assert workload is not None, "tensor-parallel planning without example inputs"
    space = SearchSpace.of_request(request).fixing(schedules=tp_schedules, tp=len(groups[0]),
                                                    pp=len(groups), virtual=None)
    plan = auto_plan(workload, names, cluster, space,
                     capacity=min(request.memory_limit) if request.memory_limit else None,
                     capture=analysis.captured.method, reserve=request.memory_reserve,
                     devices=[str(g[0]) for g in groups])
    return _check_host_memory(plan, cluster)


def _check_local_schedule(schedule: str) -> None:
    """Refuse a schedule the one-process runtimes cannot run (auto would find nothing)."""
    if schedule not in LOCAL_RUNTIME.schedules:
        raise ScheduleError(f"schedule={schedule!r} is not executed by "
                            f"{LOCAL_RUNTIME.name}; use one of "
                            f"{list(LOCAL_RUNTIME.schedules)}, or plan for a cluster with "
                            "make_plan")


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
                request.chunks or 1, request.checkpoint or EXCEPT_LAST,
                request.schedule or GPIPE, analysis.captured.method,
                precision=request.precision)


def record(plan: Plan, model: nn.Module, analysis: Analysis, request: PlanRequest,
           asked_strategy: str, spec: Spec | None = None) -> Plan:
    """``plan`` with the fingerprint, planner inputs and per-stage send bytes (per
    micro-batch of one replica) filled in.

    The planner inputs include the example batch's input signature, so the plan can be
    applied again to a model that only ``torch.export`` captures without example inputs.
    """
    stages = plan.stages
    if analysis.boundaries is not None:
        # Per micro-batch of one replica: the batch is split over the replicas first.
        share = plan.chunks * (plan.mesh.dp if plan.mesh is not None else 1)
        cut, sends = 0, []
        for stage in stages:
            cut += len(stage.layers)
            sends.append(replace(stage, send_bytes=analysis.boundaries[cut] // share))
        stages = tuple(sends)
    inputs = PlannerInputs(asked_strategy, request.balance, request.split_points,
                           request.memory_limit, _describe(request.example_inputs),
                           spec.source if spec is not None else None,
                           describe(request.example_inputs, request.example_kwargs),
                           request.memory_reserve, request.mesh)
    return replace(plan, stages=stages, planner=inputs, fingerprint=fingerprint(model))


def _describe(example_inputs: Sequence[Any] | None) -> tuple[str, ...]:
    if example_inputs is None:
        return ()
    return tuple(f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
                 if hasattr(x, "dtype") and hasattr(x, "shape") else type(x).__name__
                 for x in example_inputs)


def _labels(cluster: Cluster, config: Config) -> tuple[str, ...]:
    if cluster.is_local:
        # One process: replica r runs on devices[r pp tp:(r + 1) pp tp], stage j of replica
        # 0 (what the plan's stages describe) on its j-th group of tp devices.
        return tuple(cluster.local[j * config.tp] for j in range(config.pp))
    stride = config.dp * config.tp  # rank = (stage * dp + replica) * tp + shard
    return tuple(f"{cluster.spec(j * stride).name}#{j * stride}" for j in range(config.pp))


def plan_from(prediction: Prediction, names: Sequence[str], cluster: Cluster, *,
              strategy: str, capture: str = "fx", candidates: tuple[dict, ...] = (),
              notes: tuple[str, ...] = (), devices: Sequence[str] | None = None,
              reserve: float | None = None) -> Plan:
    """The plan of one prediction: a stage per virtual stage (``pp * virtual`` of them,
    virtual stage ``k`` on the pipeline device the schedule's placement gives it), its layers
    in order.

    Args:
        prediction: the chosen configuration's prediction.
        names: the layers' names.
        cluster: the devices it was made for.
        strategy: recorded as ``Plan.strategy``.
        capture: how the model was captured.
        candidates: the records for ``Plan.candidates`` (default: this prediction's).
        notes: remarks for ``Plan.notes``.
        devices: the pipeline devices' names (default: this machine's, or ``"A100#8"``).
        reserve: the memory reserve the prediction's capacity left, recorded in the first
            candidate for ``Plan.explain()``.
    """
    c = prediction.config
    share = replayed(c.checkpoint, c.chunks) / c.chunks
    labels = tuple(devices) if devices is not None else _labels(cluster, c)
    stages = []
    for k, s in enumerate(prediction.stages):
        j = s.device  # the schedule's placement of k (partitioner.runtime.placement)
        # A device's memory is shared by its chunks: each reports its share of the peak.
        memory = prediction.memory[j].total * _share(prediction, k)
        stages.append(Stage(k, labels[j], tuple(names[s.first:s.last]),
                            s.forward + s.backward + share * s.replay, int(memory),
                            int(s.param_bytes)))
    own = candidates or (dict(to_record(prediction, cluster), rank=1, chosen=True),)
    if reserve is not None:
        own = ({**own[0], "memory_reserve": reserve}, *own[1:])
    return Plan(strategy, labels, tuple(stages), c.chunks, c.checkpoint, c.schedule, capture,
                prediction.step_time, prediction.bubble, notes, Mesh(c.dp, c.pp, c.tp),
                candidates=own, virtual_stages=c.virtual,
                optimizer_sharding=c.optimizer_sharding)


def _share(prediction: Prediction, k: int) -> float:
    """Virtual stage ``k``'s share of its device's memory (by parameters and activations)."""
    if prediction.config.virtual == 1:
        return 1.0
    device = prediction.stages[k].device
    mine = [s for s in prediction.stages if s.device == device]
    weight = [s.param_bytes + s.activation_bytes for s in mine]
    total = sum(weight)
    return weight[mine.index(prediction.stages[k])] / total if total > 0 else 1 / len(mine)


def pipeline_plan(workload: Workload, names: Sequence[str], cluster: Cluster, *,
                  strategy: str = "pipeline", chunks: int = 1, checkpoint: str = "except_last",
                  boundaries: Sequence[int] | None = None, capacity: float | None = None,
                  optimizer: str = "adam", capture: str = "fx", schedule: str = GPIPE,
                  virtual: int = 1, reserve: float = MEMORY_RESERVE, tp: int = 1) -> Plan:
    """A plan over every device with ``schedule``: the optimal split, or ``boundaries``.

    Args:
        capacity: bytes of each device (default: its memory); plans use ``1 - reserve``
            of it.
        virtual: model chunks per device (``schedule="interleaved"``).
        tp: each stage's layers split over ``tp`` consecutive devices (``cluster.size / tp``
            stages).

    Raises:
        MemoryLimitError: no split fits (only when the split is the planner's to choose).
        ConfigError: the counts do not suit the schedule (the message says how).
    """
    config = Config(1, tp, cluster.size // tp, chunks, schedule, virtual, checkpoint,
                    optimizer)
    memory = capacity if capacity is not None else cluster.spec(0).memory_bytes
    prediction = predict(workload, cluster, config, boundaries, usable_memory(memory, reserve))
    if prediction.reason:
        raise MemoryLimitError(prediction.reason)
    prediction = predict_step(prediction, cluster)  # the one predictor every display reads
    return plan_from(prediction, names, cluster, strategy=strategy, capture=capture,
                     notes=(*workload.notes, describe_reserve(memory, reserve)),
                     reserve=reserve)


def auto_plan(workload: Workload, names: Sequence[str], cluster: Cluster,
              space: SearchSpace | None = None, *, capacity: float | None = None,
              reserve: float = MEMORY_RESERVE, budget: float | None = 5.0,
              capture: str = "fx", devices: Sequence[str] | None = None,
              **fixed: Any) -> Plan:
    """The fastest fitting configuration :func:`partitioner.planning.auto.search` finds, as a plan.

    On this machine's devices only configurations the runtimes can execute are chosen.
    ``Plan.strategy`` says what was chosen: ``"pipeline"`` (``dp = tp = 1``),
    ``"tensor_parallel"`` (``tp > 1``, ``dp = 1``), ``"replicas"`` (``dp > 1`` here) or
    ``"hybrid"`` (``dp > 1`` on a cluster).

    Args:
        space: the choices fixed and searched (``partitioner.planning.space``); ``fixed``
            is sugar for ``space.fixing(...)``.
        capacity: bytes of each device (default: its memory); plans use ``1 - reserve``
            of it (``partitioner.planning.reserve``).
        budget: seconds of search (``None``: no limit).
        capture: how the model was captured (recorded in the plan).
        devices: the pipeline devices' names in the plan (default: the cluster's).
    """
    memory = capacity if capacity is not None else cluster.spec(0).memory_bytes
    result = search(workload, cluster, space_of(space, fixed), budget=budget,
                    capacity=usable_memory(memory, reserve))
    made = records(result, cluster)
    alone = one_device_record(workload, cluster, usable_memory(memory, reserve))
    if alone is not None:
        made[0]["search"]["one_device"] = alone
    why = next(line for line in explain(made).splitlines() if line.startswith("chosen:"))
    notes = (*workload.notes, describe_reserve(memory, reserve), why)
    return plan_from(result.best, names, cluster, strategy=_kind(result.best.config, cluster),
                     capture=capture, candidates=made, notes=notes, devices=devices,
                     reserve=reserve)


def _kind(c: Config, cluster: Cluster) -> str:
    if c.dp == 1:
        return "pipeline" if c.tp == 1 else "tensor_parallel"
    return "replicas" if cluster.is_local else "hybrid"


def candidate_plan(analysis: Analysis, request: PlanRequest, config: dict[str, Any]) -> Plan:
    """The plan of one recorded candidate (``Plan.candidates[i]["config"]``): its mesh,
    micro-batches, schedule, virtual stages and checkpoint mode fixed, the split optimal.

    What measured tuning builds (``partitioner.planning.tune``); the layer costs are the
    uncalibrated model's (a calibration is not repeated per candidate).

    Raises:
        PartitionError: a subclass, when the configuration no longer fits or runs here.
    """
    cluster = request.cluster or local_cluster(list(request.devices))
    assert analysis.workload is not None, "a candidate plan without costs"
    workload = precision_workload(analysis.workload, request.precision)
    limit = min(request.memory_limit) if request.memory_limit else None
    space = SearchSpace(dp=config["dp"], tp=config["tp"], pp=config["pp"],
                        chunks=config["chunks"], checkpoint=config["checkpoint"],
                        schedules=(config["schedule"],), virtual=config["virtual"])
    plan = auto_plan(workload, analysis.layer_names, cluster, space, capacity=limit,
                     capture=analysis.captured.method, reserve=request.memory_reserve)
    return replace(_check_host_memory(plan, cluster), precision=request.precision)


def one_device_record(workload: Workload, cluster: Cluster, capacity: float | None = None
                      ) -> dict[str, Any] | None:
    """The unpartitioned model on the cluster's first device, predicted (``None`` for a
    one-device cluster): what ``Plan.explain()`` compares the plan with, since a plan over
    several devices sharing one host can be slower than the model left whole."""
    if cluster.size < 2 or not cluster.is_local:
        return None
    one = local_cluster([cluster.local[0]])
    try:
        # The one predictor, as the plan's own step time (compared in explain()).
        prediction = predict_step(predict(workload, one, Config(), capacity=capacity), one)
    except PartitionError:
        return None
    return {"device": cluster.local[0], "step_time": prediction.step_time,
            "fits": prediction.fits}
