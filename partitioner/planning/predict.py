"""Predicting one parallel configuration: its stage split, step time, bubble and memory.

A :class:`Config` (``partitioner.planning.config``) says how a
:class:`~partitioner.cost.cost.Workload` is spread over a
:class:`~partitioner.cost.devices.Cluster`: ``dp x tp x pp`` devices, ``chunks`` micro-batches per
replica, the schedule (a name of ``partitioner.runtime.schedule_registry``: ``gpipe``,
``1f1b``, or Megatron's ``interleaved`` 1F1B with ``virtual`` model chunks per device) and
the checkpoint mode. :func:`predict` finds the optimal stage split
(``partitioner.planning.solver``, unless boundaries are given) and costs it:

* per stage and micro-batch: forward, backward and replayed forward of its layers on one
  tensor-parallel rank (``partitioner.cost.cost``), plus the layers' tensor-parallel all-reduces
  inside the node, plus sending the boundary activations (and their gradients) to the next
  stage, ``1 / tp`` of them per rank, then an all-gather (Megatron's scatter-gather);
* the pipeline: ``sum_j t_j + (m - 1) max_j t_j`` for GPipe and 1F1B (fill, steady state,
  drain), ``m max_j W_j + f mean_k t_k`` with virtual stages (``W_j`` all chunks of device
  ``j``, ``t_k`` one chunk, ``f`` the schedule's fill: ``p - 1`` interleaved, counted for
  the V), and never faster than the host can get through the work on shared cores;
* after each device's last backward: the data-parallel all-reduce of its gradients
  (overlapped with that backward when ``overlap_grad_reduce``; under FSDP its all-gathers
  and reduce-scatter, the first layer's in no window; a sharded optimizer's reduce-scatter
  and all-gather after it, or in the backward and the next forward with
  ``overlap_param_gather``), then the optimizer step
  (memory-bound; devices sharing one host are stepped one after another by one process's
  optimizer once the whole backward is done);
* memory per device from ``partitioner.cost.memory``, each virtual stage's micro-batches in
  flight weighed by the activations that stage keeps (``held_by_stage``).

:mod:`partitioner.planning.simulate` plays the same numbers out event by event.

Example:
    >>> from partitioner.cost.devices import Cluster
    >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
    >>> w = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=64)
    >>> p = predict(w, Cluster.preset("A100-80GB"), Config(dp=2, tp=2, pp=2, chunks=8))
    >>> p.fits, len(p.stages), round(p.bubble, 2)
    (True, 2, 0.11)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from partitioner.cost.comm import (
    all_gather_time,
    all_reduce_time,
    computing_all_reduce_time,
    fsdp_ends_time,
    fsdp_time,
    reduce_scatter_time,
    replica_sync_time,
)
from partitioner.cost.cost import Workload, phase_times, weight_time
from partitioner.cost.devices import Cluster, DeviceSpec, interpolate_speedup
from partitioner.cost.memory import (
    MemoryBreakdown,
    activation_peak,
    device_memory,
    held_by_stage,
    in_flight,
    optimizer_temporaries,
    optimizer_traffic,
)
from partitioner.cost.optimizer_steps import optimizer_copies, overlaps
from partitioner.cost.sharing import lone_gain, lone_work, shared_work, sharing_gains
from partitioner.cost.split_backward import split_backward_overhead, split_forward_overhead
from partitioner.errors import ConfigError
from partitioner.planning.config import Config
from partitioner.planning.solver import (
    InfeasibleError,
    PartitionProblem,
    balanced_cuts,
    evaluate,
    solve,
)
from partitioner.runtime.checkpointing import (
    ALWAYS,
    EXCEPT_LAST,
    NEVER,
    checkpoint_stop,
)
from partitioner.runtime.placement import stages_on
from partitioner.runtime.schedule_registry import schedule_kind

INPUT_SHARE = 0.5
"""The share of a stage's backward its input-gradient half (``I``) takes; ``W`` the rest."""

__all__ = ["INPUT_SHARE", "ConfigError", "Config", "StageProfile", "Prediction", "predict",
           "layer_profile", "replayed", "stage_problem", "replica_sync_time"]


