"""The plan: which layers run where, how, and what that is predicted to cost.

A :class:`Plan` is a frozen, validated, printable value: the stages (their layers by module
name, device and predicted cost), the micro-batch count, schedule and checkpoint mode. It is
the only thing the partitioner hands the runtime besides the stage graphs, and it can be
written to JSON and read back.

Example:
    >>> stage = Stage(0, "cpu", ("0", "1"))
    >>> plan = Plan(strategy="pipeline", devices=("cpu",), stages=(stage,), chunks=2)
    >>> plan.balance
    (2,)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partitioner.errors import PartitionError

__all__ = ["Stage", "Plan", "PlanFormatError", "FORMAT", "VERSION"]

FORMAT = "partitioner.plan"
VERSION = 1


class PlanFormatError(PartitionError, ValueError):
    """A plan (or plan file) is malformed."""


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
    """

    index: int
    device: str
    layers: tuple[str, ...]
    predicted_time: float | None = None
    predicted_memory: int | None = None
    param_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanFormatError(f"stage {self.index} has no layers; every stage needs one")
        if self.index < 0:
            raise PlanFormatError(f"stage index {self.index} is negative")


@dataclass(frozen=True)
class Plan:
    """A pipeline partition of a model over devices.

    Attributes:
        strategy: how it was made ("pipeline", "balance", "split_points", ...).
        devices: one device string per stage.
        stages: the stages, in order.
        chunks: micro-batches per mini-batch.
        checkpoint: "always", "except_last" or "never".
        schedule: the pipeline schedule ("gpipe").
        capture: how the model was captured ("fx" or "export").
        predicted_step_time: seconds per training step, if costed.
        predicted_bubble: idle fraction of the schedule, if costed.
        notes: the planner's remarks (why this plan), free text.
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

    def __post_init__(self) -> None:
        problems = []
        if len(self.devices) != len(self.stages):
            problems.append(f"{len(self.stages)} stages but {len(self.devices)} devices")
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            problems.append(f"stage indices {[s.index for s in self.stages]} are not 0..P-1")
        if self.chunks < 1:
            problems.append(f"chunks={self.chunks}; it must be >= 1")
        if self.checkpoint not in ("always", "except_last", "never"):
            problems.append(f"checkpoint={self.checkpoint!r}; use always, except_last or never")
        names = [name for s in self.stages for name in s.layers]
        if len(set(names)) != len(names):
            problems.append("a layer appears in two stages")
        if problems:
            raise PlanFormatError("invalid plan: " + "; ".join(problems))

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
        if self.predicted_step_time is not None:
            summary += f", predicted step {_ms(self.predicted_step_time)}"
        if self.predicted_bubble is not None:
            summary += f", bubble {self.predicted_bubble:.0%}"
        return "\n".join([summary, *lines])

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the file format's name and version."""
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (validated, no code run)."""
        if data.get("format") != FORMAT:
            raise PlanFormatError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
        if data.get("version") != VERSION:
            raise PlanFormatError(f"plan file version {data.get('version')!r}; this "
                                  f"partitioner reads version {VERSION}")
        body = {k: v for k, v in data.items() if k not in ("format", "version")}
        try:
            stages = tuple(Stage(**{**s, "layers": tuple(s["layers"])}) for s in body.pop("stages"))
            return cls(**{**body, "stages": stages, "devices": tuple(body["devices"]),
                          "notes": tuple(body.get("notes", ()))})
        except (TypeError, KeyError) as error:
            raise PlanFormatError(f"malformed plan: {error}") from error

    def save(self, path: str | Path) -> None:
        """Write the plan as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise PlanFormatError(f"{path} is not JSON: {error}") from error
        return cls.from_dict(data)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"
