"""Predicted against measured step time of local pipeline plans on this machine's CPU.

Each case is a model, a number of ``"cpu"`` devices (2 to 4 pipeline stages, plus one
single-device anchor), micro-batches and a checkpoint mode. ``partition(..., strategy=
"pipeline")`` plans it with the cost model (the CPU spec measured by
``partitioner.cost.measure.measure_cpu`` in a cache of the run's own, not the user's cache of
the last hours' runs, since this VM's speed drifts by 20% over hours: ``--calibration-runs``
runs at the start plan the cases; one more run between the timed rounds, and the cases'
plans, stages as measured, are predicted again at the end with the median of the last 9
runs, the machine as it was while they ran), and the plan's predicted step
time is compared with the measured median of training steps: ``zero_grad``, forward, loss,
backward, Adam step (the optimizer the planner assumes). Reported beside it: ``simulate``
of the plan, and the prediction of ``make_plan(..., calibrate=True)``, which times each
distinct layer once. All cases are built first and timed in rounds, one step of each per
round in a rotating order, so drift in the machine's load hits them alike. On a shared
machine a step during which other processes kept more than ``--max-foreign`` of the cores
busy is discarded and run again later (the calibration is retried likewise): with 2 intra-op
threads on 2 cores, one busy core stalls every OpenMP barrier.

Cases: 16 x (Linear(1024, 1024), ReLU) with batch 64 (the spine benchmark's model; 1 and 8
micro-batches on one device is the "8 micro-batches of 8 rows cost about 3x one of 64"
case), a ResNet-style CNN (``examples.models.ResNetish``) on 32 x 32 images, and a GPT-2
small shape (``examples.models.gpt(12, 768, 12, 50257, 64)``, 64-token sequences).

Run:
    python benchmarks/predicted_vs_measured.py                 # 7 timed rounds
    python benchmarks/predicted_vs_measured.py --rounds 11 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARGS: argparse.Namespace | None = None
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed steps kept per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of every thread (OMP_NUM_THREADS)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--max-foreign", type=float, default=0.1,
                        help="discard a step if other processes kept more than this share "
                             "of the cores busy during it (1 keeps every step)")
    parser.add_argument("--calibration-runs", type=int, default=3,
                        help="CPU calibration runs at the start, of which the spec takes "
                             "the median")
    parser.add_argument("--no-track", dest="track", action="store_false",
                        help="predict with the spec measured at the start only (default: "
                             "one more calibration run between rounds, and the cases "
                             "predicted again at the end with the median of the last runs)")
    parser.add_argument("--max-attempts", type=int, default=200,
                        help="give up after this many passes over the cases")
    ARGS = parser.parse_args()
    if ARGS.threads is not None:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine_load import cpu_sample, foreign_share  # noqa: E402

from examples.models import ResNetish, gpt  # noqa: E402
from partitioner import make_plan, partition  # noqa: E402
from partitioner.cost.measure import measure_cpu  # noqa: E402
from partitioner.planning.simulate import simulate  # noqa: E402


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]
    devices: int
    chunks: int
    checkpoint: str = "never"
    loss: str = "mse"


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(1024, 1024), nn.ReLU())])
    return model, torch.randn(64, 1024), torch.randn(64, 1024)


def _cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = ResNetish(widths=(32, 64, 128), blocks=2, classes=10, groups=8)
    return model, torch.randn(32, 3, 32, 32), torch.randn(32, 10)


def _gpt() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = gpt(12, 768, 12, 50257, 64)
    tokens = torch.randint(0, 50257, (8, 64))
    return model, tokens, torch.randint(0, 50257, (8, 64))


CASES = [
    Case("mlp 1 dev, 1 mb", _mlp, 1, 1),
    Case("mlp 1 dev, 8 mb", _mlp, 1, 8),
    Case("mlp 2 dev, 1 mb", _mlp, 2, 1),
    Case("mlp 2 dev, 4 mb", _mlp, 2, 4),
    Case("mlp 2 dev, 8 mb, ckpt", _mlp, 2, 8, "except_last"),
    Case("mlp 4 dev, 8 mb", _mlp, 4, 8),
    Case("cnn 2 dev, 4 mb", _cnn, 2, 4),
    Case("cnn 3 dev, 4 mb, ckpt", _cnn, 3, 4, "always"),
    Case("gpt2-small 2 dev, 2 mb", _gpt, 2, 2, "never", "ce"),
    Case("gpt2-small 4 dev, 4 mb", _gpt, 4, 4, "never", "ce"),
]


def _loss(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "ce":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def prepare(case: Case, limit: float, attempts: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x, y = case.build()
    pm = partition(model, ["cpu"] * case.devices, strategy="pipeline", example_inputs=(x,),
                   chunks=case.chunks, checkpoint=case.checkpoint)
    optimizer = torch.optim.Adam(pm.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        _loss(case.loss, pm(x), y).backward()
        optimizer.step()
    for _ in range(attempts):  # layer timings taken while other processes were busy are void
        load = cpu_sample()
        calibrated = make_plan(model, ["cpu"] * case.devices, strategy="pipeline",
                               example_inputs=(x,), chunks=case.chunks,
                               checkpoint=case.checkpoint, calibrate=True)
        if (foreign_share(load) or 0.0) <= limit:
            break
        time.sleep(2.0)
    return {"case": case, "pm": pm, "step": step, "times": [], "model": model, "x": x,
            "predicted": pm.plan.predicted_step_time,
            "at_start": pm.plan.predicted_step_time,
            "simulated": simulate(pm.plan).step_time,
            "calibrated": calibrated.predicted_step_time}


def quiet_calibration(limit: float, attempts: int, runs: int) -> tuple[Any, float]:
    """Measure the CPU spec as the machine is during this run: ``runs`` quiet calibration
    runs in a cache directory of their own, whose median ``measure_cpu`` returns (the
    user's cache holds the last hours' runs; this VM's speed drifts by 20% over hours)."""
    begin = time.perf_counter()
    for _ in range(attempts):
        os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="calibration-")
        for _ in range(runs):
            load = cpu_sample()
            measure_cpu.cache_clear()
            spec = measure_cpu()
            if (foreign_share(load) or 0.0) > limit:
                break  # a disturbed run would stay in the median: start again
        else:
            return spec, (time.perf_counter() - begin) / runs
        time.sleep(2.0)
    return spec, (time.perf_counter() - begin) / runs


