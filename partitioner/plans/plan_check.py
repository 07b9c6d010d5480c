"""Checking a plan document field by field, as ``plan_schema.json`` says, in plain Python.

``Plan.from_dict`` runs :func:`document_problems` before building anything, so a plan file
that the shipped JSON Schema refuses is refused on load too (``jsonschema`` is only a test
dependency; a test feeds the same bad documents to both). Every problem is collected, each
prefixed by its key path, and raised once. What a schema cannot say (a stage's device must
be its entry in ``devices``, indices run 0..P-1, the fingerprint's digest matches its
entries) is checked after, by the dataclasses themselves.

Integers follow JSON Schema: ``2.0`` is an integer (JSON does not tell them apart), ``true``
is not.

Example:
    >>> for line in document_problems({"format": "partitioner.plan", "version": 1,
    ...                                "strategy": 123, "devices": ["cpu"], "stages": [],
    ...                                "notes": "a string"}):
    ...     print(line)
    strategy: 123; give a string such as "pipeline"
    stages: []; give a non-empty list of stages
    notes: 'a string'; give a list of strings
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from partitioner.plans.documents import unknown_keys
from partitioner.plans.signature import entry_problems
from partitioner.runtime.checkpointing import CHECKPOINT_MODES
from partitioner.runtime.precision import PRECISIONS
from partitioner.runtime.tensor_parallel.sharding import SPLIT_KINDS

__all__ = ["document_problems", "TOP_KEYS", "STAGE_KEYS", "CAPTURES", "CHECKPOINTS"]

TOP_KEYS = ("format", "version", "strategy", "devices", "stages", "chunks", "checkpoint",
            "schedule", "capture", "predicted_step_time", "predicted_bubble", "notes",
            "candidates", "mesh", "shard_specs", "planner", "fingerprint", "virtual_stages",
            "precision", "optimizer_sharding", "sequence_parallel")
STAGE_KEYS = ("index", "device", "layers", "predicted_time", "predicted_memory",
              "param_bytes", "send_bytes")
CAPTURES = ("fx", "export")
CHECKPOINTS = CHECKPOINT_MODES
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

Check = Callable[[Any, str], list[str]]


def document_problems(data: dict[str, Any]) -> list[str]:
    """Every way ``data`` breaks the plan file format, one line each (empty: none)."""
    problems = unknown_keys(data, TOP_KEYS, "")
    problems += [f"{key}: missing; {hint}" for key, hint in (
        ("strategy", 'give how the split was made, e.g. "pipeline"'),
        ("devices", 'give one device per stage, e.g. ["cpu", "cpu"]'),
        ("stages", "give the stages, each with its index, device and layers"))
        if key not in data]
    for key, check in _FIELDS.items():
        if key in data:
            problems += check(data[key], key)
    return problems


def is_int(value: Any, least: int = 0) -> bool:
    """An integer ``>= least`` as JSON Schema counts them (``2.0`` yes, ``True`` no)."""
    if isinstance(value, float) and value.is_integer():
        return value >= least
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _string(example: str) -> Check:
    def check(value: Any, where: str) -> list[str]:
        return [] if isinstance(value, str) else [f"{where}: {value!r}; give a string such as "
                                                  f'"{example}"']
    return check


def _strings(least: int, what: str = "strings", nullable: bool = False) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if value is None and nullable:
            return []
        if isinstance(value, (list, tuple)) and len(value) >= least and all(
                isinstance(v, str) for v in value):
            return []
        return [f"{where}: {value!r}; give a {'non-empty ' if least else ''}list of {what}"]
    return check


def _integer(least: int, nullable: bool = False) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if (value is None and nullable) or is_int(value, least):
            return []
        return [f"{where}: {value!r}; give an integer >= {least}"
                + (" or null" if nullable else "")]
    return check


def _number(top: float | None = None) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if value is None or (_is_number(value) and 0 <= value and (top is None or value <= top)):
            return []
        bound = f"between 0 and {top}" if top is not None else ">= 0"
        return [f"{where}: {value!r}; give a number {bound}, or null"]
    return check


def _boolean() -> Check:
    def check(value: Any, where: str) -> list[str]:
        return [] if isinstance(value, bool) else [f"{where}: {value!r}; give true or false"]
    return check


def _choice(choices: tuple[str, ...]) -> Check:
    def check(value: Any, where: str) -> list[str]:
        return [] if value in choices else [f"{where}: {value!r}; use one of "
                                            f"{', '.join(choices)}"]
    return check


def _const(expected: Any) -> Check:
    def check(value: Any, where: str) -> list[str]:
        same = value == expected and isinstance(value, bool) == isinstance(expected, bool)
        return [] if same else [f"{where}: {value!r}; it must be {expected!r}"]
    return check


def _array(least: int, item: Check, what: str, nullable: bool = False) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if value is None and nullable:
            return []
        if not isinstance(value, (list, tuple)) or len(value) < least:
            return [f"{where}: {value!r}; give a {'non-empty ' if least else ''}list of {what}"
                    + (" or null" if nullable else "")]
        return [p for k, v in enumerate(value) for p in item(v, f"{where}[{k}]")]
    return check


def _object(fields: dict[str, Check], required: tuple[str, ...], what: str,
            nullable: bool = False) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if value is None and nullable:
            return []
        if not isinstance(value, dict):
            return [f"{where}: {value!r}; give {what}" + (" or null" if nullable else "")]
        problems = unknown_keys(value, tuple(fields), f"{where}.")
        problems += [f"{where}.{k}: missing" for k in required if k not in value]
        return problems + [p for k, c in fields.items() if k in value
                           for p in c(value[k], f"{where}.{k}")]
    return check


def _mapping(item: Check, what: str) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if not isinstance(value, dict):
            return [f"{where}: {value!r}; give {what}"]
        return [p for k, v in value.items() for p in item(v, f"{where}[{k!r}]")]
    return check


def _any_object(nullable: bool) -> Check:
    def check(value: Any, where: str) -> list[str]:
        if isinstance(value, dict) or (value is None and nullable):
            return []
        return [f"{where}: {value!r}; give an object" + (" or null" if nullable else "")]
    return check


def _digest(value: Any, where: str) -> list[str]:
    if isinstance(value, str) and _DIGEST.fullmatch(value):
        return []
    return [f"{where}: {value!r}; give 'sha256:' and 64 lowercase hex digits (or drop the "
            "fingerprint to skip the check)"]


def _positive(value: Any, where: str) -> list[str]:
    return [] if _is_number(value) and value > 0 else [f"{where}: {value!r}; give a number > 0"]


def _reserve(value: Any, where: str) -> list[str]:
    if value is None or (_is_number(value) and 0 <= value < 1):
        return []
    return [f"{where}: {value!r}; give a number in [0, 1) (the share of memory left unused), "
            "or null"]


def _signature(value: Any, where: str) -> list[str]:
    shape = _object({"args": _array(0, entry_problems, "inputs"),
                     "kwargs": _mapping(entry_problems, "an object of keyword inputs")},
                    (), "an object with args and kwargs", nullable=True)
    return shape(value, where)


_TENSORS = _mapping(_object({"shape": _array(0, _integer(0), "sizes >= 0"),
                             "dtype": _string("float32")}, ("shape", "dtype"),
                            'an object such as {"shape": [8, 4], "dtype": "float32"}'),
                    "an object of tensor name to shape and dtype")

_STAGE = _object({"index": _integer(0), "device": _string("cpu"),
                  "layers": _strings(1, "layer names"),
                  "predicted_time": _number(), "predicted_memory": _integer(0, nullable=True),
                  "param_bytes": _integer(0, nullable=True),
                  "send_bytes": _integer(0, nullable=True)},
                 ("index", "device", "layers"), "a stage object with index, device and layers")

_MESH = _object({axis: _integer(1) for axis in ("dp", "pp", "tp")}, (),
               'an object such as {"dp": 1, "pp": 2, "tp": 1}', nullable=True)

_FIELDS: dict[str, Check] = {
    "format": _const("partitioner.plan"),
    "version": _const(1),
    "strategy": _string("pipeline"),
    "devices": _strings(1, "device strings"),
    "stages": _array(1, _STAGE, "stages"),
    "chunks": _integer(1),
    "virtual_stages": _integer(1),
    "precision": _choice(PRECISIONS),
    "optimizer_sharding": _boolean(),
    "sequence_parallel": _boolean(),
    "checkpoint": _choice(CHECKPOINTS),
    "schedule": _string("gpipe"),
    "capture": _choice(CAPTURES),
    "predicted_step_time": _number(),
    "predicted_bubble": _number(1),
    "notes": _strings(0),
    "candidates": _array(0, _any_object(nullable=False), "objects"),
    "mesh": _MESH,
    "shard_specs": _mapping(_object({"dim": _integer(0), "kind": _choice(SPLIT_KINDS)},
                                    ("dim", "kind"), 'an object such as '
                                    '{"dim": 0, "kind": "colwise"}'),
                            "an object of parameter name to shard spec"),
    "planner": _object({"strategy": _string("auto"),
                        "balance": _array(0, _integer(1), "layer counts >= 1", nullable=True),
                        "split_points": _strings(0, "module names", nullable=True),
                        "memory_limit": _array(0, _positive, "byte counts > 0", nullable=True),
                        "example_inputs": _strings(0, "input descriptions"),
                        "spec": _any_object(nullable=True),
                        "signature": _signature,
                        "memory_reserve": _reserve, "mesh": _MESH},
                       (), "an object of what the planner was asked", nullable=True),
    "fingerprint": _object({"digest": _digest, "model": _string("GPT2LMHeadModel"),
                            "modules": _strings(0, "module names"), "parameters": _TENSORS,
                            "buffers": _TENSORS},
                           ("digest", "modules", "parameters"), "a fingerprint object",
                           nullable=True),
}