@dataclass(frozen=True)
class StageProfile:
    """One (virtual) stage's costs per micro-batch, on one of its ranks.

    Attributes:
        first: its first layer.
        last: one past its last layer.
        device: its position ``j`` along the pipeline (the schedule's placement of ``k``).
        forward: seconds of forward, tensor-parallel all-reduces included.
        backward: seconds of backward, likewise.
        replay: seconds of a checkpointed micro-batch's replayed forward.
        send: seconds to hand its output to the next stage (its gradient comes back alike).
        send_bytes: bytes of that output per micro-batch (all ranks of the stage).
        grad_bytes: gradient bytes per rank (what data parallelism all-reduces).
        param_bytes: parameter bytes per rank.
        buffer_bytes: buffer bytes per rank.
        activation_bytes: bytes one micro-batch's forward keeps, per rank.
        input_bytes: bytes of one micro-batch's stage input (what a checkpoint keeps).
        sharing: on devices sharing one host's cores, for ``n = 1, 2, ...`` busy devices what
            ``n`` of them running this stage's work gain over one
            (:func:`partitioner.cost.sharing.shared_work`); empty: the device's reference figure.
        lone: on such devices, how fast one stage worker computing alone (with its share of
            the threads) runs this stage against all the threads
            (:func:`partitioner.cost.sharing.lone_work`: its launches lose nothing); 0: the
            device's ``worker_speed``.
        weight: with split backwards, the seconds of ``backward`` its ``W`` runs (its
            layers' ``cost.weight_time``, ``W``'s own cost); 0: :data:`INPUT_SHARE`'s.
        fsdp_ends: with FSDP over replicas, seconds of its first layer's all-gather and
            reduce-scatter that no compute hides (``cost.comm.fsdp_ends_time``), paid by a
            device's first stage; 0 without.
    """

    first: int
    last: int
    device: int
    forward: float
    backward: float
    replay: float
    send: float
    send_bytes: float
    grad_bytes: float
    param_bytes: float
    buffer_bytes: float
    activation_bytes: float
    input_bytes: float
    sharing: tuple[float, ...] = ()
    lone: float = 0.0
    weight: float = 0.0
    fsdp_ends: float = 0.0

    def speedup(self, spec: DeviceSpec, n: float) -> float:
        """Gain of ``n`` busy devices over one with all threads (below 2: from a lone worker's)."""
        table = self.sharing or spec.shared_speedup
        if n < 2 and spec.worker_speed < 1 and len(table) > 1:
            alone = self.lone or spec.worker_speed
            return alone + max(n - 1, 0.0) * (table[1] - alone)
        return interpolate_speedup(self.sharing, n) if self.sharing else spec.speedup(n)


@dataclass(frozen=True)
class Prediction:
    """What a configuration is predicted to cost.

    Attributes:
        config: the configuration.
        stages: per virtual stage, its profile.
        step_time: seconds per training step.
        pipeline_time: seconds from the first forward to the last backward.
        bubble: idle fraction of the devices during the pipeline, as the schedule leaves
            it (devices slowed by others sharing their host count as busy).
        memory: per device along the pipeline, the peak bytes by kind.
        capacity: bytes each device may use.
        dp_times: per device, seconds of its gradient all-reduce.
        optimizer_times: per device, seconds of its optimizer step.
        samples_per_second: the whole cluster's throughput.
        reason: why it cannot run (no split fits the memory), else empty.
        breakdown: the step's parts in seconds (compute, pipeline, gradient all-reduce,
            optimizer).
        simulated: whether the step time, pipeline time and bubble are the simulation's
            (:func:`partitioner.planning.simulate.predict_step`, what plans record) rather
            than this module's closed forms (what the search ranks with).
    """

    config: Config
    stages: tuple[StageProfile, ...]
    step_time: float
    pipeline_time: float
    bubble: float
    memory: tuple[MemoryBreakdown, ...]
    capacity: float
    dp_times: tuple[float, ...]
    optimizer_times: tuple[float, ...]
    samples_per_second: float
    reason: str = ""
    breakdown: dict[str, float] = field(default_factory=dict, compare=False)
    simulated: bool = field(default=False, compare=False)

    @property
    def fits(self) -> bool:
        """Whether every device's peak memory is within its capacity."""
        return not self.reason and all(m.total <= self.capacity for m in self.memory)

    @property
    def dp_time(self) -> float:
        """Seconds of the slowest device's gradient all-reduce."""
        return max(self.dp_times, default=0.0)

    @property
    def optimizer_time(self) -> float:
        """Seconds of the slowest optimizer step."""
        return max(self.optimizer_times, default=0.0)

    @property
    def peak_memory(self) -> float:
        """The largest device's peak bytes."""
        return max((m.total for m in self.memory), default=0.0)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The virtual stages' cuts over the layers."""
        return (*(s.first for s in self.stages), self.stages[-1].last) if self.stages else ()


