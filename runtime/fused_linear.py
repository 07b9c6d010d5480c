"""Linear layers whose weight gradient is added straight into ``.grad``.

With micro-batches, every backward of a Linear layer computes a weight gradient
``dY^T X`` from a few rows: a thin product that writes a whole (out, in) matrix into a
fresh tensor, which autograd's ``AccumulateGrad`` then adds into ``.grad`` -- a new
allocation and two more passes over the matrix, per layer and micro-batch. Here the
backward computes the input gradient as usual and adds the weight gradient into ``.grad``
in place with one ``addmm_`` (Megatron-LM's "gradient-accumulation fusion"). For 8-row
micro-batches of a Linear(1024, 1024) on one CPU thread this takes about 30 % off the
layer's backward (see ``docs/benchmarks.md``). The result is the same sum, in another order.

The parameters' post-accumulate-grad hooks (``register_post_accumulate_grad_hook``) run
right after, as ``AccumulateGrad`` would run them; data parallelism relies on them. The
plain ``F.linear`` is used instead whenever the fusion would change behaviour: without
autograd, under autocast, for weights that are not leaves or carry tensor hooks
(``register_hook``), or when the gradient itself must be differentiable.

A zero-bubble schedule splits each backward into the input gradients (``I``) and the weight
gradients (``W``), run later: inside :func:`deferring`, the forwards record a
:class:`WeightGrads` and their backwards queue each weight-gradient product there instead
of running it; ``WeightGrads.run()`` is the ``W`` action. Other parameters (norms,
embeddings) get their gradients in ``I``, as in the zero-bubble paper's implementation.

A parameter that several threads accumulate into at once (a weight tied across two stages
of a one-process pipeline, or one module called from two stages) is never fused
(:func:`accumulate_concurrently`): the in-place ``addmm_`` of two stages' ``W`` (or ``I``)
actions would race on one ``.grad`` and lose updates, whereas autograd's ``AccumulateGrad``
adds under a lock of its own, which its other uses (an embedding) take too.

Example:
    >>> layer = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3)
    >>> linear_module(x, layer).sum().backward()
    >>> torch.allclose(layer.weight.grad, torch.ones(4, 2).t() @ x)
    True
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from partitioner.runtime.device import autocast_enabled

__all__ = ["linear", "linear_module", "use_grad_buffer", "release_grad_buffer", "WeightGrads",
           "deferring", "accumulate_concurrently"]


class WeightGrads:
    """The weight-gradient products of one stage's micro-batch, queued by its backward.

    Example:
        >>> layer, grads = torch.nn.Linear(3, 2), WeightGrads()
        >>> with deferring(grads):
        ...     y = linear_module(torch.randn(4, 3), layer)
        >>> y.sum().backward()
        >>> layer.weight.grad is None, len(grads)
        (True, 1)
        >>> grads.run(); layer.weight.grad is not None
        True
    """

    def __init__(self) -> None:
        self._queued: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, work: Callable[[], None]) -> None:
        """Queue one product (called by the backward)."""
        self._queued.append(work)

    def run(self) -> None:
        """Run the queued products in order, adding into ``.grad``, and forget them."""
        queued, self._queued = self._queued, []
        for work in queued:
            work()


_DEFER = threading.local()


@contextmanager
def deferring(grads: WeightGrads | None) -> Iterator[None]:
    """Forwards run inside queue their weight gradients in ``grads`` (``None``: don't).

    The queue is taken at forward time, so the backward may run on any thread (CUDA runs
    it on the device's autograd thread).
    """
    before = getattr(_DEFER, "grads", None)
    _DEFER.grads = grads
    try:
        yield
    finally:
        _DEFER.grads = before


def _plain_leaf(t: torch.Tensor | None) -> bool:
    return t is None or (t.is_leaf and t.requires_grad and not t._backward_hooks)


#: Ids of the parameters several threads accumulate gradients into (never fused).
_CONCURRENT: set[int] = set()


def accumulate_concurrently(param: torch.Tensor) -> None:
    """Mark ``param`` as accumulated into by several threads at once: its Linear layers
    then leave the gradient to autograd (whose accumulation is locked) and queue none for
    ``W`` (see the module doc). The mark lasts as long as the parameter."""
    key = id(param)
    if key not in _CONCURRENT:
        _CONCURRENT.add(key)
        weakref.finalize(param, _CONCURRENT.discard, key)


def _fusable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (torch.is_grad_enabled() and _plain_leaf(weight) and _plain_leaf(bias)
            and id(weight) not in _CONCURRENT and (bias is None or id(bias) not in _CONCURRENT)
            and not autocast_enabled())


def linear(input: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, the weight gradient added into ``.grad`` in place."""
    if not _fusable(weight, bias):
        return F.linear(input, weight, bias)
    # The parameters go in as a non-tensor argument: as autograd inputs they would get
    # AccumulateGrad nodes, which run their hooks even for the None this backward returns.
    # A phony input that requires grad makes autograd reach the backward when ``input``
    # needs no gradient (the first layer of the first stage).
    phony = _NO_PHONY if input.requires_grad else torch.empty(0, requires_grad=True)
    return _Linear.apply(input, phony, (weight, bias))


_NO_PHONY = torch.empty(0)


def linear_module(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """:func:`linear` with an ``nn.Linear``'s own weight and bias."""
    return linear(x, module.weight, module.bias)  # type: ignore[arg-type]


_GRAD_BUFFERS: dict[int, torch.Tensor] = {}


def use_grad_buffer(param: torch.Tensor, buffer: torch.Tensor) -> None:
    """Write ``param``'s gradient into ``buffer`` whenever ``.grad`` is None.

    Data parallelism registers each parameter's view of its all-reduce bucket here, so a
    fresh gradient is computed straight into the bucket: no allocation (page faults for
    megabytes of new memory every step) and no copy into the bucket later.
    """
    if buffer.shape != param.shape or buffer.dtype != param.dtype:
        raise ValueError(f"a gradient buffer of {tuple(buffer.shape)} {buffer.dtype} for a "
                         f"parameter of {tuple(param.shape)} {param.dtype}")
    key = id(param)
    _GRAD_BUFFERS[key] = buffer
    weakref.finalize(param, _GRAD_BUFFERS.pop, key, None)


def release_grad_buffer(param: torch.Tensor) -> None:
    """Stop writing ``param``'s gradient into a registered buffer."""
    _GRAD_BUFFERS.pop(id(param), None)


def _accumulate(param: torch.Tensor, fresh: Callable[[torch.Tensor | None], torch.Tensor],
                add_into: Callable[[torch.Tensor], Any]) -> None:
    with torch.no_grad():
        if param.grad is None:
            param.grad = fresh(_GRAD_BUFFERS.get(id(param)))
        else:
            add_into(param.grad)
    for hook in (param._post_accumulate_grad_hooks or {}).values():
        hook(param)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, phony: torch.Tensor,
                params: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        weight, bias = params
        # A detached alias shares the version counter: an in-place change of the weight
        # before the backward is still caught.
        ctx.save_for_backward(x, weight.detach())
        ctx.params = params
        ctx.deferred = getattr(_DEFER, "grads", None)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        param, bias = ctx.params
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])     # (rows, out)
        x2 = x.reshape(-1, x.shape[-1])        # (rows, in)

        def weight_grads() -> None:
            _accumulate(param, lambda out: torch.mm(dy2.t(), x2, out=out),
                        lambda g: g.addmm_(dy2.t(), x2))
            if bias is not None:
                _accumulate(bias, lambda out: torch.sum(dy2, 0, out=out),
                            lambda g: g.add_(dy2.sum(0)))

        if ctx.deferred is not None:
            ctx.deferred.add(weight_grads)
        else:
            weight_grads()
        return dx, None, None
