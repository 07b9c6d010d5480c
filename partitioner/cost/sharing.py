"""How a layer's work fares on ``"cpu"`` devices sharing one host's cores.

Stage workers of one process share the host: ``n`` of them busy at once have ``1 / n`` of
the intra-op threads each (``partitioner.runtime.worker.shared_threads``), and a worker
computing alone still has only its share. What that costs depends on the work, and the
cost model's own terms say how: an op's forward and backward seconds (``op_times``) are

* its launches' fixed cost (Python and the dispatcher, taken in turn under the interpreter's
  lock): the same on one thread as on all, and no gain from other workers;
* the part the intra-op threads divide: a product's FLOPs (at the device's full rate,
  ``flops / peak``) and its memory traffic, all of a memory-bound op's traffic;
* the rest of a product: its weights' repacking and the efficiency small products lose to
  synchronising threads, which more threads do not shorten.

A layer's calibration (``time_scale``) scales both parts alike: what a call costs whatever
its rows is apart (``LayerCost.call_seconds``), so the scaled time is the rows' work. Until
2026-12-06 the excess of a product over its model was all counted in the rest; on
transformers' GPT-2 with its 50,257-word head (1.6x its model here, two threads 1.84x
one) that had two workers gaining 1.46x where they measured 1.04-1.09, and ``dp=2``
predicted 1.27x faster than it ran.

A lone worker takes ``parallel / worker_speed + rest`` (``worker_speed``: its share of the
threads against all of them, timed on a product that runs at the full rate), and two workers
busy at once each take that, so together they get ``2 * (parallel + rest) / (parallel /
worker_speed + rest)`` of the work of one worker with all the threads done. A product that
runs at the full rate alone gains nothing from a second worker (``2 * worker_speed``, about
1.0); one mostly repacking its weights (few rows) gains up to 2x. On the 2-core VM, for the
regret benchmark's models (MLPs, a CNN, encoders, a GPT, transformers' Llama), a lone
worker's speed measured 0.85-1.13 of this and two workers' gain 0.77-1.10 over four runs
(the CNN's convolutions lowest; the wide MLP's one-device pass, 64 MiB weights, read 200 ms
in one run and 381 in another); products of 64 rows repacking 4 MiB weights streamed from
memory gained 0.70-0.94 of it (their repacking shares the memory bus;
``benchmarks/sharing.py``, ``docs/benchmarks.md``, "What a second worker gains"). Three
and four workers lose what the calibration's reference products lose against two
(``DeviceSpec.shared_speedup``; three workers on two cores: one core holds two) and gain no
more than two (``gpt``'s and ``encoder``'s four workers gained 1.13-1.24 here, as
their two); memory-bound ops gain what the calibration's element-wise streams gain
(``DeviceSpec.shared_sizes``' row of 0 FLOPs).

A spec without a lone worker's speed (``worker_speed`` 1: the presets) keeps the gains by
size of product of its ``shared_sizes``.
"""

from __future__ import annotations

from partitioner.cost.cost import ATTENTION_BACKWARD, LayerCost, Op, op_times, pack_time
from partitioner.cost.devices import DeviceSpec

__all__ = ["shared_work", "lone_work", "sharing_gains", "lone_gain", "thread_parts",
           "pair_gain", "GRAIN_SIZE"]

GRAIN_SIZE = 32768
"""Elements from which torch's CPU kernels split an element-wise op over the intra-op
threads (``at::internal::GRAIN_SIZE``); a smaller op runs on one thread."""
_ELEMENT = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


