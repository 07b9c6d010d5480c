"""Measuring this machine: the CPU's spec, and (``calibrate=True``) each distinct layer.

:func:`measure_cpu` runs a short calibration (about 6 s) once per process: products of
1024 x 1024 weights with 8, 64 and 256 rows, the weights read from memory rather than cache
as a model's are (the rate, and the per-call cost of repacking the weights that makes small
micro-batches slow), a tiny product (the efficiency curve), an in-place add larger than the
last-level cache (element-wise bandwidth), an Adam step right after a backward (the
optimizer's), a chain of tiny ops with their backward (the fixed cost of one op), a pipeline
of tiny stages (the runtime's cost per stage action), and several stage workers computing
at once against one, for products of four sizes and for element-wise streams (``"cpu"``
devices share this machine's cores, and what sharing gains depends on the work). Each
timing is the median of a few repeats, and the spec takes the median of this run and the
last runs on this machine (a small cache file).

:func:`calibrate_layers` times forward + backward of every *distinct* layer once on the real
device, with the example batch: layers with the same signature (the blocks of a transformer)
are measured once, and no stage combination is ever timed. The ratio of measured to
predicted time then scales that layer's cost at every micro-batch size, so the model keeps
its shape (weight traffic, per-op costs) while its level comes from the machine.

Example:
    >>> spec = measure_cpu()
    >>> spec.flops("fp32") > 1e9 and spec.shared_speedup[0] == 1.0
    True
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.fx as fx

from partitioner.cost.adam_timing import ADAM_LAYERS, ADAM_WEIGHT, adam_step_seconds
from partitioner.cost.calibration_cache import (
    KEPT_RUNS,
    Cached,
    Run,
    cache_file,
    quiet_run,
    read_runs,
    report_problem,
    runs_to_use,
)
from partitioner.cost.call_fit import fit_calls, small_batch
from partitioner.cost.caller_spin import SETTLE, spin_timings, spin_window
from partitioner.cost.cost import LayerCost
from partitioner.cost.devices import FRESH_RAMP, DeviceSpec
from partitioner.cost.layer_timing import time_layers
from partitioner.cost.memory import optimizer_traffic
from partitioner.cost.runtime_paths import (
    fused_linear_seconds,
    optimizer_tensor_seconds,
    replica_step_seconds,
    replica_tensor_seconds,
    thread_collective_seconds,
)
from partitioner.errors import CalibrationError
from partitioner.passes.group_layers import Layer
from partitioner.runtime.host_memory import (
    cpu_host_memory_mode,
    fresh_allocation_bytes,
    steady_host_memory,
)
from partitioner.runtime.local import LocalPipeline
from partitioner.runtime.worker import Worker, shared_threads

__all__ = ["CalibrationError", "measure_cpu", "remeasure_cpu", "cached_cpu_spec", "kept_runs",
           "median_spec", "cache_file", "KEPT_RUNS", "TIMING_KEYS", "calibrate_layers", "calibrate",
           "Progress"]


def _typical(fn: Callable[[], Any], repeats: int = 5, inner: int = 1) -> float:
    """The median seconds of ``fn`` over ``repeats`` timings of ``inner`` calls, after one.

    The median, not the best: a plan predicts the step time the machine usually gives (on
    a shared VM the best of a few repeats runs 5-15% below the median of training steps).
    """
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _warm_up(fn: Callable[[], Any], seconds: float = 0.1) -> None:
    """Run ``fn`` for a while first: a cold thread pool and clock run far below speed."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()


def _op_overhead() -> float:
    """Seconds per op of a chain of tiny ops, forward + backward, per op launch."""
    w = torch.ones(8, requires_grad=True)

    def chain() -> None:
        x = w
        for _ in range(16):
            x = x * 1.0001
        x.sum().backward()
    # 16 forward + 16 backward launches (+ sum): the cost of one launch.
    return _typical(chain, repeats=7, inner=5) / 34


