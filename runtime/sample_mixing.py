"""Whether a model mixes the samples of a batch, found by running it on a few of them.

A partitioned model that splits the batch (micro-batches, replicas) computes what the whole
model computes only when no operation crosses the batch dimension. Batch norm is found by
name in the captured graph (``partitioner.cost.cost``); any other such operation
(``x - x.mean(0)``, a softmax or a sort over dim 0, ``x.T @ x``) only by its result, which
is what :func:`mixes_samples` looks at: the first :data:`PROBE_SAMPLES` samples of the
example batch run as one batch and as two halves split as the runtime splits a batch
(:func:`~partitioner.runtime.microbatch.scatter`), the outputs joined as it joins them
(``join_rules``, ``gather``) and those with a batch dimension compared with the whole's.
An output without one (a loss, an MoE router's auxiliary loss) is the micro-batches'
average by the runtime's contract (the README's restrictions), so it is not compared.
Found on 2026-12-05: ``strategy="auto"`` gave such a model two replicas and its outputs
differed from the model's by 2.4e-3, with no note.

It runs in eval mode (dropout off; batch norm's running statistics, which its own rule
covers), without gradients, under a forked random state, and puts back every buffer and
module mode afterwards. It cannot tell, and says nothing, when the batch has fewer than two
samples, a tensor is on the meta device, a forward fails on the slices, the outputs change
from one run to the next (random outputs in eval mode), or the halves' outputs do not join
into the whole's shapes.

Example:
    >>> import torch
    >>> from torch import nn
    >>> x = torch.randn(8, 4)
    >>> mixes_samples(nn.Linear(4, 4), (x,), {}) is None
    True
    >>> class Centred(nn.Module):
    ...     def forward(self, x):
    ...         return x - x.mean(0)
    >>> mixes_samples(Centred(), (x,), {})  # doctest: +ELLIPSIS
    'splitting the batch changes output 0 by up to ...: an operation mixes the samples ...'
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.errors import OutputError
from partitioner.runtime.device import fork_rng
from partitioner.runtime.microbatch import CAT, batch_size, gather, join_rules, scatter

__all__ = ["PROBE_SAMPLES", "mixes_samples"]

PROBE_SAMPLES = 4
"""Samples of the example batch run whole and as two halves of two: a few forwards of a
small batch, and halves that keep a batch dimension of more than one (a ``squeeze()`` of a
batch of one would change the shapes, not say that samples mix)."""

_SEEDS = (1234, 4321)


def mixes_samples(model: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any] | None) -> str | None:
    """A sentence naming the first output that splitting the batch changes, or ``None``
    (nothing mixes the samples, or the check cannot tell: the module docstring)."""
    values = [list(args), dict(kwargs or {})]
    batch = batch_size(values)
    tensors = [*pytree.tree_leaves(values), *model.parameters(), *model.buffers()]
    if batch is None or batch < 2 or any(isinstance(t, torch.Tensor) and t.is_meta
                                         for t in tensors):
        return None
    whole = scatter(values, batch // min(batch, PROBE_SAMPLES))[0]
    if (batch_size(whole) or 0) < 2:
        return None
    halves = scatter(whole, 2)
    try:
        with _untouched(model), torch.no_grad():
            first, again = (_run(model, whole, seed) for seed in _SEEDS)
            parts = [_run(model, half, _SEEDS[0]) for half in halves]
    except Exception:  # a forward that fails on a slice: the check cannot tell
        return None
    leaves, spec = pytree.tree_flatten(first)
    if pytree.tree_flatten(again)[1] != spec or _differs(leaves, pytree.tree_leaves(again)):
        return None  # random outputs: whole and halves cannot be compared
    if any(pytree.tree_flatten(p)[1] != spec for p in parts):
        return None
    sizes = [batch_size(half) or 1 for half in halves]
    try:  # joined as the runtime joins micro-batches' outputs
        rules = join_rules(parts, sizes)
    except OutputError:  # the runtime refuses such outputs itself
        return None
    joined = pytree.tree_leaves(gather(parts, sizes, rules=rules))
    for index, (rule, leaf, got) in enumerate(zip(rules, leaves, joined)):
        # Only outputs with a batch dimension: the others are averages by contract.
        if rule != CAT or not isinstance(leaf, torch.Tensor) or leaf.shape != got.shape:
            continue
        gap = _gap(leaf, got)
        if gap is not None:
            return (f"splitting the batch changes output {index} by up to {gap:.3g}: an "
                    "operation mixes the samples (a reduction, softmax or sort over dim 0, a "
                    "product across it); micro-batches and replicas would compute other "
                    "values than the model")
    return None


def _run(model: nn.Module, values: list[Any], seed: int) -> Any:
    torch.manual_seed(seed)
    args, kwargs = values
    return model(*args, **kwargs)


@contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Eval mode and a forked random state; buffers and modes put back after."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    model.eval()
    try:
        with fork_rng([*model.parameters(), *model.buffers()]):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, training in modes.items():
            module.training = training


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _gap(whole: torch.Tensor, joined: torch.Tensor) -> float | None:
    """The largest difference when it exceeds what summing in another order explains
    (relative to the output's scale, for the output's dtype); else ``None``."""
    if not whole.is_floating_point():
        return None if torch.equal(whole, joined.to(whole.dtype)) else 1.0
    a, b = whole.double(), joined.double()
    if a.numel() == 0:
        return None
    gap = float((a - b).abs().max())
    scale = max(float(a.abs().max()), 1.0)
    return gap if gap > _tolerance(whole.dtype) * scale else None


def _differs(first: list[Any], again: list[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
               and (a.shape != b.shape or _gap(a, b) is not None)
               for a, b in zip(first, again))
