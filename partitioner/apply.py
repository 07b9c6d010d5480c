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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.analysis import Analysis, analyze
from partitioner.cost.devices import parse_devices
from partitioner.errors import ExampleInputsError, PlanFormatError, PlanMismatchError
from partitioner.planning.planner import plan_request, record
from partitioner.plans.fingerprint import differences, fingerprint
from partitioner.plans.plan import FORMAT, Mesh, Plan
from partitioner.plans.spec import Spec, SpecError, read_document, resolve_spec
from partitioner.request import PlanRequest
from partitioner.runtime.checkpointing import EXCEPT_LAST
from partitioner.runtime.schedule_registry import Runtime, runtime_problem

__all__ = ["PlanMismatchError", "load_plan", "resolve_plan"]

PlanSource = str | Path | Plan | Spec | dict[str, Any]


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


def resolve_plan(model: nn.Module, source: PlanSource, request: PlanRequest
                 ) -> tuple[Analysis, Plan, PlanRequest]:
    """The analysis, plan and settled request ``partition`` builds from ``plan=``.

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
        return _compile(model, given, request)
    return _apply(model, given, request)


def _apply(model: nn.Module, plan: Plan, request: PlanRequest
           ) -> tuple[Analysis, Plan, PlanRequest]:
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
    inputs, kwargs = _capture_inputs(model, plan, request)
    analysis = analyze(model, inputs, kwargs, need_costs=False)
    names = analysis.layer_names
    if names != list(plan.layers):
        missing = [n for n in plan.layers if n not in names]
        extra = [n for n in names if n not in plan.layers]
        raise PlanMismatchError(
            f"the plan's layers are not this model's: missing here {missing[:8]}, not in the "
            f"plan {extra[:8]}{'' if missing or extra else ' (same names, other order)'}; "
            "re-plan the model")
    _check_executable(plan)
    settled = PlanRequest.make(list(plan.devices), "auto", chunks=plan.chunks,
                               checkpoint=plan.checkpoint, balance=plan.balance,
                               example_inputs=inputs, example_kwargs=kwargs)
    return analysis, plan, settled


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
    only ``torch.export`` captures, inputs made from the plan's input signature."""
    given = request.example_inputs, dict(request.example_kwargs or {}) or None
    if plan.capture != "export" or given != (None, None):
        return given
    signature = plan.planner.signature if plan.planner is not None else None
    if signature is None:
        raise ExampleInputsError(
            "the plan's model is captured with torch.export, which runs the model, and the "
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
    if request.devices and list(request.devices) != parse_devices(list(plan.devices)):
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
    mesh = plan.mesh or Mesh()
    if (mesh.dp, mesh.tp) != (1, 1):
        raise PlanMismatchError(f"the plan's mesh has dp={mesh.dp}, tp={mesh.tp}; this "
                                "partitioner runs pipeline plans (dp = tp = 1) in one process; "
                                "use make_plan to inspect it, or set dp and tp to 1")
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
    made = plan_request(analysis, settled)
    mesh = Mesh(spec.mesh.get("dp", 1), len(made.stages), spec.mesh.get("tp", 1))
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
