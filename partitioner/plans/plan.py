"""The plan: which layers run where, how, and what that is predicted to cost.

A :class:`Plan` is a frozen, validated, printable value: the device mesh, the stages (their
layers by module name, device and predicted cost), tensor-parallel shard specs, the
micro-batch count, schedule and checkpoint mode, what the planner was asked and predicted,
and a fingerprint of the model it was made for. It is the only thing the partitioner hands
the runtime besides the stage graphs, and it can be written to JSON and read back: the file
is meant to be read, diffed and edited by people (``docs/design/002-plan-files.md``), its
JSON Schema ships as ``partitioner/plans/plan_schema.json``, and loading it runs no code:
the file is size- and depth-checked (``partitioner.plans.documents``), then checked field by
field as the schema says (``partitioner.plans.plan_check``), then built.

Example:
    >>> stage = Stage(0, "cpu", ("0", "1"))
    >>> plan = Plan(strategy="pipeline", devices=("cpu",), stages=(stage,), chunks=2)
    >>> plan.balance
    (2,)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from partitioner.errors import PlanFormatError, PlanWriteError
from partitioner.plans.documents import check_document, parse_json, read_text
from partitioner.plans.explain import explain, format_bytes
from partitioner.plans.fingerprint import Fingerprint
from partitioner.plans.plan_check import document_problems
from partitioner.plans.signature import InputSignature
from partitioner.runtime.checkpointing import checkpoint_problem
from partitioner.runtime.mesh import Mesh
from partitioner.runtime.placement import looped
from partitioner.runtime.precision import precision_problem
from partitioner.runtime.schedule_registry import SCHEDULES
from partitioner.runtime.tensor_parallel.sharding import SPLIT_KINDS

__all__ = ["Stage", "Plan", "Mesh", "ShardSpec", "PlannerInputs", "PlanFormatError", "FORMAT",
           "VERSION", "SHARD_KINDS"]

FORMAT = "partitioner.plan"
VERSION = 1

#: How a tensor-parallel parameter is split: the runtime's :data:`SPLIT_KINDS` (defined once there).
SHARD_KINDS = SPLIT_KINDS


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        index: the stage number ``j``.
        device: where it runs (``"cpu"``, ``"cuda:1"``).
        layers: its layers, by module name, in order.
        predicted_time: seconds of forward + backward per micro-batch, if costed.
        predicted_memory: bytes it holds during a step, if costed.
        param_bytes: bytes of its parameters, if costed.
        send_bytes: bytes it hands the next stage per micro-batch (activations forward; their
            gradients come back the same size), if costed.
    """

    index: int
    device: str
    layers: tuple[str, ...]
    predicted_time: float | None = None
    predicted_memory: int | None = None
    param_bytes: int | None = None
    send_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanFormatError(f"stage {self.index} has no layers; every stage needs one")
        if self.index < 0:
            raise PlanFormatError(f"stage index {self.index} is negative")


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the tensor-parallel axis.

    Attributes:
        dim: the tensor dimension that is split.
        kind: one of :data:`SHARD_KINDS`.
    """

    dim: int
    kind: str

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise PlanFormatError(f"shard dim={self.dim!r}; pass a tensor dimension >= 0")
        if self.kind not in SHARD_KINDS:
            raise PlanFormatError(f"shard kind={self.kind!r}; use one of {SHARD_KINDS}")


@dataclass(frozen=True)
class PlannerInputs:
    """What the planner was asked: kept so a plan says how it was made.

    Attributes:
        strategy: the strategy asked for (``"auto"``, ``"pipeline"``, ``"spec"``).
        balance: ``balance=`` as given, if any.
        split_points: ``split_points=`` as given, if any.
        memory_limit: bytes per device the planner had to respect, if given.
        example_inputs: the example batch the layers were costed on, as
            ``"float32[64, 32]"`` per positional input (for people).
        spec: the hand-written spec the plan was compiled from, if any (as written).
        signature: the example batch's inputs, positional and keyword (shapes, dtypes,
            batch dimension, non-tensor values): what applying the plan captures the model
            with when no example inputs are given (``partitioner.plans.signature``).
        memory_reserve: the share of each device's memory the plan leaves unused
            (``partitioner.planning.reserve``), if recorded.
        mesh: the mesh the caller gave (``make_plan(mesh=...)``): the plan is that
            configuration, not auto's choice of mesh; ``None`` when the planner chose.
    """

    strategy: str = "auto"
    balance: tuple[int, ...] | None = None
    split_points: tuple[str, ...] | None = None
    memory_limit: tuple[float, ...] | None = None
    example_inputs: tuple[str, ...] = ()
    spec: dict[str, Any] | None = field(default=None, compare=False)
    signature: InputSignature | None = None
    memory_reserve: float | None = None
    mesh: Mesh | None = None


@dataclass(frozen=True)
class Plan:
    """A pipeline partition of a model over devices.

    Attributes:
        strategy: how it was made ("pipeline", "balance", "split_points", ...).
        devices: one device string per pipeline stage (``P`` of them).
        stages: the stages, in order: ``P * virtual_stages`` virtual stages, virtual stage
            ``k`` on ``devices[placement[k]]``, the schedule's placement (``k % P`` but for
            ``v_shape``: ``partitioner.runtime.placement``).
        chunks: micro-batches per mini-batch.
        checkpoint: "always", "except_last" or "never".
        schedule: the pipeline schedule, a name of ``partitioner.runtime.schedule_registry``.
        capture: how the model was captured ("fx" or "export").
        predicted_step_time: seconds per training step, if costed.
        predicted_bubble: idle fraction of the schedule, if costed.
        notes: the planner's remarks (why this plan), free text.
        mesh: dp x pp x tp; defaults to ``Mesh(1, P, 1)``.
        shard_specs: tensor-parallel splits by parameter name (empty: no tensor parallelism).
        planner: what the planner was asked, if recorded.
        fingerprint: the structure of the model the plan was made for; ``None`` for plans
            written by hand (then applying it checks the layer names only).
        candidates: the planner's ranked candidates as plain JSON data, the chosen one
            first with its stage costs (``partitioner.planning.auto``; read by :meth:`explain` and
            ``partitioner.planning.simulate``).
        virtual_stages: model chunks per device ``v`` (the interleaved schedule's; else 1).
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"``: stages compute under autocast to
            it, parameters and optimizer state stay fp32 (``partitioner.runtime.precision``).
        optimizer_sharding: the optimizer state is sharded over the ``mesh.dp`` replicas
            (ZeRO-1, ``partitioner.runtime.distributed.zero``).
        sequence_parallel: the tensor-parallel stages run their replicated region on
            sequence shards (Megatron's sequence parallelism,
            ``partitioner.passes.tensor_parallel.sequence_parallel``); needs ``mesh.tp >= 2``.
    """

    strategy: str
    devices: tuple[str, ...]
    stages: tuple[Stage, ...]
    chunks: int = 1
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    capture: str = "fx"
    predicted_step_time: float | None = None
    predicted_bubble: float | None = None
    notes: tuple[str, ...] = field(default=())
    mesh: Mesh | None = None
    shard_specs: dict[str, ShardSpec] = field(default_factory=dict)
    planner: PlannerInputs | None = None
    fingerprint: Fingerprint | None = None
    candidates: tuple[dict[str, Any], ...] = field(default=())
    virtual_stages: int = 1
    precision: str = "fp32"
    optimizer_sharding: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanFormatError(f"virtual_stages={v!r}; give an int >= 1 (model chunks per "
                                  "device, 1 unless the schedule is interleaved)")
        if self.mesh is None:
            object.__setattr__(self, "mesh", Mesh(1, max(len(self.stages) // v, 1), 1))
        # Sorted, so equal plans print and save alike whatever order the specs came in.
        object.__setattr__(self, "shard_specs", dict(sorted(self.shard_specs.items())))
        problems = self._device_problems()
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            problems.append(f"stage indices {[s.index for s in self.stages]} are not 0..P-1")
        if self.chunks < 1:
            problems.append(f"chunks={self.chunks}; it must be >= 1")
        unknown = checkpoint_problem(self.checkpoint)
        if unknown is not None:
            problems.append(unknown)
        unknown = precision_problem(self.precision)
        if unknown is not None:
            problems.append(unknown)
        if self.optimizer_sharding and (self.mesh is None or self.mesh.dp < 2):
            problems.append("optimizer_sharding is true but the mesh has dp=1; sharding "
                            "needs 2 or more data-parallel replicas")
        if self.sequence_parallel and (self.mesh is None or self.mesh.tp < 2):
            problems.append("sequence_parallel is true but the mesh has tp=1; sequence "
                            "parallelism splits the sequence over 2 or more tensor-parallel "
                            "ranks")
        names = [name for s in self.stages for name in s.layers]
        if len(set(names)) != len(names):
            problems.append("a layer appears in two stages")
        if problems:
            raise PlanFormatError("invalid plan: " + "; ".join(problems))

    def _device_problems(self) -> list[str]:
        """Whether stages, devices and mesh agree: virtual stage ``k`` on the device the
        schedule's placement names."""
        p, v, n = len(self.devices), self.virtual_stages, len(self.stages)
        problems = []
        if self.mesh is not None and self.mesh.pp != p:
            problems.append(f"mesh pp={self.mesh.pp} but there are {p} devices")
        if n != p * v:
            problems.append(f"{n} stages but {p} devices x virtual_stages={v} = {p * v}; "
                            "list one stage per device and model chunk")
        if not p or n != p * v:
            return problems
        where = self.placement
        problems += [f"stages[{k}].device is {s.device!r} but devices[{where[k]}] is "
                     f"{self.devices[where[k]]!r}: the plan would report one and run on the "
                     "other; make them the same" for k, s in enumerate(self.stages)
                     if s.device != self.devices[where[k]]]
        return problems

    @property
    def placement(self) -> tuple[int, ...]:
        """Per stage ``k``, the index in :attr:`devices` of the device that runs it: the
        schedule's placement (``k % P`` but for ``v_shape``: ``partitioner.runtime.placement``).

        Example:
            >>> plan = Plan("pipeline", ("cpu", "cpu"), tuple(
            ...     Stage(k, "cpu", (f"l{k}",)) for k in range(4)), schedule="interleaved",
            ...     virtual_stages=2)
            >>> plan.placement
            (0, 1, 0, 1)
        """
        p, v = len(self.devices), self.virtual_stages
        kind = SCHEDULES.get(self.schedule)
        return kind.place(p, v) if kind is not None else looped(p, v)

    def __hash__(self) -> int:
        return hash((self.strategy, self.devices, self.stages, self.chunks, self.checkpoint,
                     self.schedule, self.virtual_stages, self.precision,
                     self.optimizer_sharding, self.sequence_parallel))

    def explain(self) -> str:
        """The planner's ranked candidates and why this one won (``partitioner.planning.auto``)."""
        return explain(self.candidates)

    @property
    def balance(self) -> tuple[int, ...]:
        """Layers per stage (torchgpipe's ``balance``)."""
        return tuple(len(s.layers) for s in self.stages)

    @property
    def layers(self) -> tuple[str, ...]:
        """Every layer, in order."""
        return tuple(name for s in self.stages for name in s.layers)

    def table(self) -> str:
        """The plan as a text table, one row per stage."""
        rows = [("stage", "device", "layers", "first .. last", "time/mb", "memory", "params")]
        for s in self.stages:
            span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
            rows.append((str(s.index), s.device, str(len(s.layers)), span,
                         _ms(s.predicted_time), _bytes(s.predicted_memory),
                         _bytes(s.param_bytes)))
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        summary = (f"{self.strategy}: {len(self.stages)} stages, chunks={self.chunks}, "
                   f"checkpoint={self.checkpoint}, schedule={self.schedule}")
        if self.virtual_stages > 1:
            summary += (f" ({self.virtual_stages} virtual stages on each of "
                        f"{len(self.devices)} devices)")
        if self.precision != "fp32":
            summary += f", precision={self.precision}"
        if self.mesh is not None and (self.mesh.dp, self.mesh.tp) != (1, 1):
            summary += f", mesh dp={self.mesh.dp} pp={self.mesh.pp} tp={self.mesh.tp}"
        if self.shard_specs:
            summary += f", {len(self.shard_specs)} sharded parameters"
        if self.sequence_parallel:
            summary += ", sequence parallel"
        if self.predicted_step_time is not None:
            summary += f", predicted step {_ms(self.predicted_step_time)}"
        if self.predicted_bubble is not None:
            summary += f", bubble {self.predicted_bubble:.0%}"
        return "\n".join([summary, *lines])

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the file format's name and version."""
        body = {k: v for k, v in asdict(self).items()
                if k not in ("shard_specs", "planner", "fingerprint")}
        body["shard_specs"] = {name: asdict(s) for name, s in self.shard_specs.items()}
        body["planner"] = _planner_to_dict(self.planner)
        body["fingerprint"] = self.fingerprint.to_dict() if self.fingerprint else None
        return {"format": FORMAT, "version": VERSION, **body}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (validated, no code run).

        Raises:
            PlanFormatError: listing every field that breaks the format
                (``plan_schema.json``), or what the fields say together that cannot be.
        """
        if not isinstance(data, dict):
            raise PlanFormatError(f"a plan is a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise PlanFormatError(f"format is {data.get('format')!r}, expected {FORMAT!r}: not "
                                  "a plan file; write one with plan.save(path) or "
                                  "`partitioner plan MODEL -o plan.json`")
        if data.get("version") != VERSION:
            raise PlanFormatError(f"plan file version {data.get('version')!r}; this "
                                  f"partitioner reads version {VERSION}")
        check_document(data, "the plan", PlanFormatError)
        problems = document_problems(data)
        if problems:
            raise PlanFormatError("invalid plan:\n" + "\n".join(f"  {p}" for p in problems))
        return cls(**_fields_from_dict(data))

    def to_json(self) -> str:
        """The plan file's text: indented JSON, short lists on one line, one name a line."""
        return readable_json(self.to_dict()) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan as indented JSON (see :meth:`to_json`).

        Raises:
            PlanWriteError: naming the path, when it is not a path (``str`` or
                ``os.PathLike``), its folder is missing, it is a folder, or it cannot be
                written.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise PlanWriteError(f"Plan.save({path!r}): {type(path).__name__} is not a file "
                                 "path; pass a str or pathlib.Path, e.g. "
                                 "plan.save('plan.json')")
        target = Path(path)
        if not target.parent.is_dir():
            raise PlanWriteError(f"cannot save the plan to {str(path)!r}: folder "
                                 f"{str(target.parent)!r} does not exist; create it first "
                                 f"(os.makedirs({str(target.parent)!r})) or pass a path in "
                                 "an existing folder")
        try:
            target.write_text(self.to_json())
        except OSError as error:
            raise PlanWriteError(f"cannot save the plan to {str(path)!r}: "
                                 f"{error.strerror or error}; pass a writable file path") \
                from error

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanFormatError: naming the path, when it is missing, a directory, not UTF-8
                text, larger than ``partitioner.plans.documents.MAX_DOCUMENT_BYTES``, not
                JSON, nested too deeply, or not a valid plan.
        """
        data = parse_json(read_text(path, PlanFormatError), path, PlanFormatError)
        try:
            return cls.from_dict(data)
        except PlanFormatError as error:
            raise PlanFormatError(f"plan file {str(path)!r}: {error}") from error


def _fields_from_dict(data: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of a checked plan document (integral floats made ints)."""
    body = {k: v for k, v in data.items() if k not in ("format", "version")}
    mesh, shards = body.get("mesh"), body.get("shard_specs") or {}
    printed = body.get("fingerprint")
    body.update(
        stages=tuple(_stage(s) for s in body["stages"]), devices=tuple(body["devices"]),
        chunks=int(body.get("chunks", 1)), notes=tuple(body.get("notes", ())),
        virtual_stages=int(body.get("virtual_stages", 1)),
        mesh=Mesh(**{k: int(v) for k, v in mesh.items()}) if mesh is not None else None,
        shard_specs={str(k): ShardSpec(int(v["dim"]), v["kind"]) for k, v in shards.items()},
        planner=_planner_from_dict(body.get("planner")),
        fingerprint=Fingerprint.from_dict(printed) if printed else None,
        candidates=tuple(body.get("candidates", ())))
    return body


def _stage(data: dict[str, Any]) -> Stage:
    counts = ("index", "predicted_memory", "param_bytes", "send_bytes")
    fixed: dict[str, Any] = {k: int(v) if k in counts and v is not None else v
                             for k, v in data.items()}
    return Stage(**{**fixed, "layers": tuple(data["layers"])})


def _planner_to_dict(planner: PlannerInputs | None) -> dict[str, Any] | None:
    if planner is None:
        return None
    body = {f.name: getattr(planner, f.name) for f in fields(planner)}
    body["signature"] = planner.signature.to_dict() if planner.signature else None
    body["mesh"] = asdict(planner.mesh) if planner.mesh is not None else None
    return body


def _planner_from_dict(data: dict[str, Any] | None) -> PlannerInputs | None:
    if data is None:
        return None
    tuples = ("balance", "split_points", "memory_limit", "example_inputs")
    body: dict[str, Any] = {k: tuple(v) if k in tuples and v is not None else v
                            for k, v in data.items()}
    if body.get("balance") is not None:
        body["balance"] = tuple(int(b) for b in body["balance"])
    signature = body.get("signature")
    body["signature"] = InputSignature.from_dict(signature) if signature is not None else None
    mesh = body.get("mesh")
    body["mesh"] = Mesh(**{k: int(v) for k, v in mesh.items()}) if mesh is not None else None
    return PlannerInputs(**body)


def readable_json(value: Any, indent: int = 2, width: int = 88) -> str:
    """JSON that diffs well: containers of scalars that fit in ``width`` on one line
    (a shape, a device list), longer ones one item a line (a stage's layers).

    Example:
        >>> print(readable_json({"shape": [2, 3], "layers": ["a" * 50, "b" * 50]}))
        {
          "shape": [2, 3],
          "layers": [
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
          ]
        }
    """
    return _dump(value, 0, indent, width)


def _dump(value: Any, depth: int, indent: int, width: int) -> str:
    if not isinstance(value, (dict, list, tuple)) or not value:
        return json.dumps(value)
    flat = json.dumps(value, separators=(", ", ": "))
    if len(flat) + depth * indent <= width and _shallow(value):
        return flat
    pad, inner = " " * (indent * depth), " " * (indent * (depth + 1))
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(str(k))}: {_dump(v, depth + 1, indent, width)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    items = [f"{inner}{_dump(v, depth + 1, indent, width)}" for v in value]
    return "[\n" + ",\n".join(items) + f"\n{pad}]"


def _shallow(value: dict[str, Any] | list[Any] | tuple[Any, ...]) -> bool:
    """Whether every member is a scalar or a list of scalars (a shape)."""
    members = value.values() if isinstance(value, dict) else value
    return all(not isinstance(v, (dict, list, tuple))
               or (isinstance(v, (list, tuple)) and not any(isinstance(x, (dict, list, tuple))
                                                            for x in v))
               for v in members)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)
