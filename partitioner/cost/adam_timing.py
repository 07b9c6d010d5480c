"""Timing an Adam step as training runs it, for the calibration (:mod:`partitioner.cost.measure`).

Example:
    >>> adam_step_seconds() > 0
    True
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["ADAM_LAYERS", "ADAM_WEIGHT", "adam_step_seconds", "adam_update"]

ADAM_WEIGHT = 1024
ADAM_LAYERS = 8


def adam_step_seconds() -> float:
    """The median time of an Adam step over ``ADAM_LAYERS`` 1024 x 1024 weights, each step
    right after a forward and backward that made their gradients, as in training.

    Not repeated steps on their own: how the allocator hands out the step's temporaries after
    a backward (fresh pages or reused ones) changes its time by up to 2x, and repeated steps
    only ever see the reused case. The step is the element-wise ops of ``torch.optim.Adam``'s
    CPU path (:func:`adam_update`): the first ``torch.optim`` step in a process imports
    about 800 modules (1 s), which planning should not pay.
    """
    weights = [torch.nn.Parameter(torch.randn(ADAM_WEIGHT, ADAM_WEIGHT) / ADAM_WEIGHT**0.5)
               for _ in range(ADAM_LAYERS)]
    state = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    x = torch.randn(64, ADAM_WEIGHT)
    times = []
    for step in range(1, 5):  # the first step's pages are new to the process
        for w in weights:
            w.grad = None
        y = x
        for w in weights:
            y = torch.mm(y, w)
        y.sum().backward()
        start = time.perf_counter()
        adam_update(weights, state, step)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.no_grad()
def adam_update(weights: list[torch.nn.Parameter],
                 state: list[tuple[torch.Tensor, torch.Tensor]], step: int,
                 lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
    """One step of ``torch.optim.Adam``'s single-tensor path (its default on CPU), op for op:
    ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, a division, ``add_``, ``addcdiv_``."""
    beta1, beta2 = betas
    correction1, correction2 = 1 - beta1**step, 1 - beta2**step
    for w, (exp_avg, exp_avg_sq) in zip(weights, state):
        grad = w.grad
        assert grad is not None
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2**0.5).add_(eps)
        w.addcdiv_(exp_avg, denom, value=-lr / correction1)
