"""What the tensor-parallel pass really splits, in the costs the search ranks with.

A capture's costs count every product with a weight as split by tensor parallelism
(``partitioner.cost.cost``: ``Op.split``). The pass splits only the Megatron column/row pairs
(and heads, vocabularies) it finds (:class:`~partitioner.planning.tp_rules.ShardPlan`): a
lone input projection, or a block whose pairs it does not recognize, runs whole on every
rank. :func:`as_split` makes the workload say so, so ``"auto"`` does not rank a tensor-
parallel plan by halves its ranks never get.

Nor by all-reduces its ranks never run. The capture charges a layer one all-reduce per two
weight products (a block holding its pairs), but a flattened ``nn.Sequential`` puts a pair's
column ``Linear`` and its row ``Linear`` in layers of their own: each was charged one, twice
the pair's one all-reduce, and the column side's on its wide output (an MLP 1024 -> 4096 ->
1024 was charged 5x the bytes its tensor-parallel run all-reduces). Given the pass's pairs,
a layer holding a pair's modules is charged one all-reduce per pair it ends (its row side):
what the runtime runs, and what the layers merged for the build are charged.

Example:
    >>> from partitioner.cost.cost import LayerCost, Op, Workload
    >>> fc = Op("matmul", flops=1e3, weight_grad=64, split=True)
    >>> work = Workload((LayerCost("a", (fc,), 64, split_param_bytes=64),
    ...                  LayerCost("b", (fc,), 64, split_param_bytes=64)), (0.0,) * 3, batch=2)
    >>> [layer.splittable for layer in as_split(work, ["b.fc.weight"]).layers]
    [False, True]
    >>> both = as_split(work, ["a.fc.weight", "b.fc.weight"], pairs=((("a",), ("b",)),))
    >>> [layer.tp_all_reduces for layer in both.layers]
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from partitioner.cost.cost import LayerCost, Workload

__all__ = ["as_split"]


Pairs = Sequence[tuple[Sequence[str], Sequence[str]]]
"""The pass's Megatron pairs, ``(column modules, row modules)`` (``ShardPlan.pairs``)."""


def as_split(workload: Workload, split_names: Iterable[str], pairs: Pairs = (),
             members: Sequence[Sequence[str]] | None = None) -> Workload:
    """``workload`` with the layers none of whose parameters the pass splits (named by
    ``split_names``, the model's parameter names: ``ShardPlan.split()``) costed whole on
    every rank; the layers holding modules of ``pairs`` charged one all-reduce per pair
    whose row side they hold; the others as they were. ``members``: per layer, the names
    of the layers it holds (layers merged for tensor parallelism,
    ``TensorParallelSplit.layer_names``); by default each layer holds itself."""
    names = list(split_names)
    held = members if members is not None else [[c.name] for c in workload.layers]
    layers = tuple(_paired(layer, own, pairs) if _holds_any(own, names) else _whole(layer)
                   for layer, own in zip(workload.layers, held, strict=True))
    if layers == workload.layers:
        return workload
    return replace(workload, layers=layers)


def _holds_any(own: Sequence[str], names: Iterable[str]) -> bool:
    """Whether layers named ``own`` hold a module or parameter of ``names``."""
    prefixes = tuple(p for name in own for p in (name + ".", name.replace(".", "_") + "."))
    return any(n in own or n.startswith(prefixes) for n in names)


def _paired(layer: LayerCost, own: Sequence[str], pairs: Pairs) -> LayerCost:
    """``layer`` (holding the layers ``own``) charged the all-reduces of the pairs it ends
    (unchanged when it holds no module of a pair)."""
    if not any(_holds_any(own, (*cols, *rows)) for cols, rows in pairs):
        return layer
    ends = sum(1 for _, rows in pairs if _holds_any(own, rows))
    if ends == layer.tp_all_reduces:
        return layer
    # Layers of one signature cost the same; a column side and a row side of equal shapes
    # no longer do.
    return replace(layer, tp_all_reduces=ends, signature=f"{layer.signature}:ar{ends}")


def _whole(layer: LayerCost) -> LayerCost:
    if not layer.splittable and not any(op.split for op in layer.ops):
        return layer
    return replace(layer, ops=tuple(replace(op, split=False) for op in layer.ops),
                   split_param_bytes=0.0, split_activation_bytes=0.0, tp_all_reduces=0,
                   replayed_all_reduces=0.0, signature="")
