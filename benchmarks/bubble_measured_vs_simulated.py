"""Pipeline bubble: measured in the one-process runtime against the schedules' simulations.

For each registered schedule (``gpipe``, ``1f1b``, ``interleaved`` and ``v_shape`` with ``v``
virtual stages per device, ``zero_bubble``) and each pipeline depth ``P`` (default 2 and 4),
equal stages of (Linear(width, width), ReLU) blocks on ``P`` ``"cpu"`` devices of this process run
:meth:`LocalPipeline.step` (MSE loss per micro-batch on the last stage). After the warm-up
steps, each timed step's ``pipe.timeline`` (every action's start and end) gives

* the measured bubble ``1 - busy / (P * makespan)``: ``busy`` the summed action durations,
  ``makespan`` the last end minus the first start;
* the CPU bubble ``1 - CPU time / (P * makespan)``: the process's CPU time over the step
  instead of the actions' wall time, so an action waiting for a core does not count as
  busy (with more stages than cores it cannot go below ``1 - cores / P``);
* the mean duration of each phase (F, B, and for zero-bubble I and W).

Two simulations of the same step:

* ticks: ``partitioner.runtime.schedule.bubble_fraction`` of the schedule, a forward one
  tick and a backward ``round(B / F)`` ticks (zero-bubble: ``(I + W) / F`` rounded to an
  even number, each half of it), from the durations measured in this run;
* planner: ``partitioner.planning.simulate.simulate`` of the plan ``make_plan`` makes for
  this model, split and schedule (the cost model's times for this CPU, with the devices
  sharing the host's cores). Where ``make_plan`` takes no ``schedule=`` yet, only for the
  schedule it plans by itself.

The medians over the timed steps are printed, and the difference measured - ticks in
points (goal: within 10). Nothing is asserted.

Run:
    python benchmarks/bubble_measured_vs_simulated.py                 # P = 2 and 4
    python benchmarks/bubble_measured_vs_simulated.py --stages 2 --schedules 1f1b,zero_bubble
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from partitioner import make_plan
from partitioner.errors import PartitionError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads
from partitioner.planning.simulate import simulate
from partitioner.runtime.local import LocalPipeline
from partitioner.runtime.schedule import Phase, bubble_fraction
from partitioner.runtime.schedule_registry import (
    Runtime,
    make_schedule,
    schedule_kind,
    schedule_names,
)

SCHEDULES = schedule_names([Runtime.ONE_PROCESS])
GOAL_POINTS = 10.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="2,4", help="comma-separated pipeline depths P")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated registered schedules, of {SCHEDULES}")
    parser.add_argument("--virtual", type=int, default=2,
                        help="virtual stages per device of the interleaved schedule")
    parser.add_argument("--blocks", type=int, default=16, help="(Linear, ReLU) pairs")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of the caller and of every stage worker")
    parser.add_argument("--no-planner", action="store_true",
                        help="skip the planner's simulation (make_plan + simulate)")
    args = parser.parse_args()
    args.stages = [int(p) for p in args.stages.split(",") if p]
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"unknown schedules {unknown}; pass a subset of {SCHEDULES}")
    return args


class Chunk(nn.Module):
    """A run of blocks returning a tuple, as a stage graph hands on its outputs."""

    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.blocks(x),)


def make_model(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.blocks):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers)


def virtual_of(name: str, args: argparse.Namespace) -> int:
    return args.virtual if schedule_kind(name).virtual else 1


def stage_graphs(model: nn.Sequential, n: int) -> list[fx.GraphModule]:
    """``model`` cut into ``n`` equal runs of blocks, each traced to a graph whose Linear
    layers add their weight gradients in place, as ``partition`` builds them (that is what
    lets a zero-bubble ``W`` action compute them apart from the input gradients)."""
    size = len(model) // n
    graphs = [fx.symbolic_trace(Chunk(model[k * size:(k + 1) * size])) for k in range(n)]
    for graph in graphs:
        fuse_weight_grads(graph)
    return graphs


@dataclass
class Measured:
    """What the timed steps of one case gave."""

    bubble: float
    cpu_bubble: float
    phase_ms: dict[str, float]
    makespan_ms: float
    latency_ms: float = 0.0


def _dependency(action: Any, seen: dict[tuple[int, str, int], tuple[float, float]],
                n_total: int) -> tuple[float, float] | None:
    """The (start, end) of what ``action`` waited for from another stage, if anything."""
    k, i = action.stage, action.microbatch
    if action.phase is Phase.FORWARD:
        return seen.get((k - 1, "F", i)) if k > 0 else None
    if action.phase is Phase.WEIGHT or k + 1 >= n_total:
        return None
    return seen.get((k + 1, "B", i)) or seen.get((k + 1, "I", i))


def handoff_latency(timeline: list[tuple[Any, float, float]], n_total: int) -> float:
    """Median seconds from a stage's output being ready to its receiver starting, over the
    actions that waited for it (their device was idle): the threads' hand-off."""
    seen = {(a.stage, a.phase.value, a.microbatch): (s, e) for a, s, e in timeline}
    last_end: dict[int, float] = {}
    gaps = []
    for action, start, end in sorted(timeline, key=lambda t: t[1]):
        dep = _dependency(action, seen, n_total)
        idle = start - last_end.get(action.stage, start)
        if dep is not None and start >= dep[1] and idle > 0:
            gaps.append(start - dep[1])
        last_end[action.stage] = end
    return statistics.median(gaps) if gaps else 0.0


