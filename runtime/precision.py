"""Mixed precision: compute in bf16 or fp16 under autocast, keep fp32 master weights.

A stage's forward (and its checkpoint replay) runs under ``torch.autocast`` with the
precision's dtype (:func:`autocast`): matrix products compute in bf16/fp16 and the values
crossing stages are what autocast produces (bf16/fp16 mostly); gradients flowing back have
the dtype of the value they belong to. The parameters stay fp32: they are the master
weights, their gradients are fp32 (autograd casts back through autocast's weight cast) and
data-parallel reduction sums fp32 gradients. There is no bf16 copy of the weights kept
between steps; autocast casts them inside each forward (the cast is saved for the backward
while a micro-batch is in flight). The loss is computed in fp32 (:func:`upcast`).

Under autocast the fused Linear weight gradients (``partitioner.runtime.fused_linear``)
fall back to ``F.linear``: the weight gradients are then computed with the input gradients,
so a zero-bubble schedule's ``W`` actions have nothing left to do.

fp16 needs loss scaling (its small gradients underflow): :class:`LossScaler` has
``torch.amp.GradScaler``'s semantics. A step multiplies the loss's gradients by
:attr:`LossScaler.scale`; ``scaler.step(optimizer)`` divides the gradients by it, skips the
optimizer when one is inf or NaN, and ``scaler.update()`` adapts a ``"dynamic"`` scale
(halved after an overflow, doubled after ``growth_interval`` clean steps).

Example:
    >>> import torch
    >>> with autocast("bf16", "cpu"):
    ...     y = torch.nn.Linear(2, 2)(torch.randn(3, 2))
    >>> y.dtype
    torch.bfloat16
    >>> precision_problem("fp8")
    "precision='fp8' is unknown; pass one of ('fp32', 'bf16', 'fp16')"
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.errors import PrecisionError

__all__ = ["PRECISIONS", "LossScaler", "autocast", "check_precision", "compute_dtype",
           "loss_scale_problem", "make_scaler", "masked_fill_saturated", "precision_problem",
           "saturate", "upcast", "where_saturated"]

PRECISIONS = ("fp32", "bf16", "fp16")
"""``"fp32"``: no autocast; ``"bf16"``, ``"fp16"``: autocast to that dtype."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

DEFAULT_SCALE = 2.0**16
"""A ``"dynamic"`` scale's start, as ``torch.amp.GradScaler``'s."""


def precision_problem(precision: object) -> str | None:
    """Why ``precision`` is not one of :data:`PRECISIONS`, or ``None``."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return None
    return f"precision={precision!r} is unknown; pass one of {PRECISIONS}"


def loss_scale_problem(precision: str, loss_scale: object) -> str | None:
    """Why ``loss_scale`` does not suit ``precision``, or ``None``.

    fp16 needs one (``"dynamic"`` or a positive finite float); fp32 and bf16 take none.
    """
    if precision != "fp16":
        if loss_scale is None:
            return None
        return (f"loss_scale={loss_scale!r} with precision={precision!r}: only fp16 scales "
                "the loss (its gradients underflow); omit loss_scale or pass precision='fp16'")
    if loss_scale is None:
        return ("precision='fp16' needs loss scaling (fp16 gradients underflow) but "
                "loss_scale=None; pass loss_scale='dynamic' (or a fixed float such as "
                "1024.0), or use precision='bf16', which needs none")
    if loss_scale == "dynamic":
        return None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) \
            or not math.isfinite(loss_scale) or loss_scale <= 0:
        return (f"loss_scale={loss_scale!r}; pass 'dynamic' or a positive finite float "
                "such as 1024.0")
    return None


def check_precision(precision: object, loss_scale: object = None, *,
                    scaled: bool = True) -> str:
    """``precision`` checked (with its ``loss_scale`` when ``scaled``); returns it.

    Raises:
        PrecisionError: naming the bad value and the fix.
    """
    problem = precision_problem(precision)
    if problem is None and scaled:
        problem = loss_scale_problem(str(precision), loss_scale)
    if problem is not None:
        raise PrecisionError(problem)
    return str(precision)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a stage computes in under ``precision``."""
    return _DTYPES[check_precision(precision, scaled=False)]


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The context a stage's forward runs in: autocast to the precision's dtype, or nothing
    for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=compute_dtype(precision))


def saturate(value: float, like: torch.Tensor) -> float:
    """``value`` clamped to the finite range of ``like``'s dtype.

    A graph captured in fp32 holds ``torch.finfo(torch.float32).min`` where the model wrote
    ``torch.finfo(x.dtype).min``; under autocast ``x`` is bf16/fp16 and the constant does not
    fit it. Clamped, it is what the model computes eagerly under autocast.

    Example:
        >>> saturate(torch.finfo(torch.float32).min, torch.zeros(1, dtype=torch.float16))
        -65504.0
    """
    if not like.is_floating_point():
        return value
    info = torch.finfo(like.dtype)
    return min(max(value, info.min), info.max)


