"""A plan's input signature: what the model was called with, enough to capture it again.

A model that ``torch.fx`` cannot trace (transformers' GPT-2) is captured with
``torch.export``, which runs the model and so needs inputs. A saved plan records the input
signature of the batch it was made with: per positional and keyword input its shape, dtype
and which dimension is the dynamic batch, non-tensor inputs by value (JSON scalars) or, when
they cannot be written, by type. Applying the plan then makes inputs of that signature for
the capture alone (:meth:`InputSignature.example`): nothing is costed or planned from them.

The batch dimension follows ``partitioner.capture``'s rule: the batch is the first dimension
of the first tensor (in argument order) with one, and a tensor whose first dimension equals
it (and is more than 1) gets a dynamic batch dimension 0.

Example:
    >>> import torch
    >>> sig = describe((torch.zeros(4, 16, dtype=torch.int64),), {"return_dict": False})
    >>> sig.to_dict()
    {'args': [{'kind': 'tensor', 'dtype': 'int64', 'shape': [4, 16], 'batch_dim': 0}], \
'kwargs': {'return_dict': {'kind': 'value', 'value': False}}}
    >>> args, kwargs = InputSignature.from_dict(sig.to_dict()).example(torch.device("cpu"))
    >>> args[0].shape, args[0].dtype, kwargs
    (torch.Size([4, 16]), torch.int64, {'return_dict': False})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorInput", "ValueInput", "OpaqueInput", "ContainerInput", "InputEntry",
           "InputSignature", "describe", "entry_problems", "CONTAINER_KINDS"]

#: Containers recorded with their items (what ``torch.utils._pytree`` flattens by default).
CONTAINER_KINDS = ("tuple", "list", "dict")
#: Nesting deeper than this is recorded by type only (a plan file stays shallow).
_MAX_NESTING = 8


@dataclass(frozen=True)
class TensorInput:
    """A tensor input: its dtype (``"float32"``), shape, and dynamic batch dimension."""

    dtype: str
    shape: tuple[int, ...]
    batch_dim: int | None = None


@dataclass(frozen=True)
class ValueInput:
    """A non-tensor input written by value: ``None``, a bool, an int, a finite float or a str."""

    value: bool | int | float | str | None


@dataclass(frozen=True)
class OpaqueInput:
    """An input recorded by its type's name only: it cannot be made again from the plan."""

    type: str


@dataclass(frozen=True)
class ContainerInput:
    """A tuple, list or dict of inputs (a dict's keys in ``keys``, in order)."""

    kind: str
    items: tuple[InputEntry, ...]
    keys: tuple[str, ...] | None = None


InputEntry = TensorInput | ValueInput | OpaqueInput | ContainerInput


@dataclass(frozen=True)
class InputSignature:
    """The positional and keyword inputs of the batch a plan was made with.

    Attributes:
        args: one entry per positional input.
        kwargs: ``(name, entry)`` per keyword input, in call order.
    """

    args: tuple[InputEntry, ...] = ()
    kwargs: tuple[tuple[str, InputEntry], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``planner.signature`` in a plan file)."""
        return {"args": [_entry_to_dict(e) for e in self.args],
                "kwargs": {name: _entry_to_dict(e) for name, e in self.kwargs}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InputSignature:
        """Read :meth:`to_dict` output, already checked by :func:`entry_problems`."""
        return cls(tuple(_entry_from_dict(e) for e in data.get("args", ())),
                   tuple((str(k), _entry_from_dict(e))
                         for k, e in (data.get("kwargs") or {}).items()))

    @property
    def opaque(self) -> list[str]:
        """The inputs recorded by type only, by where they are (``"args[1]"``)."""
        found: list[str] = []
        for where, entry in self._named():
            _opaque(entry, where, found)
        return found

    def example(self, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Inputs of this signature for capturing the model (zeros; bool tensors all true).

        Their values are never used for planning: capture only needs their shapes, dtypes
        and the non-tensor values. Call it only when :attr:`opaque` is empty.
        """
        args = tuple(_make(e, device) for e in self.args)
        return args, {name: _make(e, device) for name, e in self.kwargs}

    def __str__(self) -> str:
        return ", ".join([*(_text(e) for e in self.args),
                          *(f"{name}={_text(e)}" for name, e in self.kwargs)])

    def _named(self) -> list[tuple[str, InputEntry]]:
        return ([(f"args[{k}]", e) for k, e in enumerate(self.args)]
                + [(f"kwargs[{name!r}]", e) for name, e in self.kwargs])


