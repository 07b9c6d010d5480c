"""A fingerprint of a model's structure: which model a plan was made for.

A plan names layers by module name, so it only means something for a model with those
modules, parameters, shapes and dtypes. :func:`fingerprint` records exactly that (never the
weights' values, nor the device, so a plan made on a ``meta`` model applies to the real one)
with a stable SHA-256 digest over it; :func:`differences` lists, in words, what separates two
fingerprints, so refusing a plan can say why.

Example:
    >>> from torch import nn
    >>> a = fingerprint(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    >>> b = fingerprint(nn.Sequential(nn.Linear(4, 6), nn.ReLU()))
    >>> a.digest == fingerprint(nn.Sequential(nn.Linear(4, 8), nn.ReLU())).digest
    True
    >>> differences(a, b)
    ['parameter 0.weight: shape (8, 4) in the plan, (6, 4) in the model', \
'parameter 0.bias: shape (8,) in the plan, (6,) in the model']
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from torch import nn

from partitioner.errors import PlanFormatError

__all__ = ["Fingerprint", "TensorEntry", "fingerprint", "differences"]


@dataclass(frozen=True)
class TensorEntry:
    """One parameter or buffer: its qualified name, shape and dtype (``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Fingerprint:
    """The structure of a model.

    Attributes:
        digest: ``"sha256:<hex>"`` over the modules, parameters and buffers below.
        model: the model's class name (for people; not part of the digest, so a renamed
            class of the same shape still matches).
        modules: every submodule's qualified name, in model order (``""`` is the root).
        parameters: every parameter (tied ones once), in model order.
        buffers: every buffer, in model order.
    """

    digest: str
    model: str
    modules: tuple[str, ...]
    parameters: tuple[TensorEntry, ...]
    buffers: tuple[TensorEntry, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: name-keyed mappings, so a diff shows one tensor per line."""
        return {"digest": self.digest, "model": self.model, "modules": list(self.modules),
                "parameters": _entries_to_dict(self.parameters),
                "buffers": _entries_to_dict(self.buffers)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        """Read :meth:`to_dict` output.

        Raises:
            PlanFormatError: when the digest does not match the entries (the file was
                edited by hand); a ``ValueError`` too. The fields' types are checked
                before, with the rest of the plan (``partitioner.plans.plan_check``).
            KeyError, TypeError: when a field is missing or of the wrong type.
        """
        modules = tuple(str(m) for m in data["modules"])
        params = _entries_from_dict(data["parameters"])
        buffers = _entries_from_dict(data.get("buffers", {}))
        digest = _digest(modules, params, buffers)
        if data["digest"] != digest:
            raise PlanFormatError(f"fingerprint digest {data['digest']!r} does not match its "
                                  f"entries ({digest!r}); the modules or tensors were edited "
                                  "by hand; re-plan the model, or drop the fingerprint to skip "
                                  "the check")
        return cls(digest, str(data.get("model", "")), modules, params, buffers)


def fingerprint(model: nn.Module) -> Fingerprint:
    """The :class:`Fingerprint` of ``model`` (works on ``meta`` models; reads no values)."""
    modules = tuple(name for name, _ in model.named_modules())
    params = tuple(_entry(n, t) for n, t in model.named_parameters())
    buffers = tuple(_entry(n, t) for n, t in model.named_buffers())
    return Fingerprint(_digest(modules, params, buffers), type(model).__name__, modules, params,
                       buffers)


def differences(expected: Fingerprint, actual: Fingerprint, limit: int = 6) -> list[str]:
    """What separates the plan's model (``expected``) from ``actual``, one line each.

    Args:
        expected: the fingerprint recorded in the plan.
        actual: the fingerprint of the model at hand.
        limit: at most this many lines per kind of difference (then "... and N more").

    Returns:
        An empty list when the digests agree.
    """
    if expected.digest == actual.digest:
        return []
    lines: list[str] = []
    ours, theirs = set(actual.modules), set(expected.modules)
    lines += _capped([f"module {m!r} is in the plan but not in the model"
                      for m in expected.modules if m not in ours], limit)
    lines += _capped([f"module {m!r} is in the model but not in the plan"
                      for m in actual.modules if m not in theirs], limit)
    for kind, want, have in (("parameter", expected.parameters, actual.parameters),
                             ("buffer", expected.buffers, actual.buffers)):
        lines += _tensor_differences(kind, want, have, limit)
    if not lines and expected.model != actual.model:
        lines.append(f"model class {expected.model} in the plan, {actual.model} here")
    return lines or ["the tensors are listed in another order"]


def _tensor_differences(kind: str, want: tuple[TensorEntry, ...], have: tuple[TensorEntry, ...],
                        limit: int) -> list[str]:
    wanted, had = {e.name: e for e in want}, {e.name: e for e in have}
    changed = []
    for name, w in wanted.items():
        h = had.get(name)
        if h is not None and w.shape != h.shape:
            changed.append(f"{kind} {name}: shape {w.shape} in the plan, {h.shape} in the model")
        elif h is not None and w.dtype != h.dtype:
            changed.append(f"{kind} {name}: dtype {w.dtype} in the plan, {h.dtype} in the model")
    # A missing tensor of a missing module is already said; list only the rest.
    return (_capped(changed, limit)
            + _capped([f"{kind} {n} is in the plan but not in the model"
                       for n in wanted if n not in had], limit)
            + _capped([f"{kind} {n} is in the model but not in the plan"
                       for n in had if n not in wanted], limit))


def _capped(lines: list[str], limit: int) -> list[str]:
    if len(lines) <= limit:
        return lines
    return [*lines[:limit], f"... and {len(lines) - limit} more like these"]


def _entry(name: str, tensor: Any) -> TensorEntry:
    return TensorEntry(name, tuple(int(d) for d in tensor.shape),
                       str(tensor.dtype).removeprefix("torch."))


def _digest(modules: tuple[str, ...], params: tuple[TensorEntry, ...],
            buffers: tuple[TensorEntry, ...]) -> str:
    body = {"modules": list(modules),
            "parameters": [[e.name, list(e.shape), e.dtype] for e in params],
            "buffers": [[e.name, list(e.shape), e.dtype] for e in buffers]}
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _entries_to_dict(entries: tuple[TensorEntry, ...]) -> dict[str, Any]:
    return {e.name: {"shape": list(e.shape), "dtype": e.dtype} for e in entries}


def _entries_from_dict(data: dict[str, Any]) -> tuple[TensorEntry, ...]:
    if not isinstance(data, dict):
        raise TypeError(f"expected a mapping of tensor name to shape and dtype, got {data!r}")
    return tuple(TensorEntry(str(name), tuple(int(d) for d in e["shape"]), str(e["dtype"]))
                 for name, e in data.items())
