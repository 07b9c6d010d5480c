"""``partition(model, devices, plan=...)``: apply a saved plan exactly, or compile a spec.

A full :class:`Plan` is applied as written: the same layers in the same stages on the same
devices, with its chunks, checkpoint mode and schedule, after checking that the model is the
one the plan was made for (its fingerprint) and refusing, with the differences listed, when
it is not. A :class:`~partitioner.plans.spec.Spec` is compiled: its globs resolved against the
model's layers, the rest planned, and the result recorded like any other plan.

Both paths, and plain planning, end in :func:`partitioner.planning.planner.record`, which
writes into the plan what the file format promises: the model's fingerprint, the planner's
inputs (with the example batch's input signature) and the bytes each stage sends per
micro-batch. A plan of a model that only ``torch.export`` captures is applied without
example inputs by making inputs of that signature for the capture alone.

A plan with data-parallel replicas or tensor-parallel shards (``mesh.dp`` or ``mesh.tp > 1``,
what ``strategy="auto"`` may choose) runs on ``dp x pp x tp`` devices
(``partitioner.plans.placement``). A tensor-parallel plan's stages list *merged* layers
(the tensor-parallel front merges each column/row pair, ``('3', '4')``, so that no stage
boundary cuts one; a merged layer takes its first member's name). Rather than trusting the
file's shard specs, the model is planned again by that front with the plan's fixed settings
(degree, split, chunks, checkpoint mode, schedule) and the result must equal the plan; a
difference (another torch, other sizes, a hand edit) is refused naming the first one. The
shapes decide the splits, so such a plan too is captured from its input signature when no
example inputs are given.

Example:
    >>> import torch
    >>> from partitioner import partition
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> first = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(torch.randn(2, 4),))
    >>> again = partition(model, ["cpu", "cpu"], plan=first.plan)
    >>> again.plan == first.plan
    True
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from partitioner.analysis import Analysis, analyze
from partitioner.build import TensorParallelSetup
from partitioner.cost.devices import parse_devices
from partitioner.errors import (
    BalanceError,
    ExampleInputsError,
    PartitionError,
    PlanFormatError,
    PlanMismatchError,
)
from partitioner.planning.planner import plan_request, record
from partitioner.plans.fingerprint import differences, fingerprint
from partitioner.plans.placement import mesh_device_problem, mesh_devices
from partitioner.plans.plan import FORMAT, Mesh, Plan
from partitioner.plans.spec import Spec, SpecError, read_document, resolve_spec
from partitioner.request import PlanRequest
from partitioner.runtime.checkpointing import EXCEPT_LAST
from partitioner.runtime.schedule_registry import Runtime, runtime_problem
from partitioner.tensor_parallel import plan_tensor_parallel

__all__ = ["PlanMismatchError", "load_plan", "resolve_plan", "Resolved", "check_runnable_spec",
           "layers_problem"]

PlanSource = str | Path | Plan | Spec | dict[str, Any]


class Resolved(NamedTuple):
    """What ``partition`` builds from ``plan=``.

    Attributes:
        analysis: the captured model (for a tensor-parallel plan, with its layers merged as
            the plan's stages list them).
        plan: the plan to run (a saved plan as it was saved).
        request: the settled request: every device the plan runs on (``dp x pp x tp``),
            the example inputs to capture again with.
        setup: for a saved plan with ``mesh.tp > 1``, its tensor-parallel setup (re-planned
            and checked to equal the plan).
        spec: the spec the plan was compiled from, if it was.
    """

    analysis: Analysis
    plan: Plan
    request: PlanRequest
    setup: TensorParallelSetup | None = None
    spec: Spec | None = None


def check_runnable_spec(resolved: Resolved) -> None:
    """Refuse to run a plan compiled from a spec that gives ``mesh`` dp or tp > 1: the
    spec's stages are planned as one pipeline and its mesh only recorded (make_plan). The
    replicas ``strategy="auto"`` chooses for a spec without a mesh run as a fresh plan's.

    Raises:
        SpecError: the spec asks for ``dp`` or ``tp > 1``.
    """
    asked = resolved.spec.mesh if resolved.spec is not None else {}
    mesh = resolved.plan.mesh or Mesh()
    if (asked.get("dp", 1), asked.get("tp", 1)) != (1, 1):
        raise SpecError(f"the spec's mesh dp={mesh.dp}, tp={mesh.tp} is recorded in the plan "
                        "but partition runs specs as pipelines (dp = tp = 1); drop 'mesh' "
                        "from the spec, pass tensor_parallel= to partition, or save the plan "
                        "strategy='auto' makes and apply that")


def load_plan(source: str | Path | dict[str, Any]) -> Plan | Spec:
    """Read a plan file or a spec (a file path, or already-parsed data).

    A document whose ``format`` is ``"partitioner.plan"`` is a full plan; anything else is
    read as a hand-written spec.

    Raises:
        PlanFormatError: a malformed plan file, or ``source`` of another type.
        SpecError: a malformed spec, or a file that is missing, too large, cannot be read
            or parsed (``partitioner.plans.spec.read_document``).
    """
    _check_source(source)
    data = source if isinstance(source, dict) else read_document(source)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return Plan.from_dict(data)
    return Spec.from_dict(data)


def resolve_plan(model: nn.Module, source: PlanSource, request: PlanRequest) -> Resolved:
    """The analysis, plan and settled request ``partition`` builds from ``plan=``.

    A saved plan with replicas or tensor-parallel shards (``mesh.dp`` or ``mesh.tp > 1``)
    runs on ``dp x pp x tp`` devices (``devices=None``: all ``"cpu"`` when the plan's are);
    a tensor-parallel one is planned again with its settings and must come out the same
    (below).

    Args:
        model: the model to partition.
        source: a plan or spec, or a path to one, or a parsed spec dict.
        request: ``partition``'s other options. Its devices (none: the plan's) and the
            settings given explicitly (``request.asked()``: strategy, chunks, checkpoint,
            balance, split_points, memory_limit) must agree with the plan.

    Raises:
        PlanMismatchError: the plan was made for another model or disagrees with the call.
        SpecError: a spec that is malformed or does not fit the model.
    """
    _check_source(source)
    given = source if isinstance(source, (Plan, Spec)) else load_plan(source)
    if isinstance(given, Spec):
        return Resolved(*_compile(model, given, request), spec=given)
    return _apply(model, given, request)


def _apply(model: nn.Module, plan: Plan, request: PlanRequest) -> Resolved:
    problems = _call_conflicts(plan, request)
    if plan.fingerprint is not None:
        found = differences(plan.fingerprint, fingerprint(model))
        if found:
            raise PlanMismatchError(
                f"the plan was made for another model ({plan.fingerprint.model}, "
                f"{plan.fingerprint.digest[:19]}...) than this {type(model).__name__}:\n"
                + "\n".join(f"  - {line}" for line in found)
                + "\nre-plan this model, or load the plan into the model it was made for")
    if problems:
        raise PlanMismatchError("the call disagrees with the plan it applies:\n"
                                + "\n".join(f"  - {p}" for p in problems))
    _check_executable(plan)
    inputs, kwargs = _capture_inputs(model, plan, request)
    mesh = plan.mesh or Mesh()
    if (mesh.dp, mesh.tp) == (1, 1):
        devices = list(plan.devices)
        balance: tuple[int, ...] | None = plan.balance
    else:
        devices, balance = mesh_devices(plan, request.devices), None
    settled = PlanRequest.make(devices, "auto", chunks=plan.chunks, checkpoint=plan.checkpoint,
                               balance=balance, example_inputs=inputs, example_kwargs=kwargs)
    if mesh.tp > 1:
        setup = _replan_tensor_parallel(model, plan, devices[:mesh.pp * mesh.tp], inputs,
                                       kwargs)
        return Resolved(setup.analysis, plan, settled, setup)
    analysis = analyze(model, inputs, kwargs, need_costs=False)
    problem = layers_problem(analysis.layer_names, plan)
    if problem is not None:
        raise PlanMismatchError(problem)
    return Resolved(analysis, plan, settled)


def layers_problem(names: Sequence[str], plan: Plan) -> str | None:
    """Why ``plan``'s stages do not hold the model's layers ``names`` in order, or ``None``.

    Example:
        >>> from torch import nn
        >>> from partitioner import make_plan
        >>> plan = make_plan(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["cpu"], balance=[2])
        >>> layers_problem(["0", "1"], plan) is None
        True
        >>> print(layers_problem(["0", "2"], plan))  # doctest: +NORMALIZE_WHITESPACE
        the plan's layers are not this model's: the plan has ['1'], which this model lacks,
        and lacks ['2'], which it has; re-plan the model
    """
    if list(names) == list(plan.layers):
        return None
    missing = [n for n in plan.layers if n not in names]
    extra = [n for n in names if n not in plan.layers]
    if not missing and not extra and len(names) == len(plan.layers):
        held = "; ".join(f"stage {s.index} holds {list(s.layers)[:4]}"
                         + (" ..." if len(s.layers) > 4 else "") for s in plan.stages)
        return (f"the plan's stages hold this model's layers out of order ({held}) but the "
                f"model runs them as {list(names)[:8]}{' ...' if len(names) > 8 else ''}; "
                "give each stage the layers that follow the previous stage's, in the "
                "model's order (stage 0 first), or re-plan the model")
    return (f"the plan's layers are not this model's: the plan has {missing[:8]}, which this "
            f"model lacks, and lacks {extra[:8]}, which it has; re-plan the model")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _replan_tensor_parallel(model: nn.Module, plan: Plan, devices: Sequence[str],
                           example_inputs: tuple[Any, ...] | None,
                           example_kwargs: dict[str, Any] | None) -> TensorParallelSetup:
    """The tensor-parallel setup running the saved ``plan`` (``mesh.tp > 1``) on replica 0's
    ``devices`` (``pp x tp`` of them): planned again with the plan's fixed settings and
    checked to equal it.

    Raises:
        ExampleInputsError: no inputs (the shapes decide what splits).
        PlanMismatchError: the model planned with the plan's settings gives another plan,
            or cannot be planned with them.
    """
    mesh = plan.mesh or Mesh()
    if plan.virtual_stages != 1:
        raise PlanMismatchError(f"the plan has tp={mesh.tp} and virtual_stages="
                                f"{plan.virtual_stages}; the tensor-parallel pipeline runs one "
                                "model chunk per stage: re-plan the model")
    try:
        asked = PlanRequest.make(None, "pipeline", example_inputs=example_inputs,
                                 example_kwargs=example_kwargs, chunks=plan.chunks,
                                 checkpoint=plan.checkpoint, balance=plan.balance,
                                 schedule=plan.schedule)
        setup = plan_tensor_parallel(model, list(devices), mesh.tp, asked)
    except ExampleInputsError:
        raise
    except PartitionError as error:
        raise PlanMismatchError(f"the tensor-parallel plan (tp={mesh.tp}, balance "
                                f"{list(plan.balance)}) does not fit this model: {error}; "
                                "re-plan the model and save the new plan") from error
    found = _first_difference(setup.plan, plan)
    if found is not None:
        raise PlanMismatchError(f"planning this model again with the tensor-parallel plan's "
                                f"settings gives another plan: {found}; re-plan the model "
                                "(partition or make_plan without plan=) and save the new "
                                "plan")
    return replace(setup, plan=plan)


def _first_difference(made: Plan, saved: Plan) -> str | None:
    """The first way ``made`` (planned here) differs from ``saved`` where it decides what
    runs: stages' layers, shard specs, chunks, checkpoint mode, schedule, ``pp x tp``."""
    made_mesh, saved_mesh = made.mesh or Mesh(), saved.mesh or Mesh()
    if (made_mesh.pp, made_mesh.tp) != (saved_mesh.pp, saved_mesh.tp):
        return (f"mesh pp={made_mesh.pp} tp={made_mesh.tp} here, pp={saved_mesh.pp} "
                f"tp={saved_mesh.tp} in the plan")
    for here, there in zip(made.stages, saved.stages):
        if here.layers != there.layers:
            return (f"stage {here.index} holds layers {list(here.layers)} here, "
                    f"{list(there.layers)} in the plan")
    for name in sorted(set(made.shard_specs) | set(saved.shard_specs)):
        here_spec, there_spec = made.shard_specs.get(name), saved.shard_specs.get(name)
        if here_spec != there_spec:
            return f"shard_specs[{name!r}] is {here_spec} here, {there_spec} in the plan"
    for key in ("chunks", "checkpoint", "schedule", "capture"):
        if getattr(made, key) != getattr(saved, key):
            return f"{key}={getattr(made, key)!r} here, {getattr(saved, key)!r} in the plan"
    return None


def _check_source(source: Any) -> None:
    """Refuse a ``plan=`` that is none of the things it may be, or an empty path."""
    if isinstance(source, (Plan, Spec, dict, Path)) or (isinstance(source, str) and source):
        return
    shown = reprlib.repr(source)
    if isinstance(source, str):
        raise PlanFormatError("plan='' is an empty path; pass the path of a plan or spec "
                              "file, or plan=None to plan the model")
    raise PlanFormatError(f"plan={shown} is not a plan (it is of type {type(source).__name__}); "
                          "pass the path of a plan or spec file (str or Path), a Plan, a Spec, "
                          "or a spec as a dict")


def _capture_inputs(model: nn.Module, plan: Plan, request: PlanRequest
                    ) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
    """The inputs to capture the model with: the caller's, or for a plan of a model that
    only ``torch.export`` captures (or a tensor-parallel plan, whose splits the shapes
    decide), inputs made from the plan's input signature."""
    given = request.example_inputs, dict(request.example_kwargs or {}) or None
    tp = (plan.mesh or Mesh()).tp
    if (plan.capture != "export" and tp == 1) or given != (None, None):
        return given
    signature = plan.planner.signature if plan.planner is not None else None
    if signature is None:
        why = ("captured with torch.export, which runs the model" if plan.capture == "export"
               else f"split over tp={tp} ranks, which the inputs' shapes decide")
        raise ExampleInputsError(
            f"the plan's model is {why}, and the "
            "plan records no input signature (it predates them, or was written by hand); "
            "pass example_inputs=(x,) with one batch, or save the plan again")
    if signature.opaque:
        raise ExampleInputsError(
            f"the plan records {', '.join(signature.opaque)} by type only, so they cannot be "
            "made again to capture the model with torch.export; pass example_inputs=(...) and "
            "example_kwargs={...} with one batch")
    return signature.example(_home(model))


def _home(model: nn.Module) -> torch.device:
    """Where the model's tensors live (a ``meta`` model is captured with ``meta`` inputs)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _call_conflicts(plan: Plan, request: PlanRequest) -> list[str]:
    problems = []
    asked = request.asked()
    mesh = plan.mesh or Mesh()
    if (mesh.dp, mesh.tp) != (1, 1):
        problem = mesh_device_problem(plan, request.devices,
                                      parse_devices(list(plan.devices)))
        if problem is not None:
            problems.append(problem)
    elif request.devices and list(request.devices) != parse_devices(list(plan.devices)):
        problems.append(f"devices={[str(d) for d in request.devices]} but the plan runs on "
                        f"{list(plan.devices)}; pass devices=None (or the plan's) to apply it "
                        "as saved")
    for key in ("balance", "split_points", "memory_limit"):
        if asked.get(key) is not None:
            problems.append(f"{key}= is given but the plan fixes the split; drop {key}=")
    for key, default in (("chunks", 1), ("checkpoint", EXCEPT_LAST), ("schedule", None),
                         ("virtual_stages", None)):
        value = asked.get(key, default)
        if value != default and value != getattr(plan, key):
            problems.append(f"{key}={value!r} but the plan says {getattr(plan, key)!r}; edit "
                            f"the plan or drop {key}=")
    return problems


def _check_executable(plan: Plan) -> None:
    problem = runtime_problem(plan.schedule, Runtime.ONE_PROCESS)
    if problem is not None:
        raise PlanMismatchError(f"the plan's {problem}; set its schedule to one of those")


def _compile(model: nn.Module, spec: Spec, request: PlanRequest
             ) -> tuple[Analysis, Plan, PlanRequest]:
    asked = request.asked()
    chosen = _spec_devices(spec, list(request.devices) or None)
    chunks = _merge(spec.chunks, asked.get("chunks", 1), 1, "chunks")
    checkpoint = _merge(spec.checkpoint, asked.get("checkpoint", EXCEPT_LAST), EXCEPT_LAST,
                        "checkpoint")
    strategy = _merge(spec.strategy, asked.get("strategy", "auto"), "auto", "strategy")
    schedule = _merge(spec.schedule, asked.get("schedule"), None, "schedule")
    limits = asked.get("memory_limit")
    memory = _merge(_limits(spec.memory_limit), limits, None, "memory_limit")
    for key in ("balance", "split_points"):
        if asked.get(key) is not None:
            raise SpecError(f"{key}= is given with a spec; write it into the spec instead")
    analysis = analyze(model, request.example_inputs, request.kwargs,
                       need_costs=not spec.fixes_split)
    names = analysis.layer_names
    cuts, notes, shards = resolve_spec(spec, names, model)
    balance = spec.balance
    if cuts is not None:
        balance = tuple(b - a for a, b in itertools.pairwise(cuts))
    settled = PlanRequest.make(chosen, strategy, example_inputs=request.example_inputs,
                               example_kwargs=request.example_kwargs, chunks=chunks,
                               checkpoint=checkpoint, balance=balance,
                               split_points=spec.split_points,
                               memory_limit=memory[0] if memory and len(set(memory)) == 1
                               else memory,
                               calibrate=request.calibrate, schedule=schedule,
                               virtual_stages=request.virtual_stages,
                               memory_reserve=request.memory_reserve)
    # A spec's tensor-parallel rules are recorded, not searched over: auto keeps tp = 1
    # (and may still choose data-parallel replicas, run like a fresh plan's).
    try:
        made = plan_request(analysis, settled, tp_degrees=())
    except BalanceError as error:
        if cuts is None or balance is None:
            raise
        # The spec's stages, not a balance= the caller never wrote, are what does not fit.
        stages, devices = len(balance), len(settled.devices)
        raise SpecError(f"stages: the spec cuts the model into {_count(stages, 'stage')} but "
                        f"there are {_count(devices, 'device')}; write {devices} stages into "
                        f"the spec or pass {_count(stages, 'device')}") from error
    chosen_mesh = made.mesh or Mesh(1, len(made.devices), 1)
    mesh = Mesh(spec.mesh.get("dp", chosen_mesh.dp), chosen_mesh.pp, spec.mesh.get("tp", 1))
    made = replace(made, strategy="spec" if spec.fixes_split else made.strategy,
                   schedule=spec.schedule or made.schedule, notes=(*made.notes, *notes),
                   mesh=mesh, shard_specs=shards)
    return analysis, record(made, model, analysis, settled, "spec", spec), settled


def _spec_devices(spec: Spec, devices: Any) -> Any:
    named = spec.stage_devices
    if named is not None and devices is not None:
        if parse_devices(list(named)) != parse_devices(devices):
            raise SpecError(f"devices: the spec names {list(named)} but devices={devices!r} was "
                            "passed; drop one of them")
    if named is not None:
        return list(named)
    if devices is None:
        raise SpecError("devices: the spec names no devices; pass devices= or add 'devices' "
                        "(or a device per stage) to the spec")
    return devices


def _merge(from_spec: Any, from_call: Any, default: Any, key: str) -> Any:
    if from_spec is None:
        return from_call
    if from_call != default and from_call != from_spec:
        raise SpecError(f"{key}: the spec says {from_spec!r} but {key}={from_call!r} was passed; "
                        "drop one of them")
    return from_spec


def _limits(memory_limit: float | tuple[float, ...] | None) -> tuple[float, ...] | None:
    """A spec's memory limit as a request holds it (one number: one per device, all equal)."""
    if memory_limit is None or isinstance(memory_limit, tuple):
        return memory_limit
    return (float(memory_limit),)
