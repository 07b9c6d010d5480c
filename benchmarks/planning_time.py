"""Planning time: ``make_plan`` for a GPT-2-XL-shaped model on 8 devices, without weights.

Both models are built on the meta device (``with torch.device("meta")``), so no parameter
memory is allocated; the example input (batch 8, sequence 1024) is on meta too. Timed is the
whole of ``make_plan``: capture, the analysis passes, the cost model and the solver.

* ``plain``: the nanoGPT-like ``examples.models.gpt(48, 1600, 25, 50257, 1024)``, which
  ``torch.fx.symbolic_trace`` captures.
* ``hf``: transformers' ``GPT2LMHeadModel(GPT2Config(n_layer=48, n_embd=1600, n_head=25,
  use_cache=False))``, which symbolic tracing cannot capture, so ``make_plan`` falls back to
  ``torch.export``.

Each model is planned in a fresh subprocess, so the first call is truly cold (imports,
CPU calibration) and the peak RSS (``resource.getrusage``) is that model's alone. Target:
under 2 s per plan.

Run:
    python benchmarks/planning_time.py                    # both models, 3 warm repeats
    python benchmarks/planning_time.py --model plain --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # for examples.models (appended: an installed partitioner wins)

from machine_load import cpu_sample, foreign_share  # noqa: E402

import partitioner  # noqa: E402
from examples.models import gpt  # noqa: E402
from partitioner import make_plan  # noqa: E402

TARGET_SECONDS = 2.0
SHAPE = {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab": 50257, "seq": 1024}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("plain", "hf", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3, help="warm calls after the first")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def peak_rss_mb() -> float:
    """The process's peak resident set so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(which: str) -> torch.nn.Module:
    if which == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        if which == "plain":
            return gpt(**SHAPE)
        config = GPT2Config(n_layer=SHAPE["n_layer"], n_embd=SHAPE["n_embd"],
                            n_head=SHAPE["n_head"], vocab_size=SHAPE["vocab"],
                            n_positions=SHAPE["seq"], use_cache=False)
        return GPT2LMHeadModel(config)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build ``args.model`` on meta, plan it ``1 + repeats`` times; report times and memory."""
    if args.model == "hf":
        import transformers  # noqa: F401 - imported before the clock starts
    rss_start = peak_rss_mb()
    load = cpu_sample()
    start = time.perf_counter()
    model = build(args.model)
    build_s = time.perf_counter() - start
    with torch.device("meta"):
        x = torch.zeros(args.batch, SHAPE["seq"], dtype=torch.long)  # (B, T)
    devices = ["cpu"] * args.devices
    times, plan = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(1 + args.repeats):
            start = time.perf_counter()
            plan = make_plan(model, devices, example_inputs=(x,), chunks=args.chunks)
            times.append(time.perf_counter() - start)
    tensors = list(model.parameters()) + list(model.buffers())
    if not all(t.is_meta for t in tensors):
        raise SystemExit("planning materialised some weights: a tensor left the meta device")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"model": args.model, "type": type(model).__name__, "build_s": build_s,
            "first_s": times[0], "warm_s": times[1:], "capture": plan.capture,
            "plan": str(plan), "weights_gb": weight_bytes / 1e9,
            "rss_start_mb": rss_start, "rss_peak_mb": peak_rss_mb(),
            "foreign_cpu": foreign_share(load),
            "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught})}


def run_child(args: argparse.Namespace, which: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--model", which,
               "--repeats", str(args.repeats), "--devices", str(args.devices),
               "--chunks", str(args.chunks), "--batch", str(args.batch)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"planning {which} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; intra-op threads {torch.get_num_threads()}")
    print(f"partitioner from {Path(partitioner.__file__).parent.parent}")
    print(f"GPT-2-XL shape {SHAPE}, batch {args.batch}, {args.devices} 'cpu' devices, "
          f"chunks {args.chunks}; all on meta\n")
    print(f"{'model':<16} {'capture':<7} {'build s':>7} {'first plan s':>12} "
          f"{'warm median s':>13} {'goal < 2 s':>10} {'RSS before MB':>13} "
          f"{'peak RSS MB':>11} {'weights GB':>10} {'other load':>10}")
    for r in results:
        warm = statistics.median(r["warm_s"]) if r["warm_s"] else float("nan")
        met = "met" if max(r["first_s"], warm) < TARGET_SECONDS else "NOT met"
        other = f"{r['foreign_cpu']:.0%}" if r["foreign_cpu"] is not None else "?"
        print(f"{r['type']:<16} {r['capture']:<7} {r['build_s']:>7.2f} {r['first_s']:>12.2f} "
              f"{warm:>13.2f} {met:>10} {r['rss_start_mb']:>13.0f} {r['rss_peak_mb']:>11.0f} "
              f"{r['weights_gb']:>10.2f} {other:>10}")
    print("\nRSS before: peak RSS once python, torch (and transformers) are imported, before "
          "the model is built;\nweights GB: what the parameters would take if allocated "
          "(float32); other load: share of\nall cores other processes used meanwhile.")
    for r in results:
        print(f"\nplan of {r['type']} (warm calls: "
              f"{', '.join(f'{t:.2f}' for t in r['warm_s'])} s):\n{r['plan']}")
        for w in r["warnings"]:
            print(f"  warning seen: {w.splitlines()[0][:160]}")


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    models = ["plain", "hf"] if args.model == "both" else [args.model]
    report([run_child(args, which) for which in models], args)


if __name__ == "__main__":
    main()
