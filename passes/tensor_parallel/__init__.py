"""The tensor-parallel pass: find what splits, decide each value's layout, rewrite each rank.

Owns finding the splittable products and embeddings (``sites``), Megatron's column/row
pairing found by trying (``match``), layouts (``layout``), per-op propagation rules
(``ops``, ``shape_ops``, ``decision``), propagation over a graph (``propagate``), the
rewrite into one rank's graph (``rewrite``) and the pass itself (``shard_graph``).

May import: ``partitioner.passes`` (base, dead code), ``partitioner.runtime`` (the
collectives and ops the rewritten graphs call) and ``partitioner.errors``.
"""