@contextmanager
def _together(work: Callable[[], None], n: int, share: int | None = None
              ) -> Iterator[Callable[[], None]]:
    """``work`` on ``n`` stage workers at once, each with the intra-op threads the pipeline
    runtime gives it when ``share`` workers share the host (default ``n``;
    ``partitioner.runtime.worker.shared_threads``: the caller's threads shared)."""
    cpu = torch.device("cpu")
    workers = [Worker(cpu, shared_threads([cpu] * (share or n))) for _ in range(n)]

    def run() -> None:
        for future in [w.submit(work) for w in workers]:
            future.result()
    try:
        yield run
    finally:
        for w in workers:
            w.close()


@functools.cache
def measure_cpu(progress: bool = False) -> DeviceSpec:
    """This machine's CPU as a :class:`DeviceSpec`: measured once per process, kept per machine.

    Each timing is the median of a few repetitions within a run (a plan predicts the step
    time the machine usually gives, not its best), and the spec takes, per timing, the
    median of this run and the last runs kept in the calibration cache
    (:mod:`partitioner.cost.calibration_cache`: ``$PARTITIONER_CACHE_DIR``, else
    ``~/.cache/partitioner``; ``PARTITIONER_CALIBRATION_CACHE=0`` disables it). Not the best
    across runs: on a shared VM memory-bound timings swing by 2x from run to run (an Adam
    step measured 16 ms in one run and 35 ms in the next three), and a plan should expect
    the machine as it usually is. Plans on one machine then agree from run to run.

    A run during which other processes kept more than 15% of the cores busy measures them,
    not the machine: it is taken again (twice at most, each after waiting up to 3 s for a
    quiet moment), and one still loaded is used by this process only, said on stderr, and
    never written to the cache. Processes of one host measuring at once (``torchrun``'s
    ranks) take turns on a lock beside the cache file, and one that finds a run taken since
    it started (another rank's) uses that instead of measuring.

    Returns:
        A spec from float32 products of a ``1024 x 1024`` weight with 8, 64 and 256 rows (the
        asymptotic rate, ``peak_flops`` with ``matmul_efficiency`` 1, and the weight
        repacking cost, ``pack_bandwidth``), a 48 x 48 product (``matmul_half_flops``), an
        in-place add of 64 MiB tensors (``memory_bandwidth``, ``memory_efficiency`` 1), an
        Adam step over eight 1024 x 1024 weights after their backward (``optimizer_bandwidth``;
        the median of 3 steps), tiny ops with autograd (``op_overhead``), 2, 3 and 4 stage
        workers computing 64-row products at once, each with its share of the intra-op
        threads (``shared_speedup``), and 2 workers computing products of 8, 256 and 1024
        rows and element-wise streams (``shared_sizes``; 3 and 4 workers scaled from 2 as
        for 64 rows), one worker with a two-worker share of the threads against all of them
        on 512-row products of a reused 256 x 1024 weight, which run at the full rate
        (``worker_speed``: what the threads divide, ``partitioner.cost.sharing``), and a
        2-stage, 8-micro-batch pipeline of tiny stages against the same
        stages called directly (``action_overhead``). The bfloat16 and float16 rates
        (``peak_flops["bf16"]``, ``["fp16"]``, what ``precision=`` runs under autocast) are
        float32's scaled by the time of the 64-row product in bfloat16 and the 8-row one in
        float16.

    Args:
        progress: show a progress bar on stderr while measuring.
    """
    return _calibrated(progress, share=True)


def remeasure_cpu(progress: bool = False) -> DeviceSpec:
    """Measure the CPU now, even if another process just did, and keep the run if it was
    quiet (``partitioner calibrate --measure``); the spec as :func:`measure_cpu` makes it."""
    return _calibrated(progress, share=False)