def masked_fill_saturated(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x.masked_fill(mask, value)`` with ``value`` :func:`saturate`-d to ``x``'s dtype."""
    return torch.ops.aten.masked_fill.Scalar(x, mask, saturate(value, x))


def where_saturated(condition: torch.Tensor, x: torch.Tensor, value: float) -> torch.Tensor:
    """``torch.where(condition, x, value)`` with ``value`` :func:`saturate`-d to ``x``'s
    dtype."""
    return torch.ops.aten.where.ScalarOther(condition, x, saturate(value, x))


def upcast(values: Any) -> Any:
    """``values`` (any pytree) with bf16/fp16 tensors cast to fp32, differentiably: what the
    loss is computed from (gradients flow back in the low-precision dtype)."""
    return pytree.tree_map(
        lambda v: v.float() if isinstance(v, torch.Tensor)
        and v.dtype in (torch.bfloat16, torch.float16) else v, values)


class LossScaler:
    """Loss scaling with ``torch.amp.GradScaler``'s semantics, for a pipeline's step.

    A step multiplies the gradients by :attr:`scale`; then::

        scaler.step(optimizer)   # unscale, skip when a gradient is inf or NaN
        scaler.update()          # adapt a dynamic scale

    (``scaler.unscale_(optimizer)`` first when clipping gradients.)

    Args:
        loss_scale: ``"dynamic"`` or a fixed positive float.
        agree: makes every process agree on "a gradient overflowed" (the multi-process
            runtime passes an all-reduce over the world: each rank holds other gradients).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([p], lr=1.0)
        >>> scaler = LossScaler(4.0)
        >>> p.grad = torch.full((1,), 8.0)  # a gradient of 2, scaled
        >>> scaler.step(opt), p.item()
        (None, -1.0)
        >>> scaler.update()
        >>> p.grad = torch.full((1,), float("inf"))
        >>> scaler.step(opt), scaler.found_inf, p.item()  # skipped
        (None, True, -1.0)
    """

    def __init__(self, loss_scale: float | str, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 agree: Callable[[bool], bool] | None = None) -> None:
        problem = loss_scale_problem("fp16", loss_scale)
        if problem is not None:
            raise PrecisionError(problem)
        self.dynamic = loss_scale == "dynamic"
        self.scale = DEFAULT_SCALE if self.dynamic else float(loss_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.found_inf = False
        self._agree = agree
        self._clean_steps = 0
        self._unscaled: set[int] = set()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale (once per step) and note overflows.

        Raises:
            PrecisionError: If called twice for one optimizer before :meth:`update`.
        """
        if id(optimizer) in self._unscaled:
            raise PrecisionError("unscale_() was already called for this optimizer since the "
                                 "last update(); call it once per step, then step(), update()")
        self._unscaled.add(id(optimizer))
        found = self._unscale(p.grad for group in optimizer.param_groups
                              for p in group["params"] if p.grad is not None)
        if self._agree is not None:
            found = self._agree(found)
        self.found_inf = self.found_inf or found

    def _unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        found = False
        inverse = 1.0 / self.scale
        with torch.no_grad():
            for g in grads:
                g.mul_(inverse)
                found = found or not bool(torch.isfinite(g).all())
        return found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` on the unscaled gradients, skipped (``None``) on overflow."""
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adapt a dynamic scale to the step's overflow; start the next step."""
        if self.dynamic:
            if self.found_inf:
                self.scale *= self.backoff_factor
                self._clean_steps = 0
            else:
                self._clean_steps += 1
                if self._clean_steps >= self.growth_interval:
                    self.scale *= self.growth_factor
                    self._clean_steps = 0
        self.found_inf = False
        self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        """The scale and the clean steps counted (for checkpoints)."""
        return {"scale": self.scale, "dynamic": self.dynamic, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values."""
        self.scale = float(state["scale"])
        self._clean_steps = int(state.get("clean_steps", 0))


def make_scaler(precision: str, loss_scale: float | str | None,
                agree: Callable[[bool], bool] | None = None) -> LossScaler | None:
    """The scaler a runtime with ``precision`` uses (fp16 only; checked).

    Raises:
        PrecisionError: an unknown precision, or a ``loss_scale`` that does not suit it.
    """
    check_precision(precision, loss_scale)
    if precision != "fp16" or loss_scale is None:
        return None
    return LossScaler(loss_scale, agree=agree)
