"""auto's regret across processes: ``partition_distributed(strategy="auto")`` on gloo ranks.

Each case starts a world of ``--ranks`` processes on this machine (gloo, one intra-op thread
each, as torchrun would), and every rank calls ``partition_distributed(model, (x,),
strategy="auto", tune=N)`` with ``N`` = every candidate rank 0's search ranked: each
candidate is built on every rank and timed (the slowest rank's median of the steps after a
warm-up that last ``--min-seconds``, 1 s by default; those within 25% of the fastest timed a
second time in reverse order, the mean of both counts: forward, backward in the plan's
schedule, Adam), which is the measurement this benchmark reports. ``--calibrate off``
plans without timing the model first (``partition_distributed(calibrate=False)``). From the
plan's records:

* auto's regret: the measured time of its rank-1 pick / the measured fastest - 1;
* ``tune=True``'s regret: the measured fastest of the candidates ``tune=True`` would time
  (``tuned_order``'s 4, then ``refinement``'s variant of the fastest mesh) / the fastest - 1;
* measured / predicted per candidate, and its median per kind of plan.

Run (a quiet machine; about a minute a case):
    python benchmarks/regret_distributed.py
    python benchmarks/regret_distributed.py --cases mlp --ranks 2
    python benchmarks/regret_distributed.py --no-posting   # predicted without posting
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _cases() -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    from examples.models import classifier, gpt, mlp
    return {
        "tiny": lambda: (mlp([8, 16, 16, 16, 16, 8]), torch.randn(16, 8)),
        "mlp": lambda: (classifier(32, width=128, depth=6, classes=8), torch.randn(64, 32)),
        "wide": lambda: (mlp([1024, 4096, 1024, 4096, 1024]), torch.randn(32, 1024)),
        "gpt": lambda: (gpt(4, 256, 4, 2048, 64), torch.randint(0, 2048, (8, 64))),
    }


CALIBRATE = {"default": None, "on": True, "off": False}


def rank_main(case: str, calibrate: str, min_seconds: float, no_posting: bool = False) -> None:
    """One rank: plan and tune with every candidate timed; rank 0 prints the records."""
    import torch
    import torch.distributed as dist

    if no_posting:  # the A/B of the term: predicted as before it was charged
        from partitioner.cost.links import LinkSpec
        LinkSpec.post_time = lambda self, nbytes: 0.0  # type: ignore[method-assign]

    import partitioner.distributed_plan as tuning
    import partitioner.planning.tune as tune
    from partitioner.distributed import partition_distributed
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tuning.MIN_TIMED_SECONDS = min_seconds  # each candidate's timed steps per round
    tune.MAX_TIMED_STEPS = 10_000  # the time decides, not the count
    model, x = _cases()[case]()
    dpm = partition_distributed(model, (x,), strategy="auto", tune=64, backend="gloo",
                                calibrate=CALIBRATE[calibrate])
    if dist.get_rank() == 0:
        print("RECORDS " + json.dumps([{k: r.get(k) for k in (
            "label", "rank", "step_time", "measured_step_time", "tune_error", "config")}
            | {"step_time": r.get("ranked_step_time", r.get("step_time"))}  # as ranked
            for r in dpm.plan.candidates]), flush=True)
    dpm.close()


def _steal() -> tuple[float, float]:
    """Jiffies the hypervisor gave other guests (``steal``) and all jiffies, from
    ``/proc/stat``: a case run while the VM's host was busy elsewhere is marked."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    return float(fields[7]) if len(fields) > 7 else 0.0, float(sum(fields))


def launch(case: str, ranks: int, timeout: float, extra: list[str]) -> list[dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-of", case, *extra],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"a rank failed ({p.returncode}): {err[-2000:]}")
    line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("RECORDS "))
    return json.loads(line.removeprefix("RECORDS "))


def _kind(c: dict[str, Any]) -> str:
    parts = [n for n, k in (("replicas", "dp"), ("tensor parallel", "tp"), ("pipeline", "pp"))
             if c[k] > 1]
    return " x ".join(parts) or "one device"