def _calibrated(progress: bool, share: bool) -> DeviceSpec:
    steady_host_memory()  # the spec holds under the allocator settings the runtime runs with
    def run_once() -> dict[str, float]:
        return _timings(Progress("partitioner: measuring the CPU", _PHASES, enabled=progress))
    return median_spec(runs_to_use(cache_file(), lambda: quiet_run(run_once), TIMING_KEYS,
                                   share=share))


def kept_runs() -> Cached | None:
    """What this machine's cache file holds, without measuring or saying anything (``None``:
    the cache is disabled)."""
    path = cache_file()
    return None if path is None else read_runs(path, TIMING_KEYS)


def cached_cpu_spec() -> DeviceSpec | None:
    """The spec of the runs kept in this machine's cache (their median), without measuring;
    ``None`` when there are none or the cache is disabled. An unusable cache file is said on
    stderr (its runs are measured again)."""
    cached = kept_runs()
    if cached is None:
        return None
    report_problem(cached)
    return median_spec(cached.runs[-KEPT_RUNS:]) if cached.runs else None


def median_spec(runs: Sequence[Run]) -> DeviceSpec:
    """The spec of the per-timing median of ``runs`` (at least one)."""
    return _spec({k: statistics.median(run.timings[k] for run in runs) for k in TIMING_KEYS})


def _peaks(rate: float, t: dict[str, float]) -> dict[str, float]:
    """Per dtype, the products' rate: float32's fitted ``rate``, and bfloat16's and
    float16's scaled by how long the same products took in them (what ``precision="bf16"``
    runs under autocast: a CPU with bf16 instructions multiplies bf16 several times faster
    than fp32, and fp16 may have no fast path at all, an order of magnitude slower)."""
    return {"fp32": rate, "bf16": rate * t["some"] / t["bf16_some"],
            "fp16": rate * t["few"] / t["fp16_few"], "fp64": rate / 2}


_WEIGHT, _SMALL, _COPY = 1024, 48, 16 * 2**20
_ROWS = (8, 64, 256)
_MOST = 1024  # rows of the largest products timed shared (as a transformer's at batch x seq)
_BOUND = (512, 256, 1024)  # a product at the full rate: rows, and its weight's shape


_PHASES = 7  # what _timings reports to its progress bar
_COUNTS = {2: "two", 3: "three", 4: "four"}
TIMING_KEYS = ("overhead", "few", "some", "many", "bf16_some", "fp16_few", "small", "add",
               "fill", "fresh", "adam",
               "action", "collective", "replica", "adam_tensor", "replica_tensor", "alone",
               "fused", "spin_idle", "spin_op", "bound_alone", "bound_single",
               *_COUNTS.values(),
               *(f"{name}_{work}" for work in ("few", "many", "most", "mem")
                 for name in ("alone", "two")))
"""What one calibration run times (:func:`_timings`), each in seconds."""


