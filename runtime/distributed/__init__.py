"""The multi-process runtime: one rank per device, on torch.distributed (gloo, NCCL).

Owns the (pp, dp, tp) mesh and its process groups (``mesh``), point-to-point transfers
between stages (``p2p``), one rank's pipeline (``pipeline``), bucketed gradient all-reduce
between replicas (``data_parallel``), the replica sampler (``sampler``), consolidated
checkpoints (``checkpoint_io``), failure detection (``failure``; a failed exchange is one
``CommunicationError``, ``comm_failure``), and the start-up checks that every rank was
launched into the same world (``rendezvous``) and asked for the same run (``agreement``).

May import: ``partitioner.runtime`` (schedules, stages, transfers), its
``tensor_parallel`` room, and ``partitioner.errors``. Never the planner.
"""
