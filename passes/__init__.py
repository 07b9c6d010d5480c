"""Graph passes (``partitioner.passes``): each takes a ``GraphModule``, returns a ``PassResult``.

Owns one pass per file: dead code, layer labels (``flatten_sequential``), layer grouping,
shape propagation on fake tensors, cost annotation, liveness, the stage split, private
dropout generators, input protection, input guards (what a ``torch.export`` graph
holds for), fused weight gradients, and the tensor-parallel pass
(``tensor_parallel/``). Installed as ``partitioner.passes`` (pyproject's package-dir).

May import: ``partitioner.runtime`` (the functions rewritten graphs call) and
``partitioner.errors``. Never the planner or the cost model.
"""

__all__: list[str] = []