def _timings(progress: Progress) -> dict[str, float]:
    """One calibration run's timings, in seconds (about 6 s on the idle 2-core VM)."""
    # Weights from memory, not cache: a model's layers together outgrow the last-level cache,
    # so each product here takes the next of 96 MiB of weights.
    weights = [torch.randn(_WEIGHT, _WEIGHT) for _ in range(24)]
    turn = itertools.cycle(weights)
    few, some, many = (torch.randn(n, _WEIGHT) for n in _ROWS)
    _warm_up(lambda: torch.mm(many, next(turn)))
    c, d = torch.randn(_SMALL, _SMALL), torch.randn(_SMALL, _SMALL)
    x = torch.ones(_COPY)  # touched: untouched pages read as the shared zero page
    y = torch.zeros_like(x)
    found = {"overhead": _op_overhead(),
             "few": _typical(lambda: torch.mm(few, next(turn)), repeats=7, inner=24),
             "some": _typical(lambda: torch.mm(some, next(turn)), repeats=5, inner=12),
             "many": _typical(lambda: torch.mm(many, next(turn)), repeats=3, inner=8),
             "small": _typical(lambda: torch.mm(c, d), repeats=7, inner=50)}
    found.update(_low_precision(weights, some, few))
    progress.step("matrix products")
    found.update(add=_typical(lambda: y.add_(x), repeats=5),
                 fill=_typical(lambda: y.fill_(1.0), repeats=5),
                 fresh=_typical(_fresh_fill, repeats=3) if fresh_allocation_bytes() else 0.0)
    progress.step("memory bandwidth")
    found["adam"] = adam_step_seconds()
    progress.step("optimizer step")
    found["action"] = _action_overhead()
    found.update(collective=thread_collective_seconds(2), replica=replica_step_seconds(),
                 adam_tensor=optimizer_tensor_seconds(), replica_tensor=replica_tensor_seconds(),
                 fused=fused_linear_seconds())
    progress.step("pipeline actions, thread collectives and replicas")
    # What stages computing at once get done: products of 8 to 1024 rows with weights
    # streamed from memory (the smaller, the more sharing gains), and element-wise streams
    # (each worker its own tensors; the memory bus is shared).
    local = threading.local()

    def stream() -> None:
        if not hasattr(local, "x"):
            local.x, local.y = torch.ones(_COPY), torch.ones(_COPY)
        for _ in range(4):
            local.y.add_(local.x)
    reference = _products(some, weights[:16])
    found.update(_shared_timings(reference, (2, 3, 4)))
    # A lone worker's share of the threads, on products that run at the full rate (weights
    # reused from cache, many rows): what the threads divide (partitioner.cost.sharing).
    bound = _products(torch.randn(_BOUND[0], _BOUND[1]), [torch.randn(*_BOUND[1:])] * 8)
    found.update({"bound_" + name: t
                  for name, t in _shared_timings(bound, (), single=True).items()})
    def twice() -> None:
        reference()
        reference()
    with _together(twice, 2) as two:
        found.update(spin_timings(two))  # the caller's helpers after its parallel op
    progress.step("stages sharing the cores")
    for k, (suffix, work) in enumerate( (("_few", _products(few, weights[:16])),
                         ("_many", _products(many, weights[:4])),
                         ("_most", _products(torch.randn(_MOST, _WEIGHT), weights[:2])),
                         ("_mem", stream))):
        found.update({name + suffix: t
                      for name, t in _shared_timings(work, (2,), rounds=2).items()})
        if k % 2:
            progress.step("sharing by size of work")
    return found


def _fresh_fill() -> None:
    """Fill a newly mapped 64 MiB (an anonymous mapping: fresh pages whatever ``malloc``'s
    settings), as a tensor too large for the allocator to reuse is."""
    with mmap.mmap(-1, _COPY * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as memory:
        tensor = torch.frombuffer(memory, dtype=torch.float32)
        tensor.fill_(1.0)
        del tensor


def _low_precision(weights: list[torch.Tensor], some: torch.Tensor, few: torch.Tensor
                   ) -> dict[str, float]:
    """The products of ``some`` rows in bfloat16 and of ``few`` rows in float16, with the
    operands already cast (autocast's casts are memory traffic, costed as such:
    ``partitioner.cost.precision_cost``); float16 on few rows, since a CPU without an fp16
    path takes tens of milliseconds even for those."""
    found = {}
    for key, dtype, rows, count, repeats, inner in (
            ("bf16_some", torch.bfloat16, some, len(weights), 5, 12),
            ("fp16_few", torch.float16, few, 8, 3, 2)):
        cast = [w.to(dtype) for w in weights[:count]]  # bf16: from memory, as fp32's
        found[key] = _typical(_products_in_turn(rows.to(dtype), cast), repeats=repeats,
                              inner=inner)
    return found


def _products_in_turn(rows: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], Any]:
    """One product of ``rows`` with the next of ``weights`` per call."""
    turn = itertools.cycle(weights)
    return lambda: torch.mm(rows, next(turn))


def _products(rows: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], None]:
    def work() -> None:
        for w in weights:
            torch.mm(rows, w)
    return work



