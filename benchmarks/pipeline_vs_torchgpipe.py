"""Training step time: our pipeline against torchgpipe 0.0.7, on two CPU stages.

The model is ``nn.Sequential`` of 16 x (Linear(1024, 1024), ReLU): 32 modules, split
[16, 16] by both tools, batch 64 in 8 micro-batches. One step is an SGD step: ``zero_grad``,
forward, MSE loss against a fixed random target, backward, ``step``. For each checkpoint mode
both tools run under the same thread settings, their steps interleaved (every round times each
contender once, in a rotating order), so drift in the machine hits them alike. The
unpartitioned model, with and without 8-way gradient accumulation, is the anchor.

Two of our contenders per mode: ``ours`` runs ``pm(x)``, the loss and ``loss.backward()``
(all forwards, then all backwards: GPipe's order, as torchgpipe runs it); ``ours-1f1b`` runs
``pm.step(x, y, F.mse_loss)`` on a module partitioned with ``schedule="1f1b"``: the loss is
computed per micro-batch on the last stage and each micro-batch's backward starts as soon as
its forward is done, so a stage holds at most ``P - j`` micro-batches' activations.

By default every contender lives in its own process and only the one being timed computes;
the others block on a pipe. In one process the contenders disturb each other: each thread that
has run a parallel op keeps an OpenMP team, and once a process has more OpenMP threads than
cores every team's barriers sleep and wake instead of spinning, which slows *all* of them
(``--same-process`` shows it).

Every contender's process handles freed host memory alike: with glibc's defaults, or with
``--allocator kept`` all keep it for reuse instead of page-faulting it back in each step
(``partitioner.runtime.host_memory``), so the ratio measures the pipelines, not the allocator.

Run:
    python benchmarks/pipeline_vs_torchgpipe.py                 # defaults: 5 warm-up, 20 timed
    python benchmarks/pipeline_vs_torchgpipe.py --steps 40 --threads 1 --modes never
    python benchmarks/pipeline_vs_torchgpipe.py --tools ours-1f1b,torchgpipe --modes never

Every contender starts from the same seeded model and batch, so their first losses must
agree; the script checks that before timing.
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing as mp
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MODES = ("always", "except_last", "never")
TOOLS = ("ours", "ours-1f1b", "torchgpipe")
GOALS = {"ours": 0.9, "ours-1f1b": 0.8}  # ours / torchgpipe, median step time
PLAIN, ACCUMULATED = "unpartitioned", "unpartitioned, accumulation"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per contender")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated checkpoint modes (always,except_last,never)")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help="comma-separated pipelines to time, each per mode: ours "
                             "(pm(x) + backward, GPipe order), ours-1f1b (pm.step in 1F1B), "
                             "torchgpipe")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for every thread of every process "
                             "(default: torch's default, one per core)")
    parser.add_argument("--same-process", action="store_true",
                        help="run all contenders in this process instead of one each")
    parser.add_argument("--allocator", choices=("glibc", "kept"), default="glibc",
                        help="glibc: every contender with glibc's defaults; kept: every "
                             "contender keeps freed host memory for reuse "
                             "(partitioner.runtime.host_memory.keep_freed_memory)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16, help="(Linear, ReLU) pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown checkpoint modes {unknown}; pass a subset of {MODES}")
    args.tools = [t for t in args.tools.split(",") if t]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown or "torchgpipe" not in args.tools:
        parser.error(f"--tools {','.join(args.tools)}: pass a subset of {TOOLS} that "
                     "includes torchgpipe (the ratios' anchor)")
    return args


# torch.set_num_threads changes the calling thread and the default of threads initialised
# after it, not threads already running. Setting OMP_NUM_THREADS before torch is imported
# gives every thread (ours, torchgpipe's, autograd's) the same intra-op pool whenever it was
# started, and the contender processes inherit it.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads is not None:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import partitioner  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.runtime.host_memory import keep_freed_memory  # noqa: E402
from partitioner.runtime.local import thread_plan  # noqa: E402
from partitioner.runtime.schedule_generators import gpipe as gpipe_schedule  # noqa: E402
from partitioner.runtime.worker import thread_default  # noqa: E402


def import_torchgpipe() -> type:
    """torchgpipe's ``GPipe``.

    Shims for torch 2.13: none is needed. torchgpipe 0.0.7 imports and trains on torch 2.13
    CPU as released: it reaches ``torch.cuda`` only through streams, which it replaces by a
    placeholder on CPU devices, and its checkpointing is its own ``autograd.Function``
    (checked: all three modes run and agree with the unpartitioned loss). Should a later
    torch break it, the shim goes here, with a comment saying what it patches and why.
    """
    from torchgpipe import GPipe
    return GPipe


def make_model(args: argparse.Namespace) -> nn.Sequential:
    """16 x (Linear, ReLU) as 32 separate modules, so balance counts modules for both tools."""
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = []
    for _ in range(args.blocks):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.width, generator=generator)  # (B, width)
    return x, torch.randn(args.batch, args.width, generator=generator)


def sgd_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Callable[[], float]:
    """One step on ``model``: zero_grad, forward, MSE loss, backward, SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def accumulated_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                     chunks: int) -> Callable[[], float]:
    """The same step by gradient accumulation over ``chunks`` micro-batches (no pipeline)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, ts = x.tensor_split(chunks), target.tensor_split(chunks)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for xi, ti in zip(xs, ts):
            # Weighting by the chunk's share makes the sum equal the whole-batch mean loss.
            loss = F.mse_loss(model(xi), ti) * (xi.shape[0] / x.shape[0])
            loss.backward()
            total += loss.item()
        optimizer.step()
        return total
    return step


def one_f_one_b_step(pm: nn.Module, x: torch.Tensor, target: torch.Tensor
                     ) -> Callable[[], float]:
    """One step through ``pm.step`` (loss per micro-batch on the last stage, 1F1B order)."""
    optimizer = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = pm.step(x, target, F.mse_loss)  # type: ignore[operator]
        optimizer.step()
        return float(loss)
    return step


def partition_1f1b(model: nn.Module, x: torch.Tensor, args: argparse.Namespace,
                   balance: list[int], mode: str) -> nn.Module:
    """Our pipeline in the 1F1B schedule: through ``partition(schedule=)`` where the installed
    project has it, else by setting the module's schedule before its pipeline is built (it is
    built lazily, on first use, with ``schedule=pm.schedule``)."""
    common: dict[str, Any] = dict(devices=["cpu", "cpu"], example_inputs=(x,),
                                  chunks=args.chunks, checkpoint=mode, balance=balance)
    if "schedule" in inspect.signature(partition).parameters:
        return partition(model, strategy="pipeline", schedule="1f1b", **common)
    pm = partition(model, strategy="pipeline", **common)
    pm.schedule = "1f1b"
    return pm


def contender_names(args: argparse.Namespace) -> list[str]:
    return [PLAIN, ACCUMULATED] + [f"{tool}/{mode}" for mode in args.modes
                                   for tool in args.tools]


def build_step(name: str, args: argparse.Namespace) -> tuple[Callable[[], float], list[int]]:
    """The named contender's step and the intra-op threads of the threads it computes on."""
    model, (x, target) = make_model(args), make_batch(args)
    balance = [len(model) // 2, len(model) - len(model) // 2]
    if name == PLAIN:
        return sgd_step(model, x, target), [torch.get_num_threads()]
    if name == ACCUMULATED:
        return accumulated_step(model, x, target, args.chunks), [torch.get_num_threads()]
    tool, mode = name.split("/")
    if tool == "ours-1f1b":
        pm = partition_1f1b(model, x, args, balance, mode)
        return one_f_one_b_step(pm, x, target), worker_threads(pm)
    if tool == "ours":
        pm = partition(model, devices=["cpu", "cpu"], example_inputs=(x,), chunks=args.chunks,
                       checkpoint=mode, balance=balance)
        return sgd_step(pm, x, target), worker_threads(pm)
    gpipe = import_torchgpipe()(model, balance=balance, devices=["cpu", "cpu"],
                                chunks=args.chunks, checkpoint=mode)
    # torchgpipe starts its worker threads per call: they get the default of new threads.
    return sgd_step(gpipe, x, target), [thread_default()]


def worker_threads(pm: nn.Module) -> list[int]:
    """The intra-op thread counts our stages' actions run with (``partitioner.runtime.local``: the
    caller's threads shared by the stages busy at the action's time in the schedule)."""
    pipe = pm.pipeline(True)  # type: ignore[operator]
    schedule = (gpipe_schedule(len(pipe.workers), pipe.chunks) if pm.schedule == "gpipe"
                else pipe.step_schedule(pipe.chunks))
    plan = thread_plan(schedule, [d.type == "cpu" for d in pipe.devices],
                       torch.get_num_threads())
    return sorted(set(plan.values()), reverse=True)


@dataclass
class Contender:
    """A named training step, timed where it runs; ``run()`` gives (seconds, loss)."""

    name: str
    run: Callable[[], tuple[float, float]]
    threads: list[int]
    warnings: list[str]
    close: Callable[[], None] = lambda: None
    pid: int | None = None
    times: list[float] = field(default_factory=list)


def timed(step: Callable[[], float]) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        start = time.perf_counter()
        loss = step()
        return time.perf_counter() - start, loss
    return run


def local_contender(name: str, args: argparse.Namespace) -> Contender:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, threads = build_step(name, args)
        run = timed(step)
        first = run()  # warnings of the first step too; its loss is checked by the caller
    c = Contender(name, run, threads, sorted({str(w.message) for w in caught}))
    c.run = _replay_first(first, run)
    return c


def _replay_first(first: tuple[float, float],
                  run: Callable[[], tuple[float, float]]) -> Callable[[], tuple[float, float]]:
    """``run`` whose first call returns the already-run first step (it counts as warm-up)."""
    pending = [first]
    return lambda: pending.pop() if pending else run()


def same_allocator(args: argparse.Namespace) -> None:
    """Every contender's process handles freed host memory alike (``--allocator``)."""
    if args.allocator == "kept":
        keep_freed_memory()


def serve(conn: Connection, name: str, args: argparse.Namespace) -> None:
    """A contender process: build, run the first step, then one step per request."""
    same_allocator(args)
    c = local_contender(name, args)
    conn.send((c.threads, c.warnings))
    while conn.recv() == "step":
        conn.send(c.run())


def remote_contender(name: str, args: argparse.Namespace) -> Contender:
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=serve, args=(child, name, args),
                                              daemon=True)
    process.start()

    def run() -> tuple[float, float]:
        parent.send("step")
        return parent.recv()  # type: ignore[no-any-return]

    def close() -> None:
        parent.send("stop")
        process.join(timeout=30)

    c = Contender(name, run, [], [], close, process.pid)
    c.threads, c.warnings = parent.recv()  # waits until the child has built its contender
    return c


