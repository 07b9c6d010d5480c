"""``partition_distributed(..., strategy="auto")``: rank 0 searches, every rank runs its plan.

The search (``partitioner.planning.world``) needs the world's cluster: the ranks gather
their host names (how many nodes, how many ranks each) and the device kind gives the spec,
unless ``cluster=`` names it. Only rank 0 captures the model at the whole batch, costs it
and searches; the chosen plan (or rank 0's error, so that no rank waits for a plan that
never comes) reaches every rank by one broadcast. The plan then runs as a given plan would:
``partition_distributed`` checks every rank built the same stages.

Example:
    >>> dpm = partition_distributed(model, (x,), strategy="auto")  # doctest: +SKIP
    >>> dpm.plan.mesh, dpm.plan.schedule, dpm.plan.chunks          # doctest: +SKIP
    (Mesh(dp=2, pp=2, tp=1), '1f1b', 4)
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioner.analysis import Analysis, analyze
from partitioner.cost.cost import Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.precision_cost import precision_workload
from partitioner.cost.sequence_cost import sequence_parallel_workload
from partitioner.errors import MemoryLimitError, PartitionError, ScheduleError, StrategyError
from partitioner.passes.tensor_parallel.shard_graph import merge_split_layers
from partitioner.planning.auto import SearchResult
from partitioner.planning.calibrated import calibrated, carried
from partitioner.planning.compile import SEARCH_NOTES, as_built, shard_specs, split_layers
from partitioner.planning.planner import record
from partitioner.planning.predict import Config
from partitioner.planning.space import SearchSpace
from partitioner.planning.tp_costing import as_split
from partitioner.planning.tp_rules import TensorParallelRules, resolve_shardings
from partitioner.planning.tune import (
    CONFIRM_TRIALS,
    MIN_TIMED_SECONDS,
    REFINE,
    SETTLE_TRIALS,
    chosen_first,
    restore_state,
    run_trials,
    snapshot_state,
    time_training_steps,
    tuned_records,
)
from partitioner.planning.world import (
    DEFAULT_RESERVE,
    Check,
    Degrees,
    capacity_of,
    search_world,
    world_plan,
)
from partitioner.planning.world_agreement import (
    infer_cluster,
    predicted_for_world,
    rank0_error,
)
from partitioner.plans.explain import tuned_line
from partitioner.plans.plan import Plan
from partitioner.request import PlanRequest
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.model import RunSettings, sharding_problem
from partitioner.runtime.mesh import Mesh
from partitioner.runtime.microbatch import batch_size, scatter
from partitioner.runtime.schedule_registry import schedule_kind

__all__ = ["AutoOptions", "choose_plan", "infer_cluster", "local_batch", "describe_cluster",
           "tensor_parallel_check", "tuned_choice", "fixed_options", "check_sharding",
           "auto_options", "mesh_sizes", "run_settings", "virtual_stages_of", "on_mesh",
           "check_fingerprint", "plan_digest", "checked_counts", "with_calibration",
           "predicted_for_world"]


@dataclass(frozen=True)
class AutoOptions:
    """What the caller fixed for the search (``None``: searched or the default).

    Attributes:
        degrees: fixed mesh sizes.
        cluster: ``cluster=``: a Cluster, a preset name, or ``None`` (the world's).
        chunks: micro-batches per replica.
        schedule: a schedule name.
        checkpoint: a checkpoint mode.
        memory_limit: bytes per rank.
        memory_reserve: share of each device's memory left unused.
        rules: ``tensor_parallel=`` rules (with a fixed ``tp``).
        precision: the compute precision the search costs (``partitioner.cost.precision_cost``).
        optimizer_sharding: ZeRO-1 fixed on or off; ``None``: chosen only when no
            configuration fits memory without it.
        sequence_parallel: tensor-parallel configurations are costed with sequence
            parallelism (``partitioner.cost.sequence_cost``), as they will run.
        calibrate: rank 0 times the model before the search
            (``partitioner.planning.calibrated``; ``None``: when it should).
    """

    degrees: Degrees
    cluster: Cluster | str | None = None
    chunks: int | None = None
    schedule: str | None = None
    checkpoint: str | None = None
    memory_limit: float | None = None
    memory_reserve: float | None = None
    rules: Mapping[str, str] | None = None
    precision: str = "fp32"
    optimizer_sharding: bool | None = None
    sequence_parallel: bool = False
    calibrate: bool | None = None


def describe_cluster(cluster: Cluster | str | None) -> str | None:
    """``cluster=`` as the settings check compares it."""
    return cluster.describe() if isinstance(cluster, Cluster) else cluster


def choose_plan(model: nn.Module, example_inputs: tuple[Any, ...] | None,
                example_kwargs: dict[str, Any] | None, options: AutoOptions,
                device: torch.device) -> Plan:
    """Rank 0's plan for this world, on every rank (collective).

    Raises:
        PartitionError: the subclass rank 0 raised (every rank raises it).
    """
    cluster = infer_cluster(options.cluster, device)
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = {"plan": _search(model, example_inputs, example_kwargs, options, cluster,
                                      device).to_dict()}
        except Exception as error:  # every rank must hear of it, then rank 0 re-raises
            failure = error
            box[0] = {"error": type(error).__name__, "message": str(error)}
    with communicating("sending rank 0's plan to every rank (broadcast_object_list)"):
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    outcome = box[0]
    if "error" in outcome:
        raise rank0_error(outcome["error"], outcome["message"])
    return Plan.from_dict(outcome["plan"])


def tensor_parallel_check(model: nn.Module, analysis: Analysis,
                          rules: Mapping[str, str] | None = None) -> Check:
    """Why the tensor-parallel pass cannot run a configuration on this model (``None``: it
    can): the splits must divide by ``tp`` (attention heads, say), and a stage boundary may
    not cut a column/row pair, so the layers merge and fewer stages fit.

    The search costs any ``tp``; this asks the pass, once per degree, on the capture.
    """
    parsed = TensorParallelRules.parse(rules)
    gm = analysis.captured.graph_module
    found: dict[int, tuple[str | None, int]] = {}

    def merged(tp: int) -> tuple[str | None, int]:
        if tp not in found:
            try:
                plan = resolve_shardings(gm, model, tp, parsed)
                assert plan.choice is not None, "resolve_shardings records the pass's choice"
                layers = merge_split_layers(gm, analysis.layers, plan.choice.propagation)
                found[tp] = (None, len(layers))
            except PartitionError as error:
                found[tp] = (f"tp={tp}: {str(error).splitlines()[0]}", 0)
        return found[tp]

    def check(config: Config) -> str | None:
        if config.tp == 1:
            return None
        why, count = merged(config.tp)
        if why is None and config.pp * config.virtual > count:
            why = (f"tp={config.tp} keeps each column/row pair in one stage, which leaves "
                   f"{count} layers: too few for pp={config.pp}")
        return why

    return check


def _search(model: nn.Module, example_inputs: tuple[Any, ...] | None,
            example_kwargs: dict[str, Any] | None, options: AutoOptions, cluster: Cluster,
            device: torch.device) -> Plan:
    request = PlanRequest.make([device], "auto", example_inputs=example_inputs,
                               example_kwargs=example_kwargs, chunks=options.chunks,
                               checkpoint=options.checkpoint, memory_limit=options.memory_limit,
                               calibrate=options.calibrate)
    analysis = analyze(model, request.example_inputs, request.kwargs)
    assert analysis.workload is not None, "analyze() costs a model given example inputs"
    limit = min(request.memory_limit) if request.memory_limit else None
    reserve = DEFAULT_RESERVE if options.memory_reserve is None else options.memory_reserve
    capacity = capacity_of(cluster, reserve, limit)
    # Ranks of this host's CPU: rank 0 times the model at the ranks' thread count (the
    # others wait in the broadcast of its plan), as partition() does in one process.
    scaled = calibrated(analysis, request, cluster, analysis.workload)
    workload = _as_split(model, analysis, options, scaled)
    if options.sequence_parallel:
        workload = sequence_parallel_workload(workload)

    asked = SearchSpace(chunks=request.chunks, checkpoint=request.checkpoint,
                        schedules=(options.schedule,) if options.schedule else None)

    def searched(sharding: bool | None) -> SearchResult:
        return search_world(precision_workload(workload, options.precision), cluster,
                            options.degrees, asked.fixing(optimizer_sharding=sharding),
                            capacity=capacity,
                            check=tensor_parallel_check(model, analysis, options.rules))

    if options.optimizer_sharding is not None:
        result = searched(options.optimizer_sharding)
    else:
        # Sharding asks the user to build the optimizer with dpm.make_optimizer: it is
        # chosen only when nothing fits without it.
        try:
            result = searched(False)
        except MemoryLimitError:
            result = searched(None)
    plan = world_plan(result, analysis.layer_names, cluster,
                      capture=analysis.captured.method, notes=analysis.workload.notes)
    if plan.mesh is not None and plan.mesh.tp > 1:
        plan, analysis = _split(model, analysis, options, cluster, capacity, plan, scaled)
    return record(plan, model, analysis, request, "auto")  # sends: one replica's share


def _as_split(model: nn.Module, analysis: Analysis, options: AutoOptions,
              workload: Workload) -> Workload:
    """``workload`` costed as the tensor-parallel pass splits it (``tp_costing``: the layers
    it leaves whole, the all-reduces of its pairs), from its sharding at the given degree
    (else 2); unchanged where tensor parallelism is off or the pass cannot split the model
    (``tensor_parallel_check`` then refuses its candidates)."""
    tp = options.degrees.tp
    if tp == 1:
        return workload
    try:
        plan = resolve_shardings(analysis.captured.graph_module, model, tp or 2,
                                 TensorParallelRules.parse(options.rules))
    except PartitionError:
        return workload
    return as_split(workload, plan.split(), plan.pairs)


def _split(model: nn.Module, analysis: Analysis, options: AutoOptions, cluster: Cluster,
           capacity: float | None, plan: Plan, scaled: Workload) -> tuple[Plan, Analysis]:
    """A chosen tensor-parallel ``plan`` cut from the layers merged for its ``tp`` on the
    same capture (no column/row pair across a boundary), taking what their layers measured
    in ``scaled`` (``calibrated.carried``), its mesh, micro-batches, schedule and checkpoint
    mode kept, its shard specs filled in, its own record first (``records.built_first``):
    every rank then runs it as a given plan, checking it against its own capture instead of
    planning again."""
    assert plan.mesh is not None
    mesh = plan.mesh
    merged, split = split_layers(analysis, model, mesh.tp,
                                 TensorParallelRules.parse(options.rules))
    assert merged.workload is not None, "a costed analysis stays costed when merged"
    workload = carried(scaled, merged.workload, split.layer_names, cluster.spec(0))
    if options.sequence_parallel:
        workload = sequence_parallel_workload(workload)
    merged = replace(merged, workload=workload)
    chosen = SearchSpace(chunks=plan.chunks, checkpoint=plan.checkpoint,
                         schedules=(plan.schedule,),
                         optimizer_sharding=plan.optimizer_sharding)
    result = search_world(precision_workload(workload, options.precision), cluster,
                          Degrees(mesh.pp, mesh.dp, mesh.tp), chosen, capacity=capacity)
    cut = world_plan(result, merged.layer_names, cluster, capture=plan.capture,
                     notes=workload.notes)
    built = as_built(plan, cut, [n for n in plan.notes if not n.startswith(SEARCH_NOTES)])
    return replace(built, shard_specs=shard_specs(split.shard_plan)), merged


def local_batch(example_inputs: tuple[Any, ...] | None,
                example_kwargs: dict[str, Any] | None, dp: int
                ) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
    """The first replica's rows of the whole batch (what one replica's ``step`` takes)."""
    if dp == 1:
        return example_inputs, example_kwargs
    inputs = tuple(scatter(list(example_inputs), dp)[0]) if example_inputs else example_inputs
    if not example_kwargs:
        return inputs, example_kwargs
    keys = list(example_kwargs)
    return inputs, dict(zip(keys, scatter([example_kwargs[k] for k in keys], dp)[0]))


def tuned_choice(model: nn.Module, chosen: Plan, count: int,
                 build: Callable[[dict[str, Any]], Any],
                 example_inputs: tuple[Any, ...] | None,
                 example_kwargs: dict[str, Any] | None) -> Plan:
    """``partition_distributed(..., tune=count)``: build ``count`` best-ranked candidates
    (``tuned_order``) of rank 0's ``chosen`` plan with ``build(options)`` (every rank, one after
    another), time a few training steps of each (the slowest rank's median counts, agreed by an
    all-reduce), and return the measured fastest's plan with every candidate's predicted and
    measured step time (``partitioner.planning.tune``). The model's tensors are restored afterwards.

    A candidate that fails to build or to time on a rank is skipped on every rank (the
    failure is agreed after the build and after the timing); one that fails inside a
    collective or a step on one rank only leaves its peers waiting until the watchdog's
    timeout stops the world, as any build or step does.
    """
    plans: dict[int, Plan] = {}

    def measure(index: int, record: dict[str, Any]) -> float:
        c = record["config"]
        inputs, kwargs = local_batch(example_inputs, example_kwargs, c["dp"])
        dpm, error = None, ""
        try:
            dpm = build(fixed_options(c, inputs, kwargs))
        except Exception as failure:  # agreed below: every rank skips it together
            error = f"{type(failure).__name__}: {failure}"
        try:
            _agreed(math.inf if error else 0.0, error)  # all built, or none runs
        except RuntimeError:
            if dpm is not None:
                dpm.close()
            raise
        assert dpm is not None
        try:
            seconds = time_training_steps(dpm, tuple(inputs or ()), kwargs,
                                          batch_size([inputs, kwargs]) or 1,
                                          min_seconds=MIN_TIMED_SECONDS, agree=_slowest)
            plans[index] = dpm.plan
        except Exception as failure:  # a rank failing mid-step leaves its peers waiting
            error, seconds = f"{type(failure).__name__}: {failure}", math.inf
        finally:
            dpm.close()
        return _agreed(seconds, error)

    records = list(chosen.candidates)
    saved = snapshot_state(model)
    try:
        trials = run_trials(records, count, lambda r: measure(records.index(r), r),
                            settle=SETTLE_TRIALS, confirm=CONFIRM_TRIALS, refine=REFINE)
    finally:
        restore_state(model, saved)
    tuned = tuned_records(records, trials)
    index = next(i for i, r in enumerate(tuned) if r.get("chosen"))
    base = chosen if index == 0 or index not in plans else plans[index]
    notes = tuple(n for n in chosen.notes if not n.startswith(SEARCH_NOTES))
    candidates = chosen_first(tuned, base.candidates[0]) if base is not chosen else tuned
    return replace(base, candidates=candidates, notes=(*notes, tuned_line(candidates)))


def _slowest(seconds: float) -> float:
    """The slowest rank's ``seconds`` (all-reduce MAX): the step count every rank takes."""
    agreed = torch.tensor([seconds])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return float(agreed)