def _shared_timings(work: Callable[[], None], counts: Sequence[int],
                    rounds: int = 3, single: bool = False) -> dict[str, float]:
    """The median time of ``work`` alone, and on ``n`` stage workers at once for each count
    (and on one worker with a two-worker share of the threads, ``single``), over ``rounds``
    rounds."""
    work()
    times: dict[str, list[float]] = {"alone": [], **{_COUNTS[n]: [] for n in counts}}
    with ExitStack() as stack:
        teams = {_COUNTS[n]: stack.enter_context(_together(work, n)) for n in counts}
        if single:  # one worker with the threads it has when two share the host
            times["single"] = []
            teams["single"] = stack.enter_context(_together(work, 1, share=2))
        for run in teams.values():
            run()  # each worker's first call (the element-wise stream allocates there)
        for _ in range(rounds):  # alone and together in turn: load drifting skews neither
            times["alone"].append(_typical(work, repeats=1))
            for name, run in teams.items():
                # The caller's helpers, spinning after "alone" ran on its team, asleep
                # first: an untimed run shorter than their spin left some of it in the timed
                # one (what the spin costs a step is ``caller_spin``, a term of its own).
                time.sleep(SETTLE)
                times[name].append(_typical(run, repeats=1))
    return {name: statistics.median(values) for name, values in times.items()}


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.linear(x),)


def _action_overhead() -> float:
    """Seconds the pipeline runtime adds per stage action: a 2-stage, 8-micro-batch pipeline
    of tiny stages (32 actions) against the same stages called directly."""
    stages = [fx.symbolic_trace(_Tiny()) for _ in range(2)]
    x = torch.randn(8, 8)
    pipe = LocalPipeline(stages, [torch.device("cpu")] * 2, chunks=8)

    def piped() -> None:
        pipe.run([x])[0].sum().backward()

    def direct() -> None:
        stages[1](*stages[0](x))[0].sum().backward()
    try:
        overhead = (_typical(piped, repeats=7, inner=3) - _typical(direct, repeats=7, inner=3)) / 32
    finally:
        pipe.close()
    return max(overhead, 0.0)