def thread_parts(layer: LayerCost, op: Op, spec: DeviceSpec, samples: float, tp: int = 1,
                 dtype: str = "fp32") -> tuple[float, float, float]:
    """An op's forward + backward seconds in ``layer``: the whole, its launches' fixed cost,
    and the part the intra-op threads divide (a product's all but its repacking and the
    size curve's loss, scaled as calibrated; an attention kernel's FLOPs at its full rate;
    all of a memory-bound op's work from :data:`GRAIN_SIZE` output elements on, none below).

    Example:
        >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, 1.0, 1e6, 1.0, 1e-6,
        ...                  pack_bandwidth=1e9)
        >>> big = LayerCost("fc", (Op("matmul", flops=2e6, weight_read=4e3),))
        >>> few = LayerCost("fc", (Op("matmul", flops=2e6, weight_read=4e6),))
        >>> [round(p / (s - f), 2) for s, f, p in (thread_parts(l, l.ops[0], cpu, 64)
        ...                                         for l in (big, few))]
        [0.99, 0.32]
    """
    forward, backward = op_times(op, spec, samples, tp, dtype)
    seconds = (forward * (1 + op.replay) + backward) * layer.time_scale
    launches = op.count * ((3 if op.kind == "matmul" else 2) + op.replay)
    fixed = min(launches * spec.op_overhead * layer.time_scale, seconds)
    work = seconds - fixed
    share = tp if op.split else 1
    if op.kind == "memory" or not op.flops:
        # torch splits an element-wise kernel over its threads only from GRAIN_SIZE
        # elements of output on (at::internal::GRAIN_SIZE): a smaller one runs on one.
        out = (op.out_bytes or op.bytes / 2) * samples / share
        return seconds, fixed, work if out >= GRAIN_SIZE * _ELEMENT.get(dtype, 4) else 0.0
    flops = op.flops * samples / share
    if op.kind == "attention":
        rate = spec.flops(dtype) * (spec.attention_efficiency or spec.matmul_efficiency)
        passes = 1 + ATTENTION_BACKWARD + op.replay
        return seconds, fixed, min(flops * passes * op.count / rate, work)
    # What more threads do not shorten: the size curve's loss (threads synchronising on a
    # small product) and repacking the weights, as modelled and scaled by the calibration
    # like the rest; everything else (the FLOPs, the memory traffic) they divide.
    passes = 3 + op.replay  # forward, input and weight gradients, replays
    full = flops / (spec.flops(dtype) * spec.matmul_efficiency)
    lost = max(flops / spec.matmul_rate(flops, dtype) - full, 0.0) if flops else 0.0
    packs = (1 + op.replay + (1 if op.input_grad else 0)) * pack_time(op, spec, tp)
    serial = (passes * lost + packs) * op.count * layer.time_scale
    return seconds, fixed, max(work - serial, 0.0)


def pair_gain(work: float, parallel: float, spec: DeviceSpec) -> float:
    """What two workers busy at once get done over one with all the threads, for ``work``
    seconds of which ``parallel`` the threads divide: ``2 * work / (parallel / worker_speed
    + work - parallel)``.

    Example:
        >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, worker_speed=0.5)
        >>> pair_gain(1.0, 1.0, cpu), pair_gain(1.0, 0.0, cpu), round(pair_gain(1.0, 0.7, cpu), 2)
        (1.0, 2.0, 1.18)
    """
    slowed = parallel / spec.worker_speed + work - parallel
    return 2 * work / slowed if slowed > 0 else 1.0


def _derived(spec: DeviceSpec) -> bool:
    """Whether products' gains come from their thread parts (a measured lone worker's
    speed), not the spec's table by size."""
    return spec.worker_speed < 1.0 and len(spec.shared_speedup) > 1


def _gains(spec: DeviceSpec, op: Op, size: float, work: float, parallel: float
           ) -> list[float]:
    """For ``n = 1 .. len(spec.shared_speedup)`` busy workers, what ``n`` get done of ``op``'s
    ``work`` over one with all the threads."""
    width = len(spec.shared_speedup)
    derived = _derived(spec) and work > 0
    if not derived or ((op.kind == "memory" or not op.flops) and parallel > 0):
        return [spec.speedup(n, size) for n in range(1, width + 1)]
    two = pair_gain(work, parallel, spec)  # a product, or an element-wise op on one thread
    # More workers than two: what the reference products lose (3 workers on 2 cores: one
    # core holds two of them), never what they gain (their repacking overlaps; work that
    # keeps the cores busy cannot get more done).
    reference = spec.shared_speedup
    return [1.0] + [min(max(two * min(reference[n - 1] / reference[1], 1.0), 1 / n), float(n))
                    for n in range(2, width + 1)]


