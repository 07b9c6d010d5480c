"""The cluster a ``torch.distributed`` world runs on, and the search for its plan.

``partition_distributed(model, x, strategy="auto")`` plans for the world it runs in. This
module turns what the ranks say about themselves (each rank's host name, the device kind)
into a :class:`~partitioner.cost.devices.Cluster`, and searches data x tensor x pipeline
parallelism, the schedule, the micro-batches and the checkpoint mode for it with
:func:`partitioner.planning.auto.search` and
:data:`~partitioner.planning.auto.MULTI_PROCESS_RUNTIME` (the schedules the multi-process
runtime runs, tensor parallelism inside a node). Degrees the caller fixes are kept and the
rest searched. Everything here is pure: the front (``partitioner.distributed``) gathers the
host names and hands rank 0's plan to every rank.

Example:
    >>> from partitioner.cost.devices import REFERENCE_CPU
    >>> c = world_cluster(["a", "a", "b", "b"], "cpu", cpu=REFERENCE_CPU)
    >>> c.nodes, c.devices_per_node, c.is_local
    (2, 2, False)
    >>> Degrees(pp=2).check(4), Degrees(pp=2, dp=2).label()
    (None, 'pp=2, dp=2')
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

from partitioner.cost.cost import Workload
from partitioner.cost.device_names import gpu_spec, preset_for
from partitioner.cost.devices import DEVICES, LINKS, Cluster, DeviceSpec, LinkSpec
from partitioner.cost.machine import cpu_spec
from partitioner.errors import (
    DeviceError,
    MemoryLimitError,
    MeshError,
    ScheduleError,
    StrategyError,
)
from partitioner.planning.auto import (
    MULTI_PROCESS_RUNTIME,
    SearchResult,
    configurations,
    executable,
    records,
    search,
)
from partitioner.planning.planner import plan_from
from partitioner.planning.predict import Config, Prediction, predict
from partitioner.planning.ranking import rank_within
from partitioner.planning.simulate import refine
from partitioner.planning.space import SearchSpace
from partitioner.plans.explain import explain
from partitioner.plans.plan import Plan
from partitioner.runtime import device as accelerators
from partitioner.runtime.schedule_registry import Runtime, runtime_problem

__all__ = ["Degrees", "LOOPBACK", "REFERENCE_LOOPBACK", "ETHERNET", "nodes_of",
           "world_cluster", "cluster_option", "capacity_of", "Check", "search_world",
           "world_plan", "assume_split", "DEFAULT_RESERVE"]

LOOPBACK = LINKS["loopback"]
"""Between the ranks of one CPU node (the link preset ``"loopback"``)."""

ETHERNET = LINKS["ethernet-10g"]
"""Between CPU nodes, and GPU nodes of no preset (the link preset ``"ethernet-10g"``)."""

REFERENCE_LOOPBACK = LinkSpec("gloo over loopback (reference CI machine)", 1.3e9, 60e-6,
                              wake=3e-4)
"""The link planned with beside the reference CPU spec (``PARTITIONER_CPU_SPEC=reference``,
so tests plan deterministically); ``partition_distributed`` measures the link of a
one-node CPU world otherwise (``link_probe``). Medians measured by
``link_probe.probe_link`` on the 2-core CI machine with 2 and 4 ranks (51-74 us a message,
1.1-1.9 GB/s), while other processes ran; the wake 0.12-0.48 ms with 4 ranks
(2026-12-04)."""

DEFAULT_RESERVE = 0.10
"""Share of each device's memory a plan leaves unused (allocator slack, fragmentation)."""