def _spec(t: dict[str, float]) -> DeviceSpec:
    """The spec of a set of timings (see :func:`measure_cpu`)."""
    # t = overhead + weight / pack + f / rate: a line through the products of 8, 64 and 256
    # rows, least squares in relative error (each size counts alike, not the slowest most);
    # its slope is the rate, its intercept the repacking.
    flops = [2.0 * n * _WEIGHT**2 for n in _ROWS]
    times = [t["few"], t["some"], t["many"]]
    weights = [1 / s**2 for s in times]
    total = sum(weights)
    mean_f = sum(w * f for w, f in zip(weights, flops)) / total
    mean_t = sum(w * s for w, s in zip(weights, times)) / total
    slope = sum(w * (f - mean_f) * (s - mean_t) for w, f, s in zip(weights, flops, times)) \
        / sum(w * (f - mean_f) ** 2 for w, f in zip(weights, flops))
    rate = 1 / slope if slope > 0 else flops[-1] / times[-1]
    rate = min(max(rate, flops[-1] / times[-1]), 1.5 * flops[-1] / times[-1])
    pack_time = max(mean_t - mean_f / rate - t["overhead"], t["few"] * 0.01)
    pack = _WEIGHT * _WEIGHT * 4 / pack_time
    f_small = 2.0 * _SMALL**3
    # rate * f / (f + half) = f / t  =>  half = rate * t - f (the launch cost taken out)
    half = max(rate * max(t["small"] - t["overhead"], 0.0) - f_small, f_small / 100)
    bandwidth = 3 * _COPY * 4 / t["add"]  # an in-place add reads two tensors, writes one
    # PyTorch's Adam: seven element-wise passes and two temporaries, 80 bytes per float32
    # parameter (partitioner.cost.memory.optimizer_traffic), at the rate its kernels reach.
    optimizer = optimizer_traffic("adam", 4, False) * ADAM_LAYERS * ADAM_WEIGHT**2 / t["adam"]
    # n workers sharing the caller's threads (as the runtime's stages do) get at most
    # min(n, cores) times the work of one worker done: a lone team of several threads is at
    # least as fast as one thread.
    cores = os.cpu_count() or 1

    def gain(n: int, suffix: str = "") -> float:
        return min(max(n * t["alone" + suffix] / t[_COUNTS[n] + suffix], 1 / n),
                   float(min(n, cores)))
    reference = (1.0, *(gain(n) for n in _COUNTS))

    def row(flops: float, suffix: str) -> tuple[float, ...]:
        # Timed for 2 workers; 3 and 4 scaled as the reference work scales from 2.
        two = gain(2, suffix)
        return (flops, 1.0, *(min(max(two * reference[n - 1] / reference[1], 1 / n),
                                  float(min(n, cores))) for n in _COUNTS))
    sizes = (row(0.0, "_mem"), row(2.0 * _ROWS[0] * _WEIGHT**2, "_few"),
             (2.0 * _ROWS[1] * _WEIGHT**2, *reference), row(2.0 * _ROWS[2] * _WEIGHT**2, "_many"),
             row(2.0 * _MOST * _WEIGHT**2, "_most"))
    # First touch of new memory: a fill of fresh pages against a fill of touched ones.
    threshold = fresh_allocation_bytes()
    fresh = _COPY * 4 / max(t["fresh"] - t["fill"], 1e-9) if threshold else 0.0
    return DeviceSpec("cpu (measured)", _peaks(rate, t), _total_memory(), bandwidth, 1.0, half,
                      1.0, t["overhead"], pack, optimizer, reference, sizes, t["action"],
                      fresh, threshold or 0.0,
                      # glibc's thresholds fixed (host_memory's steady or kept mode): tensors
                      # below the mmap threshold are reused, none faulted in part.
                      fresh_ramp=FRESH_RAMP if cpu_host_memory_mode() == "system" else 1.0,
                      # A two-rank all-reduce between threads is a ring of 2 steps.
                      thread_latency=t["collective"] / 2, replica_overhead=t["replica"],
                      optimizer_tensor_overhead=t["adam_tensor"],
                      replica_tensor_overhead=t["replica_tensor"],
                      worker_speed=min(t["bound_alone"] / t["bound_single"], 1.0),
                      fused_linear_overhead=t["fused"],
                      caller_spin=spin_window(t["spin_idle"], t["spin_op"], reference[1],
                                              reference[2]))


def _total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


class Progress:
    """A one-line progress bar on stderr (``label  3/7 ####.....``); silent if disabled."""

    def __init__(self, label: str, total: int, enabled: bool = True) -> None:
        self.label, self.total, self.done = label, total, 0
        self.enabled = enabled and total > 0

    def step(self, note: str = "") -> None:
        """Mark one more item done."""
        self.done += 1
        if self.enabled:
            filled = round(20 * self.done / self.total)
            sys.stderr.write(f"\r{self.label} {self.done}/{self.total} "
                             f"[{'#' * filled}{'.' * (20 - filled)}] {note[:40]:<40}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _small_batch_times(gm: fx.GraphModule, layers: Sequence[Layer], inputs: Sequence[Any],
                       batch: int, repeats: int, min_seconds: float
                       ) -> tuple[int, list[tuple[float, float]]] | None:
    """The layers' (forward, backward) seconds on a smaller batch than the example one, and
    its size (``partitioner.cost.call_fit``); ``None`` where no smaller batch can be cut or
    the graph does not run on it (its shapes fixed at capture)."""
    cut = small_batch(list(inputs), batch)
    if cut is None:
        return None
    try:
        with _preserved(gm):
            few = time_layers(gm, layers, cut[0], repeats=repeats, optimizer=False,
                              min_seconds=min_seconds)
    except Exception:  # a graph captured for one batch size: one scale, as before
        return None
    return cut[1], few.layers


