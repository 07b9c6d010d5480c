"""``partitioner calibrate``: this machine's calibration cache, shown, re-measured or cleared.

Planning for ``"cpu"`` devices uses the median of the quiet calibration runs kept in a cache
file (:mod:`partitioner.cost.calibration_cache`). This command says where that file is, how
many runs it keeps and how quiet the machine was while they ran, and the spec they give;
``--measure`` takes a run now (kept if quiet), ``--clear`` deletes the file.

Example:
    >>> from partitioner.cost.devices import REFERENCE_CPU
    >>> print(spec_lines(REFERENCE_CPU)[0])
      matmul rate (fp32)         200.0 GFLOP/s
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from partitioner.errors import CommandError

if TYPE_CHECKING:
    from partitioner.cost.calibration_cache import Cached
    from partitioner.cost.devices import DeviceSpec

__all__ = ["calibrate_command", "spec_lines", "runs_line"]


def calibrate_command(args: argparse.Namespace) -> int:
    """``partitioner calibrate``: clear (``--clear``), measure (``--measure``), then show."""
    from partitioner.cost import measure
    from partitioner.cost.calibration_cache import read_runs

    path = measure.cache_file()
    if path is None:
        raise CommandError("the calibration cache is disabled (PARTITIONER_CALIBRATION_CACHE=0);"
                           " unset it to keep and show this machine's calibration runs")
    if args.clear:
        if path.exists():
            path.unlink()
            print(f"removed {path}")
        else:
            print(f"no calibration cache to remove at {path}")
    started = time.time()
    measured = measure.remeasure_cpu(progress=True) if args.measure else None
    cached = read_runs(path, measure.TIMING_KEYS)
    if measured is not None and not any(run.at >= started for run in cached.runs):
        print("measured now, not kept (other processes kept the cores busy):")
        print("\n".join(spec_lines(measured)))
    _show(cached, measure.median_spec(cached.runs[-measure.KEPT_RUNS:]) if cached.runs
          else None)
    return 0


def _show(cached: Cached, spec: DeviceSpec | None) -> None:
    from partitioner.runtime.host_memory import HOST_MEMORY_ENV, cpu_host_memory_mode

    print(f"calibration cache: {cached.path}")
    print(f"  host memory: {cpu_host_memory_mode()} (glibc's allocator thresholds while "
          f"measuring and running; {HOST_MEMORY_ENV}=system leaves glibc's own)")
    if cached.problem is not None:
        print(f"  the file {cached.problem}; the next plan for \"cpu\" devices (or "
              "partitioner calibrate --measure) measures again and rewrites it")
    print(runs_line(cached))
    if spec is None:
        print("  the next plan for \"cpu\" devices measures the CPU (a few seconds); "
              "partitioner calibrate --measure measures now")
        return
    print("spec (the median of the kept runs):")
    print("\n".join(spec_lines(spec)))


def runs_line(cached: Cached) -> str:
    """How many runs ``cached`` keeps and how quiet the machine was while they ran."""
    from partitioner.cost.calibration_cache import KEPT_RUNS, QUIET, is_quiet

    runs = cached.runs[-KEPT_RUNS:]
    if not runs:
        return "runs kept: none"
    loads = [run.foreign for run in runs if run.foreign is not None]
    quiet = "all quiet" if all(is_quiet(run) for run in runs) else "NOT all quiet"
    busiest = (f"others kept at most {max(loads):.0%} of the cores busy while they ran"
               if loads else "the load while they ran is unknown")
    return (f"runs kept: {len(runs)} (the newest {KEPT_RUNS} count), {quiet} "
            f"(at most {QUIET:.0%} foreign load): {busiest}")


def spec_lines(spec: DeviceSpec) -> list[str]:
    """``spec``'s figures, one per line, with units."""
    lines = [_figure("matmul rate (fp32)", spec.flops("fp32") / 1e9, "GFLOP/s"),
             _figure("half rate at", spec.matmul_half_flops / 1e3, "kFLOP per product"),
             _figure("weight repacking", spec.pack_bandwidth / 1e9, "GB/s"),
             _figure("memory bandwidth", spec.memory_bandwidth / 1e9, "GB/s"),
             _figure("optimizer step", spec.optimizer_bandwidth / 1e9, "GB/s"),
             _figure("first touch", spec.fresh_bandwidth / 1e9,
                     f"GB/s (tensors of {spec.fresh_threshold / 2**20:.0f} MiB and more"
                     + (f"; in part from {spec.fresh_threshold / spec.fresh_ramp / 2**20:.0f}"
                        " MiB)" if spec.fresh_ramp > 1 else ")")),
             _figure("op overhead", spec.op_overhead * 1e6, "us per op"),
             _figure("action overhead", spec.action_overhead * 1e6, "us per stage action"),
             _figure("thread latency", spec.thread_latency * 1e6,
                     "us per step of a collective between threads"),
             _figure("replica overhead", spec.replica_overhead * 1e6,
                     "us per replica per step (one process)"),
             _figure("replica per tensor", spec.replica_tensor_overhead * 1e6,
                     "us per parameter tensor per replica past the first"),
             _figure("optimizer per tensor", spec.optimizer_tensor_overhead * 1e6,
                     "us per parameter tensor (Adam)"),
             _figure("fused Linear", spec.fused_linear_overhead * 1e6,
                     "us per Linear's forward and backward through fused_linear"),
             _figure("lone worker", spec.worker_speed * 100,
                     "% of all threads' speed (a stage computing alone)"),
             _figure("caller's spin", spec.caller_spin * 1e3,
                     "ms a step's workers share the cores with the caller's OpenMP helpers"),
             _figure("memory", spec.memory_bytes / 2**30, "GiB")]
    if spec.shared_speedup:
        workers = ", ".join(str(n) for n in range(1, len(spec.shared_speedup) + 1))
        lines.append(f"  stages sharing the cores (speed-up of {workers} workers at once):")
        if spec.worker_speed < 1:
            lines.append("    (as timed; a layer's products gain by the part of them the threads "
                         "divide, partitioner.cost.sharing)")
        for flops, *gains in spec.shared_sizes or ((64.0, *spec.shared_speedup),):
            work = f"products of {flops / 1e6:,.0f} MFLOP" if flops else "element-wise"
            lines.append(f"    {work:<25}" + " ".join(f"{g:5.2f}" for g in gains))
    return lines


def _figure(label: str, value: float, unit: str) -> str:
    return f"  {label:<24}{value:8.1f} {unit}"