def _agreed(seconds: float, error: str) -> float:
    """The slowest rank's ``seconds`` (all-reduce MAX); every rank raises when any failed
    (``inf``), so all skip the candidate together and the next one starts in step."""
    agreed = _slowest(seconds)
    if error or not math.isfinite(agreed):
        raise RuntimeError(error or "failed on another rank")
    return agreed


def checked_counts(**given: Any) -> dict[str, Any]:
    """``partition_distributed``'s keywords as given, with the counts checked as that front
    always has (a ``StrategyError`` naming ``tp=`` or ``virtual_stages=``)."""
    for key, what in (("tp", "a whole number of tensor-parallel shards >= 1"),
                      ("virtual_stages", "the model chunks per pipeline rank, an int >= 1 "
                                         "(2 or more for schedule='interleaved')")):
        value = given[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise StrategyError(f"{key}={value!r}; pass {what}")
    return given


def with_calibration(auto: AutoOptions | None, calibrate: object) -> AutoOptions | None:
    """``auto`` told whether rank 0 times the model before its search (``calibrate=``).

    Raises:
        StrategyError: ``calibrate`` is not a bool or ``None``, or ``True`` without
            ``strategy="auto"`` (``auto`` is ``None``).
    """
    if calibrate is not None and not isinstance(calibrate, bool):
        raise StrategyError(f"calibrate={calibrate!r}; pass True, False or None (time the "
                            "model before planning when it is cheap on this host's CPU)")
    if calibrate and auto is None:
        raise StrategyError("calibrate=True times the model for the search of "
                            "strategy='auto'; pass strategy='auto' or drop calibrate=")
    return replace(auto, calibrate=calibrate) if auto is not None else None


def fixed_options(config: dict[str, Any], inputs: Any, kwargs: Any) -> dict[str, Any]:
    """``partition_distributed`` keywords that run exactly one candidate's configuration."""
    virtual = config.get("virtual", 1)
    return dict(example_inputs=inputs, example_kwargs=kwargs, pp=config["pp"],
                dp=config["dp"], tp=config["tp"], chunks=config["chunks"],
                schedule=config["schedule"], checkpoint=config["checkpoint"],
                virtual_stages=virtual if virtual > 1 else None,
                optimizer_sharding=bool(config.get("optimizer_sharding", False)))


def check_sharding(optimizer_sharding: object, dp: int | None) -> None:
    """Raises a :class:`StrategyError` unless ``optimizer_sharding`` is a bool that fits
    ``dp`` replicas (``None``: not known yet)."""
    if not isinstance(optimizer_sharding, bool):
        raise StrategyError(f"optimizer_sharding={optimizer_sharding!r}; pass True (shard the "
                            "optimizer state over the data-parallel replicas) or False")
    if optimizer_sharding and dp is not None and dp < 2:
        raise StrategyError(sharding_problem(dp))


def auto_options(strategy: str | None, given: Plan | None, pp: int | None, dp: int | None,
                  tp: int | None, rules: Mapping[str, str] | None, chunks: int | None,
                  schedule: str | None, checkpoint: str | None,
                  balance: Sequence[int] | None, split_points: Sequence[str] | None,
                  memory_limit: float | None, cluster: Cluster | str | None,
                  memory_reserve: float | None) -> AutoOptions | None:
    """The search's options when ``strategy="auto"`` (``None`` otherwise), after refusing
    options that fix what the search chooses, or that only the search reads."""
    if strategy not in (None, "auto", "pipeline"):
        raise StrategyError(f"strategy={strategy!r} is unknown; pass 'auto' (search the mesh, "
                            "schedule and micro-batches) or 'pipeline' (the sizes as given)")
    if strategy != "auto":
        if cluster is not None or memory_reserve is not None:
            raise StrategyError("cluster= and memory_reserve= shape the search of "
                                "strategy='auto'; pass strategy='auto' or drop them")
        return None
    fixed = [name for name, value in (("plan", given), ("balance", balance),
                                      ("split_points", split_points)) if value is not None]
    if fixed:
        raise StrategyError(f"strategy='auto' chooses the split, but {fixed[0]}= fixes it; "
                            f"drop {fixed[0]}= or strategy='auto'")
    if rules is not None and (tp is None or tp == 1):
        raise StrategyError("tensor_parallel= rules split layers over the tp shards of a "
                            f"stage, but tp={tp}; pass tp=2 (or more) with them")
    memory = float(memory_limit) if memory_limit is not None else None
    return AutoOptions(Degrees(pp, dp, tp), cluster, chunks, schedule, checkpoint, memory,
                       memory_reserve, rules)


def mesh_sizes(given: Plan | None, pp: int | None, dp: int | None, tp: int | None
                ) -> tuple[int | None, int | None, int]:
    """The call's mesh sizes, completed from a given plan: it fixes the stages, and a
    replica count it names (> 1) is kept unless overridden."""
    if given is not None:
        pp = len(given.stages) // given.virtual_stages if pp is None else pp
        if dp is None and given.mesh is not None and given.mesh.dp > 1:
            dp = given.mesh.dp
        if tp is None and given.mesh is not None:
            tp = given.mesh.tp
    tp = 1 if tp is None else tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise StrategyError(f"tp={tp!r}; pass a whole number of tensor-parallel shards >= 1")
    return pp, dp, tp


def run_settings(model: nn.Module, given: Plan | None, chunks: int | None,
                  schedule: str | None, checkpoint: str | None,
                  balance: Sequence[int] | None, split_points: Sequence[str] | None
                  ) -> tuple[int, str, str]:
    """Chunks, schedule and checkpoint mode (the call's, else the given plan's, else the
    defaults), after checking a given plan fits the model and is not overridden."""
    if given is not None:
        if balance is not None or split_points is not None:
            raise StrategyError("plan= fixes the split; drop balance= and split_points=")
        check_fingerprint(model, given)
    return (chunks or (given.chunks if given else 1),
            schedule or (given.schedule if given else "1f1b"),
            checkpoint or (given.checkpoint if given else "never"))


def virtual_stages_of(given: Plan | None, virtual: int | None, schedule: str, shape: Mesh,
                    chunks: int, balance: Sequence[int] | None) -> int:
    """Virtual stages per rank (the call's, else the given plan's, else 1), checked against
    the schedule, the mesh and ``balance``.

    Raises:
        StrategyError: If ``virtual`` is not a positive int, is 2 or more with ``tp > 1``,
            or ``balance`` does not list ``pp * virtual`` stages.
        ScheduleError: If the schedule does not suit ``pp``, ``chunks`` and ``virtual``.
    """
    v = virtual if virtual is not None else (given.virtual_stages if given else 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise StrategyError(f"virtual_stages={v!r}; pass the model chunks per pipeline rank, "
                            "an int >= 1 (2 or more for schedule='interleaved')")
    problems = schedule_kind(schedule).problems(shape.pp, chunks, v)
    if problems:
        raise ScheduleError("; ".join(problems))
    if v > 1 and shape.tp > 1:
        # The runtime holds a rank's virtual stages whole: each of the tp ranks would run
        # the whole stage, the split silently not applied.
        raise StrategyError(f"virtual_stages={v} with tp={shape.tp}: a rank's virtual "
                            "stages run whole, not split over tensor-parallel ranks; pass "
                            "tp=1 with virtual stages, or virtual_stages=1 (a schedule "
                            "without them) with tp > 1")
    if balance is not None and len(balance) != shape.pp * v:
        raise StrategyError(f"balance has {len(balance)} entries but pp={shape.pp} x "
                            f"virtual_stages={v} needs {shape.pp * v} (layers per virtual "
                            f"stage, in the schedule's placement); pass {shape.pp * v}")
    return v


def on_mesh(made: Plan, shape: Mesh, virtual: int) -> Plan:
    """``made`` (``P v`` stages in order) on the mesh: ``P`` devices, virtual stage ``k``
    on ``devices[placement[k]]``, the schedule's own placement
    (``partitioner.runtime.placement``; ``k % P`` for the looped schedules).

    Raises:
        StrategyError: If the plan does not have ``P v`` stages (too few layers, say).
    """
    p = shape.pp
    if virtual == 1 and made.virtual_stages == 1:
        return replace(made, mesh=Mesh(dp=shape.dp, pp=p, tp=shape.tp))
    if len(made.stages) != p * virtual:
        raise StrategyError(f"the plan has {len(made.stages)} stages but pp={p} x "
                            f"virtual_stages={virtual} needs {p * virtual}; the model may "
                            f"have too few layers: pass a smaller virtual_stages or pp")
    placement = schedule_kind(made.schedule).place(p, virtual)
    devices = tuple(made.devices[k % len(made.devices)] for k in range(p))
    stages = tuple(replace(s, device=devices[placement[s.index]]) for s in made.stages)
    return replace(made, devices=devices, stages=stages, virtual_stages=virtual,
                   mesh=Mesh(dp=shape.dp, pp=p, tp=shape.tp))


def check_fingerprint(model: nn.Module, plan: Plan) -> None:
    if plan.fingerprint is None:
        return
    from partitioner.plans.fingerprint import differences, fingerprint

    found = differences(plan.fingerprint, fingerprint(model))
    if found:
        raise StrategyError("the plan was made for another model:\n"
                            + "\n".join(f"  - {line}" for line in found[:10])
                            + "\nre-plan this model, or run the plan on the model it was "
                              "made for")


def plan_digest(plan: Plan, graphs: Sequence[fx.GraphModule], shape: Mesh,
                settings: RunSettings) -> tuple[str, str]:
    """What every rank must agree on: the split, the settings, each stage's code and tensors
    (a digest to compare, and a line that says what it covers, for
    ``partitioner.runtime.distributed.failure.check_same_plan``)."""
    body = {
        "layers": [list(s.layers) for s in plan.stages], "chunks": plan.chunks,
        "checkpoint": plan.checkpoint, "schedule": plan.schedule,
        "virtual_stages": settings.virtual,
        "mesh": [shape.pp, shape.dp, shape.tp], "loss_reduction": settings.loss_reduction,
        "shard_specs": sorted((k, repr(v)) for k, v in plan.shard_specs.items()),
        "bucket_bytes": settings.bucket_bytes, "seed": settings.seed,
        "stages": [{"code": gm.code,
                    "tensors": [(n, list(t.shape), str(t.dtype)) for n, t in
                                [*gm.named_parameters(), *gm.named_buffers()]]}
                   for gm in graphs]}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    summary = (f"balance {plan.balance}, chunks {plan.chunks}, {plan.schedule}, checkpoint "
               f"{plan.checkpoint}, pp={shape.pp} dp={shape.dp}, graphs {digest[:8]}")
    return digest, summary
