"""Where a training step of ``benchmarks/gpu_check.py``'s cases spends its time on a GPU.

For each case, a few steps under ``torch.profiler`` (CPU and CUDA): wall time per step, the
GPU's kernel time per step (its busy share), kernel launches per step, and the operators
taking the most CPU time and the kernels taking the most GPU time. A step whose GPU is
mostly idle is bound by the host's dispatch (Python, the dispatcher, autocast's casts),
which the presets' ``op_overhead`` (5 us a kernel) must then account for.

Run (on a machine with CUDA):
    python benchmarks/gpu_step_profile.py --cases "one device,pipeline bf16"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import gpu_check  # noqa: E402


def profile(name: str, args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    module, step, predicted = gpu_check.build_case(name, args)
    try:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.steps
    finally:
        if hasattr(module, "close"):
            module.close()
    events = prof.key_averages()
    on_gpu = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    kernels = len(on_gpu)
    # Kernels as CUPTI saw them (from every thread), not as ops recorded them.
    busy = sum(e.time_range.elapsed_us() for e in on_gpu) / 1e6 / args.steps
    pred = f"{predicted * 1e3:.1f} ms" if predicted else "-"
    print(f"\n## {name}: {wall * 1e3:.1f} ms a step (predicted {pred}), GPU kernels "
          f"{busy * 1e3:.1f} ms ({busy / wall:.0%} busy), {kernels / args.steps:.0f} "
          f"kernels a step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                       max_name_column_width=48))
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows // 2,
                       max_name_column_width=48))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="one device,pipeline bf16",
                        help="comma-separated cases of gpu_check.CASES")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in gpu_check.CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; use some of {list(gpu_check.CASES)}")
    import torch
    if not torch.cuda.is_available():
        print("gpu_step_profile: skipped, no CUDA device here")
        return 0
    for name in cases:
        try:
            profile(name, args)
        except Exception as error:
            print(f"{name}: failed ({type(error).__name__}: {error})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
