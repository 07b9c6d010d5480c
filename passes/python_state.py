"""Python state a model's ``forward`` changes while it is captured: :func:`snapshot`,
:func:`changes`, :func:`restore`.

Capture (``torch.fx.symbolic_trace`` or ``torch.export``) runs ``forward`` once and records
its tensor operations. Plain Python effects run during that one call and leave no node:
``self.seen.append(x)`` or ``self.calls += 1`` happen once at capture and never again in the
partitioned model, silently. Tensor state is checked elsewhere (buffers written in place,
:mod:`partitioner.capture`); this module looks at every module's own public plain
attributes: numbers, strings, ``None`` and the sizes of lists, dicts, sets and tuples, and
puts them back as they were (so the user's model keeps no tracing proxies). Private ones
(a leading underscore) are a library's own bookkeeping, often set once on the first call:
transformers' MoE models mark ``_output_capturing_hooks_installed`` when their first
forward installs hooks, and putting that back would install the hooks twice. They are left
alone.

Example:
    >>> from torch import nn
    >>> class Counting(nn.Linear):
    ...     calls = 0
    ...     def forward(self, x):
    ...         self.calls += 1
    ...         return super().forward(x)
    >>> model = nn.Sequential(Counting(2, 2))
    >>> before = snapshot(model)
    >>> _ = model(torch.zeros(1, 2))
    >>> changes(model, before)
    ['0.calls: 0 -> 1']
    >>> restore(model, before)
    >>> model[0].calls, changes(model, before)
    (0, [])
"""

from __future__ import annotations

import copy
from typing import Any

import torch  # noqa: F401  (the doctest's namespace)
from torch import nn

__all__ = ["State", "snapshot", "changes", "restore"]

# What every nn.Module keeps in its __dict__ (hooks, registries, mode): not user state.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_SIZED = (list, dict, set, frozenset, tuple)


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()

State = dict[tuple[str, str], tuple[Any, Any]]
"""Per (module name, attribute): its fingerprint (a scalar, or a container's ``(type name,
size)``) and a shallow copy of the value."""


def snapshot(model: nn.Module) -> State:
    """The plain Python attributes of every module of ``model`` (see the module docs)."""
    state: State = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in _MODULE_INTERNALS or key.startswith("_"):
                continue
            seen = _fingerprint(value)
            if seen is not _UNSET:
                state[name, key] = (seen, copy.copy(value))
    return state


def changes(model: nn.Module, before: State) -> list[str]:
    """What changed since ``before`` (``"name.attr: old -> new"``), in module order."""
    after = snapshot(model)
    found = []
    for key in sorted(set(before) | set(after), key=_order(model)):
        old = before[key][0] if key in before else _fingerprint(_class_value(model, key))
        new = after[key][0] if key in after else _UNSET
        if old != new or type(old) is not type(new):
            path = ".".join(p for p in key if p)
            found.append(f"{path}: {_show(old)} -> {_show(new)}")
    return found


def restore(model: nn.Module, before: State) -> None:
    """Put every attribute :func:`changes` would name back as it was in ``before`` (a list,
    dict or set in place; one set only since then removed)."""
    after = snapshot(model)
    for key in set(before) | set(after):
        if key in before and key in after and before[key][0] == after[key][0] \
                and type(before[key][0]) is type(after[key][0]):
            continue
        try:
            module = model.get_submodule(key[0])
        except AttributeError:
            continue
        if key not in before:
            module.__dict__.pop(key[1], None)
            continue
        saved = before[key][1]
        value = module.__dict__.get(key[1], _UNSET)
        if isinstance(value, list) and isinstance(saved, list):
            value[:] = saved
        elif isinstance(value, (dict, set)) and type(value) is type(saved):
            value.clear()
            value.update(saved)  # type: ignore[arg-type]
        else:
            module.__dict__[key[1]] = saved


def _fingerprint(value: Any) -> Any:
    """A scalar itself, a container's ``(type name, size)``, else ``_UNSET`` (not tracked)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, _SIZED):
        return (type(value).__name__, len(value))
    return _UNSET


def _class_value(model: nn.Module, key: tuple[str, str]) -> Any:
    """What ``module.attr`` read before the instance set its own (a class attribute)."""
    try:
        module = model.get_submodule(key[0])
    except AttributeError:
        return _UNSET
    return getattr(type(module), key[1], _UNSET)


def _order(model: nn.Module) -> Any:
    rank = {name: k for k, (name, _) in enumerate(model.named_modules())}
    return lambda key: (rank.get(key[0], len(rank)), key[1])


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and value[0] in {
            t.__name__ for t in _SIZED}:
        return f"{value[0]} of {value[1]}"
    return repr(value)