def replayed(checkpoint: str, chunks: int) -> int:
    """Micro-batches whose forward is replayed in the backward (torchgpipe's rule)."""
    return checkpoint_stop(checkpoint, chunks)


def layer_profile(workload: Workload, cluster: Cluster, samples: float, tp: int,
                  chunks: int = 1, rank: int = 0) -> list[tuple[float, float]]:
    """Per layer, (forward, backward) seconds on one TP rank, all-reduces included (in the
    backward also those its replayed forward runs again, ``replayed_all_reduces``), each
    with what an all-reduce entered from compute costs beyond its ring's figure
    (``LinkSpec.computing_excess``, measured between processes).

    With ``chunks`` micro-batches all but the first backward accumulate weight gradients.
    """
    spec = cluster.spec(rank)
    link = cluster.group_link(range(rank, rank + tp)) if tp > 1 else cluster.intra_node
    cache: dict[str, tuple[float, float]] = {}
    out = []
    for layer in workload.layers:
        if layer.signature not in cache:
            f, b = phase_times(layer, spec, samples, tp if layer.splittable else 1,
                               workload.dtype, (chunks - 1) / chunks)
            nbytes, ends = layer.output_bytes * samples, max(layer.tp_all_reduces, 1)
            fa, ba = (computing_all_reduce_time(nbytes, tp, link, t / ends) for t in (f, b))
            # A replayed forward all-reduces again (torchtitan's checkpointing does).
            cache[layer.signature] = (f + layer.tp_all_reduces * fa,
                                      b + layer.tp_all_reduces * ba
                                      + layer.replayed_all_reduces * fa)
        out.append(cache[layer.signature])
    return out


def _check_fit(workload: Workload, cluster: Cluster, config: Config) -> None:
    problems = []
    if config.devices != cluster.size:
        problems.append(f"dp*tp*pp = {config.devices} but the cluster has {cluster.size} "
                        "devices; make the product the device count")
    if config.tp > cluster.devices_per_node:
        problems.append(f"tp={config.tp} exceeds the {cluster.devices_per_node} devices of a "
                        "node (tensor parallelism stays inside a node); lower tp")
    if workload.batch % config.dp:
        problems.append(f"batch {workload.batch} does not split over dp={config.dp}; use a "
                        "dp dividing the batch")
    elif config.chunks > workload.batch // config.dp:
        problems.append(f"chunks={config.chunks} exceeds the {workload.batch // config.dp} "
                        "samples of a replica; pass fewer chunks or a larger example batch")
    if config.stages > len(workload.layers):
        problems.append(f"{config.stages} stages for {len(workload.layers)} layers; use at "
                        f"most {len(workload.layers)}")
    if problems:
        raise ConfigError(f"{config.label()} does not fit: " + "; ".join(problems))


def stage_problem(workload: Workload, cluster: Cluster, config: Config,
                  times: list[tuple[float, float]], samples: float,
                  capacity: float) -> PartitionProblem:
    """The solver's problem: per layer its time (replays included) and memory, per
    boundary the time to receive it, on ``config.stages`` stages of ``capacity`` bytes."""
    replay = replayed(config.checkpoint, config.chunks) / config.chunks
    compute = [f * (1 + replay) + b for f, b in times]
    transfer = [2 * _send(workload, cluster, config, bound * samples, 0, 1 % config.pp)
                for bound in workload.boundaries]
    # The busiest device's in-flight count (the first when looped, the last in a V).
    held = max(in_flight(config.schedule, config.pp, config.chunks, j, config.virtual)
               for j in range(config.pp))
    element = workload.param_bytes_per_element
    memory = []
    for layer in workload.layers:
        tp = config.tp if layer.splittable else 1
        static = device_memory(layer.params_on(tp), layer.buffer_bytes, 0.0,
                               optimizer=config.optimizer, element=element,
                               mixed_precision=workload.mixed_precision,
                               shards=config.optimizer_shards,
                               param_shards=config.dp if workload.fsdp else 1).total
        act = layer.activations_on(tp) * samples
        memory.append(static + (act * held / config.virtual if config.checkpoint == NEVER
                                else act))
    n = config.stages
    return PartitionProblem((tuple(compute),) * n, (tuple(transfer),) * n, tuple(memory),
                            (capacity / config.virtual,) * n)


