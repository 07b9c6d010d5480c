"""Training step time: our pipeline against torchgpipe 0.0.7, on two CPU stages.

The model is ``nn.Sequential`` of 16 x (Linear(1024, 1024), ReLU): 32 modules, split
[16, 16] by both tools, batch 64 in 8 micro-batches. One step is an SGD step: ``zero_grad``,
forward, MSE loss against a fixed random target, backward, ``step``. For each checkpoint mode
both tools run in the same process under the same thread settings, their steps interleaved
(every round times each contender once, in a rotating order), so drift in the machine hits
them alike. The unpartitioned model, with and without 8-way gradient accumulation, is the
anchor.

Run:
    python benchmarks/pipeline_vs_torchgpipe.py                 # defaults: 5 warm-up, 20 timed
    python benchmarks/pipeline_vs_torchgpipe.py --steps 40 --threads 1 --modes never

Every contender starts from a copy of one model and sees the same batch, so their first
losses must agree; the script checks that before timing.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

MODES = ("always", "except_last", "never")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per contender")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated checkpoint modes (always,except_last,never)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for every thread of the process "
                             "(default: torch's default, one per core)")
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
    return args


# torch.set_num_threads changes the calling thread and threads started after it, but not
# threads already running. Setting OMP_NUM_THREADS before torch is imported gives every thread
# (ours, torchgpipe's, autograd's) the same intra-op pool whenever it was started.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads is not None:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from partitioner import partition  # noqa: E402


def import_torchgpipe() -> tuple[type, list[str]]:
    """torchgpipe's ``GPipe``, and the warnings its import raised.

    Shims for torch 2.13 (each applied only if needed, so a fixed torchgpipe runs untouched):

    * none has been needed so far: torchgpipe 0.0.7 imports and trains on torch 2.13 CPU as
      released (it touches ``torch.cuda`` only through ``torch.cuda.Stream``, which it never
      builds for CPU devices, and its checkpoint is its own ``autograd.Function``).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from torchgpipe import GPipe
    return GPipe, [str(w.message) for w in caught]


def make_model(width: int, blocks: int, seed: int) -> nn.Sequential:
    """16 x (Linear, ReLU) as 32 separate modules, so balance counts modules for both tools."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


@dataclass
class Contender:
    """A named training step, its own model copy, and the step times measured for it."""

    name: str
    step: Callable[[], float]
    times: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def sgd_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Callable[[], float]:
    """One step on ``model``: zero_grad, forward, MSE loss, backward, SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        return float(loss)
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
            total += float(loss)
        optimizer.step()
        return total
    return step


def contenders(args: argparse.Namespace, gpipe_cls: type) -> list[Contender]:
    base = make_model(args.width, args.blocks, args.seed)
    x = torch.randn(args.batch, args.width)
    target = torch.randn(args.batch, args.width)
    n = len(base)
    balance = [n // 2, n - n // 2]
    out = [Contender("unpartitioned", sgd_step(copy.deepcopy(base), x, target)),
           Contender(f"unpartitioned, {args.chunks}-way accumulation",
                     accumulated_step(copy.deepcopy(base), x, target, args.chunks))]
    for mode in args.modes:
        ours = partition(copy.deepcopy(base), devices=["cpu", "cpu"], example_inputs=(x,),
                         chunks=args.chunks, checkpoint=mode, balance=balance)
        out.append(Contender(f"ours/{mode}", sgd_step(ours, x, target)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            theirs = gpipe_cls(copy.deepcopy(base), balance=balance, devices=["cpu", "cpu"],
                               chunks=args.chunks, checkpoint=mode)
        c = Contender(f"torchgpipe/{mode}", sgd_step(theirs, x, target))
        c.warnings = [str(w.message) for w in caught]
        out.append(c)
    return out


def check_first_losses(runners: list[Contender]) -> float:
    """Run each contender's first step; they start from one model, so losses must agree."""
    losses = {}
    for c in runners:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses[c.name] = c.step()
        c.warnings += [str(w.message) for w in caught]
    first = next(iter(losses.values()))
    spread = max(abs(v - first) for v in losses.values())
    if spread > 1e-4 * max(1.0, abs(first)):
        raise SystemExit(f"first-step losses disagree: {losses}")
    return first


def measure(runners: list[Contender], warmup: int, steps: int) -> None:
    """Interleave: each round times every contender once, starting one further along."""
    for r in range(warmup + steps):
        shift = r % len(runners)
        for c in runners[shift:] + runners[:shift]:
            start = time.perf_counter()
            c.step()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                c.times.append(elapsed)


def summary(times: list[float]) -> tuple[float, float, float]:
    """Median, first and third quartile, in milliseconds."""
    q1, med, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return med * 1e3, q1 * 1e3, q3 * 1e3


def thread_report() -> str:
    probe: list[int] = []
    t = threading.Thread(target=lambda: probe.append(torch.get_num_threads()))
    t.start()
    t.join()
    return (f"intra-op threads: main {torch.get_num_threads()}, new threads {probe[0]}; "
            f"inter-op threads {torch.get_num_interop_threads()}; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def print_results(args: argparse.Namespace, runners: list[Contender]) -> None:
    by_name = {c.name: c for c in runners}
    plain = summary(by_name["unpartitioned"].times)[0]
    print(f"\n{'contender':<38} {'median ms':>9} {'IQR ms':>15} {'/ unpart.':>9}")
    for c in runners:
        med, q1, q3 = summary(c.times)
        print(f"{c.name:<38} {med:>9.1f} {q1:>7.1f}-{q3:<7.1f} {med / plain:>9.2f}")
    print(f"\n{'mode':<12} {'ours ms':>8} {'torchgpipe ms':>13} {'ours/torchgpipe':>15} "
          f"{'goal <= 0.9':>11} {'ours/unpart.':>12}")
    for mode in args.modes:
        ours = summary(by_name[f"ours/{mode}"].times)[0]
        theirs = summary(by_name[f"torchgpipe/{mode}"].times)[0]
        ratio = ours / theirs
        print(f"{mode:<12} {ours:>8.1f} {theirs:>13.1f} {ratio:>15.2f} "
              f"{'met' if ratio <= 0.9 else 'NOT met':>11} {ours / plain:>12.2f}")


def main() -> None:
    args = ARGS or parse_args()
    gpipe_cls, import_warnings = import_torchgpipe()
    import torchgpipe
    print(f"torch {torch.__version__}, torchgpipe {torchgpipe.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs ({platform.machine()})")
    print(thread_report())
    print(f"model: {args.blocks} x (Linear({args.width}, {args.width}), ReLU), batch "
          f"{args.batch}, chunks {args.chunks}, balance [{args.blocks}, {args.blocks}], "
          f"{args.warmup} warm-up + {args.steps} timed steps, interleaved")
    runners = contenders(args, gpipe_cls)
    loss = check_first_losses(runners)
    print(f"first-step losses agree across all {len(runners)} contenders ({loss:.6f})")
    notes = sorted({w for c in runners for w in c.warnings} | set(import_warnings))
    for w in notes:
        print(f"warning seen (once per kind): {w}")
    measure(runners, args.warmup, args.steps)
    print_results(args, runners)


if __name__ == "__main__":
    main()
