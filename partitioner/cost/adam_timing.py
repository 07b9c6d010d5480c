"""Timing an Adam step as training runs it, for the calibration (:mod:`partitioner.cost.measure`).

Example:
    >>> adam_step_seconds() > 0
    True
"""

from __future__ import annotations

import statistics
import time

import torch

from partitioner.runtime.distributed.optimizer_probe import adam_update

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
