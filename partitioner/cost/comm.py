"""Communication times by the alpha-beta model.

A message of ``S`` bytes over a link of latency ``alpha`` and bandwidth ``beta`` takes
``alpha + S / beta``. The ring collectives over ``n`` ranks move ``S / n`` per step:

==================  ==========================================  ==================
collective          time                                        ``S`` is
==================  ==========================================  ==================
point-to-point      ``alpha + S / beta``                        the message
all-reduce          ``2 (n - 1) (alpha + S / (n beta))``        each rank's buffer
all-gather          ``(n - 1) (alpha + S / (n beta))``          the gathered result
reduce-scatter      ``(n - 1) (alpha + S / (n beta))``          each rank's input
==================  ==========================================  ==================

An all-reduce is a reduce-scatter then an all-gather, hence twice their time. ``beta`` is
the link's *effective* bandwidth (datasheet times the efficiency collectives reach); which
link a group of ranks uses, and how many of a node's NICs it gets, is
:meth:`partitioner.cost.devices.Cluster.group_link`'s business.

Example:
    >>> link = LinkSpec("test", bandwidth=100e9, latency=5e-6)
    >>> round(all_reduce_time(1e9, 8, link) * 1e3, 3)  # 2 * 7 * (5 us + 1.25 ms)
    17.57
    >>> all_reduce_time(1e9, 1, link)
    0.0
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.cost.devices import Cluster, LinkSpec
from partitioner.errors import CommError

__all__ = ["CommError", "COLLECTIVES", "p2p_time", "all_reduce_time", "all_gather_time",
           "reduce_scatter_time", "collective_time", "replica_sync_time", "fsdp_time",
           "fsdp_ends_time", "computing_all_reduce_time"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _check(nbytes: float, n: int = 1) -> None:
    problems = []
    if not nbytes >= 0:
        problems.append(f"nbytes={nbytes!r}; pass a size >= 0")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        problems.append(f"n={n!r}; pass the number of ranks, an int >= 1")
    if problems:
        raise CommError("; ".join(problems))


def p2p_time(nbytes: float, link: LinkSpec) -> float:
    """Seconds to send ``nbytes`` from one rank to another over ``link``.

    Example:
        >>> p2p_time(1e6, LinkSpec("l", 1e9, 1e-5))
        0.00101
    """
    _check(nbytes)
    return link.time(nbytes)


def all_reduce_time(nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` per rank over ``n`` ranks.

    Example:
        >>> all_reduce_time(8e9, 2, LinkSpec("l", 1e9, 0.0))  # 2 * 1 * (8e9 / 2e9)
        8.0
    """
    _check(nbytes, n)
    return 2 * _ring_steps(nbytes, n, link)


def computing_all_reduce_time(nbytes: float, n: int, link: LinkSpec,
                              between: float) -> float:
    """Seconds of an all-reduce of ``nbytes`` among ``n`` ranks entered from ``between``
    seconds of compute, as a tensor-parallel layer's: :func:`all_reduce_time` and what
    the link measured such an all-reduce to cost beyond it (``LinkSpec.computing_excess``;
    processes on one CPU host, nothing elsewhere).

    Example:
        >>> link = LinkSpec("l", 1e9, 1e-4, computing_all_reduce=((2, 1e-3, 5e-4),))
        >>> round(computing_all_reduce_time(1e6, 2, link, 3e-3) * 1e3, 2)  # 1.2 + 0.5
        1.7
    """
    if n <= 1:
        return 0.0
    return all_reduce_time(nbytes, n, link) + link.computing_excess(n, between)