def check_first_losses(runners: list[Contender]) -> float:
    """Run each contender's first step; they start from one model, so losses must agree."""
    losses = {c.name: c.run()[1] for c in runners}
    first = losses[PLAIN]
    if max(abs(v - first) for v in losses.values()) > 1e-4 * max(1.0, abs(first)):
        raise SystemExit(f"first-step losses disagree: {losses}")
    return first


def measure(runners: list[Contender], warmup: int, steps: int) -> None:
    """Interleave: each round times every contender once, starting one further along."""
    for r in range(warmup + steps):
        shift = r % len(runners)
        for c in runners[shift:] + runners[:shift]:
            elapsed, _ = c.run()
            if r >= warmup:
                c.times.append(elapsed)


class MachineLoad:
    """CPU time other processes took meanwhile, as a share of all cores.

    With 2 intra-op threads on 2 cores, a core busy elsewhere stalls every OpenMP barrier,
    so a loaded machine slows the most-threaded contenders most. Reported so a reader can
    judge a run. ``pids`` are our contender processes: their time is not "other".
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        tick = os.sysconf("SC_CLK_TCK")
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            children = 0
            for pid in self.pids:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rpartition(")")[2].split()
                children += int(stat[11]) + int(stat[12])  # utime, stime
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        own = os.times()
        return busy / tick, own.user + own.system + children / tick, time.perf_counter()

    def foreign_share(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, end))
        return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


def summary(times: list[float]) -> tuple[float, float, float]:
    """Median, first and third quartile, in milliseconds."""
    q1, med, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return med * 1e3, q1 * 1e3, q3 * 1e3


def print_header(args: argparse.Namespace) -> None:
    import torchgpipe
    print(f"torch {torch.__version__}, torchgpipe {torchgpipe.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs ({platform.machine()})")
    print(f"partitioner from {Path(partitioner.__file__).parent.parent}")
    print(f"intra-op threads {torch.get_num_threads()} (new threads {thread_default()}), "
          f"inter-op threads {torch.get_num_interop_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; contenders "
          f"{'share this process' if args.same_process else 'run in one process each'}; "
          f"freed host memory: {args.allocator}")
    print(f"model: {args.blocks} x (Linear({args.width}, {args.width}), ReLU), batch "
          f"{args.batch}, chunks {args.chunks}, balance [{args.blocks}, {args.blocks}], "
          f"{args.warmup} warm-up + {args.steps} timed steps, interleaved")


def print_setup(runners: list[Contender], loss: float) -> None:
    print(f"first-step losses agree across all {len(runners)} contenders ({loss:.6f})")
    ours = next((c.threads for c in runners if c.name.startswith("ours")), None)
    theirs = next((c.threads for c in runners if c.name.startswith("torchgpipe/")), None)
    print(f"ours: a worker thread per stage, intra-op threads per action {ours} (all of them "
          f"when a stage runs alone, shared when stages run together; per the schedule "
          f"timed); torchgpipe: a "
          f"worker thread per distinct device (both 'cpu' stages share one, {theirs} threads), "
          "backward on autograd's thread")
    for w in sorted({w for c in runners for w in c.warnings}):
        print(f"warning seen (once per kind): {w}")


def print_results(args: argparse.Namespace, runners: list[Contender]) -> None:
    by_name = {c.name: c for c in runners}
    plain = summary(by_name[PLAIN].times)[0]
    print(f"\n{'contender':<32} {'median ms':>9} {'IQR ms':>15} {'/ unpart.':>9}")
    for c in runners:
        med, q1, q3 = summary(c.times)
        label = f"{ACCUMULATED} x{args.chunks}" if c.name == ACCUMULATED else c.name
        print(f"{label:<32} {med:>9.1f} {q1:>7.1f}-{q3:<7.1f} {med / plain:>9.2f}")
    print(f"\n{'ours':<10} {'mode':<12} {'ours ms':>8} {'torchgpipe ms':>13} "
          f"{'ours/torchgpipe':>15} {'goal':>6} {'':>7} {'ours/unpart.':>12}")
    for tool in (t for t in args.tools if t != "torchgpipe"):
        for mode in args.modes:
            ours = summary(by_name[f"{tool}/{mode}"].times)[0]
            theirs = summary(by_name[f"torchgpipe/{mode}"].times)[0]
            ratio, goal = ours / theirs, GOALS[tool]
            print(f"{tool:<10} {mode:<12} {ours:>8.1f} {theirs:>13.1f} {ratio:>15.2f} "
                  f"{'<= ' + str(goal):>6} {'met' if ratio <= goal else 'NOT met':>7} "
                  f"{ours / plain:>12.2f}")


def main() -> None:
    args = ARGS or parse_args()
    print_header(args)
    if args.same_process:
        same_allocator(args)
    make = local_contender if args.same_process else remote_contender
    runners = [make(name, args) for name in contender_names(args)]
    try:
        print_setup(runners, check_first_losses(runners))
        load = MachineLoad([c.pid for c in runners if c.pid is not None])
        measure(runners, args.warmup, args.steps)
        share = load.foreign_share()
    finally:
        for c in runners:
            c.close()
    print_results(args, runners)
    if share is not None:
        print(f"\nother processes used {share:.0%} of the machine's CPU time during the timed "
              f"rounds (load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