def describe(args: tuple[Any, ...] | None, kwargs: Mapping[str, Any] | None
             ) -> InputSignature | None:
    """The signature of a call's inputs (``None`` when there were none to record)."""
    if args is None and not kwargs:
        return None
    batch = _batch(list(args or ()) + list((kwargs or {}).values()))
    return InputSignature(tuple(_describe(a, batch, 0) for a in args or ()),
                          tuple((str(k), _describe(v, batch, 0))
                                for k, v in (kwargs or {}).items()))


def entry_problems(data: Any, where: str) -> list[str]:
    """Every problem of an input entry in a plan file, each prefixed by its key path."""
    if not isinstance(data, dict):
        return [f"{where}: {data!r}; an input is an object with a 'kind'"]
    kind = data.get("kind")
    fields = {"tensor": ("kind", "dtype", "shape", "batch_dim"), "value": ("kind", "value"),
              "type": ("kind", "type")}.get(str(kind), ("kind", "items"))
    problems = [f"{where}.{k}: unknown key; an input of kind {kind!r} has "
                f"{', '.join(fields)}" for k in data if k not in fields]
    if kind == "tensor":
        problems += _tensor_problems(data, where)
    elif kind == "value":
        value = data.get("value", ...)
        if value is ... or not _is_scalar(value):
            problems.append(f"{where}.value: {value!r}; give null, a bool, a number or a string")
    elif kind == "type":
        if not isinstance(data.get("type"), str):
            problems.append(f"{where}.type: {data.get('type')!r}; give the type's name")
    elif kind in CONTAINER_KINDS:
        problems += _container_problems(data, str(kind), where)
    else:
        problems.append(f"{where}.kind: {kind!r}; use one of tensor, value, type, "
                        f"{', '.join(CONTAINER_KINDS)}")
    return problems


def _tensor_problems(data: dict[str, Any], where: str) -> list[str]:
    problems = []
    dtype = data.get("dtype")
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        problems.append(f"{where}.dtype: {dtype!r}; give a torch dtype such as 'float32'")
    shape = data.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(_is_int(d) and d >= 0 for d in shape):
        problems.append(f"{where}.shape: {shape!r}; give a list of sizes >= 0")
        shape = None
    batch = data.get("batch_dim")
    if batch is not None and (not _is_int(batch) or batch < 0
                              or (shape is not None and batch >= len(shape))):
        problems.append(f"{where}.batch_dim: {batch!r}; give null or one of the tensor's "
                        f"dimensions")
    return problems


def _container_problems(data: dict[str, Any], kind: str, where: str) -> list[str]:
    items = data.get("items")
    if kind == "dict":
        if not isinstance(items, dict):
            return [f"{where}.items: {items!r}; a dict input lists its items as an object"]
        return [p for k, v in items.items() for p in entry_problems(v, f"{where}.items[{k!r}]")]
    if not isinstance(items, (list, tuple)):
        return [f"{where}.items: {items!r}; a {kind} input lists its items as an array"]
    return [p for k, v in enumerate(items) for p in entry_problems(v, f"{where}.items[{k}]")]


def _batch(values: list[Any]) -> int | None:
    """The batch size ``partitioner.capture`` makes dynamic: the first tensor's first dim."""
    stack = list(reversed(values))
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, (tuple, list)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return None