def _send(workload: Workload, cluster: Cluster, config: Config, nbytes: float,
          device: int, to: int) -> float:
    """Seconds for a stage's ranks (on pipeline device ``device``) to hand ``nbytes`` to the
    next stage's ranks (on device ``to``; the same device hands over for free)."""
    if nbytes <= 0 or (to == device and config.pp > 1):
        return 0.0
    stride = config.dp * config.tp  # rank = (stage * dp + replica) * tp + shard
    src = device * stride
    dst = to * stride
    link = cluster.link(src, dst) if config.pp > 1 else cluster.intra_node
    part = link.time(nbytes / config.tp)
    if config.tp > 1:
        part += all_gather_time(nbytes, config.tp, cluster.group_link(range(config.tp)))
    return part


def predict(workload: Workload, cluster: Cluster, config: Config,
            boundaries: Sequence[int] | None = None, capacity: float | None = None) -> Prediction:
    """Cost ``config`` on ``cluster`` (optimal split unless ``boundaries`` are given).

    Args:
        workload: the model's costs.
        cluster: the devices and links.
        config: the parallel configuration.
        boundaries: ``pp * virtual + 1`` cuts over the layers; the solver's optimum if None.
        capacity: bytes a device may use (default: the device's memory).

    Returns:
        The :class:`Prediction`; when no split fits the memory its ``reason`` says so.

    Raises:
        ConfigError: the configuration does not match the cluster or the workload.
    """
    _check_fit(workload, cluster, config)
    samples = workload.batch / (config.dp * config.chunks)
    cap = capacity if capacity is not None else cluster.spec(0).memory_bytes
    times = layer_profile(workload, cluster, samples, config.tp, config.chunks)
    problem = stage_problem(workload, cluster, config, times, samples, cap)
    reason = ""
    if boundaries is None:
        try:
            best = solve(problem)
            boundaries = best.boundaries if config.virtual == 1 else balanced_cuts(
                problem, best.bottleneck)
        except InfeasibleError as error:
            reason = str(error)
            boundaries = evaluate(problem, _even(len(workload.layers), config.stages)).boundaries
    else:
        evaluate(problem, boundaries)  # validates the cuts
    stages = _profiles(workload, cluster, config, times, tuple(boundaries), samples)
    return _assemble(workload, cluster, config, stages, cap, reason)


def _even(n_layers: int, n_stages: int) -> tuple[int, ...]:
    return tuple(round(k * n_layers / n_stages) for k in range(n_stages + 1))


def _profiles(workload: Workload, cluster: Cluster, config: Config,
              times: list[tuple[float, float]], cuts: tuple[int, ...],
              samples: float) -> tuple[StageProfile, ...]:
    out = []
    spec = cluster.spec(0)
    shared: dict[str, tuple[float, ...]] = {}
    lone: dict[str, float] = {}
    if cluster.is_local and spec.shared_sizes:
        for lay in workload.layers:
            if lay.signature not in shared:
                tp = config.tp if lay.splittable else 1
                shared[lay.signature] = shared_work(lay, spec, samples, tp, workload.dtype)
                lone[lay.signature] = lone_work(lay, spec, samples, tp, workload.dtype)
    where = schedule_kind(config.schedule).place(config.pp, config.virtual)
    split = schedule_kind(config.schedule).splits_backward
    for k in range(config.stages):
        a, b = cuts[k], cuts[k + 1]
        layers = workload.layers[a:b]
        # The runtime's own cost per action: one forward and one backward per micro-batch
        # (a split backward: two, and its weight products queued through Python).
        forward = sum(times[i][0] for i in range(a, b)) + spec.action_overhead + (
            split_forward_overhead(layers, spec) if split else 0.0)
        backward = sum(times[i][1] for i in range(a, b)) + spec.action_overhead + (
            split_backward_overhead(layers, spec) if split else 0.0)
        # What W runs: the Linear weight products (traced on 4 gloo ranks, `mlp` x4's I
        # took 0.65-0.72 of its 1F1B backward; docs/benchmarks.md "A backward with no input").
        weight = min(sum(weight_time(lay, spec, samples, config.tp if lay.splittable else 1,
                                     workload.dtype, (config.chunks - 1) / config.chunks)
                         for lay in layers) + split_backward_overhead(layers, spec),
                     backward) if split else 0.0
        out_bytes = workload.boundaries[b] * samples
        params = sum(lay.params_on(config.tp if lay.splittable else 1) for lay in layers)
        ends = fsdp_ends_time(
            layers[0].params_on(config.tp if layers[0].splittable else 1), config.dp,
            cluster.group_link([(where[k] * config.dp + r) * config.tp
                                for r in range(config.dp)]),
            workload.reduce_scale) if workload.fsdp and config.dp > 1 else 0.0
        out.append(StageProfile(
            a, b, where[k], forward, backward, forward - spec.action_overhead,
            _send(workload, cluster, config, out_bytes, where[k], where[k + 1]) if b < len(
                workload.layers) else 0.0,
            out_bytes, params, params, sum(lay.buffer_bytes for lay in layers),
            sum(lay.activations_on(config.tp if lay.splittable else 1) for lay in layers)
            * samples, workload.boundaries[a] * samples, sharing_gains(
                [shared[lay.signature] for lay in layers] if shared else []),
            lone_gain(forward + backward, [shared[lay.signature][0] for lay in layers],
                  [lone[lay.signature] for lay in layers]) if shared else 0.0, weight, ends))
    return tuple(out)


