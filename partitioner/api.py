"""``partition()``: validate, capture, run the passes, plan, and hand off to the runtime.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> x = torch.randn(4, 8)
    >>> pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2)
    >>> torch.allclose(pm(x), model(x))
    True
    >>> pm.plan.balance
    (2, 1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, overload

import torch
from torch import nn

from partitioner.analysis import Analysis
from partitioner.apply import check_runnable_spec, resolve_plan
from partitioner.build import (
    TensorParallelSetup,
    build_pipeline,
    build_replicas,
    build_tensor_parallel,
)
from partitioner.errors import (
    DeviceError,
    MeshError,
    ModelError,
    PrecisionError,
    StrategyError,
    TuneError,
)
from partitioner.planning.compile import (
    SEARCH_NOTES,
    TensorParallelSplit,
    compile_model,
    device_groups_of,
    split_plan,
)
from partitioner.planning.options import (
    Options,
    check_sequence_parallel,
    one_process_options,
    resolve_options,
)
from partitioner.planning.planner import candidate_plan, record
from partitioner.planning.tune import (
    CONFIRM_TRIALS,
    MIN_TIMED_SECONDS,
    REFINE,
    chosen_first,
    restore_state,
    run_trials,
    snapshot_state,
    time_training_steps,
    tune_count,
    tuned_records,
)
from partitioner.plans.explain import tuned_line
from partitioner.plans.plan import Mesh, Plan
from partitioner.plans.plan_precision import planned_precision
from partitioner.plans.spec import Spec
from partitioner.request import STRATEGIES, PlanRequest
from partitioner.runtime.host_memory import steady_host_memory
from partitioner.runtime.materialize import InitFn, MaterializerFactory, materializer_for
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.precision import check_precision
from partitioner.runtime.replicas import ReplicatedModule
from partitioner.runtime.tensor_parallel.module import TensorParallelModule
from partitioner.runtime.wrapper import ModelWrapper
from partitioner.tensor_parallel import partition_tensor_parallel

__all__ = ["partition", "make_plan", "route", "plan_record", "STRATEGIES"]


@overload
def partition(model: nn.Module, devices: Any, strategy: str | None = ..., *,
              example_inputs: tuple[Any, ...] | None = ...,
              example_kwargs: dict[str, Any] | None = ..., chunks: int | None = ...,
              checkpoint: str | None = ..., balance: Sequence[int] | None = ...,
              split_points: Sequence[str] | None = ...,
              memory_limit: float | Sequence[float] | None = ...,
              plan: str | Path | Plan | Spec | dict[str, Any] | None = ...,
              calibrate: bool | None = ...,
              tensor_parallel: None = ..., schedule: str | None = ...,
              virtual_stages: int | None = ...,
              memory_reserve: float | None = ..., precision: str | None = ...,
              loss_scale: float | str | None = ..., mesh: Mesh | None = ...,
              init_fn: InitFn | None = ..., seed: int = ..., tune: bool | int = ...,
              options: Options | None = ..., sequence_parallel: bool = ...
              ) -> PartitionedModule | TensorParallelModule | ReplicatedModule:
    ...


@overload
def partition(model: nn.Module, devices: Any, strategy: str | None = ..., *,
              example_inputs: tuple[Any, ...] | None = ...,
              example_kwargs: dict[str, Any] | None = ..., chunks: int | None = ...,
              checkpoint: str | None = ..., balance: Sequence[int] | None = ...,
              split_points: Sequence[str] | None = ...,
              memory_limit: float | Sequence[float] | None = ...,
              plan: None = ...,
              calibrate: bool | None = ...,
              tensor_parallel: int | Mapping[str, str], schedule: str | None = ...,
              virtual_stages: int | None = ...,
              memory_reserve: float | None = ..., precision: str | None = ...,
              loss_scale: float | str | None = ..., mesh: None = ...,
              init_fn: InitFn | None = ..., seed: int = ..., tune: bool | int = ...,
              options: Options | None = ..., sequence_parallel: bool = ...
              ) -> TensorParallelModule: ...


def partition(model: nn.Module, devices: Any, strategy: str | None = None, *,
              example_inputs: tuple[Any, ...] | None = None,
              example_kwargs: dict[str, Any] | None = None, chunks: int | None = None,
              checkpoint: str | None = None, balance: Sequence[int] | None = None,
              split_points: Sequence[str] | None = None,
              memory_limit: float | Sequence[float] | None = None,
              plan: str | Path | Plan | Spec | dict[str, Any] | None = None,
              calibrate: bool | None = None,
              tensor_parallel: int | Mapping[str, str] | None = None,
              schedule: str | None = None, virtual_stages: int | None = None,
              memory_reserve: float | None = None, precision: str | None = None,
              loss_scale: float | str | None = None, mesh: Mesh | None = None,
              init_fn: InitFn | None = None, seed: int = 0, tune: bool | int = False,
              options: Options | None = None, sequence_parallel: bool = False
              ) -> PartitionedModule | TensorParallelModule | ReplicatedModule:
    """Partition ``model`` into pipeline stages over ``devices``.

    Args:
        model: any ``nn.Module`` that ``torch.fx`` or ``torch.export`` can capture.
        devices: device strings, ``torch.device`` objects, a count, or a local
            :class:`~partitioner.cost.devices.Cluster`.
        strategy: ``"auto"`` (search data x tensor x pipeline parallelism, micro-batches,
            schedule and checkpoint mode, keeping what the one-process runtimes execute,
            ``partitioner.planning.auto``: the result may be a pipeline, a tensor-parallel
            module or replicas, whichever is predicted fastest) or ``"pipeline"`` (every
            device a stage).
        example_inputs: one batch of positional inputs; needed to cost the layers (so always,
            unless ``balance`` or ``split_points`` fixes the split) and for export capture.
        example_kwargs: keyword inputs of that batch.
        chunks: micro-batches per mini-batch (split along dim 0); ``"auto"`` chooses when
            omitted, otherwise 1.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's meaning);
            ``"auto"`` chooses when omitted, otherwise ``"except_last"``.
        balance: layers per stage, torchgpipe style; one entry per device.
        split_points: module names at which a new stage begins.
        memory_limit: bytes per device (one number for all, or one per device); defaults to
            each device's memory.
        plan: a saved :class:`Plan` (or its file) to apply exactly, after checking the model
            is the one it was made for; or a hand-written spec (file, dict or ``Spec``) to
            compile (``partitioner.apply``). ``devices`` may then be ``None``.
        calibrate: time every layer's forward and backward and the Adam step in a few
            training passes of the whole model on this machine (``partitioner.cost.
            layer_timing``) and scale the cost model to match (``True``, saying so on
            stderr). Default ``None``: do so when the devices are this machine's CPU,
            planned with its measured spec (not a pinned one or
            ``PARTITIONER_CPU_SPEC=reference``), the weights are real and a training step
            is predicted under a second (``partitioner.planning.calibrated``); ``False``:
            the cost model alone.

        tensor_parallel: split weight matrices too (Megatron-style): a degree ``n`` groups
            ``devices`` by ``n`` per pipeline stage and chooses the splits; a mapping of
            module globs to ``"colwise"``/``"rowwise"``/``"vocab"``/``"replicate"``
            overrides the choice (``devices`` is then one stage's list, or a list of them).
            See ``docs/design/005-tensor-parallel.md``. With ``strategy="auto"`` the degree
            (and rules) are kept and the rest is searched.
        schedule: the pipeline schedule, a registered name (``"gpipe"``, ``"1f1b"``,
            ``"interleaved"``, ...); ``"auto"`` then searches only it, ``"pipeline"`` plans
            it (default: ``"auto"`` searches all, ``"pipeline"`` runs GPipe).
        virtual_stages: model chunks per device for ``schedule="interleaved"`` (default:
            the most of 4, 3, 2 that leaves every chunk a layer; ``"auto"`` searches them).
        memory_reserve: the share of each device's memory (or of ``memory_limit``) plans
            leave unused, in ``[0, 1)``; default 0.10.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: every stage computes
            under autocast to it, the parameters (master weights), their gradients and the
            optimizer state stay fp32, the loss is computed in fp32; the plan records it and
            is costed at that precision (``partitioner.runtime.precision``). Runs on the
            pipeline runtime: ``"auto"`` then searches pipelines only, and
            ``tensor_parallel=`` is refused.
        loss_scale: fp16 only, and needed there: ``"dynamic"`` or a fixed float.
            ``pm.step`` scales the gradients by ``pm.scaler.scale``; step the optimizer with
            ``pm.scaler.step(optimizer)`` then ``pm.scaler.update()``.
        mesh: run exactly this :class:`~partitioner.plans.plan.Mesh` (``dp x pp x tp`` =
            the devices; with ``strategy="auto"`` the rest is still searched); see
            :func:`make_plan`.
        init_fn: for a model built on the meta device (``with torch.device("meta"):``, a
            pipeline only): ``init_fn(module)`` fills one module's own tensors as each
            stage is built on its device (default: the module's ``reset_parameters()``;
            ``partitioner.runtime.materialize``).
        seed: the base seed of a meta-built model's initialization (module ``name`` draws
            from a seed of ``(seed, name)``: the same values whatever the split).
        tune: measured tuning (``partitioner.planning.tune``): ``True`` builds 4 of the best-ranked
            candidates (``n``: that many; the best of each mesh first), times a few training steps
            of each on the example batch (forward, backward, Adam step; the model's weights are
            restored afterwards) and runs the measured fastest, or a better-ranked candidate
            measured within 10% of it (a tie the timing cannot break). ``plan.candidates``
            record the predicted and measured step times and ``plan.explain()`` prints both; a
            candidate that fails is skipped with its reason. Default ``False``: the cost
            model's choice.
        options: the same settings as one value, shared with :func:`make_plan` and
            ``partition_distributed`` (:class:`partitioner.Options`: ``strategy``,
            ``mesh``, ``schedule=Schedule(name, chunks, virtual_stages)``,
            ``precision=Precision(compute, loss_scale)``, ``checkpoint``, ``tune``,
            ``init_fn``, ``seed``, ``sequence_parallel``); the keywords above are sugar for
            it, and one setting given both ways with different values is refused
            (``OptionsError``).
        sequence_parallel: with ``tensor_parallel=`` (a degree of 2 or more, or rules),
            Megatron's sequence parallelism: the norms, residual adds and dropout between
            the column/row pairs run on each rank's share of the sequence (dim 1), a
            reduce-scatter and an all-gather in place of each all-reduce
            (``partitioner.passes.tensor_parallel.sequence_parallel``).

    Returns:
        A :class:`partitioner.runtime.module.PartitionedModule` (with ``tensor_parallel``, a
        :class:`partitioner.runtime.tensor_parallel.module.TensorParallelModule`); its ``.plan``
        says what was done
        (``pm.plan.explain()``: the candidates and why this one won).

    Raises:
        PartitionError: a subclass naming the offending value and a fix.
    """
    _check_model(model)
    opts = one_process_options(resolve_options(
        options, strategy=strategy, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
        virtual_stages=virtual_stages, precision=precision, loss_scale=loss_scale, mesh=mesh,
        init_fn=init_fn, seed=seed, tune=tune, sequence_parallel=sequence_parallel))
    opts.check_runnable("partition")
    strategy, mesh, checkpoint = opts.strategy or "auto", opts.whole_mesh, opts.checkpoint
    chunks, schedule, virtual_stages = (opts.schedule.chunks, opts.schedule.name,
                                        opts.schedule.virtual_stages)
    precision, loss_scale = opts.precision.compute, opts.precision.loss_scale
    init_fn, seed, tune = opts.init_fn, opts.seed, opts.tune
    sequence_parallel = opts.sequence_parallel
    count = tune_count(tune)
    check_precision("fp32" if precision is None else precision, loss_scale,
                    scaled=plan is None or precision is not None)
    _check_mesh_alone(mesh, plan=plan, tensor_parallel=tensor_parallel)
    _check_tune_alone(count, plan=plan, tensor_parallel=tensor_parallel)
    materializer = materializer_for(model, init_fn, seed)
    if materializer is not None and tensor_parallel is not None:
        raise StrategyError(_META_PIPELINE_ONLY.format(what="tensor_parallel= was given"))
    if tensor_parallel is not None:
        if isinstance(tensor_parallel, int):
            check_sequence_parallel(opts, tensor_parallel, "tensor_parallel")
        if precision not in (None, "fp32"):
            raise PrecisionError(f"precision={precision!r} with tensor_parallel=: the "
                                 "one-process tensor-parallel runtime computes in fp32; "
                                 "omit tensor_parallel= (pipelines run mixed precision) or "
                                 "use partition_distributed(..., tp=..., precision=...)")
        if plan is not None or calibrate is True:
            raise StrategyError(f"pass {'plan=' if plan is not None else 'calibrate=True'} or "
                                "tensor_parallel=, not both (tensor-parallel plans are made "
                                "from the uncalibrated cost model)")
        asked = PlanRequest.make(None, strategy, example_inputs=example_inputs,
                                 example_kwargs=example_kwargs, chunks=chunks,
                                 checkpoint=checkpoint, balance=balance,
                                 split_points=split_points, memory_limit=memory_limit,
                                 schedule=schedule, virtual_stages=virtual_stages,
                                 memory_reserve=memory_reserve)  # devices: per group
        return partition_tensor_parallel(model, devices, tensor_parallel, asked,
                                         sequence_parallel=sequence_parallel)
    if sequence_parallel:
        raise StrategyError("sequence_parallel=True splits the sequence between tensor-"
                            "parallel ranks; pass tensor_parallel=<degree> with it")
    if devices is None and plan is None:
        raise DeviceError("devices=None; pass the devices to partition over, e.g. "
                          "devices=['cpu', 'cpu'], or plan= a saved plan that names them")
    request = PlanRequest.make(devices, strategy, example_inputs=example_inputs,
                               example_kwargs=example_kwargs, chunks=chunks,
                               checkpoint=checkpoint, balance=balance,
                               split_points=split_points, memory_limit=memory_limit,
                               calibrate=calibrate, local=True, schedule=schedule,
                               virtual_stages=virtual_stages, memory_reserve=memory_reserve,
                               precision=precision, loss_scale=loss_scale, mesh=mesh)
    if plan is not None:
        resolved = resolve_plan(model, plan, request)
        check_runnable_spec(resolved)
        made = planned_precision(resolved.plan, precision)
        settled = resolved.request.with_changes(precision=made.precision,
                                                loss_scale=loss_scale)
        check_precision(made.precision, loss_scale)
        routed = route(model, resolved.analysis, made, settled, resolved.setup)
        return build(model, resolved.analysis, routed, settled, materializer)
    if materializer is not None and request.strategy == "auto" and request.mesh is None \
            and not request.fixes_split:
        # A meta-built model is materialized stage by stage: only as a pipeline here.
        request = request.with_changes(mesh=Mesh(1, request.n_devices, 1))
    analysis, made, split = compile_model(model, request)
    if count:
        _check_tunable(request, analysis)
        tuned = _tuned(model, split.unmerged if split else analysis, made, request, count,
                       materializer)
        if split is not None and (tuned.stages, tuned.mesh) != (made.stages, made.mesh):
            analysis, split = split.unmerged, None  # another candidate won: split it anew
        made = tuned
    return build(model, analysis, route(model, analysis, made, request, split=split),
                 request, materializer)


def _tuned(model: nn.Module, analysis: Analysis, made: Plan, request: PlanRequest,
           count: int, materializer: MaterializerFactory | None) -> Plan:
    """``made`` or the candidate measured fastest of its ``count`` best-ranked ones, its
    candidates recording predicted and measured step times (``partitioner.planning.tune``)."""
    inputs, kwargs = tuple(request.example_inputs or ()), request.kwargs
    batch = analysis.workload.batch if analysis.workload is not None else 1
    planned: dict[int, Plan] = {}

    def plan_of(record: dict[str, Any]) -> Plan:
        if record.get("chosen"):
            return made
        key = id(record)
        if key not in planned:
            planned[key] = plan_record(model, analysis, request, record)
        return planned[key]

    def measure(record: dict[str, Any]) -> float:
        module = build(model, analysis, route(model, analysis, plan_of(record), request),
                       request, materializer)
        try:
            return time_training_steps(module, inputs, kwargs, batch,
                                       min_seconds=MIN_TIMED_SECONDS)
        finally:
            module.close()

    saved = snapshot_state(model)
    try:
        records = list(made.candidates)
        trials = run_trials(records, count, measure, confirm=CONFIRM_TRIALS, refine=REFINE)
        alone = records[0].get("search", {}).get("one_device") if records else None
        if alone is not None and _on_device(model, alone["device"]):
            records[0] = {**records[0], "search": {**records[0]["search"], "one_device": {
                **alone, "measured_step_time": time_training_steps(
                    model, inputs, kwargs, batch, min_seconds=MIN_TIMED_SECONDS)}}}
    finally:
        restore_state(model, saved)
    tuned = tuned_records(records, trials)
    index = next(i for i, r in enumerate(tuned) if r.get("chosen"))
    base = made if index == 0 else plan_of(records[index])
    notes = tuple(n for n in base.notes if not n.startswith(SEARCH_NOTES))
    candidates = chosen_first(tuned, base.candidates[0]) if base.candidates else tuned
    return replace(base, candidates=candidates, notes=(*notes, tuned_line(candidates)))


def plan_record(model: nn.Module, analysis: Analysis, request: PlanRequest,
                candidate: dict[str, Any]) -> Plan:
    """The recorded plan of one of a plan's candidates (its configuration fixed)."""
    return record(candidate_plan(analysis, request, candidate["config"]), model, analysis,
                  request, request.strategy)