def calibrate_layers(gm: fx.GraphModule, layers: Sequence[Layer], costs: Sequence[LayerCost],
                     inputs: Sequence[Any], spec: DeviceSpec, batch: int, *,
                     progress: bool = True, repeats: int = 3) -> list[LayerCost]:
    """The layers' costs scaled to their times in context (:func:`calibrate`'s first half)."""
    return calibrate(gm, layers, costs, inputs, spec, batch, progress=progress,
                     repeats=repeats)[0]


def calibrate(gm: fx.GraphModule, layers: Sequence[Layer], costs: Sequence[LayerCost],
              inputs: Sequence[Any], spec: DeviceSpec, batch: int, *,
              progress: bool = True, repeats: int = 3, optimizer: bool = False,
              min_seconds: float = 0.0) -> tuple[list[LayerCost], float | None]:
    """Time the layers in training passes of the whole model; scale their costs to match.

    :func:`partitioner.cost.layer_timing.time_layers` times every layer's forward and
    backward in context (a layer timed alone paid a whole autograd run of its own); layers
    with the same signature (the blocks of a transformer) take the median of their times.

    Args:
        gm: the captured graph, with real weights, after shape propagation.
        layers: its layers.
        costs: their predicted costs (:func:`partitioner.cost.cost.layer_costs`).
        inputs: one value per placeholder of ``gm`` (the example batch).
        spec: the spec the prediction used.
        batch: samples in the example batch.
        progress: say on stderr what was timed.
        repeats: timed training passes (the median counts), after two warm-up passes.
        optimizer: time an Adam step after each pass too (learning rate 0).
        min_seconds: more passes (up to 64) until the timed ones last this long.

    Returns:
        The costs with ``time_scale`` set to measured / predicted for each layer, and the
        measured seconds of the whole model's Adam step (``None`` unless ``optimizer``).

    Raises:
        CalibrationError: the model's weights are on the meta device.
    """
    if any(p.is_meta for p in gm.parameters()):
        raise CalibrationError("calibrate=True times the layers on this machine, but the "
                               "model's weights are on the meta device; build it with real "
                               "weights or pass calibrate=False")
    with _preserved(gm):
        timed = time_layers(gm, layers, list(inputs), repeats=repeats, optimizer=optimizer,
                            min_seconds=min_seconds)
    few = _small_batch_times(gm, layers, inputs, batch, repeats, min_seconds)
    # Repeated blocks share one fit: the medians of their times.
    scaled = fit_calls(costs, spec, batch, timed.layers, *(few or (None, None)))
    if progress:
        print(f"partitioner: timed {len(costs)} layers in training passes of the whole "
              f"model ({len({c.signature for c in costs})} distinct, {timed.passes} passes"
              f"{'; a smaller batch too, for what each call costs' if few else ''})",
              file=sys.stderr)
    return scaled, timed.optimizer


class _preserved:
    """Restore parameter gradients, buffers and the CPU random generator after timing
    (calibration leaves no trace: dropout in the timed passes draws from it). The
    parameters are never written (the timed optimizer steps stand-ins); a buffer is copied
    back only where a pass changed its values (batch norm's running statistics, which its
    kernel updates without a new version), so a model nothing wrote keeps its tensors'
    versions (what a live tensor-parallel wrapper of it checks)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm

    def __enter__(self) -> None:
        self.grads = {p: p.grad for p in self.gm.parameters()}
        self.buffers = {b: b.detach().clone() for b in self.gm.buffers()}
        self.rng = torch.random.get_rng_state()
        for p in self.grads:
            p.grad = None

    def __exit__(self, *exc: object) -> None:
        torch.random.set_rng_state(self.rng)
        for p, g in self.grads.items():
            p.grad = g
        with torch.no_grad():
            for b, saved in self.buffers.items():
                if not torch.equal(b, saved):
                    b.copy_(saved)
