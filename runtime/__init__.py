"""Runtimes (``partitioner.runtime``): execute a plan's stage graphs, knowing no planner.

Owns schedules as data (``action``, ``schedule``, the generators ``schedules`` and their one
registry ``schedule_registry``), the checkpoint modes (``checkpointing``), micro-batching,
one stage's forward and backward (``stage``), workers and transfers, per-stage dropout
generators (``rng``), the one-process pipeline (``local``) and the module the user holds
(``module``); the multi-process runtime (``distributed/``) and tensor-parallel execution
(``tensor_parallel/``). Installed as ``partitioner.runtime`` (pyproject's package-dir).

May import: only itself and ``partitioner.errors``.
"""

__all__: list[str] = []