def _on_device(model: nn.Module, device: str) -> bool:
    """Whether every tensor of ``model`` is on ``device`` (the one-device run is timed
    as the model is, never moved)."""
    target = torch.device(device)
    return all(t.device == target or (target.type == t.device.type and target.index is None)
               for t in [*model.parameters(), *model.buffers()])


def _check_tunable(request: PlanRequest, analysis: Analysis) -> None:
    if request.fixes_split or analysis.workload is None or not request.example_inputs:
        raise TuneError("tune=True needs example_inputs and a split the planner chooses (it "
                        "times the planner's candidates on the example batch); pass "
                        "example_inputs=(x,) and drop balance=/split_points=, or tune=False")


def _check_tune_alone(count: int, *, plan: object, tensor_parallel: object) -> None:
    if count and plan is not None:
        raise TuneError("tune=True and plan= given: a saved plan is applied exactly, with "
                        "nothing to choose; pass one of them")
    if count and tensor_parallel is not None:
        raise TuneError("tune=True and tensor_parallel= given; pass mesh=Mesh(dp=..., "
                        "pp=..., tp=n) with tune=True to tune the rest, or tune=False")


_META_PIPELINE_ONLY = (
    "a model built on the meta device runs in one process as a pipeline only, but {what}; "
    "pass strategy='pipeline' (or use partition_distributed for tensor and data parallelism)")