def all_gather_time(nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds of a ring all-gather whose result is ``nbytes`` on every rank.

    Example:
        >>> all_gather_time(4e9, 4, LinkSpec("l", 1e9, 0.0))  # 3 steps of 1 GB
        3.0
    """
    _check(nbytes, n)
    return _ring_steps(nbytes, n, link)


def reduce_scatter_time(nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds of a ring reduce-scatter of ``nbytes`` of input per rank.

    Example:
        >>> reduce_scatter_time(4e9, 4, LinkSpec("l", 1e9, 0.0))
        3.0
    """
    _check(nbytes, n)
    return _ring_steps(nbytes, n, link)


def fsdp_time(nbytes: float, n: int, link: LinkSpec, reduce_scale: float = 1.0) -> float:
    """Seconds of FSDP's collectives in a step over ``n`` replicas holding ``nbytes`` of
    parameters each (whole): all-gathered for the forward and again for the backward, and
    the gradients reduce-scattered, ``reduce_scale`` times their bytes (2 where bf16
    parameters reduce their gradients in fp32, torchtitan's ``MixedPrecisionPolicy``
    default); at 1, an all-reduce and a half.

    Example:
        >>> link = LinkSpec("l", 1e9, 0.0)
        >>> fsdp_time(4e9, 4, link) / all_reduce_time(4e9, 4, link)
        1.5
        >>> fsdp_time(4e9, 4, link, reduce_scale=2.0) / all_reduce_time(4e9, 4, link)
        2.0
    """
    return 2 * all_gather_time(nbytes, n, link) \
        + reduce_scatter_time(nbytes * reduce_scale, n, link)


def fsdp_ends_time(unit_bytes: float, n: int, link: LinkSpec,
                   reduce_scale: float = 1.0) -> float:
    """Seconds of FSDP's collectives that no compute hides: a step's first unit (the
    parameters of a rank's first layer, ``unit_bytes`` whole) is all-gathered before the
    first forward can start, and the same unit's gradients, whose backward is the step's
    last, are reduce-scattered after it; every other unit's are prefetched or reduced
    beside the compute.

    Example:
        >>> round(fsdp_ends_time(1e9, 8, LinkSpec("l", 1e9, 0.0), reduce_scale=2.0), 3)
        2.625
    """
    return all_gather_time(unit_bytes, n, link) \
        + reduce_scatter_time(unit_bytes * reduce_scale, n, link)


def _ring_steps(nbytes: float, n: int, link: LinkSpec) -> float:
    if n == 1 or nbytes == 0:
        return 0.0
    alpha, beta = link.ring_step(n)
    return (n - 1) * (alpha + nbytes / (n * beta))


_TIMES = {"all_reduce": all_reduce_time, "all_gather": all_gather_time,
          "reduce_scatter": reduce_scatter_time}


def collective_time(kind: str, nbytes: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Seconds of collective ``kind`` over ``ranks`` of ``cluster``, on the link they share.

    Args:
        kind: one of :data:`COLLECTIVES`.
        nbytes: ``S`` as in the module's table.
        ranks: the group's ranks (their nodes decide the link).
        cluster: the devices and links.

    Raises:
        CommError: for an unknown kind, a negative size or an empty group.

    Example:
        >>> from partitioner.cost.devices import Cluster
        >>> c = Cluster.preset("A100-80GB", nodes=2)
        >>> inside = collective_time("all_reduce", 1e8, range(8), c)
        >>> across = collective_time("all_reduce", 1e8, [0, 8], c)
        >>> inside < across
        True
    """
    if kind not in _TIMES:
        raise CommError(f"collective {kind!r} is unknown; use one of {COLLECTIVES}")
    ranks = list(ranks)
    if not ranks:
        raise CommError("ranks is empty; a collective needs at least one rank")
    return _TIMES[kind](nbytes, len(ranks), cluster.group_link(ranks))


def replica_sync_time(grad_bytes: float, param_bytes: float, dp: int, bandwidth: float
                      ) -> float:
    """Seconds to sum ``dp`` replicas' gradients and copy the weights back to each, in one
    process (``runtime/replicas.py``): copies over the host's memory bandwidth, after the
    backward (nothing overlaps them).

    The sum reads every replica's gradients and writes one; the broadcast reads the weights
    and writes ``dp - 1`` copies, each ``dp - 1`` times a read and a write.

    Example:
        >>> replica_sync_time(1e9, 1e9, 2, 10e9)  # (3 + 2) GB at 10 GB/s
        0.5
    """
    if dp <= 1 or bandwidth <= 0:
        return 0.0
    return ((dp + 1) * grad_bytes + 2 * (dp - 1) * param_bytes) / bandwidth
