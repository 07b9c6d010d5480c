"""The loss on the last stage, per micro-batch: the seeds' ``DataParallelCriterion`` idea.

A training step computes ``loss_fn(output_i, target_i)`` on the last stage right after its
forward of micro-batch ``i`` and starts that micro-batch's backward from it, so no stage
waits for the whole batch's output (1F1B and zero-bubble schedules need that). The step's
loss is the weighted sum of the micro-batch losses: with ``loss_reduction="mean"`` each is
weighted by its share of the batch's samples (a ``mean`` loss over the whole batch, for
uneven micro-batches too), with ``"sum"`` by 1. The same weights scale the gradients, so
they equal those of ``loss_fn`` over the whole batch.

Example:
    >>> import torch
    >>> head = LossHead(torch.nn.functional.mse_loss, [torch.zeros(2, 1), torch.ones(2, 1)],
    ...                 [0.5, 0.5])
    >>> out = torch.ones(2, 1, requires_grad=True)
    >>> [g.shape for g in head(0, out, stage=1)], head.loss
    ([torch.Size([2, 1])], 0.5)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.errors import ChunksError, LossError, StageExecutionError
from partitioner.runtime.microbatch import batch_size, scatter
from partitioner.runtime.precision import upcast
from partitioner.runtime.transfer import move_leaves

__all__ = ["LOSS_REDUCTIONS", "LossHead", "loss_weights", "split_targets", "to_device",
           "loss_reduction_problem", "check_loss", "check_loss_fn"]

LOSS_REDUCTIONS = ("mean", "sum")
"""How ``loss_fn`` reduces over a micro-batch's samples."""


def loss_reduction_problem(loss_reduction: object) -> str | None:
    """Why ``loss_reduction`` is not one of :data:`LOSS_REDUCTIONS`, or ``None``."""
    if loss_reduction in LOSS_REDUCTIONS:
        return None
    return (f"loss_reduction={loss_reduction!r}; use one of {LOSS_REDUCTIONS} (how loss_fn "
            "reduces over a micro-batch's samples)")


def check_loss_fn(loss_fn: object) -> None:
    """Raises a :class:`LossError` unless ``loss_fn`` can be called (a name such as
    ``"mse"`` or a loss class instead of an instance would otherwise fail mid-step)."""
    if not callable(loss_fn) or isinstance(loss_fn, type):
        raise LossError(f"loss_fn={loss_fn!r} is a {type(loss_fn).__name__}, not a function "
                        "of (outputs, targets); pass one such as torch.nn.functional.mse_loss "
                        "or an instance such as nn.CrossEntropyLoss()")


