"""The original model's tensors that a wrapper copied and no longer reads: :class:`Originals`.

A pipeline (``partitioner.runtime.module``) computes with the model's own parameters, so
loading weights into the model, or stepping an optimizer built over ``model.parameters()``,
works after ``partition`` as before it. A tensor-parallel module cannot: each rank holds its
slice (or copy) of every weight, on its own device, and trains those. Rather than let such
a change go unseen (the module computing with the old weights, or an optimizer stepping
parameters that never get a gradient), the wrapper refuses it:

- every call checks the originals' version counters (bumped by any in-place write:
  ``load_state_dict``, ``copy_``, an optimizer step) and raises a
  :class:`~partitioner.errors.TensorParallelError` naming what changed;
- ``optimizer.step()`` of an optimizer holding an original parameter raises at once (a
  global step pre-hook of ``torch.optim``; the originals get no gradients, so that step
  would do nothing).

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> guard = Originals(dict(layer.named_parameters()), "TensorParallelModule")
    >>> guard.check()
    >>> with torch.no_grad():
    ...     _ = layer.weight.zero_()
    >>> try:
    ...     guard.check()
    ... except TensorParallelError as error:
    ...     print(str(error)[:61])
    the original model's weight changed after partitioning, but a
    >>> guard.release()
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from partitioner.errors import TensorParallelError

__all__ = ["Originals", "guarding"]

_FIX = ("load weights with wrapper.load_state_dict(...) and build the optimizer over "
        "wrapper.parameters(), or partition the model again after changing it")

#: Original parameter id -> the name of the live wrapper that copied it.
_GUARDED: dict[int, str] = {}
_LOCK = threading.Lock()
_HOOK: list[Any] = []


class Originals:
    """Watches the original tensors a wrapper copied (see the module doc).

    Args:
        tensors: by state-dict key, the original model's tensors the wrapper copied.
        owner: the wrapper's name, for messages.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], owner: str) -> None:
        self.owner = owner
        self._tensors = dict(tensors)
        self._versions = {key: t._version for key, t in self._tensors.items()}
        self._params = [t for t in self._tensors.values() if isinstance(t, torch.nn.Parameter)]
        with _LOCK:
            for param in self._params:
                _GUARDED[id(param)] = owner
            if not _HOOK:
                _HOOK.append(register_optimizer_step_pre_hook(_refuse))
        self._finalizer = weakref.finalize(self, _forget, [id(p) for p in self._params])

    def check(self) -> None:
        """Raise if an original tensor was written since the wrapper copied it.

        Raises:
            TensorParallelError: naming the changed entries and the fix.
        """
        changed = [key for key, t in self._tensors.items() if t._version != self._versions[key]]
        if changed:
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more"
                                               if len(changed) > 4 else "")
            raise TensorParallelError(
                f"the original model's {shown} changed after partitioning, but a "
                f"{self.owner} computes with its own slices of the weights and would not see "
                f"it; {_FIX}")

    def release(self) -> None:
        """Stop refusing optimizers over the originals (the wrapper was closed)."""
        self._finalizer()


def guarding(tensors: Iterable[torch.Tensor]) -> str | None:
    """The name of a live wrapper guarding one of ``tensors``, or ``None``: what must be
    closed before anything else trains them (``tune=True`` on the same model)."""
    with _LOCK:
        return next((_GUARDED[id(t)] for t in tensors if id(t) in _GUARDED), None)


def _forget(ids: list[int]) -> None:
    with _LOCK:
        for key in ids:
            _GUARDED.pop(key, None)


def _refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """``torch.optim``'s step pre-hook: refuse an optimizer over guarded originals."""
    if not _GUARDED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = _GUARDED.get(id(param))
            if owner is not None:
                raise TensorParallelError(
                    f"this optimizer steps the original model's parameters (one of shape "
                    f"{tuple(param.shape)}), which get no gradients: a {owner} trains its own "
                    f"slices of them; build it over the wrapper's parameters() instead "
                    f"(torch.optim.AdamW(wrapper.parameters(), ...)); {_FIX}")