def tune_timed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed records ``tune=True`` would have timed: one per mesh first (4), then the
    next variant of the mesh measured fastest (``partitioner.planning.tune``)."""
    from partitioner.planning.tune import DEFAULT_CANDIDATES, REFINE, refinement, tuned_order
    order = [i for i in tuned_order(records, DEFAULT_CANDIDATES)
             if records[i].get("measured_step_time")]
    for _ in range(REFINE):
        extra = refinement(records, order,
                           {i: records[i]["measured_step_time"] for i in order})
        if extra is None or not records[extra].get("measured_step_time"):
            break
        order.append(extra)
    return [records[i] for i in order]


def report(case: str, ranks: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(records, key=lambda r: r["rank"])
    timed = [r for r in ranked if r.get("measured_step_time")]
    best = min(timed, key=lambda r: r["measured_step_time"])
    tuned = min(tune_timed(records), key=lambda r: r["measured_step_time"])
    print(f"\n{case} on {ranks} gloo ranks")
    print(f"  {'candidate':46} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in ranked:
        measured = r.get("measured_step_time")
        text = (f"{measured * 1e3:8.2f}ms {measured / r['step_time']:6.2f}" if measured
                else f"{'failed' if r.get('tune_error') else '-':>10}")
        mark = " <- auto" if r is ranked[0] else ""
        print(f"  {r['label']:46} {r['step_time'] * 1e3:8.2f}ms {text}{mark}")
    row = {"case": f"{case} x{ranks} ranks",
           "auto_regret": ranked[0]["measured_step_time"] / best["measured_step_time"] - 1
           if ranked[0].get("measured_step_time") else float("nan"),
           "tune_regret": tuned["measured_step_time"] / best["measured_step_time"] - 1,
           "best": best["label"],
           "ratios": [(_kind(r["config"]), r["measured_step_time"] / r["step_time"])
                      for r in timed]}
    print(f"  fastest: {best['label']}; auto's regret {row['auto_regret']:+.1%}, with "
          f"tune=True {row['tune_regret']:+.1%}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="tiny,mlp,wide,gpt")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--calibrate", choices=sorted(CALIBRATE), default="default",
                        help="partition_distributed(calibrate=): default None (rank 0 times "
                             "the model when it is cheap), on, off")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="each candidate's timed steps last at least this long per round "
                             "(tune's own default is 0.3 s)")
    parser.add_argument("--no-posting", action="store_true",
                        help="predict without the sender's posting of its messages "
                             "(LinkSpec.post_time 0, as before 2026-12-05): the A/B of it")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(args.rank_of, args.calibrate, args.min_seconds, args.no_posting)
        return
    extra = ["--calibrate", args.calibrate, "--min-seconds", str(args.min_seconds),
             *(["--no-posting"] if args.no_posting else [])]
    rows = []
    for case in args.cases.split(","):
        for ranks in [int(r) for r in args.ranks.split(",")]:
            before = _steal()
            records = launch(case, ranks, args.timeout, extra)
            after = _steal()
            row = report(case, ranks, records)
            row["steal"] = (after[0] - before[0]) / max(after[1] - before[1], 1.0)
            print(f"  the VM's host took {row['steal']:.0%} of the cores meanwhile (steal)")
            rows.append(row)
    print("\n| case | auto's regret | tune=True regret | measured fastest | steal |")
    print("|---|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['auto_regret']:+.1%} | {r['tune_regret']:+.1%} | "
              f"{r['best']} | {r['steal']:.0%} |")
    kinds: dict[str, list[float]] = {}
    for r in rows:
        for kind, ratio in r["ratios"]:
            kinds.setdefault(kind, []).append(ratio)
    print("\nmeasured / predicted, median over the candidates of each kind:")
    for kind, ratios in sorted(kinds.items()):
        print(f"  {kind:32} {statistics.median(ratios):5.2f}  ({len(ratios)} candidates)")


if __name__ == "__main__":
    main()
