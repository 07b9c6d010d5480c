"""What the ranks of a world agree on around planning: their cluster and rank 0's figures.

Collective (every rank calls each function, in the same order): :func:`infer_cluster`
gathers the ranks' host names and, on one CPU host, measures the gloo link between them
once per world (:func:`cpu_world_link`); :func:`predicted_for_world` sends rank 0's
prediction of a plan whose sizes the caller gave (``partitioner.planning.world_prediction``)
to every rank; :func:`rank0_error` rebuilds on the other ranks the error rank 0 raised.

Example:
    >>> cluster = infer_cluster(None, torch.device("cpu"))  # doctest: +SKIP
    >>> cluster.processes, cluster.size                      # doctest: +SKIP
    (True, 4)
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from partitioner import errors
from partitioner.cost.comm import all_reduce_time
from partitioner.cost.cost import Workload
from partitioner.cost.devices import REFERENCE_CPU, Cluster, LinkSpec
from partitioner.cost.links import fit_ring_steps
from partitioner.cost.machine import cpu_spec
from partitioner.errors import PartitionError, StrategyError
from partitioner.planning.world import (
    REFERENCE_LOOPBACK,
    cluster_option,
    nodes_of,
    world_cluster,
)
from partitioner.planning.world_prediction import not_predicted, predicted_as_run
from partitioner.plans.plan import Plan
from partitioner.runtime import device as accelerators
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.link_probe import (
    COLLECTIVE_BYTES,
    POST_BYTES,
    STAGGER_AFTER,
    ProbedLink,
    probe_link,
)

__all__ = ["infer_cluster", "cpu_world_link", "computing_excess", "post_figures",
           "predicted_for_world", "rank0_error"]


def infer_cluster(option: Cluster | str | None, device: torch.device) -> Cluster:
    """The cluster of this world (collective: every rank gives its host name).

    Raises:
        DeviceError: ``cluster=`` does not fit the world, the ranks are not laid out node
            by node, or no preset matches the GPUs (then pass ``cluster=``).
    """
    hosts: list[Any] = [None] * dist.get_world_size()
    with communicating("gathering the ranks' host names (all_gather_object)"):
        dist.all_gather_object(hosts, socket.gethostname())
    if isinstance(option, Cluster):
        return cluster_option(option, len(hosts), 1, len(hosts))
    if option is not None:
        nodes, per = nodes_of(hosts)
        return cluster_option(option, len(hosts), nodes, per)
    if accelerators.is_accelerator(device):
        name, memory = accelerators.properties(device)
        return world_cluster(hosts, device.type, gpu_name=name, gpu_memory=memory)
    return world_cluster(hosts, device.type, link=cpu_world_link(hosts))


def cpu_world_link(hosts: list[Any]) -> LinkSpec | None:
    """The link between the ranks of a one-host CPU world, measured now (collective; about
    50 round trips, ``link_probe``); the reference one when the reference CPU spec is
    pinned (tests plan deterministically); ``None`` (the assumed preset) across hosts."""
    if len(set(hosts)) != 1 or len(hosts) < 2:
        return None
    if cpu_spec() is REFERENCE_CPU:
        return REFERENCE_LOOPBACK
    key = (tuple(hosts), dist.get_rank())  # every rank of a world calls in the same order
    if key not in _MEASURED_LINKS:
        got = probe_link()
        # The all-reduces timed are the ring's own figure; the floor that noise may not
        # beat is a lone pair's message. The busy pairs' median flips between about 50 us
        # and 2 ms from one probe to the next (round trips of every pair at once on 4 ranks
        # of 2 cores are either, in shares that change within a second): as the floor it
        # made each step of a tensor-parallel all-reduce 0.45 or 2.0 ms by the draw.
        pairs = LinkSpec("pairs", got.bandwidth, got.latency)
        world = len(hosts)
        rings = [(world, *fit_ring_steps(world, COLLECTIVE_BYTES, got.collective, pairs))]
        if got.pairs is not None:
            rings.insert(0, (2, *fit_ring_steps(2, COLLECTIVE_BYTES, got.pairs, pairs)))
        steps = ", ".join(f"{n} ranks {a * 1e6:.0f} us and {b / 1e9:.2f} GB/s"
                          for n, a, b in rings)
        staggered = " or ".join(f"{t * 1e3:.2f} ms ({a * 1e3:.1f} ms of compute after)"
                                for a, t in zip(STAGGER_AFTER, got.staggered))
        computing = computing_excess(got, LinkSpec("rings", got.bandwidth, got.latency,
                                                   rings=tuple(rings)))
        beyond = ", ".join(f"{n} ranks {t * 1e3:.2f} ms ({a * 1e3:.1f} ms of compute before)"
                           for n, a, t in computing) or "nothing"
        _MEASURED_LINKS[key] = LinkSpec(
            f"gloo over loopback (measured: {got.latency * 1e6:.0f} us a message, "
            f"{got.bandwidth / 1e9:.1f} GB/s; an all-reduce's step over {steps}; a rank's "
            f"compute {got.wake * 1e3:.2f} ms slower after a wait; a one-number all-reduce "
            f"{got.scalar * 1e3:.2f} ms, the last rank out {staggered} after the last "
            "in when they come one by one; the ranks' optimizer steps at once "
            f"{got.optimizer_gain:.2f}x one alone; posting a message "
            f"{got.posting[0] * 1e6:.0f} us, {POST_BYTES >> 20} MiB {got.posting[1] * 1e6:.0f} "
            f"us; an all-reduce between computing ranks costs {beyond} more)",
            got.bandwidth, got.latency, computing_all_reduce=computing,
            busy_latency=got.busy_latency, wake=got.wake, rings=tuple(rings),
            scalar_all_reduce=got.scalar, optimizer_gain=got.optimizer_gain,
            staggered_all_reduce=tuple(zip(STAGGER_AFTER, got.staggered)),
            **post_figures(got.posting))
    return _MEASURED_LINKS[key]


def computing_excess(got: ProbedLink, ring: LinkSpec) -> tuple[tuple[int, float, float], ...]:
    """``LinkSpec.computing_all_reduce`` from the probe's all-reduces between computations
    (``ProbedLink.computing``): each row's seconds beyond what the fitted ``ring`` charges
    the same all-reduce (``COLLECTIVE_BYTES[0]``), never below 0; ordered by group size,
    then compute.

    Example:
        >>> from partitioner.runtime.distributed.link_probe import ProbedLink
        >>> got = ProbedLink(5e-5, 3e9, 5e-5, 0.0, (1e-3, 4e-3),
        ...                  computing=((2, 4e-3, 2.5e-3), (2, 1e-3, 1e-4)))
        >>> ring = LinkSpec("ring", 3e9, 5e-5, rings=((2, 5e-4, 1e9),))
        >>> [(n, a, round(t * 1e3, 3)) for n, a, t in computing_excess(got, ring)]
        [(2, 0.001, 0.0), (2, 0.004, 1.434)]
    """
    rows = {(int(n), between): max(took - all_reduce_time(COLLECTIVE_BYTES[0], int(n), ring),
                                   0.0) for n, between, took in got.computing}
    return tuple((n, between, excess) for (n, between), excess in sorted(rows.items()))


def post_figures(posting: tuple[float, float]) -> dict[str, float]:
    """``LinkSpec``'s ``post_latency`` and ``post_bandwidth`` from the probe's posting times
    of a 4-byte message and a :data:`POST_BYTES` one (no per-byte term where the larger
    posted no slower).

    Example:
        >>> figures = post_figures((4e-5, 2.4e-4))
        >>> figures["post_latency"], round(figures["post_bandwidth"] / 1e9, 2)
        (4e-05, 5.24)
    """
    small, large = posting
    per_byte = max(large - small, 0.0) / (POST_BYTES - 4)
    return {"post_latency": small, "post_bandwidth": 1 / per_byte if per_byte > 0 else 0.0}


_MEASURED_LINKS: dict[tuple[Any, ...], LinkSpec] = {}
"""The link of each world this process was in, measured once (tuning builds every candidate
with its sizes given, and each would measure it again)."""


def predicted_for_world(made: Plan, workload: Workload | None, device: torch.device,
                        precision: str) -> Plan:
    """``made``, a plan of sizes the caller gave, with its step predicted as this world's
    ranks run it (``partitioner.planning.world_prediction``), on every rank (collective:
    rank 0 predicts and sends). Unchanged in a world of one, or without costs."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or workload is None:
        return made
    try:
        cluster = infer_cluster(None, device)
    except PartitionError as error:  # alike on every rank (their host names are gathered)
        return not_predicted(made, str(error).splitlines()[0])
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = {"plan": predicted_as_run(made, workload, cluster,
                                               precision=precision).to_dict()}
        except Exception as error:  # every rank must hear of it, then rank 0 re-raises
            failure, box[0] = error, {"error": type(error).__name__, "message": str(error)}
    with communicating("sending rank 0's predicted step to every rank (broadcast_object_list)"):
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if "error" in box[0]:
        raise rank0_error(box[0]["error"], box[0]["message"])
    return Plan.from_dict(box[0]["plan"])


def rank0_error(name: str, message: str) -> Exception:
    """The error rank 0 raised (its class's ``name`` and ``message``), for another rank to
    raise: the same :class:`~partitioner.errors.PartitionError` subclass, saying where it
    came from, else a :class:`~partitioner.errors.StrategyError` naming it."""
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, PartitionError):
        return kind(f"(on rank 0, which plans) {message}")
    return StrategyError(f"rank 0 failed while planning ({name}: {message}); see its error")
