"""Hand-written plan specs: the few decisions a person makes; the compiler fills in the rest.

A spec names stages by module-name globs (or split points, or a balance), tensor-parallel
rules and options; everything else (the layers no pattern names, devices not given, costs,
the fingerprint) comes from the model when the spec is compiled into a :class:`Plan` by
``partition(model, devices, plan=spec)`` or ``make_plan``. Specs are YAML or JSON (YAML for
its comments; any JSON spec is valid YAML too): see ``docs/design/002-plan-files.md``.

::

    # spec.yaml
    chunks: 4
    checkpoint: never
    stages:
      - {layers: "h.[0-2]", device: cpu}   # wte, wpe, drop join stage 0 (nothing names them)
      - {layers: "h.[3-5]"}                # ln_f and lm_head join the last stage
    tensor_parallel:
      "h.*.mlp.c_fc": colwise
      "h.*.mlp.c_proj": rowwise

Validation collects every problem and names the key that is wrong, e.g.
``stages[2].layers: pattern 'blocks.9*' matches no layer; layers are stem, blocks.0 ..
blocks.5, head``.

Example:
    >>> spec = Spec.from_dict({"stages": [{"layers": "b*"}, {"layers": "head"}], "chunks": 2})
    >>> stage_boundaries(spec, ["stem", "blocks.0", "blocks.1", "head"])[0]
    (0, 3, 4)
    >>> try:
    ...     Spec.from_dict({"stages": [{"layer": "x"}]})
    ... except SpecError as error:
    ...     print(error)
    invalid spec:
      stages[0].layer: unknown key; did you mean 'layers'?
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import nn

from partitioner.errors import PartitionError, SpecError
from partitioner.plans.documents import (
    check_document,
    parse_json,
    parse_yaml,
    read_text,
    unknown_keys,
)
from partitioner.plans.plan import SHARD_KINDS, ShardSpec
from partitioner.runtime.checkpointing import CHECKPOINT_MODES
from partitioner.runtime.schedule_registry import Runtime, schedule_names

__all__ = ["Spec", "StageSpec", "SpecError", "resolve_spec", "stage_boundaries", "shard_specs",
           "read_document", "summarize_names"]

SPEC_FORMAT = "partitioner.plans.spec"
_KEYS = ("format", "version", "devices", "stages", "split_points", "balance", "chunks",
         "checkpoint", "schedule", "strategy", "memory_limit", "mesh", "tensor_parallel")
_STAGE_KEYS = ("layers", "device")
#: Which dimension each kind splits, by the parameter's own name (Megatron's convention:
#: a row-parallel Linear's bias is added after the all-reduce, so it is not split).
_KIND_DIMS = {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1},
              "vocab": {"weight": 0}}


@dataclass(frozen=True)
class StageSpec:
    """One stage of a spec: module-name globs for its layers and its device, each optional."""

    layers: tuple[str, ...] | None = None
    device: str | None = None


@dataclass(frozen=True)
class Spec:
    """A hand-written plan spec (see the module docstring).

    Attributes:
        stages: the stages, each with optional layer globs and device.
        devices: one device per stage (alternative to devices in ``stages``).
        split_points: module names at which a stage begins (instead of layer globs).
        balance: layers per stage (instead of layer globs).
        chunks, checkpoint, schedule, strategy, memory_limit: as ``partition()`` takes them.
        mesh: ``{"dp": n, "tp": n}`` recorded in the plan (execution needs dp = tp = 1 today).
        tensor_parallel: module or parameter glob -> shard kind, or ``{"kind", "dim"}``.
        source: the spec as written, kept in the plan for the record.
    """

    stages: tuple[StageSpec, ...] = ()
    devices: tuple[str, ...] | None = None
    split_points: tuple[str, ...] | None = None
    balance: tuple[int, ...] | None = None
    chunks: int | None = None
    checkpoint: str | None = None
    schedule: str | None = None
    strategy: str | None = None
    memory_limit: float | tuple[float, ...] | None = None
    mesh: dict[str, int] = field(default_factory=dict)
    tensor_parallel: dict[str, ShardSpec | str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fixes_split(self) -> bool:
        """Whether the spec decides the stage boundaries (else the planner does)."""
        return (self.split_points is not None or self.balance is not None
                or any(s.layers is not None for s in self.stages))

    @property
    def stage_devices(self) -> tuple[str, ...] | None:
        """The devices the spec names, from ``devices`` or from every stage's ``device``."""
        if self.devices is not None:
            return self.devices
        if self.stages and all(s.device is not None for s in self.stages):
            return tuple(str(s.device) for s in self.stages)
        return None

    @classmethod
    def from_dict(cls, data: Any) -> Spec:
        """Validate a parsed spec.

        Raises:
            SpecError: listing every problem, each prefixed by the key it is about.
        """
        if not isinstance(data, dict):
            raise SpecError(f"a spec is a mapping of keys such as 'stages' and 'chunks', got "
                            f"{type(data).__name__}")
        check_document(data, "the spec", SpecError)
        problems = unknown_keys(data, _KEYS, "")
        if data.get("format", SPEC_FORMAT) != SPEC_FORMAT:
            problems.append(f"format: {data['format']!r}; a spec has format {SPEC_FORMAT!r} "
                            "or none (plan files have 'partitioner.plan')")
        if data.get("version", 1) != 1:
            problems.append(f"version: {data['version']!r}; this partitioner reads version 1")
        stages = _stages(data.get("stages"), problems)
        values: dict[str, Any] = {
            "devices": _str_list(data, "devices", problems),
            "split_points": _str_list(data, "split_points", problems),
            "balance": _int_list(data, "balance", problems),
            "chunks": _positive(data, "chunks", problems),
            "checkpoint": _choice(data, "checkpoint", CHECKPOINT_MODES, problems),
            # A spec's schedule is run, so only a schedule some runtime executes.
            "schedule": _choice(data, "schedule", schedule_names(Runtime), problems),
            "strategy": _choice(data, "strategy", ("auto", "pipeline"), problems),
            "memory_limit": _memory(data, problems),
            "mesh": _mesh(data.get("mesh"), problems),
            "tensor_parallel": _rules(data.get("tensor_parallel"), problems),
        }
        problems += _conflicts(data, stages, values)
        if problems:
            raise SpecError("invalid spec:\n" + "\n".join(f"  {p}" for p in problems))
        return cls(stages=stages, source=data, **values)

    @classmethod
    def load(cls, path: str | Path) -> Spec:
        """Read a spec file (``.yaml``/``.yml`` as YAML, anything else as JSON)."""
        return cls.from_dict(read_document(path))