def replay_bubble(schedule: Any, phase_ms: dict[str, float], latency_ms: float) -> float:
    """The schedule's bubble replayed with the measured mean duration of each phase and
    the measured hand-off latency between stages (the simulator, calibrated)."""
    p = len(schedule)
    n_total = 1 + max(a.stage for actions in schedule for a in actions)
    ends: dict[tuple[int, str, int], float] = {}
    free, pos, busy = [0.0] * p, [0] * p, 0.0
    progressed = True
    while progressed:
        progressed = False
        for j, actions in enumerate(schedule):
            while pos[j] < len(actions):
                a = actions[pos[j]]
                k, i = a.stage, a.microbatch
                if a.phase is Phase.FORWARD:
                    deps = [(k - 1, "F", i)] if k > 0 else []
                elif a.phase is Phase.WEIGHT:
                    deps = [(k, "I", i)]
                else:
                    deps = [(k, "F", i)] + ([(k + 1, "G", i)] if k + 1 < n_total else [])
                if not all(d in ends for d in deps):
                    break
                ready = [ends[d] + (latency_ms if d[0] != k else 0.0) for d in deps]
                start = max([free[j], *ready])
                length = phase_ms[a.phase.value]
                free[j] = start + length
                busy += length
                ends[(k, a.phase.value, i)] = free[j]
                if a.phase.value in "BI":
                    ends[(k, "G", i)] = free[j]
                pos[j] += 1
                progressed = True
    return 1 - busy / (p * max(free))