def make_plan(model: nn.Module, devices: Any, strategy: str | None = None, *,
              example_inputs: tuple[Any, ...] | None = None,
              example_kwargs: dict[str, Any] | None = None, chunks: int | None = None,
              checkpoint: str | None = None, balance: Sequence[int] | None = None,
              split_points: Sequence[str] | None = None,
              memory_limit: float | Sequence[float] | None = None,
              plan: str | Path | Plan | Spec | dict[str, Any] | None = None,
              calibrate: bool | None = None, schedule: str | None = None,
              virtual_stages: int | None = None, memory_reserve: float | None = None,
              precision: str | None = None, mesh: Mesh | None = None,
              compiled: bool | None = None, options: Options | None = None) -> Plan:
    """Plan like :func:`partition` without building the runtime (works on meta models).

    ``options=`` takes the same :class:`partitioner.Options` as :func:`partition` (the
    keywords are sugar for it; ``tune``, ``init_fn`` and ``seed`` concern building and are
    not read here).

    With ``plan=`` a hand-written spec is compiled (or a saved plan checked) for ``model``.
    ``devices`` may also be a :class:`~partitioner.cost.devices.Cluster` beyond this machine
    (``Cluster.preset("A100-80GB", nodes=4)``): ``"auto"`` then plans any mix of data,
    tensor and pipeline parallelism for it. On this machine's devices the plan is the one
    :func:`partition` would run (a tensor-parallel choice with its shard specs).
    ``precision="bf16"`` (or ``"fp16"``) costs the model, built in fp32, as mixed precision
    runs it (bf16 throughput, 2-byte activations, fp32 weights and optimizer state) and
    records it in the plan.

    For a transformers Llama model planned for a cluster beyond this machine the costs are
    those of such runs (``partitioner.planning.llama_plan``): ``checkpoint="selective"``
    asks for torchtitan's per-op recomputation (``None`` tries none, selective, then full,
    the first that fits), and ``compiled=False`` costs the element-wise steps as eager
    PyTorch runs them (``None``: compiled, one kernel each, as ``torch.compile`` runs them).

    ``mesh=Mesh(dp=, pp=, tp=)`` costs that configuration: the plan has exactly that mesh
    (the split, and the micro-batches, schedule and checkpoint mode unless given, still
    optimised; ``example_inputs`` is the whole step's batch, split over the replicas), and
    ``plan.explain()`` compares it with auto's best (``partitioner.planning.given_mesh``).

    Example:
        >>> import torch
        >>> from partitioner import Cluster, Mesh
        >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
        >>> x = torch.randn(64, 64)
        >>> plan = make_plan(model, Cluster.preset("H100-SXM"), example_inputs=(x,),
        ...                  mesh=Mesh(dp=2, pp=4, tp=1))
        >>> plan.mesh, plan.planner.mesh == plan.mesh
        (Mesh(dp=2, pp=4, tp=1), True)
    """
    _check_model(model)
    opts = one_process_options(resolve_options(
        options, strategy=strategy, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
        virtual_stages=virtual_stages, precision=precision, mesh=mesh, compiled=compiled))
    strategy, mesh, checkpoint = opts.strategy or "auto", opts.whole_mesh, opts.checkpoint
    chunks, schedule, virtual_stages = (opts.schedule.chunks, opts.schedule.name,
                                        opts.schedule.virtual_stages)
    precision = opts.precision.compute
    _check_mesh_alone(mesh, plan=plan)
    if devices is None and plan is None:
        raise DeviceError("devices=None; pass the devices (or a Cluster) to plan for, e.g. "
                          "devices=['cpu', 'cpu'], or plan= a spec that names them")
    request = PlanRequest.make(devices, strategy, example_inputs=example_inputs,
                               example_kwargs=example_kwargs, chunks=chunks,
                               checkpoint=checkpoint, balance=balance,
                               split_points=split_points, memory_limit=memory_limit,
                               calibrate=calibrate, schedule=schedule,
                               virtual_stages=virtual_stages, memory_reserve=memory_reserve,
                               precision=precision, mesh=mesh, compiled=opts.compiled)
    if plan is not None:
        return planned_precision(resolve_plan(model, plan, request)[1], precision)
    return compile_model(model, request).plan