def read_document(path: str | Path) -> dict[str, Any]:
    """Parse a JSON or YAML file into a mapping; never runs code (``yaml.safe_load``).

    ``.yaml``/``.yml`` files are read as YAML, anything else as JSON. The size is checked
    before parsing, the depth and expansion after (``partitioner.plans.documents``).

    Raises:
        SpecError: naming the path, when the file is missing or a directory, cannot be read,
            is too large, is not UTF-8 text, does not parse, nests too deeply, or is not a
            mapping; or when it is YAML and PyYAML is absent.
    """
    text = read_text(path, SpecError, "plan or spec file")
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        data = parse_yaml(text, path, SpecError, "spec")
    else:
        data = parse_json(text, path, SpecError, "plan or spec file")
    if not isinstance(data, dict):
        shown = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(f"{str(path)!r} is {shown}, not a mapping; a plan or spec file holds "
                        "keys such as 'stages' and 'chunks' at its top level")
    return data


def resolve_spec(spec: Spec, layers: Sequence[str], model: nn.Module
                 ) -> tuple[tuple[int, ...] | None, tuple[str, ...], dict[str, ShardSpec]]:
    """Resolve a spec's names against a model: stage boundaries (``None`` when the spec
    leaves the split to the planner), notes on the layers filled in, and shard specs.

    Raises:
        SpecError: every problem of :func:`stage_boundaries` and :func:`shard_specs`, at once.
    """
    cuts: tuple[int, ...] | None = None
    notes: tuple[str, ...] = ()
    problems: list[str] = []
    if any(s.layers is not None for s in spec.stages):
        cuts, notes, problems = _boundaries(spec, layers)
    shards, shard_problems = _shards(spec, model)
    _raise(problems + shard_problems)
    return cuts, notes, shards