def check_loss(loss: Any, *, training: bool = True, where: str = "the batch") -> torch.Tensor:
    """``loss`` if it is a one-element tensor that (when ``training``) back-propagates.

    A loss without a gradient (``loss_fn`` detached it, computed it under ``no_grad`` or
    from ``.item()``) would leave every ``.grad`` as it was and the optimizer would step on
    nothing; plain ``loss.backward()`` refuses it, and so does every wrapper's ``step``.

    Raises:
        LossError: If ``loss`` is not a one-element tensor, or does not require grad.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
        raise LossError(f"loss_fn returned {shape}; return a scalar tensor (reduce over "
                        f"{where} with mean or sum)")
    if training and not loss.requires_grad:
        raise LossError(f"loss_fn returned a loss that does not require grad "
                        f"({loss.detach().reshape(()).item():.6g}), so no gradient would "
                        "reach the parameters; compute it from the model's outputs with "
                        "torch operations (no .item(), .detach() or torch.no_grad())")
    return loss


def loss_weights(micro: Sequence[Sequence[Any]], values: Sequence[Any], loss_reduction: str
                 ) -> list[float]:
    """Per micro-batch, the factor on its loss: its share of the samples, or 1 for sums."""
    if loss_reduction == "sum":
        return [1.0] * len(micro)
    total = batch_size(list(values))
    if not total:
        return [1.0 / len(micro)] * len(micro)
    return [(batch_size(list(mb)) or 0) / total for mb in micro]


def split_targets(targets: Any, m: int, batch: int | None) -> list[Any]:
    """``targets`` cut into ``m`` micro-batches as the inputs are (``None``: ``None`` each).

    Raises:
        ChunksError: If the targets' batch size differs from the inputs'.
    """
    if targets is None:
        return [None] * m
    size = batch_size([targets])
    if m > 1 and size != batch:
        raise ChunksError(f"targets have batch size {size} but the inputs {batch}; pass "
                          "targets with one row per sample of the batch")
    return [parts[0] for parts in scatter([targets], m)]


def to_device(values: Any, device: torch.device) -> Any:
    """``values`` (any pytree) with its tensors moved to ``device``, without autograd."""
    leaves, spec = pytree.tree_flatten(values)
    return pytree.tree_unflatten(move_leaves(leaves, device, grad=False), spec)


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


class LossHead:
    """Computes each micro-batch's loss from the last stage's output and its gradients.

    Args:
        loss_fn: ``loss_fn(output, target)`` returning a scalar tensor.
        targets: one target per micro-batch (on the last stage's device).
        weights: one factor per micro-batch (:func:`loss_weights`).
        restructure: turns the last stage's output into what the model returns.
        training: whether to return gradients (else only the loss is summed).
        grad_scale: a factor on the gradients only, not on :attr:`loss` (``1 / dp``, a
            loss scale).
        upcast: compute the loss on fp32 copies of bf16/fp16 outputs (mixed precision);
            the gradients returned keep the outputs' dtypes.

    Attributes:
        loss: the weighted sum of the losses so far, a float.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any], targets: Sequence[Any],
                 weights: Sequence[float], restructure: Callable[[Any], Any] = lambda o: o,
                 *, training: bool = True, grad_scale: float = 1.0,
                 upcast: bool = False) -> None:
        check_loss_fn(loss_fn)
        self.loss_fn = loss_fn
        self.targets = list(targets)
        self.weights = list(weights)
        self.restructure = restructure
        self.training = training
        self.grad_scale = grad_scale
        self.upcast = upcast
        self.loss = 0.0

    def __call__(self, i: int, out: Any, *, stage: int) -> list[torch.Tensor | None]:
        """The loss of micro-batch ``i`` from ``out``; returns the gradients of ``out``'s
        leaves (``None`` where there is none, and for all of them without training).

        Raises:
            StageExecutionError: If ``loss_fn`` raises, naming the stage and micro-batch.
            LossError: If it returns something other than a one-element tensor, or (training)
                one that does not require grad.
        """
        leaves, spec = pytree.tree_flatten(out)
        detached = [leaf.detach().requires_grad_(self.training and _differentiable(leaf))
                    if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        with torch.enable_grad() if self.training else torch.no_grad():
            try:
                outputs = pytree.tree_unflatten(detached, spec)
                loss = self.loss_fn(self.restructure(upcast(outputs) if self.upcast
                                                     else outputs), self.targets[i])
            except Exception as error:
                raise StageExecutionError(
                    f"loss_fn raised on stage {stage} (micro-batch {i}): "
                    f"{type(error).__name__}: {error}", stage, i, None) from error
            check_loss(loss, training=self.training,
                       where="the micro-batch")
            weighted = loss.reshape(()) * self.weights[i]
        self.loss += float(weighted.detach().double().item())
        per_leaf: list[torch.Tensor | None] = [None] * len(leaves)
        if not self.training:
            return per_leaf
        if self.grad_scale != 1.0:
            weighted = weighted * self.grad_scale
        wanted = [k for k, leaf in enumerate(detached)
                  if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if wanted and weighted.requires_grad:
            grads = torch.autograd.grad(weighted, [detached[k] for k in wanted],
                                        allow_unused=True)
            for k, g in zip(wanted, grads):
                per_leaf[k] = g
        return per_leaf