@dataclass(frozen=True)
class Replicas:
    """A plan with ``mesh.dp > 1`` replicas in one process, each running ``pp x tp``."""

    plan: Plan
    setup: TensorParallelSetup | None = None


def route(model: nn.Module, analysis: Analysis, plan: Plan, request: PlanRequest,
          setup: TensorParallelSetup | None = None, *,
          split: TensorParallelSplit | None = None) -> Plan | TensorParallelSetup | Replicas:
    """Where a plan for this machine goes: the one place that picks the runtime.

    A pipeline plan (``dp = tp = 1``) is built as it is. A tensor-parallel plan comes with
    its ``split`` from :func:`~partitioner.planning.compile.compile_model` (layers merged on
    the same capture); a candidate's that does not is cut from the merged layers here
    (:func:`~partitioner.planning.compile.split_plan`, no second capture); a saved
    tensor-parallel plan comes with its ``setup`` already (``partitioner.apply``). A plan
    with ``dp > 1`` replicas runs ``dp`` copies of that (``runtime/replicas.py``), replica
    ``r`` on the ``r``-th group of ``pp x tp`` devices.
    """
    mesh = plan.mesh or Mesh()
    if mesh.tp == 1:
        return plan if mesh.dp == 1 else Replicas(plan)
    if setup is not None:
        return setup if mesh.dp == 1 else Replicas(setup.plan, setup)
    if split is None:
        analysis, plan, split = split_plan(model, analysis, request, plan)
    assert split is not None, "split_plan returns the split"
    groups = device_groups_of(request, mesh)
    setup = TensorParallelSetup(analysis, plan, split.shard_plan, groups, split.layer_names,
                                request)
    return setup if mesh.dp == 1 else Replicas(plan, setup)


