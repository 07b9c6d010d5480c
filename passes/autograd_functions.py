"""Keep a model's own ``torch.autograd.Function``s whole while ``symbolic_trace`` runs.

``Function.apply`` called with tracing proxies runs the Function's ``forward`` on them, so
the graph held its forward's ops and autograd differentiated those: the Function's own
``backward`` (a straight-through estimator, a gradient reversal, a custom kernel's) was
silently lost, and the partitioned model's gradients differed from the model's (a Function
returning ``x`` with a backward of ``2 * g`` gave half the gradients). While tracing, the
call becomes one ``call_function`` node whose target is the Function's ``apply``: the graph
runs the Function itself, forward and backward (:func:`caller`: a function of this
module, since fx writes a target from ``torch``'s own modules as an attribute path).

Example:
    >>> import torch
    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 1.0
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g * 2
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Twice.apply(x)
    >>> tracer = torch.fx.Tracer()
    >>> with functions_as_calls(tracer):
    ...     graph = tracer.trace(M())
    >>> [n.target.function for n in graph.nodes if n.op == "call_function"] == [Twice]
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint

__all__ = ["functions_as_calls", "caller", "functions_called"]


@functools.cache
def caller(function: type) -> Callable[..., Any]:
    """The graph's target for ``function.apply`` (one per Function class)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = f"{function.__name__}_apply"
    call.function = function  # type: ignore[attr-defined]
    return call


_REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction
"""``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)``'s Function: its forward
runs ``fn`` under ``torch.no_grad()`` and its backward reruns it. Exported, the forward was
inlined and the backward dropped: no gradient reached any parameter before or inside it
(transformers' gradient checkpointing and older code use it). While capturing, the call is
``fn(*args)`` traced as it is: the same values and gradients, and the partitioner's own
``checkpoint=`` does the memory saving, per stage."""


def _checkpointed(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
    """What a reentrant checkpoint computes: ``function(*args)``."""
    return function(*args)


@contextmanager
def _apply_replaced(apply: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """``Function.apply`` is ``classmethod(apply)`` while the block runs (a reentrant
    checkpoint's is its function's call, :data:`_REENTRANT_CHECKPOINT`); the block gets the
    original (``original(cls, *args)``), which is put back however the block ends."""
    kept = torch.autograd.Function.__dict__["apply"]

    def replaced(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is _REENTRANT_CHECKPOINT:
            return _checkpointed(*args, **kwargs)
        return apply(cls, *args, **kwargs)
    torch.autograd.Function.apply = classmethod(replaced)  # type: ignore[method-assign,assignment]
    try:
        yield kept.__func__
    finally:
        torch.autograd.Function.apply = kept  # type: ignore[method-assign]


@contextmanager
def functions_as_calls(tracer: fx.Tracer) -> Iterator[None]:
    """While the block runs, ``Function.apply`` on a proxy records one node (``tracer``'s)."""
    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves((args, kwargs))):
            return tracer.create_proxy("call_function", caller(cls), args, kwargs)
        return run(cls, *args, **kwargs)

    with _apply_replaced(apply) as run:
        yield


@contextmanager
def functions_called() -> Iterator[list[type]]:
    """While the block runs, the ``Function`` classes outside torch whose ``apply`` ran, in
    the order first called: ``torch.export`` inlines a Function's forward and drops its
    backward, so the capture refuses a model that calls one (:mod:`partitioner.capture`)."""
    seen: list[type] = []

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch.") and cls not in seen:
            seen.append(cls)
        return run(cls, *args, **kwargs)

    with _apply_replaced(apply) as run:
        yield seen
