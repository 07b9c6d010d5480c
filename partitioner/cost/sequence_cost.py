"""What Megatron's sequence parallelism changes in a captured model's costs.

Under tensor parallelism alone, the replicated part of a split layer (residual adds, norms,
dropout: what lies between a row-parallel product's all-reduce and the next column-parallel
product) runs on the whole activation on every rank, and keeps it whole for the backward.
Sequence parallelism (``partitioner.passes.tensor_parallel.sequence_parallel``; Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", 2022) runs that
part on ``s / tp`` tokens per rank. So in every layer tensor parallelism splits:

- the memory-bound ops (element-wise, norms, dropout) take ``1 / tp`` of their time;
- every activation the layer keeps for the backward is divided by ``tp`` (Megatron's
  ``34 s b h / t`` per block instead of ``10 s b h + 24 s b h / t``);
- the collectives move what the all-reduces moved (a ring all-reduce is a reduce-scatter
  and an all-gather): no change.

Layers no split touches (an embedding, a last norm outside the pairs) keep their costs.
What the model leaves out: a stage's first replicated op, before its first column product,
runs on the whole boundary value (the runtime's stage boundaries carry whole sequences),
one norm's activations per stage.

Example:
    >>> from partitioner.cost.cost import LayerCost, Op, Workload
    >>> block = LayerCost("block", (Op("matmul", flops=8e6, split=True),
    ...                             Op("memory", bytes=4e3)),
    ...                   param_bytes=100, activation_bytes=1000, split_param_bytes=96,
    ...                   split_activation_bytes=600)
    >>> embed = LayerCost("embed", (Op("memory", bytes=4e3),), activation_bytes=400)
    >>> w = sequence_parallel_workload(Workload((embed, block), (0, 10, 0), batch=4))
    >>> w.layers[1].activations_on(4), block.activations_on(4)
    (250.0, 550.0)
    >>> w.layers[0].activations_on(4), [op.split for op in w.layers[1].ops]
    (400.0, [True, True])
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.cost.cost import LayerCost, Workload

__all__ = ["sequence_parallel_workload", "SEQUENCE_PARALLEL_NOTE"]

SEQUENCE_PARALLEL_NOTE = ("sequence parallel: the replicated part of each tensor-parallel "
                          "layer (norms, dropout, residual adds) costed on s / tp tokens, its "
                          "activations divided by tp")
"""The note a workload costed with sequence parallelism carries (``plan.explain()``)."""


def sequence_parallel_workload(workload: Workload) -> Workload:
    """``workload`` as tensor parallelism with sequence parallelism runs it (see the module
    docstring); unchanged for ``tp = 1`` (every share divides by 1)."""
    if SEQUENCE_PARALLEL_NOTE in workload.notes:
        return workload
    layers = tuple(_on_shards(layer) if layer.splittable else layer
                   for layer in workload.layers)
    return replace(workload, layers=layers, notes=(*workload.notes, SEQUENCE_PARALLEL_NOTE))


def _on_shards(layer: LayerCost) -> LayerCost:
    """A split layer whose replicated part runs on sequence shards."""
    ops = tuple(replace(op, split=True) if op.kind == "memory" else op for op in layer.ops)
    return replace(layer, ops=ops, split_activation_bytes=layer.activation_bytes,
                   signature=f"{layer.signature}+sp")