@dataclass(frozen=True)
class Degrees:
    """The mesh sizes the caller fixed; ``None`` ones are searched.

    Raises:
        MeshError: a size is not an int >= 1.
    """

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
               if getattr(self, f.name) is not None and (
                   isinstance(getattr(self, f.name), bool)
                   or not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1)]
        if bad:
            raise MeshError(f"mesh sizes must be ints >= 1 or None (searched), got "
                            f"{', '.join(bad)}")

    @property
    def given(self) -> dict[str, int]:
        """The fixed sizes by axis name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def label(self) -> str:
        """``"pp=2, dp=2"``: the fixed sizes, for messages."""
        return ", ".join(f"{k}={v}" for k, v in self.given.items()) or "no sizes"

    def check(self, world_size: int) -> None:
        """Refuse sizes that cannot make a mesh of ``world_size`` ranks.

        Raises:
            MeshError: their product does not divide the world size, or all three are
                given and their product is not the world size.
        """
        given = self.given
        product = math.prod(given.values())
        if world_size % product or (len(given) == 3 and product != world_size):
            raise MeshError(
                f"{self.label()} need {product} ranks per mesh, but the world has "
                f"{world_size}; pass sizes whose product "
                f"{'is' if len(given) == 3 else 'divides'} {world_size}, or leave them out "
                "for strategy='auto' to choose")

    def matches(self, config: Config) -> bool:
        """Whether ``config`` has the fixed sizes."""
        return all(getattr(config, k) == v for k, v in self.given.items())


def nodes_of(hostnames: Sequence[str]) -> tuple[int, int]:
    """``(nodes, devices per node)`` from each rank's host name, in rank order.

    Raises:
        DeviceError: nodes hold different numbers of ranks, or one node's ranks are not
            consecutive (the cost model numbers ranks node by node, as torchrun does).
    """
    order = list(dict.fromkeys(hostnames))
    counts = {host: list(hostnames).count(host) for host in order}
    if len(set(counts.values())) > 1:
        raise DeviceError(f"the nodes run different numbers of ranks ({counts}); launch the "
                          "same --nproc-per-node on every node, or pass cluster= to plan for "
                          "the devices yourself")
    per = counts[order[0]]
    expected = [order[r // per] for r in range(len(hostnames))]
    if list(hostnames) != expected:
        raise DeviceError(f"the ranks of a node are not consecutive (hosts by rank: "
                          f"{list(hostnames)[:16]}); launch with torchrun, which numbers "
                          "ranks node by node, or pass cluster=")
    return len(order), per


def world_cluster(hostnames: Sequence[str], device_type: str, *,
                  cpu: DeviceSpec | None = None, gpu_name: str = "",
                  gpu_memory: float = 0.0, link: LinkSpec | None = None) -> Cluster:
    """The cluster of a world whose rank ``r`` runs on host ``hostnames[r]``.

    ``"cpu"`` ranks are planned with this machine's CPU spec
    (:func:`partitioner.cost.machine.cpu_spec`, the reference spec in tests); the ranks of
    one node share its cores (as the spec's ``shared_speedup`` models) and its memory.
    GPU ranks get the preset named like the GPU; a GPU no preset matches is planned as a
    mid-range accelerator (:func:`~partitioner.cost.device_names.gpu_spec`) with PCIe inside
    a node and one assumed Ethernet link between nodes (pass ``cluster=`` for real figures).

    Args:
        hostnames: each rank's host, in rank order.
        device_type: ``"cpu"`` or the accelerator's type.
        cpu: the CPU spec (default: :func:`~partitioner.cost.machine.cpu_spec`).
        gpu_name: ``torch.cuda.get_device_name()`` of the ranks' GPUs.
        gpu_memory: their memory in bytes.

    Raises:
        DeviceError: the ranks are not laid out node by node, or another device type.
    """
    nodes, per = nodes_of(hostnames)
    if accelerators.is_accelerator(device_type):
        cluster = _gpu_cluster(gpu_name, gpu_memory, nodes, per)
        if nodes == 1:
            cluster = replace(cluster, local=tuple(str(accelerators.device(k))
                                                   for k in range(per)), processes=True)
        return cluster
    if device_type != "cpu":
        raise DeviceError(f"ranks on {device_type!r} devices; strategy='auto' plans for 'cpu' "
                          f"and {accelerators.ACCELERATOR!r} ranks, pass cluster= for others")
    spec = cpu if cpu is not None else cpu_spec()
    intra = link if link is not None else LOOPBACK
    if nodes == 1:  # this machine: its ranks share its cores, as the search models
        return Cluster(spec, 1, per, intra, None, 1, ("cpu",) * per, processes=True)
    return Cluster(spec, nodes, per, intra, ETHERNET, 1)


def _gpu_cluster(name: str, memory: float, nodes: int, per: int) -> Cluster:
    preset = preset_for(name, memory)
    if preset is not None:
        return Cluster.preset(preset, nodes, per)
    return Cluster(gpu_spec(name, memory), nodes, per, LINKS["pcie4"],
                   ETHERNET if nodes > 1 else None, 1)


def cluster_option(cluster: Cluster | str, world_size: int, nodes: int, per_node: int
                   ) -> Cluster:
    """``cluster=`` as a :class:`Cluster` of the world's size.

    Args:
        cluster: a Cluster, or a preset device name laid out like the world.
        world_size: ranks in the world.
        nodes: nodes of the world.
        per_node: ranks per node.

    Raises:
        DeviceError: an unknown preset, another type, or a cluster of another size.
    """
    if isinstance(cluster, str):
        return Cluster.preset(cluster, nodes, per_node)
    if not isinstance(cluster, Cluster):
        raise DeviceError(f"cluster={cluster!r} ({type(cluster).__name__}); pass a Cluster or "
                          f"a preset name, one of {sorted(DEVICES)}")
    if cluster.size != world_size:
        raise DeviceError(f"cluster= has {cluster.size} devices ({cluster.describe()}) but "
                          f"the world has {world_size} ranks; pass a cluster of {world_size} "
                          f"devices, or launch {cluster.size} ranks")
    return cluster


def capacity_of(cluster: Cluster, reserve: float, memory_limit: float | None = None) -> float:
    """Bytes one rank may plan for: ``memory_limit`` if given, else its device's memory
    less ``reserve`` (a share), split among a node's ranks when they share the host's.

    Raises:
        StrategyError: ``reserve`` is not in ``[0, 1)``.
    """
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) \
            or not 0 <= reserve < 1:
        raise StrategyError(f"memory_reserve={reserve!r}; pass a share in [0, 1), e.g. 0.1 "
                            "to leave 10% of each device's memory unused")
    if memory_limit is not None:
        return float(memory_limit)
    spec = cluster.spec(0)
    shared = cluster.devices_per_node if spec.shared_speedup else 1
    return spec.memory_bytes * (1 - reserve) / shared


Check = Callable[[Config], str | None]
"""Why the model cannot run a configuration (``None``: it can), beyond what the runtime
supports: e.g. whether tensor parallelism splits this model ``tp`` ways."""


def search_world(workload: Workload, cluster: Cluster, degrees: Degrees = Degrees(),
                 space: SearchSpace | None = None, *, capacity: float | None = None,
                 budget: float | None = 5.0, check: Check | None = None) -> SearchResult:
    """The fastest configuration of ``workload`` that the multi-process runtime runs on
    ``cluster``, with the ``degrees`` given and the other choices ``space`` fixes
    (micro-batches, checkpoint mode, schedules, optimizer sharding). Without ``space``
    everything is searched, optimizer sharding included (``optimizer_sharding=None``:
    ``partition_distributed`` may shard the state over its replicas, one process may not).

    Without fixed degrees this is :func:`partitioner.planning.auto.search`; with them, the
    configurations of those degrees are predicted one by one (fewer: no bound needed).
    ``check`` refuses configurations the model cannot take: the search's ranked candidates
    are kept only if it passes them, and when none passes, the search runs again without
    tensor parallelism (which ``check`` is for).

    Raises:
        ScheduleError: a schedule of ``space`` the multi-process runtime does not run.
        StrategyError: no configuration has the fixed degrees (saying why).
        MemoryLimitError: none fits.
    """
    space = space or SearchSpace(optimizer_sharding=None)
    for name in space.schedules or ():
        problem = runtime_problem(name, Runtime.MULTI_PROCESS)
        if problem is not None:
            raise ScheduleError(problem)
    support = MULTI_PROCESS_RUNTIME
    # On this machine the search records why it skips what the runtime cannot run; for a
    # cluster elsewhere it is told the schedules (it only checks executability here).
    if space.schedules is None and not cluster.is_local:
        space = space.fixing(schedules=support.schedules)
    if degrees.tp is not None and degrees.tp > 1 and workload.max_tp == 1:
        workload = assume_split(workload)
    if degrees.given:
        return _fixed_search(workload, cluster, degrees, space, capacity=capacity,
                             budget=budget, check=check)
    result = search(workload, cluster, space, executable_only=cluster.is_local,
                    support=support, budget=budget, capacity=capacity)
    if check is None:
        return result
    refused = [(p.config.label(), why, p.step_time) for p in result.ranked
               for why in [check(p.config)] if why is not None]
    kept = tuple(p for p in result.ranked if check(p.config) is None)
    if not kept:
        return _fixed_search(workload, cluster, Degrees(tp=1), space, capacity=capacity,
                             budget=budget, check=check, refused=refused)
    # The refused were predicted faster than the new best: they lead the explanation.
    return replace(result, best=kept[0], ranked=kept,
                   not_executable=result.not_executable + len(refused),
                   excluded=(*refused, *result.excluded)[:5],
                   excluded_faster=result.excluded_faster + len(refused))


def assume_split(workload: Workload) -> Workload:
    """``workload`` with every layer's parameters counted as split by tensor parallelism.

    A capture's costs do not say what the tensor-parallel pass splits; when the caller fixes
    ``tp``, the search still needs to cost it, and this optimistic count (every weight
    divided, no extra collectives) only ranks the other choices against each other.
    """
    layers = tuple(replace(lay, split_param_bytes=lay.param_bytes) for lay in workload.layers)
    note = "tp fixed by the caller: costed as if every layer's weights were split"
    return replace(workload, layers=layers, notes=(*workload.notes, note))


def _fixed_search(workload: Workload, cluster: Cluster, degrees: Degrees,
                  space: SearchSpace, *, capacity: float | None, budget: float | None,
                  check: Check | None = None,
                  refused: Sequence[tuple[str, str, float]] = ()) -> SearchResult:
    start = time.perf_counter()
    every = list(configurations(workload, cluster, space))
    wanted = [c for c in every if degrees.matches(c)]
    excluded: list[tuple[str, str, float]] = list(refused)
    runnable = []
    for c in wanted:
        why = executable(c, cluster, MULTI_PROCESS_RUNTIME) if cluster.is_local else None
        if why is None and check is not None:
            why = check(c)
        if why is None:
            runnable.append(c)
        else:
            excluded.append((c.label(), why, math.inf))
    if not runnable:
        raise StrategyError(_no_configuration(workload, cluster, degrees, excluded))
    shared = cluster.is_local and bool(cluster.spec(0).shared_speedup)
    fitting: list[Prediction] = []
    not_fitting = evaluated = 0
    timed_out = False
    for c in runnable:
        if budget is not None and fitting and time.perf_counter() - start > budget:
            timed_out = True
            break
        evaluated += 1
        prediction = predict(workload, cluster, c, capacity=capacity)
        if not prediction.fits:
            not_fitting += 1
            excluded.append((c.label(), "does not fit memory", math.inf))
            continue
        fitting.append(refine(prediction, cluster) if shared else prediction)
    if not fitting:
        reason = predict(workload, cluster, runnable[-1], capacity=capacity).reason
        raise MemoryLimitError(f"no configuration with {degrees.label()} fits: "
                               f"{reason or 'every one needs more memory'}; fix fewer sizes "
                               "or use more or larger devices")
    fitting.sort(key=lambda p: p.step_time)
    # What the plan records: the one predictor, within the budget (planning/ranking.py).
    kept = rank_within(fitting[:10], cluster, None if budget is None else start + budget)
    best = kept[0]
    return SearchResult(best, kept, len(wanted), evaluated,
                        len(wanted) - len(runnable), not_fitting, best.step_time, 0.0,
                        time.perf_counter() - start, timed_out, tuple(excluded[:5]), 0)


def _no_configuration(workload: Workload, cluster: Cluster, degrees: Degrees,
                      excluded: list[tuple[str, str, float]]) -> str:
    """Why no configuration has ``degrees``: the first rule they break."""
    given, layers, n = degrees.given, len(workload.layers), cluster.size
    if excluded:
        return (f"no configuration with {degrees.label()} runs here: {excluded[0][1]}; fix "
                "other sizes or leave them to strategy='auto'")
    if given.get("pp", 1) > layers:
        why = f"pp={given['pp']} but the model has {layers} layers"
    elif workload.batch % given.get("dp", 1):
        why = (f"dp={given['dp']} does not divide the example batch of {workload.batch} "
               "(with strategy='auto' example_inputs is the whole batch of a step, all "
               "replicas' rows)")
    elif given.get("tp", 1) > 1 and workload.max_tp == 1:
        why = (f"tp={given['tp']}: the cost model finds no layer tensor parallelism splits "
               "in this capture")
    elif given.get("tp", 1) > min(n, cluster.devices_per_node):
        why = (f"tp={given['tp']} but a node has {cluster.devices_per_node} ranks (tensor "
               "parallelism stays inside a node)")
    else:
        why = f"the sizes leave no mesh of the {n} ranks"
    return f"no configuration has {degrees.label()}: {why}; change or drop those sizes"


def world_plan(result: SearchResult, names: Sequence[str], cluster: Cluster, *,
               capture: str = "fx", notes: Sequence[str] = ()) -> Plan:
    """The search's best configuration as a plan, its candidates kept for ``explain()``."""
    made = records(result, cluster)
    why = explain(made).splitlines()[-1]
    c = result.best.config
    kind = "pipeline" if c.dp == c.tp == 1 else "hybrid"
    return plan_from(result.best, names, cluster, strategy=kind, capture=capture,
                     candidates=made, notes=(*notes, why))