def measure(pipe: LocalPipeline, p: int, args: argparse.Namespace) -> Measured:
    """Warm up, then time ``args.steps`` steps; medians of the per-step figures."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator)  # (B, width)
    y = torch.randn(args.batch, args.width, generator=generator)
    params = [q for r in pipe.runners for q in r.graph_module.parameters()]
    bubbles, cpu_bubbles, spans, latencies = [], [], [], []
    durations: dict[str, list[float]] = {}
    n_total = len(pipe.runners)
    for step in range(args.warmup + args.steps):
        for q in params:
            q.grad = None
        cpu = time.process_time()
        pipe.step([x], y, F.mse_loss, restructure=lambda out: out[0])
        cpu = time.process_time() - cpu
        if step < args.warmup:
            continue
        start = min(s for _, s, _ in pipe.timeline)
        span = max(e for _, _, e in pipe.timeline) - start
        busy = sum(e - s for _, s, e in pipe.timeline)
        bubbles.append(1 - busy / (p * span))
        cpu_bubbles.append(1 - cpu / (p * span))
        spans.append(span)
        latencies.append(handoff_latency(pipe.timeline, n_total))
        for action, s, e in pipe.timeline:
            durations.setdefault(action.phase.value, []).append(e - s)
    return Measured(statistics.median(bubbles), statistics.median(cpu_bubbles),
                    {k: statistics.mean(v) * 1e3 for k, v in durations.items()},
                    statistics.median(spans) * 1e3, statistics.median(latencies) * 1e3)


def tick_bubble(name: str, p: int, v: int, chunks: int, phase_ms: dict[str, float]
                ) -> tuple[float, int]:
    """The schedule's bubble in clock ticks whose backward/forward ratio is the measured one
    rounded (to an even number where the backward is split); and that ratio."""
    schedule = make_schedule(name, p, chunks, v)
    split = any(a.phase is Phase.INPUT for actions in schedule for a in actions)
    forward = phase_ms["F"]
    if split:
        ratio = max(2, 2 * round((phase_ms["I"] + phase_ms["W"]) / forward / 2))
    else:
        ratio = max(1, round(phase_ms["B"] / forward))
    return bubble_fraction(schedule, 1.0, float(ratio)), ratio


def planner_bubble(model: nn.Module, name: str, p: int, v: int, args: argparse.Namespace
                   ) -> str:
    """The planner's simulated bubble for this case, or why there is none.

    Where ``make_plan`` takes no ``schedule=`` yet, its plan's own schedule is simulated
    when it is ``name`` (GPipe for ``"pipeline"`` plans), else there is no figure.
    """
    if args.no_planner:
        return "skipped"
    parameters = inspect.signature(make_plan).parameters
    extra: dict[str, Any] = {"schedule": name} if "schedule" in parameters else {}
    if v > 1:
        if "virtual_stages" not in parameters:
            return "n/a (make_plan has no virtual_stages= yet)"
        extra["virtual_stages"] = v
    x = torch.randn(args.batch, args.width)
    try:
        # Planned with this machine's CPU spec, the devices sharing its cores.
        fixed = {"balance": [len(model) // p] * p} if v == 1 else {}
        plan = make_plan(model, ["cpu"] * p, "pipeline", example_inputs=(x,),
                         chunks=args.chunks, checkpoint="never", **fixed, **extra)
        if plan.schedule != name:
            return f"n/a (make_plan has no schedule= yet; it planned {plan.schedule})"
        return f"{simulate(plan).bubble:.3f}"
    except (PartitionError, TypeError) as error:
        return f"n/a ({type(error).__name__}: {str(error)[:80]})"


def run_case(name: str, p: int, args: argparse.Namespace) -> dict[str, Any] | str:
    """One schedule at one depth: the measured and simulated figures, or why it was
    skipped."""
    v = virtual_of(name, args)
    if args.blocks % (p * v):
        return (f"{args.blocks} blocks do not split into {p * v} equal stages; pass --blocks "
                f"a multiple of {p * v}")
    model = make_model(args)
    try:
        pipe = LocalPipeline(stage_graphs(model, p * v), [torch.device("cpu")] * p,
                             chunks=args.chunks, checkpoint="never", threads=args.threads,
                             schedule=name, virtual=v)
    except PartitionError as error:
        return f"refused: {error}"
    try:
        measured = measure(pipe, p, args)
    finally:
        pipe.close()
    ticks, ratio = tick_bubble(name, p, v, args.chunks, measured.phase_ms)
    replayed = replay_bubble(make_schedule(name, p, args.chunks, v), measured.phase_ms,
                             measured.latency_ms)
    return {"measured": measured, "ticks": ticks, "ratio": ratio, "replay": replayed,
            "planner": planner_bubble(model, name, p, v, args)}


def print_row(name: str, p: int, v: int, case: dict[str, Any]) -> None:
    m: Measured = case["measured"]
    diff = (m.bubble - case["replay"]) * 100
    phases = " ".join(f"{k}={m.phase_ms[k]:.2f}" for k in "FBIW" if k in m.phase_ms)
    label = f"{name}" + (f" v={v}" if v > 1 else "")
    planner = case["planner"]
    if planner[:1].isdigit():  # a figure: with its own difference, measured - planner
        planner += f" ({(m.bubble - float(planner)) * 100:+.1f})"
    print(f"{label:<16} {p:>2} {m.makespan_ms:>9.1f} {m.bubble:>8.3f} {m.cpu_bubble:>8.3f} "
          f"{case['ticks']:>7.3f} {case['ratio']:>5} {case['replay']:>7.3f} "
          f"{m.latency_ms:>6.2f} {diff:>+7.1f} "
          f"{'met' if abs(diff) <= GOAL_POINTS else 'NOT met':>7}  {planner:<15} "
          f"{phases}")


def main() -> None:
    args = parse_args()
    # The caller's threads and each worker's are the same fixed number, so every action
    # computes with the same pool whatever else runs (the default would share the caller's
    # threads among the busy stages, which changes action lengths within a step).
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs ({platform.machine()}), {args.threads} intra-op thread(s) "
          f"per stage worker and caller")
    print(f"model: {args.blocks} x (Linear({args.width}, {args.width}), ReLU) in equal stages, "
          f"batch {args.batch}, {args.chunks} micro-batches, checkpoint never; "
          f"{args.warmup} warm-up + {args.steps} timed steps per case (medians)")
    print(f"\n{'schedule':<16} {'P':>2} {'step ms':>9} {'measured':>8} {'CPU':>8} "
          f"{'ticks':>7} {'B/F':>5} {'replay':>7} {'lat ms':>6} {'points':>7} {'goal':>7}  "
          f"{'planner (pts)':<15} phase ms")
    for p in args.stages:
        for name in args.schedules:
            case = run_case(name, p, args)
            if isinstance(case, str):
                print(f"{name:<16} {p:>2} skipped: {case}")
            else:
                print_row(name, p, virtual_of(name, args), case)
    print(f"\npoints: measured - replay, in percentage points (goal within {GOAL_POINTS:g}); "
          "replay: the schedule's action lists replayed with the measured mean phase "
          "durations and hand-off latency (lat ms); ticks: unit ticks, no latency; planner "
          "(pts): its bubble and measured - planner; CPU: the bubble counting CPU time "
          "instead of action wall time")


if __name__ == "__main__":
    main()
