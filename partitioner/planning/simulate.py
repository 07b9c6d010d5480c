"""A discrete-event simulation of one training step of a plan.

Every device runs its list of actions in order, as the plan's schedule gives them
(``partitioner.runtime.schedule_registry``: GPipe, 1F1B, Megatron's interleaved 1F1B, any
registered schedule); an action starts when the device is free and its inputs have arrived:

* ``F(k, i)`` (virtual stage ``k``, micro-batch ``i``) needs the activations of
  ``F(k - 1, i)``, sent over the link between their devices;
* ``B(k, i)`` needs ``F(k, i)`` and the gradient of ``B(k + 1, i)``, sent back; a
  zero-bubble schedule splits it into ``I(k, i)`` (the input gradients, sent back; it
  replays a checkpointed forward) and ``W(k, i)`` (the weight gradients, after ``I``):
  ``W`` the stage's Linear weight products (``StageProfile.weight``), ``I`` the rest (the
  input gradients' products, element-wise ops, other parameters' gradients), or
  ``partitioner.planning.predict.INPUT_SHARE`` of the backward each where not costed;
* each link carries one message at a time in each direction (alpha-beta times);
* a device's tensor-parallel all-reduces are part of its forward and backward (they block
  compute, as in Megatron-LM);
* once a stage's last backward has produced its gradients, they are all-reduced over the
  data-parallel replicas in buckets, on a channel of their own, overlapping that backward
  when the plan says so; then the optimizer steps;
* devices that share one host's cores (several ``"cpu"`` devices) share its compute: ``n``
  busy at once each progress at ``speedup(n) / n`` of their own speed (the runtime gives
  ``n`` busy stage workers ``1 / n`` of the intra-op threads each, as the calibration
  measured them); their optimizer steps run one after another once every stage's backward
  is done (one process's optimizer, in the caller's thread).

With equal stages and free communication GPipe's bubble comes out as ``(p - 1) / (m + p - 1)``
exactly.

This is the one predictor of a plan's step (``docs/design/003-cost-model.md``, "One
predictor"): :func:`predict_step` gives the step time, pipeline time and bubble every plan
records, and so shows in its header, its notes, ``Plan.explain()``, ``partitioner simulate``
and the predicted timeline. :func:`partitioner.planning.predict.predict`'s closed forms only
rank configurations inside the search, where they are fast enough to cost thousands.

Example:
    >>> from partitioner.cost.devices import Cluster
    >>> from partitioner.planning.predict import Config, predict
    >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
    >>> w = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=64)
    >>> cluster = Cluster.preset("A100-80GB")
    >>> p = predict(w, cluster, Config(dp=2, tp=2, pp=2, chunks=8, schedule="1f1b"))
    >>> result = simulate(p, cluster)
    >>> abs(result.step_time / p.step_time - 1) < 0.05, str(result.timeline[0][0])
    (True, '0F0')
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from partitioner.cost.comm import all_reduce_time
from partitioner.cost.devices import Cluster
from partitioner.cost.optimizer_steps import optimizer_copies
from partitioner.errors import SimulationError
from partitioner.planning.predict import INPUT_SHARE, Prediction, StageProfile, replayed
from partitioner.runtime.placement import stages_on
from partitioner.runtime.schedule import Action, Phase
from partitioner.runtime.schedule_registry import make_schedule, schedule_kind

__all__ = ["SimulationError", "SimulationResult", "simulate", "predict_step",
           "refine", "REDUCE", "OPTIMIZER", "loss_all_reduce_time"]

REDUCE = "all-reduce"
"""The kind of a device's gradient all-reduce (or replica sum) in ``SimulationResult.updates``."""
OPTIMIZER = "optimizer"
"""The kind of a device's optimizer step in ``SimulationResult.updates``."""


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated step did.

    Attributes:
        step_time: seconds from the first forward to the last optimizer step.
        pipeline_time: seconds from the first forward to the last backward.
        bubble: idle fraction of the devices during the pipeline.
        peak_memory: per device along the pipeline, the peak bytes.
        timeline: every forward and backward as ``(action, start, end)``, ``action.stage``
            being the virtual stage; in start order.
        transfers: every message, all-reduce and optimizer step as ``(label, start, end)``.
        updates: what follows each device's last backward, as ``(device, kind, start, end)``
            with ``kind`` :data:`REDUCE` or :data:`OPTIMIZER`; the last end is ``step_time``.
    """

    step_time: float
    pipeline_time: float
    bubble: float
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[Action, float, float], ...]
    transfers: tuple[tuple[str, float, float], ...]
    updates: tuple[tuple[int, str, float, float], ...] = field(default=())


class _Host:
    """Compute shared by the devices of one host (processor sharing).

    ``speedup(device, n, extra)``: what ``n`` busy devices gain over one for the work
    ``device`` is doing, with ``extra`` more busy threads that are no device's; each running
    device progresses at ``speedup / n`` of its speed alone. Until ``spin_until`` the
    caller's spinning OpenMP helpers are one such thread (``DeviceSpec.caller_spin``; the
    simulation re-times the host then).
    """

    def __init__(self, speedup: Callable[[int, int, int], float], spin_until: float = 0.0
                 ) -> None:
        self.speedup = speedup
        self.spin_until = spin_until
        self.running: dict[int, float] = {}  # device -> remaining work (seconds alone)
        self.updated = 0.0
        self.version = 0

    def rate(self, device: int) -> float:
        n = len(self.running)
        extra = 1 if self.updated < self.spin_until else 0
        return self.speedup(device, n, extra) / n if n else 1.0

    def advance(self, now: float) -> None:
        if self.updated < self.spin_until < now:  # the rates change when the spin ends
            self.advance(self.spin_until)
        rates = {device: self.rate(device) for device in self.running}
        for device in self.running:
            self.running[device] -= (now - self.updated) * rates[device]
        self.updated = now

    def next_finish(self) -> tuple[float, int] | None:
        if not self.running:
            return None
        left = {d: max(self.running[d], 0.0) / self.rate(d) for d in self.running}
        device = min(left, key=lambda d: (left[d], d))
        return self.updated + left[device], device


class _Simulation:
    def __init__(self, prediction: Prediction, cluster: Cluster) -> None:
        self.p = prediction
        self.config = c = prediction.config
        self.stages = prediction.stages
        self.order = make_schedule(c.schedule, c.pp, c.chunks, c.virtual)
        self.where = schedule_kind(c.schedule).place(c.pp, c.virtual)
        self.replay_below = replayed(c.checkpoint, c.chunks)
        spec = cluster.spec(0)
        shared = cluster.is_local and bool(spec.shared_speedup) and c.devices > 1
        self.shared = shared
        # One process steps each tensor-parallel shard of a stage, one after another (and
        # the replicas' master only); ranks of one host step their own at once, sharing its
        # cores; ranks of a cluster elsewhere step their own at once.
        self.shards = optimizer_copies(c.dp, c.tp, cluster) if cluster.is_local else 1
        self.stepped: set[int] = set()
        self.spec = spec
        # One process: its caller's OpenMP helpers spin on the cores as the step starts.
        spin = spec.caller_spin if shared and not cluster.processes else 0.0
        self.hosts = [_Host(self.gain, spin)] if shared else [
            _Host(lambda j, n, extra: float(n)) for _ in range(c.pp)]
        self.host_of = [0 if shared else j for j in range(c.pp)]
        self.now = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.next_index = [0] * c.pp
        self.busy = [False] * c.pp
        self.current: list[Action | None] = [None] * c.pp
        self.started: dict[Action, float] = {}
        self.arrived: set[tuple[str, int, int]] = set()
        self.links: dict[tuple[int, int], deque[tuple[str, float, Any]]] = {}
        self.link_busy: dict[tuple[int, int], bool] = {}
        self.timeline: list[tuple[Action, float, float]] = []
        self.transfers: list[tuple[str, float, float]] = []
        self.live = [0.0] * c.pp
        self.peak = [0.0] * c.pp
        self.last_backward: dict[int, tuple[float, float]] = {}
        self.remaining_b = [sum(1 for a in acts if a.phase.frees) for acts in self.order]
        self.tags: dict[int, tuple[str, Any]] = {}
        self.updates: list[tuple[int, str, float, float]] = []
        # Ranks of a torch.distributed world (processes): an action that waited for its
        # message starts on an idle core (``LinkSpec.wake``), and every rank all-reduces
        # the step's loss before its optimizer steps (``DistributedPipeline._reduce_loss``).
        self.processes = cluster.processes
        self.link = cluster.intra_node
        self.free_since = [0.0] * c.pp
        self.loss_time = loss_all_reduce_time(
            cluster, c.devices, staggered=c.pp > 1,
            after=max(self.p.optimizer_times, default=0.0))
        self.ready_to_step: list[int] = []
        self.ready_at = [0.0] * c.pp  # when each rank's backward (and its reduce) ended

    def gain(self, j: int, n: int, extra: int = 0) -> float:
        """What ``n`` busy devices sharing the host gain, for the stage device ``j`` runs
        (on a shared host only compute runs there; the optimizers step after it). Every
        replica and tensor-parallel shard of the pipeline computes alike at the same time on
        the same cores: ``n`` busy devices are ``w = n dp tp`` busy workers, each
        progressing at ``speedup(w) / w``.

        ``extra`` busy threads that are no device's (the caller's spinning OpenMP helpers)
        hold cores, not memory: each worker loses what one more worker costs the reference
        work (products), ``(ref(w + 1) / (w + 1)) / (ref(w) / w)``, whatever its own work
        (a lone worker beside them loses nothing where the host has a core for each)."""
        copies = self.config.dp * self.config.tp
        workers = n * copies
        gain = self.stages[self.tags[j][1].stage].speedup(self.spec, workers) / copies
        if extra:
            def per_worker(w: int) -> float:
                alone = self.spec.worker_speed if w == 1 else self.spec.speedup(w)
                return alone / w
            gain *= min(per_worker(workers + extra) / per_worker(workers), 1.0)
        return gain

    def loss_wake(self, j: int, reduced: float) -> float:
        """What rank ``j``'s optimizer loses after waiting in the loss all-reduce until
        ``reduced`` (a rank of a world only: ``LinkSpec.wake_time``)."""
        if not self.processes or self.loss_time == 0:
            return 0.0
        return self.link.wake_time(reduced - self.ready_at[j])

    def push(self, time: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, payload))

    def duration(self, action: Action) -> float:
        """Compute time, plus the send it waits for when sends block (then free on the
        link), or else the posting of that send (``LinkSpec.post_time``, ranks of a world)."""
        stage, k = self.stages[action.stage], action.stage
        blocked = 0.0 if self.config.overlap_p2p else 1.0
        if action.phase is Phase.FORWARD:
            return stage.forward + (blocked * stage.send or self.posting(k, k + 1))
        replay = stage.replay if action.microbatch < self.replay_below else 0.0
        send = (blocked * self.stages[k - 1].send or self.posting(k, k - 1)) if k else 0.0
        weight = stage.weight or (1 - INPUT_SHARE) * stage.backward
        if action.phase is Phase.WEIGHT:
            return weight
        if action.phase is Phase.INPUT:
            return stage.backward - weight + replay + send
        return stage.backward + replay + send

    def posting(self, k: int, to: int) -> float:
        """Seconds stage ``k``'s rank spends posting its message to stage ``to`` (the
        boundary's bytes per tensor-parallel rank): nothing in one process, past the ends,
        or where both stages share a device."""
        if not self.processes or not 0 <= to < len(self.stages) \
                or self.where[to] == self.where[k]:
            return 0.0
        boundary = self.stages[min(k, to)]
        return self.link.post_time(boundary.send_bytes / self.config.tp)

    def link_time(self, seconds: float) -> float:
        return seconds if self.config.overlap_p2p else 0.0

    def ready(self, action: Action) -> bool:
        k, i, last = action.stage, action.microbatch, len(self.stages) - 1
        if action.phase is Phase.FORWARD:
            return k == 0 or ("act", k, i) in self.arrived
        if action.phase is Phase.WEIGHT:
            return ("input", k, i) in self.arrived
        return ("done", k, i) in self.arrived and (k == last or ("grad", k, i) in self.arrived)

    def try_start(self, j: int) -> None:
        if self.busy[j] or self.next_index[j] >= len(self.order[j]):
            return
        action = self.order[j][self.next_index[j]]
        if not self.ready(action):
            return
        self.next_index[j] += 1
        self.busy[j] = True
        self.current[j] = action
        self.started[action] = self.now
        self.account_memory(j, action)
        wake = self.link.wake_time(self.now - self.free_since[j]) if self.processes else 0.0
        self.run_on_host(j, self.duration(action) + wake, ("compute", action))

    def account_memory(self, j: int, action: Action) -> None:
        stage = self.stages[action.stage]
        checkpointed = action.microbatch < self.replay_below
        kept = stage.input_bytes if checkpointed else stage.activation_bytes
        if action.phase is Phase.FORWARD:
            self.live[j] += kept
            self.peak[j] = max(self.peak[j], self.live[j] - kept + stage.activation_bytes)
        elif action.phase is not Phase.WEIGHT:
            self.peak[j] = max(self.peak[j], self.live[j] + (stage.activation_bytes
                                                             if checkpointed else 0.0))

    def run_on_host(self, j: int, work: float, tag: tuple[str, Any]) -> None:
        self.tags[j] = tag
        if not self.shared:
            # A device alone on its host runs at its own speed: its end is known now.
            self.push(self.now + work, "done", j)
            return
        host = self.hosts[self.host_of[j]]
        host.advance(self.now)
        host.running[j] = work
        host.version += 1
        self.schedule_host(self.host_of[j])

    def schedule_host(self, h: int) -> None:
        found = self.hosts[h].next_finish()
        if found is not None:
            self.push(found[0], "host", (h, self.hosts[h].version))

    def send(self, src: int, dst: int, seconds: float, label: str, payload: Any) -> None:
        if src == dst:  # consecutive stages on one device (a V's turn): nothing travels
            self.arrived.add(payload)
            return
        key = (src, dst)
        self.links.setdefault(key, deque()).append((label, seconds, payload))
        if not self.link_busy.get(key):
            self.start_link(key)

    def start_link(self, key: tuple[int, int]) -> None:
        queue = self.links[key]
        if not queue:
            self.link_busy[key] = False
            return
        label, seconds, payload = queue.popleft()
        self.link_busy[key] = True
        self.transfers.append((label, self.now, self.now + seconds))
        self.push(self.now + seconds, "link", (key, payload))

    def finish_compute(self, j: int, action: Action) -> None:
        self.timeline.append((action, self.started[action], self.now))
        self.busy[j] = False
        self.free_since[j] = self.now
        stage: StageProfile = self.stages[action.stage]
        k, i = action.stage, action.microbatch
        if action.phase is Phase.FORWARD:
            self.arrived.add(("done", k, i))
            if k + 1 < len(self.stages):
                self.send(j, self.where[k + 1], self.link_time(stage.send),
                          f"send {k}->{k + 1} F{i}",
                          ("act", k + 1, i))
        else:
            if action.phase is Phase.INPUT:
                self.arrived.add(("input", k, i))
            if action.phase.frees:
                # A split backward keeps the activations until its W: what the weight
                # gradients read (a layer's inputs) is most of them.
                self.live[j] -= stage.input_bytes if i < self.replay_below \
                    else stage.activation_bytes
            if action.phase.gives_input_grad and k > 0:
                self.send(j, self.where[k - 1], self.link_time(self.stages[k - 1].send),
                          f"send {k}->{k - 1} B{i}", ("grad", k - 1, i))
            if action.phase.frees:
                self.remaining_b[j] -= 1
                self.last_backward[j] = (self.started[action], self.now)
                if self.remaining_b[j] == 0:
                    self.reduce_gradients(j)
        self.try_start(j)

    def reduce_gradients(self, j: int) -> None:
        """All-reduce device ``j``'s gradients in 25 MB buckets, then step its optimizer.

        Overlapped, bucket ``b`` of ``n`` is ready ``(b + 1) / n`` of the way through the
        device's last backward; otherwise all are ready at its end.
        """
        seconds = self.p.dp_times[j]
        start, end = self.last_backward[j]
        # FSDP's first layer: gathered before the first forward, reduced after the last
        # backward, hidden by nothing (``StageProfile.fsdp_ends``).
        exposed = self.stages[min(stages_on(self.where, j))].fsdp_ends
        if seconds == 0:
            self.push(end + exposed, "optimizer", j)
            return
        grads = sum(self.stages[k].grad_bytes for k in stages_on(self.where, j))
        buckets = max(1, math.ceil(grads / 25e6))
        overlap = self.config.overlap_grad_reduce and self.config.reduces_in_backward
        free = begin = start if overlap else end
        for b in range(buckets):
            ready = start + (b + 1) / buckets * (end - start) if overlap else end
            free = max(free, ready) + seconds / buckets
        free += exposed
        self.transfers.append((f"all-reduce grads device {j}", begin, free))
        self.updates.append((j, REDUCE, begin, free))
        self.push(free, "optimizer", j)

    def run(self) -> SimulationResult:
        for h, host in enumerate(self.hosts):
            if host.spin_until > 0:
                self.push(host.spin_until, "spin", h)
        for j in range(self.config.pp):
            self.try_start(j)
        finished: dict[int, float] = {}
        pipeline_end = 0.0
        while self.events:
            time, _, kind, payload = heapq.heappop(self.events)
            self.now = time
            if kind in ("host", "done"):
                ended = payload if kind == "done" else self.host_finish(*payload)
                if ended is None:
                    continue
                j = ended
                tag, what = self.tags.pop(j)
                if tag == "compute":
                    pipeline_end = max(pipeline_end, self.now)
                    self.finish_compute(j, what)
                else:
                    self.transfers.append((f"optimizer device {j}", what, self.now))
                    self.updates.append((j, OPTIMIZER, what, self.now))
                    finished[j] = self.now
            elif kind == "spin":  # the caller's helpers stop: the work left runs faster
                host = self.hosts[payload]
                host.advance(self.now)
                host.version += 1
                self.schedule_host(payload)
            elif kind == "link":
                key, arrival = payload
                self.arrived.add(arrival)
                self.start_link(key)
                self.try_start(self.where[arrival[1]])
            elif self.shared:
                # One process's optimizer steps every device's parameters, in the caller's
                # thread with all of its intra-op threads, once backward has returned.
                self.stepped.add(payload)
                self.ready_at[payload] = self.now
                if len(self.stepped) == self.config.pp:
                    # Ranks of a world all-reduce the loss first (``loss_time``; 0 in one).
                    begin = reduced = max(self.now, pipeline_end) + self.loss_time
                    for j in range(self.config.pp):
                        end = (begin + self.shards * self.p.optimizer_times[j]
                               + self.loss_wake(j, reduced))
                        self.transfers.append((f"optimizer device {j}", begin, end))
                        self.updates.append((j, OPTIMIZER, begin, end))
                        finished[j], begin = end, end
            elif self.processes and kind == "optimizer":
                # Every rank all-reduces the loss first: none steps before the last is done.
                self.ready_to_step.append(payload)
                self.ready_at[payload] = self.now
                if len(self.ready_to_step) == self.config.pp:
                    self.push(max(self.now, pipeline_end) + self.loss_time, "step", None)
            elif kind == "step":
                for j in self.ready_to_step:
                    self.run_on_host(j, self.shards * self.p.optimizer_times[j]
                                     + self.loss_wake(j, self.now), ("optimizer", self.now))
            else:
                self.run_on_host(payload, self.shards * self.p.optimizer_times[payload],
                                 ("optimizer", self.now))
        return self.result(finished, pipeline_end)

    def host_finish(self, h: int, version: int) -> int | None:
        """The device whose work on shared host ``h`` ends now (``None``: a stale event)."""
        host = self.hosts[h]
        if version != host.version:
            return None
        host.advance(self.now)
        _, j = host.next_finish()  # type: ignore[misc]
        del host.running[j]
        host.version += 1
        self.schedule_host(h)
        return j

    def result(self, finished: dict[int, float], pipeline_end: float) -> SimulationResult:
        stuck = [j for j in range(self.config.pp) if self.next_index[j] < len(self.order[j])]
        if stuck:
            raise SimulationError(f"the schedule deadlocked: devices {stuck} never ran "
                                  f"{[str(self.order[j][self.next_index[j]]) for j in stuck]}")
        busy = sum(end - start for _, start, end in self.timeline)
        pp = self.config.pp
        bubble = max(0.0, 1 - busy / (pp * pipeline_end)) if pipeline_end > 0 else 0.0
        static = [m.total - m.activations for m in self.p.memory]
        self.timeline.sort(key=lambda entry: (entry[1], entry[0].stage))
        return SimulationResult(max(finished.values(), default=pipeline_end), pipeline_end,
                                bubble, tuple(s + peak for s, peak in zip(static, self.peak)),
                                tuple(self.timeline), tuple(self.transfers),
                                tuple(sorted(self.updates, key=lambda u: (u[2], u[0]))))


def loss_all_reduce_time(cluster: Cluster, ranks: int, staggered: bool = False,
                         after: float = 0.0) -> float:
    """Seconds of the one-number all-reduce of the step's loss over a world of ``ranks``
    processes (0 for one process's devices): as the link probe timed it in this world
    (``LinkSpec.scalar_all_reduce``; with ``staggered``, a pipeline's ranks arriving one
    after another and then stepping optimizers of ``after`` seconds each,
    ``LinkSpec.staggered_time``: from the last arrival to the last release), else a ring
    of lone hand-offs, since every rank but the last to finish its backward is waiting in
    it already.

    Example:
        >>> from partitioner.cost.devices import REFERENCE_CPU
        >>> from partitioner.planning.world import REFERENCE_LOOPBACK, world_cluster
        >>> c = world_cluster(["h"] * 4, "cpu", cpu=REFERENCE_CPU, link=REFERENCE_LOOPBACK)
        >>> round(loss_all_reduce_time(c, 4) / REFERENCE_LOOPBACK.latency)  # 2 (n - 1) steps
        6
    """
    if not cluster.processes or ranks < 2:
        return 0.0
    link = cluster.intra_node
    timed = link.staggered_time(after) if staggered and ranks == cluster.size else None
    if timed is not None:
        return timed
    if link.scalar_all_reduce is not None and ranks == cluster.size:  # timed in this world
        return link.scalar_all_reduce
    return all_reduce_time(8.0, ranks, replace(link, busy_latency=None, rings=()))


def simulate(plan: Any, cluster: Cluster | None = None) -> SimulationResult:
    """Simulate one training step of ``plan`` on ``cluster``.

    Args:
        plan: a :class:`~partitioner.plans.plan.Plan` made by the planner (its chosen candidate
            carries the stage costs), or a :class:`~partitioner.planning.predict.Prediction`.
        cluster: the devices and links; a plan's own cluster when omitted. Compute times
            are the plan's (re-plan with ``make_plan(devices=cluster)`` for other devices);
            the cluster decides which devices share a host.

    Returns:
        The :class:`SimulationResult`.

    Raises:
        SimulationError: the plan has no cost record.
        ScheduleError: the plan's schedule cannot be built for its counts.
    """
    from partitioner.planning.records import from_record
    if isinstance(plan, Prediction):
        prediction = plan
    else:
        records = getattr(plan, "candidates", ())
        if not records:
            raise SimulationError("the plan carries no cost record (it was written by hand or "
                                  "made without example inputs); make it with make_plan(...)")
        prediction, own = from_record(records[0])
        cluster = cluster or own
    if cluster is None:
        raise SimulationError("pass the cluster to simulate a Prediction on")
    return _Simulation(prediction, cluster).run()


def predict_step(prediction: Prediction, cluster: Cluster) -> Prediction:
    """The one predictor of a step: ``prediction`` with its step time, pipeline time, bubble
    and throughput from the simulation of its own schedule's action lists.

    Every plan's recorded step time comes from here (its header, notes, ``explain()``), and
    :func:`simulate` replays the same events for ``partitioner simulate`` and the timeline,
    so they all agree. The phase times are the prediction's: per stage its forward,
    backward, replay and send (:class:`~partitioner.planning.predict.StageProfile`), per
    device its gradient all-reduce and optimizer step.

    Example:
        >>> from partitioner.cost.devices import Cluster
        >>> from partitioner.planning.predict import Config, predict
        >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
        >>> cluster = Cluster.preset("A100-80GB")
        >>> p = predict(gpt_workload(GPTShape(4, 256, 4, 128, 1000), 16), cluster,
        ...             Config(dp=4, pp=2, chunks=4))
        >>> step = predict_step(p, cluster)
        >>> step.step_time == simulate(p, cluster).step_time, step.simulated
        (True, True)
    """
    if prediction.simulated:
        return prediction
    result = _Simulation(prediction, cluster).run()
    step = result.step_time
    breakdown = {**prediction.breakdown, "pipeline": result.pipeline_time}
    return replace(prediction, step_time=step, pipeline_time=result.pipeline_time,
                   bubble=result.bubble, breakdown=breakdown, simulated=True,
                   samples_per_second=prediction.samples_per_second
                   * prediction.step_time / step if step > 0 else math.inf)


def refine(prediction: Prediction, cluster: Cluster, max_actions: int = 20_000) -> Prediction:
    """:func:`predict_step` where the search needs it to rank, if not too long to simulate.

    Used where the closed forms are weakest: devices sharing one host's cores, whose
    contention depends on which stages happen to overlap. Plans with more than
    ``max_actions`` forward and backward actions are returned unchanged (the search passes
    the ones it keeps through :func:`predict_step` at the end, within its budget:
    ``partitioner.planning.ranking``).

    Example:
        >>> from partitioner.cost.devices import Cluster
        >>> from partitioner.planning.predict import Config, predict
        >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
        >>> cluster = Cluster.preset("A100-80GB")
        >>> p = predict(gpt_workload(GPTShape(4, 256, 4, 128, 1000), 16), cluster,
        ...             Config(dp=4, pp=2, chunks=4))
        >>> refine(p, cluster).step_time == simulate(p, cluster).step_time
        True
    """
    c = prediction.config
    if 2 * c.stages * c.chunks > max_actions:
        return prediction
    return predict_step(prediction, cluster)