def _fresh_temporaries(workload: Workload, config: Config, stages: Sequence[StageProfile],
                       spec: DeviceSpec) -> float:
    """Seconds of faulting in the optimizer's temporaries for weights too large for the
    allocator to reuse (``spec.fresh_threshold``), on one device."""
    temporaries = optimizer_temporaries(config.optimizer)
    if not temporaries or not spec.fresh_bandwidth:
        return 0.0
    return sum(temporaries * spec.fresh_time(op.weight_grad / (config.tp if op.split else 1))
               * op.count for s in stages for layer in workload.layers[s.first:s.last]
               for op in layer.ops)


def _assemble(workload: Workload, cluster: Cluster, config: Config,
              stages: tuple[StageProfile, ...], capacity: float, reason: str) -> Prediction:
    p, m, v = config.pp, config.chunks, config.virtual
    kind = schedule_kind(config.schedule)
    share = replayed(config.checkpoint, m) / m
    blocked = 0.0 if config.overlap_p2p else 1.0
    work = [s.forward + s.backward + share * s.replay
            + blocked * (s.send + (stages[k - 1].send if k else 0.0))
            for k, s in enumerate(stages)]
    where = kind.place(p, v)
    per_device = [sum(work[k] for k in stages_on(where, j)) for j in range(p)]
    if v == 1:
        edges = sum(work) + 2 * sum(s.send for s in stages)
        # What of the first micro-batch's path the schedule hides, by its own hook (a split
        # backward leaves the weight halves to the bubbles).
        edges -= kind.hidden([s.backward for s in stages], INPUT_SHARE)
        steady = (m - 1) * max(max(work), max(s.send for s in stages))
    else:
        # The schedule's own fill and drain in chunk times (its hook: P - 1 when looped).
        edges = kind.fill_drain(p, m, v) * sum(work) / len(work) \
            + 2 * sum(s.send for s in stages[:p])
        steady = m * max(per_device)
    # The schedule's idle fraction, before any slowdown from sharing a host: a device slowed
    # by its neighbours is computing, not waiting.
    bubble = max(0.0, 1 - m * sum(per_device) / (p * (edges + steady))) \
        if edges + steady > 0 else 0.0
    spec = cluster.spec(0)
    shared = bool(spec.shared_speedup) and cluster.is_local
    if shared and config.devices > 1:
        # Devices sharing the host's cores: the fill and drain run one worker per replica
        # and shard. In the steady state device j is busy w_j / w_max of the time in every
        # replica and shard: n = dp * tp * sum of the shares compete, each stage gaining
        # what its kind of work gains (small products more than large).
        edges *= config.dp * config.tp / stages[0].speedup(spec, config.dp * config.tp)
        busy = config.dp * config.tp * sum(per_device) / max(per_device)
        slowed = sum(w / s.speedup(spec, busy) for w, s in zip(work, stages))
        steady *= busy * slowed / sum(work) if sum(work) > 0 else 1.0
    pipeline = edges + steady
    memory, dp_times, opt_times, ends = [], [], [], []
    element = workload.param_bytes_per_element
    traffic = optimizer_traffic(config.optimizer, element, workload.mixed_precision)
    drained = 0.0
    for j in range(p):
        mine = [stages[k] for k in stages_on(where, j)]
        # Each chunk's micro-batches in flight weighed by what the chunk keeps.
        held = held_by_stage(config.schedule, p, m, j, v)
        full, inputs = [s.activation_bytes for s in mine], [s.input_bytes for s in mine]
        acts = activation_peak(config.checkpoint, held, full, inputs)
        if config.checkpoint == EXCEPT_LAST and not kind.last_backward_first:
            # The last micro-batch is kept whole on every chunk of the device while earlier
            # ones are replayed (GPipe runs its backward first, 1F1B does not).
            acts = activation_peak(ALWAYS, held, full, inputs) + sum(full)
        params = sum(s.param_bytes for s in mine)
        memory.append(device_memory(params, sum(s.buffer_bytes for s in mine), acts,
                                    optimizer=config.optimizer, element=element,
                                    mixed_precision=workload.mixed_precision,
                                    shards=config.optimizer_shards,
                                    param_shards=config.dp if workload.fsdp else 1))
        ranks = [(j * config.dp + r) * config.tp for r in range(config.dp)]
        grads = sum(s.grad_bytes for s in mine)
        if config.dp > 1 and cluster.is_local and not cluster.processes:
            # Replicas in one process: the copies' sums and weight checks, plus each
            # replica's fixed cost per step (split, hand-offs) and per tensor, measured.
            reduce = replica_sync_time(grads, params, config.dp, cluster.intra_node.bandwidth) \
                + (config.dp * cluster.spec(j).replica_overhead + (config.dp - 1) * sum(
                    lay.param_tensors for lay in workload.layers)
                   * cluster.spec(j).replica_tensor_overhead if j == 0 else 0.0)
        elif config.dp == 1:
            reduce = 0.0
        elif workload.fsdp:  # its ends in no window (``StageProfile.fsdp_ends``)
            reduce = fsdp_time(grads, config.dp, cluster.group_link(ranks),
                               workload.reduce_scale)
        elif config.overlap_param_gather:
            # The reduce-scatter in the backward's window; the all-gather behind the next
            # step's first forward, what it leaves charged there too.
            link = cluster.group_link(ranks)
            reduce = reduce_scatter_time(grads, config.dp, link) + max(
                all_gather_time(params, config.dp, link) - mine[0].forward, 0.0)
        else:
            reduce = all_reduce_time(grads, config.dp, cluster.group_link(ranks))
        # The runtime's sharded optimizer reduce-scatters after the last backward; where
        # the others hide behind it: ``optimizer_steps.overlaps``.
        window = mine[0].backward + share * mine[0].replay if config.overlap_grad_reduce \
            and overlaps(cluster) and config.reduces_in_backward else 0
        # Plus a fixed cost per parameter tensor (one flat buffer when sharded).
        tensors = 1 if config.optimizer_sharding else sum(
            lay.param_tensors for s in mine for lay in workload.layers[s.first:s.last])
        shards = config.dp if workload.fsdp else config.optimizer_shards
        optimizer = (params / element / shards * traffic / cluster.spec(j).optimizer_rate
                     + _fresh_temporaries(workload, config, mine, cluster.spec(j))
                     + tensors * cluster.spec(j).optimizer_tensor_overhead) \
            * workload.optimizer_scale
        ends.append(pipeline - drained + max(reduce - window, 0.0) + mine[0].fsdp_ends
                    + (0.0 if shared else optimizer))
        drained += stages[j].backward + share * stages[j].replay
        dp_times.append(reduce)
        opt_times.append(optimizer)
    # Devices sharing a host are stepped by one process's optimizer, one after another.
    # One process steps the master's parameters only (replicas copy them), each tensor-
    # parallel shard once: tp x the pipeline devices' steps, one after another.
    stepped = (optimizer_copies(config.dp, config.tp, cluster) if cluster.is_local
               else config.tp * config.dp) * sum(opt_times)
    step = max(ends) + (stepped if shared else 0.0)
    breakdown = {"compute": m * max(per_device), "pipeline": pipeline,
                 "dp_all_reduce": max(dp_times),
                 "optimizer": stepped if shared else max(opt_times)}
    return Prediction(config, stages, step, pipeline, bubble, tuple(memory), capacity,
                      tuple(dp_times), tuple(opt_times),
                      workload.batch / step if step > 0 else math.inf, reason, breakdown)

