"""What the tensor-parallel pass really splits, in the costs the search ranks with.

A capture's costs count every product with a weight as split by tensor parallelism
(``partitioner.cost.cost``: ``Op.split``). The pass splits only the Megatron column/row pairs
(and heads, vocabularies) it finds (:class:`~partitioner.planning.tp_rules.ShardPlan`): a
lone input projection, or a block whose pairs it does not recognize, runs whole on every
rank. :func:`as_split` makes the workload say so, so ``"auto"`` does not rank a tensor-
parallel plan by halves its ranks never get.

Example:
    >>> from partitioner.cost.cost import LayerCost, Op, Workload
    >>> fc = Op("matmul", flops=1e3, weight_grad=64, split=True)
    >>> work = Workload((LayerCost("a", (fc,), 64, split_param_bytes=64),
    ...                  LayerCost("b", (fc,), 64, split_param_bytes=64)), (0.0,) * 3, batch=2)
    >>> [layer.splittable for layer in as_split(work, ["b.fc.weight"]).layers]
    [False, True]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from partitioner.cost.cost import LayerCost, Workload

__all__ = ["as_split"]


def as_split(workload: Workload, split_names: Iterable[str]) -> Workload:
    """``workload`` with the layers none of whose parameters the pass splits (named by
    ``split_names``, the model's parameter names: ``ShardPlan.split()``) costed whole on
    every rank; the others as they were."""
    names = list(split_names)
    layers = tuple(layer if _holds_any(layer, names) else _whole(layer)
                   for layer in workload.layers)
    if layers == workload.layers:
        return workload
    return replace(workload, layers=layers)


def _holds_any(layer: LayerCost, names: list[str]) -> bool:
    prefixes = {layer.name + ".", layer.name.replace(".", "_") + "."}
    return any(n == layer.name or any(n.startswith(p) for p in prefixes) for n in names)


def _whole(layer: LayerCost) -> LayerCost:
    if not layer.splittable and not any(op.split for op in layer.ops):
        return layer
    return replace(layer, ops=tuple(replace(op, split=False) for op in layer.ops),
                   split_param_bytes=0.0, split_activation_bytes=0.0, tp_all_reduces=0,
                   replayed_all_reduces=0.0, signature="")
