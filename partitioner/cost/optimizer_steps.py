"""How long a host spends on its devices' optimizer steps, in units of one step alone, and
whether its gradient reduction can hide behind the backward.

One process (``partition``: worker threads, ``runtime/replicas.py``) steps each
tensor-parallel shard of a stage once, one after another, in the caller's thread, and the
replicas' master only (they copy its weights): ``tp`` steps per pipeline device. Ranks of one
host (``partition_distributed``: a process each) step their own at the same time, ``dp x tp``
per pipeline device, sharing the host's cores: all of the host's ranks at once get
``LinkSpec.optimizer_gain`` steps done in the time of one alone, as the world's link probe
timed them (``partitioner.runtime.distributed.optimizer_probe``); unmeasured, as memory-bound
work shares them (``DeviceSpec.speedup`` of 0 FLOPs over all of the host's ranks). The
simulation steps the pipeline devices' optimizers one after another, so their sum is what
the host spends (``partitioner.planning.simulate``).

Example:
    >>> from partitioner.cost.devices import REFERENCE_CPU, Cluster
    >>> threads = Cluster(REFERENCE_CPU, 1, 4, local=("cpu",) * 4)
    >>> ranks = Cluster(REFERENCE_CPU, 1, 4, local=("cpu",) * 4, processes=True)
    >>> optimizer_copies(2, 1, threads), round(optimizer_copies(2, 1, ranks), 2)
    (1, 2.86)
    >>> from dataclasses import replace
    >>> probed = replace(ranks, intra_node=replace(ranks.intra_node, optimizer_gain=2.0))
    >>> optimizer_copies(2, 1, probed)  # 4 ranks step at once, 2 of them in the time of 1
    1.0
"""

from __future__ import annotations

from partitioner.cost.devices import Cluster

__all__ = ["optimizer_copies", "overlaps"]


def optimizer_copies(dp: int, tp: int, cluster: Cluster) -> float:
    """Steps of one pipeline device's optimizer the host spends time on (see the module
    docstring); ``cluster`` has local devices, ``cluster.size`` of them busy at once. Ranks
    on devices that share nothing (GPUs) each step their own once: 1.

    Example:
        >>> gpus = Cluster.preset("A100-80GB")
        >>> optimizer_copies(2, 2, Cluster(gpus.device, 1, 4, local=("cuda:0",) * 4,
        ...                                processes=True))
        1.0
    """
    if not cluster.processes:
        return tp
    spec = cluster.spec(0)
    if not spec.shared_speedup:
        return 1.0
    measured = cluster.intra_node.optimizer_gain if cluster.is_local else 0.0
    return dp * tp / (measured or spec.speedup(cluster.size, 0.0))


def overlaps(cluster: Cluster) -> bool:
    """Whether the replicas' gradient reduction runs beside the last backward: on GPU ranks
    (NCCL's stream) and clusters elsewhere, yes; one process's replicas sum after it, and
    CPU ranks' gloo thread needs the cores that backward uses (measured, dp=2 on the 2-core
    VM: the all-reduce of a 3.4 ms backward still waited 2.9 ms after it).

    Example:
        >>> from partitioner.cost.devices import REFERENCE_CPU, Cluster
        >>> cpu = Cluster(REFERENCE_CPU, 1, 2, local=("cpu",) * 2, processes=True)
        >>> gpu = Cluster.preset("A100-80GB")
        >>> overlaps(cpu), overlaps(gpu), overlaps(Cluster(gpu.device, 1, 2,
        ...                                                local=("cuda:0", "cuda:1"),
        ...                                                processes=True))
        (False, True, True)
    """
    if not cluster.is_local:
        return True
    return cluster.processes and not any(d.startswith("cpu") for d in cluster.local)