def main(args: argparse.Namespace) -> None:
    chosen = [c for c in CASES if not args.cases or c.name.split()[0] in args.cases.split(",")]
    spec, calibration = quiet_calibration(args.max_foreign, args.max_attempts,
                                          args.calibration_runs)
    runs = [prepare(c, args.max_foreign, args.max_attempts) for c in chosen]
    for run in runs:
        for _ in range(args.warmup):
            run["step"]()
    attempts = discarded = 0
    while attempts < args.max_attempts:
        waiting = [run for run in runs if len(run["times"]) < args.rounds]
        if not waiting:
            break
        attempts += 1
        if args.track:  # one more calibration run for the spec's median, between rounds
            measure_cpu.cache_clear()
            measure_cpu()
        for run in waiting[attempts % len(waiting):] + waiting[:attempts % len(waiting)]:
            load = cpu_sample()
            begin = time.perf_counter()
            run["step"]()
            seconds = time.perf_counter() - begin
            if (foreign_share(load) or 0.0) > args.max_foreign:
                discarded += 1
                continue
            run["times"].append(seconds)
    if args.track:
        spec = repredict(runs)
    report(runs, spec, calibration, discarded, args)


def repredict(runs: list[dict[str, Any]]) -> Any:
    """Predict every case's plan (its stages as measured) again with the spec of the runs
    taken between the timed rounds: the machine as it was while they ran."""
    measure_cpu.cache_clear()
    spec = measure_cpu()
    for run in runs:
        case, plan = run["case"], run["pm"].plan
        again = make_plan(run["model"], ["cpu"] * case.devices, balance=list(plan.balance),
                          example_inputs=(run["x"],), chunks=case.chunks,
                          checkpoint=case.checkpoint)
        run["predicted"], run["simulated"] = again.predicted_step_time, simulate(again).step_time
    return spec


