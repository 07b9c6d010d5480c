"""Running tensor-parallel stages: ranks as threads in one process, or one per process.

Owns how one tensor is split (``sharding``), autograd-aware collectives on thread or
process groups (``collectives``), the other ops rank graphs call (``ops``), a stage's
ranks as one autograd node (``stage``), the one-process module (``module``), one rank per
process (``multiprocess``), whole-tensor state dicts (``state``, ``shard_state``).

May import: ``partitioner.runtime`` (workers, stages, the local pipeline) and
``partitioner.errors``. Never the planner.
"""
