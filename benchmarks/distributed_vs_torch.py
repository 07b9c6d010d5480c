"""Multi-process training on gloo (CPU): ours against torch.distributed.pipelining and DDP.

Three parts, each in its own world of processes on this machine (one intra-op thread per
rank, ``127.0.0.1``):

(a) pipeline, on each of ``--ranks`` (default 2 and 4) ranks: ``nn.Sequential`` of
    16 x (Linear(1024, 1024), ReLU), batch 64 in 8 micro-batches, the same equal split for
    both tools, an SGD step, for each schedule: ours
    (``partition_distributed(..., pp=P, schedule=...)``; ``"interleaved"`` with
    ``virtual_stages=2``) against torch's ``PipelineStage`` s with the closest schedule class
    (``benchmarks/torch_pipelines.py``: ``ScheduleGPipe``, ``Schedule1F1B``,
    ``ScheduleInterleaved1F1B`` with 2 stages per rank, ``ScheduleInterleavedZeroBubble``
    with 1). Goal: ours/theirs <= 0.9 each. A schedule the installed project refuses (its
    ``PartitionError``) is skipped with the reason printed. For gpipe and 1f1b ours also
    runs with unfused weight gradients (``fuse_weight_grads=False``; ``--no-unfused`` drops
    those).
(b) pure data parallel, 2 ranks: the same model and batch (64 per rank), ours with
    ``dp=2`` (one micro-batch) against ``DistributedDataParallel``. Goal: ratio <= 1.0.
(c) memory, 4 ranks: 4 stages, 16 micro-batches, GPipe against 1F1B: per rank, the peak
    number of micro-batches held, the peak bytes autograd saved for backward (tracked
    exactly with ``saved_tensors_hooks``; parameters excluded), and the peak resident
    memory during the timed steps above the resident memory before them (Linux: the peak
    is restarted through ``/proc/self/clear_refs``).

Timing: every contender is timed on the same ranks in the same run, steps interleaved
(each round times each contender once, in a rotating order); a step is timed on rank 0
from a barrier before it to a barrier after it. Contenders start from copies of one model
and see the same batch, so their first losses must agree; the script checks that.

Run:
    python benchmarks/distributed_vs_torch.py                  # all parts, defaults
    python benchmarks/distributed_vs_torch.py --parts a --steps 40 --warmup 5
    python benchmarks/distributed_vs_torch.py --parts a --ranks 4 --schedules interleaved
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Ours and torch's contenders under one allocator setting: glibc's own (and the MALLOC_*
# variables set here), not the steady mode planning for CPU devices applies to its process
# (partitioner.runtime.host_memory), which torch's contenders would not get.
os.environ.setdefault("PARTITIONER_HOST_MEMORY", "system")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch_pipelines import THEIR_ZERO_BUBBLE, their_label, torch_pipeline_step

from partitioner.distributed import partition_distributed
from partitioner.errors import PartitionError
from partitioner.runtime.distributed.mesh import init_distributed

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="abc",
                        help="which parts to run: a, b, c, and p (part a profiled)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16, help="(Linear, ReLU) pairs")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--mem-batch", type=int, default=1024,
                        help="batch of part (c), split into 16 micro-batches")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes (pipeline depths) of part (a)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="comma-separated schedules of part (a)")
    parser.add_argument("--virtual", type=int, default=2,
                        help="virtual stages per rank of the interleaved schedule")
    parser.add_argument("--their-zero-bubble", choices=THEIR_ZERO_BUBBLE,
                        default="interleaved1",
                        help="torch's stand-in for our zero_bubble: "
                             "ScheduleInterleavedZeroBubble with 1 or --virtual stages per "
                             "rank, or ScheduleZBVZeroBubble")
    parser.add_argument("--no-unfused", action="store_true",
                        help="part (a) without our unfused-weight-gradient contenders")
    args = parser.parse_args()
    args.schedules = [name for name in args.schedules.split(",") if name]
    unknown = [name for name in args.schedules if name not in SCHEDULES]
    if unknown:
        parser.error(f"unknown schedules {unknown}; pass a subset of {SCHEDULES}")
    return args


def make_model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def data(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world`` fresh processes; their results, by rank."""
    out = Path(tempfile.mkdtemp())
    mp.spawn(_entry, (fn, world, free_port(), str(out), args), nprocs=world, join=True)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str,
           args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    init_distributed("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = fn(rank, *args)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def interleave(steps: dict[str, Callable[[], float]], warmup: int, timed: int
               ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Time each contender's step between barriers, rounds in rotating order."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    first: dict[str, float] = {}
    for r in range(warmup + timed):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            loss = steps[name]()
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
            first.setdefault(name, loss)
    return times, first


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def ours_step(dpm: Any, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    optimizer = sgd(dpm.parameters())

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = dpm.step(x, y, F.mse_loss)
        optimizer.step()
        return loss
    return step


def ours_pipeline(base: nn.Sequential, x: torch.Tensor, args: argparse.Namespace,
                  world: int, kind: str, fused: bool) -> Any:
    """Our pipeline over ``world`` ranks in schedule ``kind``, or why the installed project
    refuses it (every rank refuses alike, before any collective, so none hangs)."""
    virtual = args.virtual if kind == "interleaved" else 1
    n = world * virtual
    if len(base) % n:
        return f"{len(base)} modules do not split into {n} equal stages"
    extra: dict[str, Any] = {"virtual_stages": virtual} if virtual > 1 else {}
    try:
        return partition_distributed(copy.deepcopy(base), example_inputs=(x,), pp=world,
                                     chunks=args.chunks, schedule=kind, checkpoint="never",
                                     balance=[len(base) // n] * n, fuse_weight_grads=fused,
                                     **extra)
    except (PartitionError, TypeError) as error:  # TypeError: no virtual_stages= yet
        return f"ours refused: {type(error).__name__}: {error}"


def part_a(rank: int, args: argparse.Namespace, world: int) -> dict[str, Any]:
    base = make_model(args.width, args.blocks)
    x, y = data(args.batch, args.width)
    steps: dict[str, Callable[[], float]] = {}
    skipped: dict[str, str] = {}
    for kind in args.schedules:
        variants = (True,) if args.no_unfused or kind not in ("gpipe", "1f1b") else (True, False)
        for fused in variants:
            name = f"ours/{kind}" + ("" if fused else "/unfused")
            dpm = ours_pipeline(base, x, args, world, kind, fused)
            if isinstance(dpm, str):
                skipped[name] = dpm
            else:
                steps[name] = ours_step(dpm, x, y)
        try:
            steps[f"torch/{kind}"] = torch_pipeline_step(
                kind, base, rank, world, args.chunks, x, y, virtual=args.virtual,
                zero_bubble=args.their_zero_bubble)
        except (ValueError, RuntimeError) as error:
            skipped[f"torch/{kind}"] = f"torch refused: {type(error).__name__}: {error}"
    times, first = interleave(steps, args.warmup, args.steps)
    return {"times": times, "first": first, "skipped": skipped}


class Timers:
    """Wall time spent inside chosen functions (patched in place), by label."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()


def profile_a(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Where a step's time goes on each rank: compute, waiting for peers, the rest."""
    import torch.distributed.pipelining.schedules as their_schedules
    import torch.distributed.pipelining.stage as their_stage

    import partitioner.runtime.distributed.p2p as our_p2p
    import partitioner.runtime.distributed.pipeline as our_executor
    import partitioner.runtime.stage as our_stage

    base = make_model(args.width, args.blocks)
    x, y = data(args.batch, args.width)
    half = len(base) // 2
    out: dict[str, Any] = {}
    for kind in ("gpipe", "1f1b"):
        fused, unfused = (partition_distributed(
            copy.deepcopy(base), example_inputs=(x,), pp=2, chunks=args.chunks, schedule=kind,
            checkpoint="never", balance=[half, len(base) - half], fuse_weight_grads=flag)
            for flag in (True, False))
        for name, step in ((f"ours/{kind}", ours_step(fused, x, y)),
                           (f"ours/{kind}/unfused", ours_step(unfused, x, y)),
                           (f"torch/{kind}", torch_pipeline_step(kind, base, rank, 2,
                                                                 args.chunks, x, y))):
            for _ in range(args.warmup):
                step()
            timers = Timers()
            timers.wrap(our_stage.StageRunner, "forward", "compute")
            timers.wrap(our_stage.StageRunner, "backward", "compute")
            timers.wrap(our_executor._Run, "_loss", "compute")
            timers.wrap(our_p2p.Pending, "wait", "wait")
            timers.wrap(our_p2p.PipeLinks, "finish", "wait")
            timers.wrap(our_executor.DistributedPipeline, "_reduce_loss", "wait")
            timers.wrap(their_stage._PipelineStageBase, "forward_one_chunk", "compute")
            timers.wrap(their_stage._PipelineStageBase, "backward_one_chunk", "compute")
            timers.wrap(their_schedules, "_wait_batch_p2p", "wait")
            timers.wrap(dist, "broadcast", "wait")
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            elapsed = time.perf_counter() - start
            timers.restore()
            out[name] = {"step_ms": elapsed / args.steps * 1e3,
                         **{k: v / args.steps * 1e3 for k, v in timers.total.items()}}
    return out


def part_b(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    base = make_model(args.width, args.blocks)
    x, y = data(args.batch * 2, args.width)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    dpm = partition_distributed(copy.deepcopy(base), example_inputs=(x[rows],), dp=2, pp=1,
                                chunks=1, schedule="gpipe")
    ddp = DistributedDataParallel(copy.deepcopy(base))
    optimizer = sgd(ddp.parameters())

    def ddp_step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        value = loss.detach().reshape(1)
        dist.all_reduce(value)  # the batch's loss on every rank, as ours returns it
        return float(value) / 2

    times, first = interleave({"ours/dp": ours_step(dpm, x[rows], y[rows]),
                               "torch/DDP": ddp_step}, args.warmup, args.steps)
    return {"times": times, "first": first}


class SavedBytes:
    """Bytes of distinct storages autograd holds for backward right now, and the peak
    (parameters, which backward also saves, are left out: they are there either way)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0
        self.ignore = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.ignore:
            return _Holder(t)
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        if key not in self.live:
            return
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]

    @staticmethod
    def unpack(holder: Any) -> torch.Tensor:
        return holder.tensor


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def part_c(rank: int, args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    base = make_model(args.width, args.blocks)
    x, y = data(args.mem_batch, args.width)
    dpm = partition_distributed(base, example_inputs=(x,), pp=4, chunks=16, schedule=schedule,
                                checkpoint="never", balance=[len(base) // 4] * 4)
    optimizer = sgd(dpm.parameters())
    for p in dpm.parameters():  # allocate gradients before the baseline
        p.grad = torch.zeros_like(p)
    tracker = SavedBytes(list(dpm.parameters()))
    dpm.step(x, y, F.mse_loss)          # warm-up: buffers, caches, the allocator's pools
    dist.barrier()
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # restart the kernel's peak (VmHWM)
    peaks = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            dpm.step(x, y, F.mse_loss)
        peaks.append(dpm.pipeline.peak_in_flight)
        optimizer.step()
    return {"stage": dpm.stage_index, "in_flight": max(peaks), "saved_mb": tracker.peak / 2**20,
            "rss_growth_mb": (_rss("VmHWM") - before) / 2**20}


def _rss(field: str) -> int:
    """Bytes of a field of /proc/self/status (VmRSS: now; VmHWM: peak since reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def summary(times: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return med * 1e3, q1 * 1e3, q3 * 1e3


def print_times(result: dict[str, Any], pairs: list[tuple[str, str, float]]) -> None:
    times, first = result["times"], result["first"]
    for name, reason in result.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    pairs = [(ours, theirs, goal) for ours, theirs, goal in pairs
             if ours in times and theirs in times]
    if not times:
        return
    losses = list(first.values())
    if max(losses) - min(losses) > 1e-4 * max(1.0, abs(losses[0])):
        raise SystemExit(f"first-step losses disagree: {first}")
    print(f"first-step losses agree ({losses[0]:.6f})")
    print(f"{'contender':<20} {'median ms':>9} {'IQR ms':>15}")
    for name, values in times.items():
        med, q1, q3 = summary(values)
        print(f"{name:<20} {med:>9.1f} {q1:>7.1f}-{q3:<7.1f}")
    if not pairs:
        print("\nno pair of ours and theirs ran: nothing to compare")
        return
    print(f"\n{'ours':<20} {'theirs':<12} {'ratio':>6} {'goal':>6}")
    for ours, theirs, goal in pairs:
        ratio = summary(times[ours])[0] / summary(times[theirs])[0]
        verdict = "met" if ratio <= goal else "NOT met"
        print(f"{ours:<20} {theirs:<12} {ratio:>6.2f} <= {goal:<4} {verdict}")


def cpu_busy() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, wall seconds), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), time.time()


def report_load(start: tuple[float, float] | None, ours: float) -> None:
    """How busy the machine was besides this benchmark (it shares 2 cores with others)."""
    end = cpu_busy()
    if start is None or end is None:
        return
    busy, wall = end[0] - start[0], end[1] - start[1]
    print(f"machine: {busy / wall:.2f} of {os.cpu_count()} cores busy on average during the "
          f"run, this benchmark's ranks at most {ours:.0f}; load average now "
          f"{os.getloadavg()[0]:.2f}")


def main() -> None:
    args = parse_args()
    start = cpu_busy()
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs ({platform.machine()}), gloo on 127.0.0.1, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, 1 intra-op thread per rank")
    print(f"model: {args.blocks} x (Linear({args.width}, {args.width}), ReLU); "
          f"{args.warmup} warm-up + {args.steps} timed steps per contender, interleaved")
    if "a" in args.parts:
        for world in args.ranks:
            print(f"\n(a) pipeline, {world} ranks, batch {args.batch}, {args.chunks} "
                  f"micro-batches, equal stages, checkpoint never; theirs: "
                  + ", ".join(f"{kind} = {their_label(kind, args.their_zero_bubble)}"
                              for kind in args.schedules))
            result = spawn(part_a, world, args, world)[0]
            print_times(result, [(f"ours/{kind}{variant}", f"torch/{kind}", 0.9)
                                 for variant in ("", "/unfused") for kind in args.schedules])
    if "p" in args.parts:
        print(f"\n(a, profiled) per rank and step, ms: {args.steps} steps after "
              f"{args.warmup} warm-up, contenders one after another")
        print(f"{'contender':<20} {'rank':>4} {'step':>7} {'compute':>8} {'wait':>7} "
              f"{'other':>7}")
        for rank, result in enumerate(spawn(profile_a, 2, args)):
            for name, t in result.items():
                other = t["step_ms"] - t.get("compute", 0) - t.get("wait", 0)
                print(f"{name:<20} {rank:>4} {t['step_ms']:>7.1f} {t.get('compute', 0):>8.1f} "
                      f"{t.get('wait', 0):>7.1f} {other:>7.1f}")
    if "b" in args.parts:
        print(f"\n(b) data parallel, 2 ranks, batch {args.batch} per rank")
        result = spawn(part_b, 2, args)[0]
        print_times(result, [("ours/dp", "torch/DDP", 1.0)])
    if "c" in args.parts:
        print(f"\n(c) memory, 4 ranks = 4 stages, batch {args.mem_batch} in 16 micro-batches")
        print(f"{'schedule':<8} {'stage':>5} {'held':>5} {'saved MB':>9} {'RSS growth MB':>14}")
        # Allocations above 64 KB get their own mappings, returned to the system when freed,
        # so resident memory follows live memory instead of glibc's cached arenas.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        for schedule in ("gpipe", "1f1b"):
            for r in spawn(part_c, 4, args, schedule):
                print(f"{schedule:<8} {r['stage']:>5} {r['in_flight']:>5} {r['saved_mb']:>9.1f} "
                      f"{r['rss_growth_mb']:>14.1f}")
    report_load(start, 2.0)


if __name__ == "__main__":
    main()