def report(runs: list[dict[str, Any]], spec: Any, calibration: float, discarded: int,
           args: argparse.Namespace) -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, intra-op threads {torch.get_num_threads()}; "
          f"{args.rounds} timed rounds after {args.warmup} warm-up")
    source = ("median of the last 9 runs, between the rounds" if args.track
              else f"median of {args.calibration_runs} runs at the start")
    print(f"CPU spec ({source}, {calibration:.2f} s each): {spec.flops() / 1e9:.0f} GFLOP/s, "
          f"element-wise {spec.memory_bandwidth / 1e9:.0f} GB/s, optimizer "
          f"{spec.optimizer_rate / 1e9:.0f} GB/s, weight repacking "
          f"{spec.pack_bandwidth / 1e9:.0f} GB/s, {spec.op_overhead * 1e6:.1f} us per op, "
          f"speedup of 2/3/4 busy threads {spec.shared_speedup[1]:.2f}/"
          f"{spec.shared_speedup[2]:.2f}/{spec.shared_speedup[3]:.2f}")
    print(f"{discarded} steps discarded (other processes above {args.max_foreign:.0%} of "
          "the cores during them)")
    print("\n| case | stages x micro-batches | measured median (ms) | min (ms) | predicted (ms) "
          "| error | simulated (ms) | error | calibrated (ms) | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors, sim_errors, cal_errors = [], [], []
    for run in runs:
        case, times = run["case"], run["times"]
        if not times:
            print(f"| {case.name} | no quiet step measured | | | | | | | | |")
            continue
        measured = statistics.median(times)
        error = run["predicted"] / measured - 1
        sim_error = run["simulated"] / measured - 1
        cal_error = run["calibrated"] / measured - 1
        errors.append(abs(error))
        sim_errors.append(abs(sim_error))
        cal_errors.append(abs(cal_error))
        print(f"| {case.name} | {case.devices} x {case.chunks} ({case.checkpoint}) | "
              f"{measured * 1e3:.1f} | {min(times) * 1e3:.1f} | {run['predicted'] * 1e3:.1f} "
              f"| {error:+.0%} | {run['simulated'] * 1e3:.1f} | {sim_error:+.0%} | "
              f"{run['calibrated'] * 1e3:.1f} | {cal_error:+.0%} |")
    starts = [abs(run["at_start"] / statistics.median(run["times"]) - 1)
              for run in runs if run["times"]]
    print(f"\nmedian absolute error: predicted {statistics.median(errors):.1%}, simulated "
          f"{statistics.median(sim_errors):.1%}, calibrated (calibrate=True) "
          f"{statistics.median(cal_errors):.1%} (goal <= 20%)")
    if args.track:
        print(f"predicted with the spec measured at the start only: median absolute error "
              f"{statistics.median(starts):.1%}")
    names = {run["case"].name: run for run in runs if run["times"]}
    one, eight = names.get("mlp 1 dev, 1 mb"), names.get("mlp 1 dev, 8 mb")
    if one and eight:
        print(f"8 micro-batches of 8 rows / one of 64: measured "
              f"{statistics.median(eight['times']) / statistics.median(one['times']):.2f}x, "
              f"predicted {eight['predicted'] / one['predicted']:.2f}x")
    print("command: python benchmarks/predicted_vs_measured.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    assert ARGS is not None
    main(ARGS)
