"""``strategy="auto"``: search data x tensor x pipeline parallelism for the fastest plan.

For ``n`` devices the search enumerates every ``dp x tp x pp = n`` (tensor parallelism only
inside a node and only when some layer can be split), the micro-batch counts, the schedule
(every schedule of ``partitioner.runtime.schedule_registry``: GPipe, 1F1B, and Megatron's
interleaved 1F1B with ``v`` chunks per device) and the checkpoint mode. Each configuration
gets a lower bound on its step time from the per-layer costs alone (perfect balance, the
schedule's unavoidable fill and drain) and a cheap memory bound; configurations are then
predicted (:func:`partitioner.planning.predict.predict`, which runs the exact stage-split
solver) in order of their bound, a branch and bound that stops when no
bound beats the best prediction, or when the planning budget (5 s by default) runs out --
then the best found is returned with its gap to the smallest bound not yet explored. The
order is deterministic: equal inputs give equal plans. The candidates kept are then costed
by the one predictor of a step, :func:`partitioner.planning.simulate.predict_step`, and
ranked by it: the step times a plan shows are the ones it was ranked by. The budget covers
that simulation too (:mod:`partitioner.planning.ranking`): the search stops in time to
simulate its best candidate, and keeps the others it has time to simulate.

When the plan will run here, only configurations the runtime can execute are chosen:
:func:`executable` is that predicate, and :data:`LOCAL_RUNTIME` says what the one-process
runtimes can do: pipelines with every schedule the registry says the one-process runtime
executes, tensor parallelism (``partitioner.tensor_parallel``: groups of ``tp`` consecutive
devices per pipeline stage, GPipe only, as ``TensorParallelModule`` drives the pipeline),
and data-parallel replicas once ``runtime/replicas.py`` is there.

Example:
    >>> from partitioner.cost.devices import Cluster
    >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
    >>> w = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=64)
    >>> result = search(w, Cluster.preset("A100-80GB"), executable_only=False)
    >>> result.best.config.devices, result.gap
    (8, 0.0)
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from partitioner.cost.cost import Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.memory import device_memory, in_flight
from partitioner.errors import MemoryLimitError, PartitionError
from partitioner.planning.predict import (
    INPUT_SHARE,
    Config,
    Prediction,
    layer_profile,
    predict,
    replayed,
)
from partitioner.planning.ranking import CLOCK, rank_within
from partitioner.planning.records import to_record
from partitioner.planning.simulate import refine
from partitioner.planning.space import SearchSpace, space_of
from partitioner.plans.explain import format_bytes
from partitioner.runtime.checkpointing import ALWAYS, EXCEPT_LAST, NEVER
from partitioner.runtime.schedule_registry import (
    CAPABILITIES,
    GPIPE,
    Runtime,
    make_schedule,
    schedule_kind,
    schedule_names,
)
from partitioner.runtime.tensor_parallel.stage import rank_device_problem

__all__ = ["RuntimeSupport", "LOCAL_RUNTIME", "MULTI_PROCESS_RUNTIME", "local_support",
           "runtime_support",
           "executable", "SearchResult", "search", "configurations", "CHECKPOINT_ORDER"]

CHECKPOINT_ORDER = (NEVER, EXCEPT_LAST, ALWAYS)
"""Checkpoint modes from the least recomputation to the most (the search's order)."""


@dataclass(frozen=True)
class RuntimeSupport:
    """What a runtime can execute.

    Attributes:
        name: shown in explanations.
        schedules: schedule names it runs (by default those the registry says the
            one-process runtime executes).
        data_parallel: whether it runs ``dp > 1``.
        tensor_parallel: whether it runs ``tp > 1``.
        tp_schedules: the schedules it runs with ``tp > 1`` (``None``: all of ``schedules``).
        dp_missing: why ``dp > 1`` does not run, when ``data_parallel`` is false.
        optimizer_sharding: whether it shards the optimizer state over replicas (ZeRO-1).
    """

    name: str
    schedules: tuple[str, ...] = schedule_names([Runtime.ONE_PROCESS])
    data_parallel: bool = False
    tensor_parallel: bool = False
    tp_schedules: tuple[str, ...] | None = None
    dp_missing: str = ""
    optimizer_sharding: bool = False


def runtime_support(runtime: Runtime) -> RuntimeSupport:
    """What ``runtime`` executes, as its registry entry publishes it
    (``partitioner.runtime.schedule_registry.CAPABILITIES`` and the schedules that name it).

    Example:
        >>> runtime_support(Runtime.MULTI_PROCESS).optimizer_sharding
        True
    """
    can = CAPABILITIES[runtime]
    return RuntimeSupport(
        runtime.label, schedule_names([runtime]), data_parallel=can.data_parallel,
        tensor_parallel=can.tensor_parallel, optimizer_sharding=can.optimizer_sharding,
        tp_schedules=None if can.virtual_with_tp else schedule_names([runtime], virtual=False))


def local_support() -> RuntimeSupport:
    """What the one-process runtimes execute in this installation: pipelines with the
    schedules the registry lists for ``Runtime.ONE_PROCESS``, tensor parallelism
    (``TensorParallelModule``) and replicas (``runtime/replicas.py``), as the registry's
    :data:`~partitioner.runtime.schedule_registry.CAPABILITIES` says."""
    return runtime_support(Runtime.ONE_PROCESS)


LOCAL_RUNTIME = local_support()
"""The one-process runtimes: pipelines, tensor parallelism, replicas."""

MULTI_PROCESS_RUNTIME = runtime_support(Runtime.MULTI_PROCESS)
"""``partition_distributed``: one process per rank, data and tensor parallelism (tensor
parallelism inside a node: :func:`configurations` keeps it there), the schedules it runs."""


def executable(config: Config, cluster: Cluster,
               support: RuntimeSupport = LOCAL_RUNTIME) -> str | None:
    """Why ``config`` cannot run on ``cluster`` with ``support``, or ``None`` if it can.

    Example:
        >>> from partitioner.cost.devices import REFERENCE_CPU, Cluster
        >>> here = Cluster.local_devices(["cpu", "cpu"], [REFERENCE_CPU] * 2)
        >>> print(executable(Config(pp=2), here))
        None
        >>> executable(Config(tp=2, pp=1), here) is None
        True
    """
    if not cluster.is_local:
        return f"the cluster ({cluster.describe()}) is not this machine"
    if config.dp > 1 and not support.data_parallel:
        return (f"dp={config.dp}: {support.name} has no data parallelism"
                + (f" ({support.dp_missing})" if support.dp_missing else ""))
    if config.optimizer_sharding and not support.optimizer_sharding:
        return (f"optimizer sharding: {support.name} does not shard the optimizer state "
                "(the one-process replicas step one optimizer; partition_distributed does)")
    if config.overlap_param_gather:
        return ("overlap_param_gather: no runtime here overlaps the sharded optimizer's "
                "all-gather with the next forward (a configuration for published runs)")
    if config.tp > 1 and not support.tensor_parallel:
        return f"tp={config.tp}: {support.name} has no tensor parallelism"
    if config.tp > 1 and support.name == LOCAL_RUNTIME.name:
        groups = [cluster.local[k:k + config.tp] for k in range(0, len(cluster.local), config.tp)]
        problem = next(filter(None, map(rank_device_problem, groups)), None)
        if problem is not None:
            return problem
    if config.schedule not in support.schedules:
        return f"schedule {config.schedule!r}: {support.name} runs {list(support.schedules)}"
    if config.tp > 1 and support.tp_schedules is not None \
            and config.schedule not in support.tp_schedules:
        return (f"schedule {config.schedule!r} with tp={config.tp}: the tensor-parallel "
                f"pipeline runs {list(support.tp_schedules)}")
    return None


@dataclass(frozen=True)
class SearchResult:
    """The outcome of :func:`search`.

    Attributes:
        best: the chosen configuration's prediction.
        ranked: the fastest fitting candidates found, best first (``best`` included).
        considered: configurations enumerated.
        evaluated: configurations predicted in full.
        not_executable: configurations the runtime cannot run here (skipped).
        not_fitting: configurations with no split fitting the memory.
        lower_bound: a step time no configuration can beat (seconds).
        gap: ``best.step_time / lower_bound_of_the_unexplored - 1``; 0 when exhausted.
        elapsed: seconds spent.
        timed_out: whether the budget ran out.
        excluded: the excluded configurations with the smallest bounds:
            ``(label, why, bound)``.
        excluded_faster: how many excluded configurations have a bound below the best.
    """

    best: Prediction
    ranked: tuple[Prediction, ...]
    considered: int
    evaluated: int
    not_executable: int
    not_fitting: int
    lower_bound: float
    gap: float
    elapsed: float
    timed_out: bool
    excluded: tuple[tuple[str, str, float], ...] = field(default=())
    excluded_faster: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(workload: Workload, cluster: Cluster, space: SearchSpace | None = None,
                   **fixed: Any) -> Iterator[Config]:
    """Every configuration the search considers in ``space``, in a fixed order.

    ``fixed`` is sugar for ``space.fixing(...)`` (``configurations(w, cluster, tp=2)``).
    ``space.optimizer_sharding=None`` tries each ``dp > 1`` configuration both plain and
    with the optimizer state sharded over its replicas (plain first: sharding only costs
    time); ``True`` or ``False`` fixes it (``True`` keeps ``dp > 1`` only).

    Fixed choices (``chunks``, ``checkpoint``, ``dp``, ``tp``, ``pp``, ``virtual``) are kept;
    micro-batches split the batch evenly (``chunks`` divides each replica's batch) and stay
    at 1 when the workload is not micro-batch safe (batch norm) unless ``chunks`` is given.
    ``space.tp_degrees`` lists the degrees > 1 the model's split dimensions divide by
    (default: every power of two in a node).
    """
    s = space_of(space, fixed)
    n, layers = cluster.size, len(workload.layers)
    splittable = workload.max_tp != 1
    tps = [t for t in _divisors(min(n, cluster.devices_per_node))
           if t == 1 or (splittable and t in workload_tp_degrees(workload, cluster))]
    if s.tp_degrees is not None:
        tps = [t for t in tps if t == 1 or t in s.tp_degrees]
    if s.tp is not None:
        tps = [s.tp] if n % s.tp == 0 else []
    names = s.schedules if s.schedules is not None else schedule_names(searched=True)
    modes = (s.checkpoint,) if s.checkpoint is not None else CHECKPOINT_ORDER
    for t in tps:
        for p in _divisors(n // t):
            dp = n // (t * p)
            if p > layers or workload.batch % dp or (s.pp is not None and p != s.pp) \
                    or (s.dp is not None and dp != s.dp):
                continue
            if dp > 1 and not workload.microbatch_safe:
                continue  # replicas split the batch as micro-batches do
            shardings = [x for x in (False, True) if s.optimizer_sharding in (None, x)
                         and (dp > 1 or not x)]
            for m, name, mode, x in itertools.product(_counts(workload, s, dp), names, modes,
                                                      shardings):
                if mode == EXCEPT_LAST and m == 1 and mode != s.checkpoint:
                    continue  # replays nothing: NEVER at no less memory
                for v in _chunk_counts(name, p, m, layers, s.schedules is not None):
                    if s.virtual is None or v == s.virtual:
                        yield Config(dp, t, p, m, name, v, mode, s.optimizer,
                                     s.overlap_grad_reduce, s.overlap_p2p, x)


def _counts(workload: Workload, s: SearchSpace, dp: int) -> list[int]:
    """The micro-batch counts tried per replica of ``dp``."""
    per_replica = workload.batch // dp
    if s.chunks is not None:
        counts = [s.chunks] if s.chunks <= per_replica else []
    elif not workload.microbatch_safe:
        counts = [1]
    else:
        counts = [m for m in _divisors(per_replica) if m <= s.max_microbatches
                  or per_replica // m <= 8]
    if workload.splits is not None:
        # A chunks= the graph does not hold for is the user's: it is refused with the
        # guard it breaks when the stages are built.
        counts = [m for m in counts if m * dp in workload.splits
                  or (dp == 1 and s.chunks is not None)]
    return counts


def workload_tp_degrees(workload: Workload, cluster: Cluster) -> tuple[int, ...]:
    """Tensor-parallel degrees the workload allows (powers of two within a node)."""
    limit = min(cluster.devices_per_node, 64)
    return tuple(2**k for k in range(int(math.log2(limit)) + 1))


def _chunk_counts(schedule: str, pp: int, m: int, layers: int, asked: bool = False
                  ) -> list[int]:
    """Virtual stages per stage worth trying (none: the schedule does not apply)."""
    kind = schedule_kind(schedule)
    if pp == 1 and not (asked and not kind.virtual):
        # One stage runs every schedule alike: try it once, as GPipe (or as the one asked).
        return [1] if schedule == GPIPE else []
    if not kind.virtual:
        return [1]
    return [v for v in range(2, min(layers // pp, 8) + 1) if not kind.problems(pp, m, v)]


class _Bounds:
    """Lower bounds per configuration from cached per-layer costs."""

    def __init__(self, workload: Workload, cluster: Cluster, capacity: float) -> None:
        self.workload, self.cluster, self.capacity = workload, cluster, capacity
        self.cache: dict[tuple[float, int, int], list[tuple[float, float]]] = {}
        # Per (tp, optimizer, shards, param shards): the whole model's static bytes and
        # activations per sample (sums over the layers, the same for every split).
        self.memory: dict[tuple[int, str, int, int], tuple[float, float]] = {}

    def times(self, samples: float, tp: int, chunks: int) -> list[tuple[float, float]]:
        key = (samples, tp, chunks)
        if key not in self.cache:
            self.cache[key] = layer_profile(self.workload, self.cluster, samples, tp, chunks)
        return self.cache[key]

    def step(self, c: Config) -> float:
        samples = self.workload.batch / (c.dp * c.chunks)
        share = replayed(c.checkpoint, c.chunks) / c.chunks
        times = self.times(samples, c.tp, c.chunks)
        work = sum(f * (1 + share) + b for f, b in times)
        bound = schedule_kind(c.schedule).bound(
            c.pp, c.chunks, c.virtual, [f * (1 + share) for f, _ in times],
            [b for _, b in times], INPUT_SHARE)
        spec = self.cluster.spec(0)
        if spec.shared_speedup and self.cluster.is_local:
            # Every device's work goes through one host, at best max(speedup) times as fast.
            bound = max(bound, c.devices * c.chunks * work / c.pp / spec.max_speedup)
        return bound

    def may_fit(self, c: Config) -> bool:
        w = self.workload
        samples = w.batch / (c.dp * c.chunks)
        static, acts = self._model_memory(c.tp, c.optimizer, c.optimizer_shards,
                                          c.dp if w.fsdp else 1)
        # The device holding the fewest (the last when looped, not in a V).
        held = min(in_flight(c.schedule, c.pp, c.chunks, j, c.virtual) for j in range(c.pp))
        least = acts * samples / c.pp if c.checkpoint != NEVER else \
            acts * samples * held / (c.pp * c.virtual)
        return (static / c.pp + least) <= self.capacity

    def _model_memory(self, tp: int, optimizer: str, shards: int, param_shards: int
                      ) -> tuple[float, float]:
        key = (tp, optimizer, shards, param_shards)
        if key not in self.memory:
            w = self.workload
            static = sum(device_memory(lay.params_on(tp if lay.splittable else 1),
                                       lay.buffer_bytes, 0.0, optimizer=optimizer,
                                       element=w.param_bytes_per_element,
                                       mixed_precision=w.mixed_precision, shards=shards,
                                       param_shards=param_shards).total
                         for lay in w.layers)
            acts = sum(lay.activations_on(tp if lay.splittable else 1) for lay in w.layers)
            self.memory[key] = (static, acts)
        return self.memory[key]


def search(workload: Workload, cluster: Cluster, space: SearchSpace | None = None, *,
           executable_only: bool | None = None, support: RuntimeSupport = LOCAL_RUNTIME,
           budget: float | None = 5.0, capacity: float | None = None, keep: int = 10,
           **fixed: Any) -> SearchResult:
    """The fastest configuration of ``workload`` on ``cluster`` that fits.

    Args:
        workload: the model's costs.
        cluster: the devices.
        space: the choices fixed and searched (:class:`SearchSpace`; default: all searched,
            the optimizer state unsharded).
        executable_only: keep only configurations ``support`` can run (default: when the
            cluster is this machine).
        support: what the runtime can execute.
        budget: seconds of planning before returning the best found (None: no limit).
        capacity: bytes a device may use (default: its memory; the caller takes off the
            memory reserve, ``partitioner.planning.reserve``).
        keep: how many ranked candidates to return.
        fixed: sugar for ``space.fixing(...)``: ``search(w, cluster, chunks=4, tp=2)``.

    Returns:
        The :class:`SearchResult`.

    Raises:
        MemoryLimitError: no configuration fits; the message is the solver's (how many
            devices of that size would).
    """
    start = time.perf_counter()
    local_only = cluster.is_local if executable_only is None else executable_only
    cap = capacity if capacity is not None else cluster.spec(0).memory_bytes
    bounds = _Bounds(workload, cluster, cap)
    # Devices sharing this machine's cores: the simulation decides (see simulate.refine).
    shared = cluster.is_local and bool(cluster.spec(0).shared_speedup)
    configs = list(configurations(workload, cluster, space_of(space, fixed)))
    queue, excluded, not_executable = [], [], 0
    for c in configs:
        why = executable(c, cluster, support) if local_only else None
        bound = bounds.step(c)
        if why is not None:
            not_executable += 1
            excluded.append((c.label(), why, bound))
        else:
            queue.append((bound, _key(c), c))
    queue.sort(key=lambda entry: (entry[0], entry[1]))
    queue = _distinct_programs(queue)
    ranked: list[Prediction] = []
    evaluated = not_fitting = 0
    timed_out, frontier = False, math.inf
    for bound, _, c in queue:
        if ranked and bound >= ranked[0].step_time:
            break
        # Stop in time to simulate the best found (partitioner.planning.ranking).
        if budget is not None and ranked and time.perf_counter() - start \
                > budget - CLOCK.estimate(ranked[0].config):
            timed_out, frontier = True, bound
            break
        if not bounds.may_fit(c):
            not_fitting += 1
            continue
        evaluated += 1
        prediction = predict(workload, cluster, c, capacity=cap)
        if shared:
            prediction = refine(prediction, cluster)
        if not prediction.fits:
            not_fitting += 1
            excluded.append((c.label(), "does not fit memory", bound))
            continue
        ranked.append(prediction)
        ranked.sort(key=lambda p: (p.step_time, _key(p.config)))
        del ranked[keep:]
    if not ranked:
        raise _nothing_fits(workload, cluster, [c for _, _, c in queue], cap, not_executable)
    ranked = list(rank_within(ranked, cluster, None if budget is None else start + budget,
                              key=lambda p: _key(p.config)))
    best = ranked[0]
    lowest = min((b for b, _, _ in queue), default=best.step_time)
    gap = best.step_time / frontier - 1 if timed_out else 0.0
    excluded.sort(key=lambda e: e[2])
    faster = sum(1 for e in excluded if e[2] < best.step_time)
    return SearchResult(best, tuple(ranked), len(configs), evaluated, not_executable,
                        not_fitting, lowest, max(gap, 0.0), time.perf_counter() - start,
                        timed_out, tuple(excluded[:5]), faster)


def _distinct_programs(queue: list[tuple[float, tuple[Any, ...], Config]]
                       ) -> list[tuple[float, tuple[Any, ...], Config]]:
    """``queue`` without the configurations that run the same program as an earlier one:
    two schedules whose action lists are equal for the same stages, micro-batches and
    checkpointing (GPipe and 1F1B with one micro-batch) are one candidate, which would
    otherwise take two places in the ranked list and in what ``tune=`` times."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for entry in queue:
        c = entry[2]
        key: tuple[Any, ...] = (c,)
        if c.pp > 1 and c.pp * c.chunks * c.virtual <= _COMPARED_ACTIONS:
            rest = tuple(getattr(c, name) for name in _NOT_SCHEDULE)
            key = (rest, _program(c.schedule, c.pp, c.chunks, c.virtual))
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out


_NOT_SCHEDULE = tuple(f.name for f in fields(Config) if f.name != "schedule")
"""Every field of a configuration but its schedule (read per configuration in the search's
loop: no ``asdict`` copy)."""

_COMPARED_ACTIONS = 256
"""Schedules are compared action by action while ``pp x chunks x virtual`` is at most this
(equal lists come from few micro-batches); beyond it they are not compared, and a duplicate
would only take a second place in the ranked list."""


@functools.lru_cache(maxsize=1024)
def _program(schedule: str, p: int, m: int, v: int) -> Any:
    return make_schedule(schedule, p, m, v)


def _key(c: Config) -> tuple[Any, ...]:
    return (c.dp, c.tp, c.pp, c.chunks, c.schedule, c.virtual,
            CHECKPOINT_ORDER.index(c.checkpoint), c.optimizer_sharding)


def _nothing_fits(workload: Workload, cluster: Cluster, queue: list[Config], capacity: float,
                  not_executable: int) -> PartitionError:
    """The solver's own message for the most frugal configuration (how many devices would)."""
    if not queue:
        return MemoryLimitError(f"none of the configurations for {cluster.size} devices can run "
                                f"here ({not_executable} need a runtime this machine lacks)")
    frugal = max(queue, key=lambda c: (c.pp, c.checkpoint == ALWAYS, c.chunks, -c.dp))
    reason = predict(workload, cluster, frugal, capacity=capacity).reason
    message = reason or (f"no configuration of {workload.name} fits {cluster.describe()}; "
                         "use more or larger devices")
    if cluster.is_local and cluster.device.shared_speedup \
            and capacity == cluster.device.memory_bytes:
        message += (f". The {cluster.size} 'cpu' devices share this machine's "
                    f"{format_bytes(capacity)} of memory, so more 'cpu' devices add none; plan a "
                    "smaller model or batch, or use a machine with more memory")
    return MemoryLimitError(message)


def records(result: SearchResult, cluster: Cluster) -> tuple[dict[str, Any], ...]:
    """Plan records: the winner in detail (first), then the other ranked candidates."""
    out = []
    for rank, prediction in enumerate(result.ranked, start=1):
        chosen = prediction is result.best
        record = to_record(prediction, cluster, detail=chosen)
        record.update(rank=rank, chosen=chosen)
        out.append(record)
    summary = {"considered": result.considered, "evaluated": result.evaluated,
               "not_executable": result.not_executable, "not_fitting": result.not_fitting,
               "lower_bound": result.lower_bound, "gap": result.gap,
               "elapsed": result.elapsed, "timed_out": result.timed_out,
               "excluded": [list(e) for e in result.excluded],
               "excluded_faster": result.excluded_faster}
    out[0]["search"] = summary
    return tuple(out)
