"""What a layer pays per call, whatever its rows: fitted from the model timed at two batches.

The cost model builds a layer's time per sample (products, bytes) plus a fixed cost per op
launch (``DeviceSpec.op_overhead``), and a calibration scaled it to the layer's time on the
example batch (``LayerCost.time_scale``). A real layer pays more per call than its ops'
launches: autograd's nodes, Python, allocations. Scaled by one factor from a large batch,
that part shrank with the micro-batch: on the 2-core CI VM (2026-12-06, one thread) a
``nn.TransformerEncoderLayer`` (d=256, 64 tokens) took 1.27x per sample at 1 sample what it
took at 8, the model said 1.14x; a ViT block 1.48x against 1.20x, its patch embedding 9.6x
against 1.8x. Pipelines of such micro-batches ran 1.3-1.46x their predictions.

So the calibration also times the model at a smaller batch (:func:`small_batch`), and
:func:`fit_calls` fits each layer's ``time_scale`` and ``call_seconds`` to both:
``measured(b) = time_scale x predicted(b) + call`` at the two batch sizes (layers of one
signature: the medians of their times), the per-call part split between forward and
backward as the small batch measured it beyond the scaled model. A layer whose two
predicted times are too close to tell a call's cost from noise (:data:`MAX_SMALL_SHARE`)
keeps one scale, as before. A fit that would make
either part negative (noise, a layer whose time does not grow with its rows) keeps what it
can: no per-call part and the large batch's scale, or the large batch's time all per call
but the smallest scale.

Example:
    >>> from partitioner.cost.cost import LayerCost, Op, phase_times
    >>> from partitioner.cost.devices import DeviceSpec
    >>> cpu = DeviceSpec("cpu", {"fp32": 1e9}, 1e9, 1e10, matmul_half_flops=1.0,
    ...                  op_overhead=0.0)
    >>> layer = LayerCost("fc", (Op("matmul", flops=1e6),))
    >>> f, b = phase_times(layer, cpu, 8)  # 8 ms and 16 ms
    >>> [fitted] = fit_calls([layer], cpu, 8, [(2 * f + 1e-3, 2 * b + 2e-3)], 2,
    ...                      [(2 * f / 4 + 1e-3, 2 * b / 4 + 2e-3)])
    >>> round(fitted.time_scale, 3), [round(t * 1e3, 3) for t in fitted.call_seconds]
    (2.0, [1.0, 2.0])
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from partitioner.cost.cost import LayerCost, phase_times
from partitioner.cost.devices import DeviceSpec

__all__ = ["fit_calls", "small_batch", "SMALL_SHARE", "MIN_SCALE", "MAX_SMALL_SHARE"]

SMALL_SHARE = 8
"""The smaller batch timed is the example batch over this (at least 1 sample): as small as
the micro-batches the search tries (up to 8 a replica on the regret benchmark's models)."""

MAX_SMALL_SHARE = 0.5
"""A layer predicted to take more than this share of its large-batch time at the small
batch keeps one scale: the two times differ too little for their difference to say what a
call costs. The fit divides by the predicted difference, so a timing's noise grows by the
large time over it: for the regret benchmark's `wide` MLP (64 MiB weights read per call,
8 samples predicted at 0.58 of 64) 2.4x, and one noisy calibration predicted its 4
micro-batch pipeline at 1.47 s where it ran 0.74 (2026-12-06, 02:35 UTC)."""

MIN_SCALE = 1e-3
"""The smallest ``time_scale`` a fit gives (a layer whose time does not grow with its rows)."""


def small_batch(inputs: Sequence[Any], batch: int) -> tuple[list[Any], int] | None:
    """The example inputs cut to ``batch // SMALL_SHARE`` samples (at least 1) along dim 0
    where that is the batch, and that size; ``None`` when it would not be smaller or no
    input has the batch in dim 0.

    Example:
        >>> small_batch([torch.ones(16, 3), torch.ones(3)], 16)[1]
        2
        >>> small_batch([torch.ones(1, 3)], 1) is None
        True
    """
    small = max(1, batch // SMALL_SHARE)
    if small >= batch:
        return None
    cut = [x[:small] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch
           else x for x in inputs]
    if all(a is b for a, b in zip(cut, inputs)):
        return None
    return cut, small


def fit_calls(costs: Sequence[LayerCost], spec: DeviceSpec, batch: int,
              timed: Sequence[tuple[float, float]], small: int | None = None,
              timed_small: Sequence[tuple[float, float]] | None = None) -> list[LayerCost]:
    """``costs`` with ``time_scale`` and ``call_seconds`` fitted to their (forward,
    backward) seconds ``timed`` on ``batch`` samples and ``timed_small`` on ``small``
    (layers of one signature: the medians of their times); without a small batch, one
    scale each, measured / predicted."""
    rows: dict[str, list[tuple[float, ...]]] = {}
    for k, (cost, big) in enumerate(zip(costs, timed, strict=True)):
        few = timed_small[k] if timed_small is not None else (0.0, 0.0)
        rows.setdefault(cost.signature, []).append((sum(big), sum(few), *few))
    medians = {k: [statistics.median(column) for column in zip(*v)] for k, v in rows.items()}
    return [_fitted(cost, spec, batch, small if timed_small is not None else None,
                    *medians[cost.signature]) for cost in costs]


def _fitted(cost: LayerCost, spec: DeviceSpec, batch: int, small: int | None, big: float,
            few: float, few_f: float, few_b: float) -> LayerCost:
    bare = replace(cost, time_scale=1.0, call_seconds=(0.0, 0.0))
    predicted = sum(phase_times(bare, spec, batch))
    one_scale = replace(bare, time_scale=max(big / max(predicted, 1e-12), MIN_SCALE))
    if small is None or predicted <= 0:
        return one_scale
    sf, sb = phase_times(bare, spec, small)
    if sf + sb > MAX_SMALL_SHARE * predicted:
        return one_scale
    scale = (big - few) / (predicted - sf - sb)
    if big - scale * predicted <= 0:  # no per-call part: the large batch's scale
        return one_scale
    scale = max(scale, MIN_SCALE)
    call = max(big - scale * predicted, 0.0)
    forward, backward = max(few_f - scale * sf, 0.0), max(few_b - scale * sb, 0.0)
    share = forward / (forward + backward) if forward + backward > 0 else \
        few_f / few if few > 0 else 0.5
    return replace(bare, time_scale=scale, call_seconds=(call * share, call * (1 - share)))