def stage_boundaries(spec: Spec, layers: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Stage boundaries from the stages' layer globs, and notes on the layers filled in.

    Stage ``j`` runs from its first matching layer up to the next stage's first matching
    layer; stage 0 starts at the first layer. Layers no pattern names join the stage whose
    range they fall in (embeddings before the first named block join stage 0).

    Raises:
        SpecError: a pattern matching no layer, stages out of model order, or a pattern
            reaching into another stage's range.
    """
    cuts, notes, problems = _boundaries(spec, layers)
    _raise(problems)
    return cuts, notes


def _raise(problems: list[str]) -> None:
    if problems:
        raise SpecError("spec does not fit the model:\n" + "\n".join(f"  {p}" for p in problems))


def _boundaries(spec: Spec, layers: Sequence[str]
                ) -> tuple[tuple[int, ...], tuple[str, ...], list[str]]:
    problems: list[str] = []
    matched: list[list[int]] = []
    for j, stage in enumerate(spec.stages):
        if stage.layers is None:
            problems.append(f"stages[{j}].layers: missing; name layers for every stage or "
                            "for none (then the planner chooses the split)")
            matched.append([])
            continue
        hits: set[int] = set()
        for p, pattern in enumerate(stage.layers):
            found = {k for k, name in enumerate(layers) if layer_matches(pattern, name)}
            if not found:
                key = f"stages[{j}].layers" + (f"[{p}]" if len(stage.layers) > 1 else "")
                problems.append(f"{key}: pattern {pattern!r} matches no layer; layers are "
                                f"{summarize_names(layers)}")
            hits |= found
        matched.append(sorted(hits))
    if not problems:
        problems += _order_problems(matched, layers)
    if problems:
        return (), (), problems
    cuts = (0, *(hits[0] for hits in matched[1:]), len(layers))
    notes = []
    for j, run in enumerate(matched):
        extra = [layers[k] for k in range(cuts[j], cuts[j + 1]) if k not in set(run)]
        if extra:
            notes.append(f"stages[{j}] also takes {summarize_names(extra)} (no pattern names "
                         "them; they fall in its range)")
    return cuts, tuple(notes), []


def _order_problems(matched: list[list[int]], layers: Sequence[str]) -> list[str]:
    problems = []
    starts = [hits[0] for hits in matched]
    for j in range(1, len(matched)):
        if starts[j] <= starts[j - 1] or (j == 1 and starts[j] == 0):
            problems.append(f"stages[{j}].layers: its first layer {layers[starts[j]]} does not "
                            f"come after stages[{j - 1}]'s first layer "
                            f"{layers[starts[j - 1]]}; list stages in model order")
    if problems:
        return problems
    ends = [*starts[1:], len(layers)]
    for j, hits in enumerate(matched):
        stray = [layers[k] for k in hits if k >= ends[j]]
        if stray:
            problems.append(f"stages[{j}].layers: matches {summarize_names(stray)}, which "
                            f"come after stages[{j + 1}] begins at {layers[ends[j]]}; a stage "
                            "is a contiguous run of layers, so narrow the pattern")
    return problems


def layer_matches(pattern: str, layer: str) -> bool:
    """Whether a glob names a layer: the layer itself, or a module containing it.

    ``#2`` suffixes of reused modules are ignored, and the flattened spelling ``0_1`` of
    ``0.1`` matches too.
    """
    name = layer.split("#")[0]
    for candidate in (name, name.replace(".", "_")):
        if fnmatchcase(candidate, pattern) or candidate.startswith(pattern + "."):
            return True
    return False


def shard_specs(spec: Spec, model: nn.Module) -> dict[str, ShardSpec]:
    """Resolve the tensor-parallel rules to a shard spec per parameter name.

    A rule's glob may name modules (their own ``weight`` and ``bias`` are split as the kind
    says) or parameters. Only names are checked here; the tensor-parallel pass executes them.

    Raises:
        SpecError: a glob naming nothing, a dimension a parameter does not have, or two
            rules splitting one parameter differently.
    """
    result, problems = _shards(spec, model)
    _raise(problems)
    return result


def _shards(spec: Spec, model: nn.Module) -> tuple[dict[str, ShardSpec], list[str]]:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    result: dict[str, ShardSpec] = {}
    problems: list[str] = []
    for pattern, rule in spec.tensor_parallel.items():
        key = f"tensor_parallel[{pattern!r}]"
        kind = rule if isinstance(rule, str) else rule.kind
        # (parameter, named directly): a module's explicit dim is its weight's; its bias
        # follows the kind's rule.
        targets = [(n, True) for n in params if fnmatchcase(n, pattern)]
        for name, module in modules.items():
            if name and fnmatchcase(name, pattern):
                targets += [(f"{name}.{leaf}", leaf == "weight")
                            for leaf, _ in module.named_parameters(recurse=False)]
        if not targets:
            near = difflib.get_close_matches(pattern, [*modules, *params], n=4, cutoff=0.5)
            problems.append(f"{key}: pattern matches no module or parameter; "
                            + (f"names like it: {', '.join(near)}" if near else
                               f"modules are {summarize_names([n for n in modules if n])}"))
            continue
        for name, direct in targets:
            leaf = name.rsplit(".", 1)[-1]
            explicit = isinstance(rule, ShardSpec) and direct
            dim = rule.dim if isinstance(rule, ShardSpec) and explicit else \
                _KIND_DIMS[kind].get(leaf)
            if dim is None:
                continue  # e.g. a row-parallel bias: kept whole
            if dim >= params[name].dim():
                problems.append(f"{key}: {name} has {params[name].dim()} dimensions, so it "
                                f"cannot be split along dim {dim}")
                continue
            new = ShardSpec(dim, kind)
            if result.setdefault(name, new) != new:
                problems.append(f"{key}: {name} is already split as {result[name]} by an "
                                "earlier rule; make the patterns disjoint")
    return result, problems


def summarize_names(names: Sequence[str], limit: int = 12) -> str:
    """Names joined by commas, runs like ``h.0, h.1, ..., h.47`` written ``h.0 .. h.47``.

    Example:
        >>> summarize_names(["wte", "h.0", "h.1", "h.2", "ln_f"])
        'wte, h.0 .. h.2, ln_f'
    """
    runs: list[list[str]] = []
    previous: tuple[str, int] | None = None
    for name in names:
        found = re.fullmatch(r"(.*?)(\d+)", name)
        key = (found.group(1), int(found.group(2))) if found else None
        if key and previous and key[0] == previous[0] and key[1] == previous[1] + 1 and runs:
            runs[-1].append(name)
        else:
            runs.append([name])
        previous = key
    parts = [p for run in runs
             for p in (run if len(run) < 3 else [f"{run[0]} .. {run[-1]}"])]
    if len(parts) > limit:
        parts = [*parts[:limit - 1], f"... ({len(names)} in all)", parts[-1]]
    return ", ".join(parts)


def _stages(value: Any, problems: list[str]) -> tuple[StageSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        problems.append(f"stages: {value!r}; give a non-empty list of stages such as "
                        "[{layers: 'h.[0-5]', device: cpu}, ...]")
        return ()
    stages = []
    for j, entry in enumerate(value):
        key = f"stages[{j}]"
        if isinstance(entry, str):
            entry = {"layers": entry}
        if not isinstance(entry, dict):
            problems.append(f"{key}: {entry!r}; a stage is a mapping with 'layers' and/or "
                            "'device'")
            continue
        problems += unknown_keys(entry, _STAGE_KEYS, key + ".")
        layers = entry.get("layers")
        if isinstance(layers, str):
            layers = [layers]
        if layers is not None and (not isinstance(layers, list) or not layers
                                   or not all(isinstance(p, str) and p for p in layers)):
            problems.append(f"{key}.layers: {entry['layers']!r}; give a module-name glob or a "
                            "non-empty list of them")
            layers = None
        device = entry.get("device")
        if device is not None and not isinstance(device, str):
            problems.append(f"{key}.device: {device!r}; give a device string such as 'cpu'")
            device = None
        stages.append(StageSpec(tuple(layers) if layers is not None else None, device))
    return tuple(stages)


def _str_list(data: dict[str, Any], key: str, problems: list[str]) -> tuple[str, ...] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        problems.append(f"{key}: {value!r}; give a non-empty list of strings")
        return None
    return tuple(value)


def _int_list(data: dict[str, Any], key: str, problems: list[str]) -> tuple[int, ...] | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
        problems.append(f"{key}: {value!r}; give a non-empty list of positive integers")
        return None
    return tuple(value)


def _positive(data: dict[str, Any], key: str, problems: list[str]) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"{key}: {value!r}; give a positive integer")
        return None
    return value


def _choice(data: dict[str, Any], key: str, choices: tuple[str, ...],
            problems: list[str]) -> str | None:
    value = data.get(key)
    if value is not None and value not in choices:
        problems.append(f"{key}: {value!r}; use one of {', '.join(choices)}")
        return None
    return value


def _memory(data: dict[str, Any], problems: list[str]) -> float | tuple[float, ...] | None:
    value = data.get("memory_limit")
    if value is None:
        return None
    numbers = value if isinstance(value, list) else [value]
    if not numbers or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                              for v in numbers):
        problems.append(f"memory_limit: {value!r}; give bytes per device, one positive number "
                        "or one per device")
        return None
    return tuple(float(v) for v in numbers) if isinstance(value, list) else float(value)


def _mesh(value: Any, problems: list[str]) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"mesh: {value!r}; give a mapping such as {{dp: 1, tp: 2}}")
        return {}
    problems += unknown_keys(value, ("dp", "tp"), "mesh.")
    good = {}
    for axis in ("dp", "tp"):
        size = value.get(axis, 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(f"mesh.{axis}: {size!r}; give a positive integer")
        else:
            good[axis] = size
    return good


def _rules(value: Any, problems: list[str]) -> dict[str, ShardSpec | str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"tensor_parallel: {value!r}; give a mapping of module glob to kind, "
                        "such as {'h.*.mlp.c_fc': 'colwise'}")
        return {}
    rules: dict[str, ShardSpec | str] = {}
    for pattern, rule in value.items():
        key = f"tensor_parallel[{pattern!r}]"
        if isinstance(rule, str):
            if rule not in SHARD_KINDS:
                problems.append(f"{key}: kind {rule!r}; use one of {', '.join(SHARD_KINDS)}")
            else:
                rules[str(pattern)] = rule
        elif isinstance(rule, dict):
            problems += unknown_keys(rule, ("kind", "dim"), key + ".")
            try:
                rules[str(pattern)] = ShardSpec(rule.get("dim"), rule.get("kind"))  # type: ignore[arg-type]
            except PartitionError as error:
                problems.append(f"{key}: {error}")
        else:
            problems.append(f"{key}: {rule!r}; give a kind ({', '.join(SHARD_KINDS)}) or "
                            "{kind: ..., dim: ...}")
    return rules


def _conflicts(data: dict[str, Any], stages: tuple[StageSpec, ...],
               values: dict[str, Any]) -> list[str]:
    problems = []
    named = any(s.layers is not None for s in stages)
    ways = [k for k, present in (("stages[].layers", named),
                                 ("split_points", values["split_points"] is not None),
                                 ("balance", values["balance"] is not None)) if present]
    if len(ways) > 1:
        problems.append(f"{' and '.join(ways)}: give one way of splitting, not {len(ways)}")
    counts = {"stages": len(stages) or None,
              "devices": len(values["devices"]) if values["devices"] else None,
              "balance": len(values["balance"]) if values["balance"] else None,
              "split_points": (len(values["split_points"]) + 1
                               if values["split_points"] else None)}
    given = {k: n for k, n in counts.items() if n is not None}
    if len(set(given.values())) > 1:
        said = ", ".join(f"{k} says {n}" for k, n in given.items())
        problems.append(f"stages: the number of stages disagrees ({said}); make them agree")
    if values["devices"] is not None and any(s.device is not None for s in stages):
        problems.append("devices: given both at the top and in stages[]; keep one")
    return problems
