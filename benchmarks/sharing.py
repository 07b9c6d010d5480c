"""What a second stage worker gains on a shared host, measured beside the model (issue 18).

Several ``"cpu"`` devices in one process are stage workers sharing the host's cores: with
two busy, each has half the intra-op threads; one alone still has only its share. The cost
model says what that does to each layer from its own terms (``partitioner.cost.sharing``:
the part of an op the threads divide, a product's FLOPs at the full rate, against the rest,
its weights' repacking and launches). This benchmark times, for models whose layers are
products of different shapes (weights streamed from memory or reused from cache, few rows
or many) and for transformer stacks, one training pass (forward and backward, gradients
set to ``None`` first):

* ``alone``: on the caller with all the intra-op threads (one device);
* ``lone``: on one stage worker with a two-worker share of the threads (a pipeline stage
  computing while the other waits);
* ``two``: two stage workers at once, each its own copy of the model (two replicas);
* ``four``: four workers at once, each with a four-worker share of the threads.

and prints the measured ``lone`` speed (``alone / lone``), two workers' gain (``2 x alone /
two``) and four's (``4 x alone / four``) beside what the model predicts for the same layers,
each scaled to its time in context as ``partition`` does on this machine's CPU, with this
machine's calibrated spec (``partitioner.cost.sharing.lone_work`` and ``shared_work``),
and the ratio measured / predicted of each.

Run (a quiet machine; about a minute, plus a calibration if none is cached):
    python benchmarks/sharing.py
    python benchmarks/sharing.py --rounds 7 --cases gpt,narrow
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner.analysis import analyze  # noqa: E402
from partitioner.cost.measure import calibrate, measure_cpu  # noqa: E402
from partitioner.cost.sharing import lone_work, shared_work  # noqa: E402
from partitioner.runtime.worker import Worker, shared_threads  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from regret import _case  # noqa: E402


def _linears(rows: int, width: int, out: int, layers: int) -> tuple[nn.Module, torch.Tensor]:
    blocks: list[nn.Module] = []
    for k in range(layers):
        blocks.append(nn.Linear(width if k % 2 == 0 else out, out if k % 2 == 0 else width))
    return nn.Sequential(*blocks), torch.randn(rows, width)


CASES: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "few rows, weights from memory": lambda: _linears(8, 1024, 1024, 16),
    "64 rows, weights from memory": lambda: _linears(64, 1024, 1024, 16),
    "512 rows, 256 x 1024": lambda: _linears(512, 256, 1024, 8),
    "4096 rows, 64 x 64": lambda: _linears(4096, 64, 64, 8),
    **{name: (lambda name=name: _case(name))
       for name in ("narrow", "mlp", "wide", "cnn", "vit", "encoder", "gpt", "llama")},
}


def _pass(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for p in model.parameters():
            p.grad = None
        out = model(x)
        out = out if isinstance(out, torch.Tensor) else out[0]
        out.float().sum().backward()
    return run


def _back_to_back(fn: Callable[[], None], steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls after an untimed one, back to back as training
    steps run (the caller's helpers awake for ``alone``, spinning out after it for the
    first of the others: the median leaves that out)."""
    fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(model: nn.Module, x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median seconds of one training pass alone, on a lone worker, and on two at once."""
    cpu = torch.device("cpu")
    copies = [model, *(copy.deepcopy(model) for _ in range(3))]
    lone = Worker(cpu, shared_threads([cpu] * 2))
    pair = [Worker(cpu, shared_threads([cpu] * 2)) for _ in range(2)]
    quad = [Worker(cpu, shared_threads([cpu] * 4)) for _ in range(4)]
    alone_pass = _pass(model, x)
    try:
        def on_lone() -> None:
            lone.submit(alone_pass).result()

        def on_pair() -> None:
            for future in [w.submit(_pass(m, x)) for w, m in zip(pair, copies)]:
                future.result()

        def on_quad() -> None:
            for future in [w.submit(_pass(m, x)) for w, m in zip(quad, copies)]:
                future.result()
        times: dict[str, list[float]] = {"alone": [], "lone": [], "two": [], "four": []}
        for _ in range(rounds):  # in turn: load drifting skews none of them
            for key, fn in (("alone", alone_pass), ("lone", on_lone), ("two", on_pair),
                            ("four", on_quad)):
                times[key] += _back_to_back(fn, 3)
    finally:
        for w in (lone, *pair, *quad):
            w.close()
    return {key: statistics.median(values) for key, values in times.items()}


def predict(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """The model's seconds of the same pass alone, on a lone worker, and two at once."""
    spec = measure_cpu()
    analysis = analyze(model, (x,))
    workload = analysis.workload
    assert workload is not None
    # As partition() plans on this machine's CPU: each layer scaled to its time in context.
    layers = calibrate(analysis.captured.graph_module, analysis.layers, workload.layers,
                       analysis.inputs or [], spec, workload.batch, progress=False)[0]
    shared = [shared_work(layer, spec, workload.batch, 1, workload.dtype) for layer in layers]
    lone = sum(lone_work(layer, spec, workload.batch, 1, workload.dtype) for layer in layers)
    return {"alone": sum(s[0] for s in shared), "lone": lone,
            "two": 2 * sum(s[1] for s in shared), "four": 4 * sum(s[3] for s in shared)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = measure_cpu()
    print(f"spec: lone worker {spec.worker_speed:.2f}, two workers on the reference products "
          f"{spec.shared_speedup[1]:.2f}; {torch.get_num_threads()} threads")
    print(f"{'case':<32}{'alone ms':>9}{'pred':>7} | {'lone':>5}{'pred':>6}{'m/p':>6} | "
          f"{'gain2':>6}{'pred':>6}{'m/p':>6} | {'gain4':>6}{'pred':>6}{'m/p':>6}")
    wanted = {name.strip() for name in args.cases.split(",") if name.strip()}
    ratios: dict[str, list[float]] = {"lone": [], "gain2": [], "gain4": []}
    for name, build in CASES.items():
        if wanted and not any(w in name for w in wanted):
            continue
        model, x = build()
        got, want = measure(model, x, args.rounds), predict(model, x)
        lone, lone_p = got["alone"] / got["lone"], want["alone"] / want["lone"]
        gain, gain_p = 2 * got["alone"] / got["two"], 2 * want["alone"] / want["two"]
        four, four_p = 4 * got["alone"] / got["four"], 4 * want["alone"] / want["four"]
        ratios["lone"].append(lone / lone_p)
        ratios["gain2"].append(gain / gain_p)
        ratios["gain4"].append(four / four_p)
        print(f"{name:<32}{got['alone'] * 1e3:9.2f}{want['alone'] * 1e3:7.2f} | {lone:5.2f}"
              f"{lone_p:6.2f}{lone / lone_p:6.2f} | {gain:6.2f}{gain_p:6.2f}"
              f"{gain / gain_p:6.2f} | {four:6.2f}{four_p:6.2f}{four / four_p:6.2f}",
              flush=True)
    for key, values in ratios.items():
        if values:
            print(f"{key}: measured / predicted median {statistics.median(values):.2f}, "
                  f"range {min(values):.2f}-{max(values):.2f}")


if __name__ == "__main__":
    main()