def shared_work(layer: LayerCost, spec: DeviceSpec, samples: float, tp: int = 1,
                dtype: str = "fp32") -> tuple[float, ...]:
    """How a layer's forward + backward fares on devices sharing one host's cores.

    Returns:
        For ``n = 1 .. len(spec.shared_speedup)`` busy devices, the layer's seconds divided
        by what ``n`` devices gain when each of its ops is on all of them at once (products:
        :func:`pair_gain` of their thread parts; memory-bound ops: the spec's element-wise
        row; the ops' fixed launch costs, taken in turn under the interpreter's lock, gain
        none). Entry 0 is the layer's time alone; ``entry[0] / entry[n - 1]`` is the layer's
        gain. Empty for devices with their own compute.

    Example:
        >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, 1.0, 1e3, 1.0, 0.0,
        ...                  shared_speedup=(1.0, 1.2), shared_sizes=((1e6, 1.0, 2.0),))
        >>> alone, two = shared_work(LayerCost("fc", (Op("matmul", flops=1e4),)), cpu, 10)
        >>> round(alone / two, 6)  # no lone worker's speed: the table (1e5 FLOPs: 2x)
        2.0
        >>> from dataclasses import replace
        >>> alone, two = shared_work(LayerCost("fc", (Op("matmul", flops=1e4),)),
        ...                          replace(cpu, worker_speed=0.5), 1e4)
        >>> round(alone / two, 2)  # 1e8 FLOPs at the full rate: what one worker gets done
        1.0
    """
    if not spec.shared_speedup:
        return ()
    width = len(spec.shared_speedup)
    out = [0.0] * width
    for op in layer.ops:
        seconds, fixed, parallel = thread_parts(layer, op, spec, samples, tp, dtype)
        size = op.flops * samples / (tp if op.split else 1) if op.kind != "memory" else 0.0
        for n, gain in enumerate(_gains(spec, op, size, seconds - fixed, parallel)):
            out[n] += (seconds - fixed) / gain + fixed
    return tuple(out)


def lone_work(layer: LayerCost, spec: DeviceSpec, samples: float, tp: int = 1,
              dtype: str = "fp32") -> float:
    """A layer's forward + backward on one stage worker computing alone on a host it shares
    with other devices' workers: the part of its ops the threads divide at ``worker_speed``
    (its share of the threads against all of them), the rest of a product's time (repacking
    weights, threads synchronising) and the ops' fixed launch costs (Python and the
    dispatcher) as long as with all the threads.

    A model of small layers, whose time is mostly launches, so runs about as fast on a lone
    worker as with every thread: charging ``worker_speed`` to the whole layer predicted the
    pipelines of such models up to 2x slower than their replicas (``docs/benchmarks.md``,
    "A lone worker's launches").

    Example:
        >>> from partitioner.cost.cost import LayerCost, Op
        >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 1e9, 1e10, 1.0, 1e3, 1.0, 1e-5,
        ...                  shared_speedup=(1.0, 1.2), worker_speed=0.5)
        >>> big = LayerCost("fc", (Op("matmul", flops=1e9),))
        >>> tiny = LayerCost("fc", (Op("matmul", flops=10),))
        >>> [round(shared_work(l, cpu, 1)[0] / lone_work(l, cpu, 1), 2) for l in (big, tiny)]
        [0.5, 1.0]
    """
    total = 0.0
    derived = _derived(spec)
    for op in layer.ops:
        seconds, fixed, parallel = thread_parts(layer, op, spec, samples, tp, dtype)
        if not derived:  # every kernel at the lone worker's speed
            parallel = seconds - fixed
        total += parallel / spec.worker_speed + (seconds - fixed - parallel) + fixed
    return total


def sharing_gains(works: list[tuple[float, ...]]) -> tuple[float, ...]:
    """A stage's gain from sharing a host, from its layers' :func:`shared_work`."""
    totals = [sum(column) for column in zip(*works)]
    if not totals or not all(t > 0 for t in totals):
        return ()
    return tuple(totals[0] / t for t in totals)


def lone_gain(stage: float, alone: list[float], lone: list[float]) -> float:
    """A stage's speed on a lone worker against all threads: its layers' work (``alone``:
    :func:`shared_work`'s first entry; ``lone``: :func:`lone_work`), plus the rest of its
    ``stage`` seconds (the runtime's action overheads: Python, as fast on one thread)."""
    rest = max(stage - sum(alone), 0.0)
    slowed = sum(lone) + rest
    return (sum(alone) + rest) / slowed if slowed > 0 else 0.0