def build(model: nn.Module, analysis: Analysis, routed: Plan | TensorParallelSetup | Replicas,
          request: PlanRequest, materializer: MaterializerFactory | None = None
          ) -> PartitionedModule | TensorParallelModule | ReplicatedModule:
    """The module running a routed plan in this process (a meta-built model's stages made
    real by ``materializer``: pipelines only).

    Raises:
        StrategyError: a meta-built model routed to replicas or tensor parallelism.
    """
    if any(d.type == "cpu" for d in request.devices):  # as planned, also for a given plan
        steady_host_memory()
    if materializer is not None and not isinstance(routed, Plan):
        mesh = routed.plan.mesh or Mesh()
        raise StrategyError(_META_PIPELINE_ONLY.format(
            what=f"the plan has dp={mesh.dp}, tp={mesh.tp}"))
    if isinstance(routed, Replicas):
        return build_replicas(model, analysis, routed.plan, request, routed.setup)
    if isinstance(routed, TensorParallelSetup):
        return build_tensor_parallel(model, routed)
    return build_pipeline(model, analysis, routed, request, materializer)


def _check_mesh_alone(mesh: Mesh | None, *, plan: object = None,
                      tensor_parallel: object = None) -> None:
    """Refuse ``mesh=`` beside an option that decides the mesh itself."""
    if mesh is None:
        return
    if plan is not None:
        raise MeshError(f"mesh={mesh} and plan= given: the plan names its own mesh; pass "
                        "one of them")
    if tensor_parallel is not None:
        raise MeshError(f"mesh={mesh} and tensor_parallel={tensor_parallel!r} given; pass "
                        f"mesh=Mesh(dp=..., pp=..., tp=n) to fix the degree, or "
                        "tensor_parallel= alone (its rules need it)")


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        hint = (" (a class: pass an instance, e.g. Model())" if isinstance(model, type)
                else " (a function: wrap it in an nn.Module)" if callable(model) else "")
        raise ModelError(f"model={model!r} is a {type(model).__name__}, not an nn.Module"
                         f"{hint}; pass the nn.Module to partition")
    if isinstance(model, ModelWrapper):
        raise ModelError(f"model is already partitioned (a {type(model).__name__}); pass the "
                         "original model (pm.module) to partition it again")