def _describe(value: Any, batch: int | None, depth: int) -> InputEntry:
    if isinstance(value, torch.Tensor):
        shape = tuple(int(d) for d in value.shape)
        dynamic = batch is not None and batch > 1 and len(shape) > 0 and shape[0] == batch
        return TensorInput(str(value.dtype).removeprefix("torch."), shape,
                           0 if dynamic else None)
    if _is_scalar(value):
        return ValueInput(value)
    if depth < _MAX_NESTING and type(value) in (tuple, list):
        return ContainerInput(type(value).__name__,
                              tuple(_describe(v, batch, depth + 1) for v in value))
    if depth < _MAX_NESTING and type(value) is dict and all(isinstance(k, str) for k in value):
        return ContainerInput("dict", tuple(_describe(v, batch, depth + 1)
                                            for v in value.values()), tuple(value))
    return OpaqueInput(type(value).__qualname__)


def _entry_to_dict(entry: InputEntry) -> dict[str, Any]:
    if isinstance(entry, TensorInput):
        return {"kind": "tensor", "dtype": entry.dtype, "shape": list(entry.shape),
                "batch_dim": entry.batch_dim}
    if isinstance(entry, ValueInput):
        return {"kind": "value", "value": entry.value}
    if isinstance(entry, OpaqueInput):
        return {"kind": "type", "type": entry.type}
    if entry.kind == "dict":
        return {"kind": "dict",
                "items": {k: _entry_to_dict(e) for k, e in zip(entry.keys or (), entry.items)}}
    return {"kind": entry.kind, "items": [_entry_to_dict(e) for e in entry.items]}


def _entry_from_dict(data: Mapping[str, Any]) -> InputEntry:
    kind = data["kind"]
    if kind == "tensor":
        batch = data.get("batch_dim")
        return TensorInput(str(data["dtype"]), tuple(int(d) for d in data["shape"]),
                           None if batch is None else int(batch))
    if kind == "value":
        return ValueInput(data["value"])
    if kind == "type":
        return OpaqueInput(str(data["type"]))
    items = data["items"]
    if kind == "dict":
        return ContainerInput("dict", tuple(_entry_from_dict(e) for e in items.values()),
                              tuple(str(k) for k in items))
    return ContainerInput(str(kind), tuple(_entry_from_dict(e) for e in items))


def _opaque(entry: InputEntry, where: str, found: list[str]) -> None:
    if isinstance(entry, OpaqueInput):
        found.append(f"{where} ({entry.type})")
    elif isinstance(entry, ContainerInput):
        names = entry.keys or tuple(str(k) for k in range(len(entry.items)))
        for name, item in zip(names, entry.items):
            _opaque(item, f"{where}[{name!r}]" if entry.keys else f"{where}[{name}]", found)


def _make(entry: InputEntry, device: torch.device) -> Any:
    if isinstance(entry, TensorInput):
        dtype = getattr(torch, entry.dtype)
        # All-true masks: an all-false attention mask is the one value that changes a path.
        fill = torch.ones if dtype is torch.bool else torch.zeros
        return fill(entry.shape, dtype=dtype, device=device)
    if isinstance(entry, ValueInput):
        return entry.value
    if isinstance(entry, ContainerInput):
        items = [_make(e, device) for e in entry.items]
        if entry.kind == "dict":
            return dict(zip(entry.keys or (), items))
        return tuple(items) if entry.kind == "tuple" else items
    raise TypeError(f"input of type {entry.type} is recorded by type only")


def _text(entry: InputEntry) -> str:
    if isinstance(entry, TensorInput):
        return f"{entry.dtype}{list(entry.shape)}"
    if isinstance(entry, ValueInput):
        return repr(entry.value)
    if isinstance(entry, OpaqueInput):
        return entry.type
    inner = ", ".join(_text(e) for e in entry.items)
    return {"tuple": f"({inner})", "list": f"[{inner}]"}.get(entry.kind, f"{{{inner}}}")


def _is_int(value: Any) -> bool:
    """An integer as JSON Schema counts them: ``2.0`` is one, ``True`` is not."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (bool, int, str))
