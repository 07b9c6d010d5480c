"""auto's regret: every candidate it ranked, built and timed beside its pick, on this CPU.

For each case (a model and a number of ``"cpu"`` devices) the benchmark plans
``partition(model, devices, example_inputs=(x,))`` (default ``strategy="auto"``), builds
every candidate the search ranked (``plan.candidates``, up to 10), the plain 1F1B pipeline
over all the devices and the unpartitioned model on one device, each in a process of its
own (``benchmarks/isolated.py``: modules alive beside each other in one process slowed each
other by up to a third), and times training steps of each (``zero_grad``, ``pm.step`` with
a loss over the outputs, Adam step) in rounds: each round a burst of steps back to back
(``--burst`` seconds, as a training loop runs them) of each contender in a rotating order,
so drift in the machine's load hits them alike; a burst during which other processes kept
more than ``--max-foreign`` of the cores busy is discarded and run again. Then
``partition(..., tune=True)`` plans the case again and its pick is looked up in the same
table.

Per case it prints each candidate's predicted and measured step time and their ratio, and:

* auto's regret: the measured time of auto's pick / the measured fastest candidate - 1;
* the same with ``tune=True``;
* auto's pick against the plain 1F1B pipeline and against one device.

The fastest of many contenders timed with noise is an optimistic figure (the winner's
curse: on the 2-core VM one plan's bursts spread by 10-25%), and so the regret against it
is a pessimistic one. Where auto's or tune's pick measured more than ``--confirm-above``
slower than the fastest, the two are timed again head to head (``--confirm`` more bursts
of ``--confirm-burst`` seconds each, alternating which goes first), and the regret is also
reported from those bursts alone ("confirmed": 0 where the pick then measures as fast or
faster). Both figures are printed; the screening's is never replaced.

At the end: the median measured / predicted per kind of plan (pipeline, tensor parallel,
replicas, mixes) and the regrets' median and maximum.

Run (a quiet machine; 30-40 minutes for every case):
    python benchmarks/regret.py
    python benchmarks/regret.py --cases mlp,gpt --devices 2 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from isolated import Isolated, Spec  # noqa: E402

from examples.models import ResNetish, classifier, gpt, mlp  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.analysis import analyze  # noqa: E402
from partitioner.api import build, plan_record, route  # noqa: E402
from partitioner.planning.tune import synthetic_loss  # noqa: E402
from partitioner.request import PlanRequest  # noqa: E402
from partitioner.runtime.host_memory import release_host_memory, steady_host_memory  # noqa: E402


@dataclass
class Case:
    name: str
    kind: str
    build: Callable[[], tuple[nn.Module, torch.Tensor]]


class Encoder(nn.Module):
    """A stack of ``nn.TransformerEncoderLayer`` (an encoder, BERT-like)."""

    def __init__(self, layers: int = 4, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ViT(nn.Module):
    """A small vision transformer: 4 x 4 patches of 28 x 28 images (49 patches), 4 blocks."""

    def __init__(self, d: int = 192, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(
            d, 3, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 49, d)
        return self.head(self.norm(self.blocks(x)).mean(1))


def _llama() -> tuple[nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128, use_cache=False)
    return LlamaForCausalLM(config), torch.randint(0, 2048, (4, 64))


CASES = [
    Case("mlp", "the demo's residual MLP classifier",
         lambda: (classifier(32, width=128, depth=6, classes=8), torch.randn(64, 32))),
    Case("wide", "a wide MLP (tensor parallelism should win)",
         lambda: (mlp([2048, 8192, 2048, 8192, 2048]), torch.randn(64, 2048))),
    Case("narrow", "a deep narrow MLP on a large batch (replicas should win)",
         lambda: (mlp([64] + [64] * 12 + [10]), torch.randn(1024, 64))),
    Case("cnn", "a ResNet-style CNN on 32 x 32 images",
         lambda: (ResNetish(widths=(32, 64, 128), blocks=2, classes=10, groups=8),
                  torch.randn(32, 3, 32, 32))),
    Case("encoder", "4 nn.TransformerEncoderLayer, d=256, batch 8 x 64",
         lambda: (Encoder(), torch.randn(8, 64, 256))),
    Case("vit", "a small vision transformer, 49 patches",
         lambda: (ViT(), torch.randn(16, 3, 28, 28))),
    Case("gpt", "a decoder (GPT, 4 blocks, d=256, 64 tokens)",
         lambda: (gpt(4, 256, 4, 2048, 64), torch.randint(0, 2048, (8, 64)))),
    Case("llama", "transformers' LlamaForCausalLM (GQA, rotary), 4 layers, d=256",
         _llama),
]


def _kind(config: dict[str, int]) -> str:
    parts = [name for name, key in (("replicas", "dp"), ("tensor parallel", "tp"),
                                     ("pipeline", "pp")) if config[key] > 1]
    return " x ".join(parts) if parts else "one device"


class Contender:
    """One way to run the case, with its training step (built in its own process)."""

    def __init__(self, module: nn.Module, x: torch.Tensor, predicted: float | None = None
                 ) -> None:
        self.module, self.x, self.predicted = module, x, predicted
        self.optimizer = torch.optim.Adam(
            [p for p in module.parameters() if p.requires_grad], lr=1e-6)
        self.targets = torch.zeros(x.shape[0])

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(self.module, "plan"):
            self.module.step((self.x,), self.targets, synthetic_loss)
        else:
            synthetic_loss(self.module(self.x), self.targets).backward()
        self.optimizer.step()

    def close(self) -> None:
        if hasattr(self.module, "plan"):
            self.module.close()


def _case(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return next(c for c in CASES if c.name == name).build()


def candidate(name: str, devices: int, record: dict[str, Any]) -> Contender:
    """One ranked candidate of auto's plan, built from its record (in a child process)."""
    model, x = _case(name)
    cpus = ["cpu"] * devices
    request = PlanRequest.make(cpus, "auto", example_inputs=(x,), local=True)
    analysis = analyze(model, (x,), None)
    plan = plan_record(model, analysis, request, record)
    return Contender(build(model, analysis, route(model, analysis, plan, request), request), x)


def unpartitioned(name: str) -> Contender:
    """The model itself on one device, under the allocator settings planning for CPU
    devices gives the plans' processes (``partitioner.runtime.host_memory``)."""
    steady_host_memory()
    model, x = _case(name)
    return Contender(model, x)


def plain_1f1b(name: str, devices: int, chunks: int) -> Contender:
    """The plain 1F1B pipeline over every device, ``checkpoint="never"``."""
    model, x = _case(name)
    pm = partition(model, ["cpu"] * devices, strategy="pipeline", schedule="1f1b",
                   chunks=chunks, checkpoint="never", example_inputs=(x,))
    return Contender(pm, x, pm.plan.predicted_step_time)


@dataclass
class Run:
    """A contender as the parent sees it: its label, kind, prediction and timings."""

    label: str
    kind: str
    predicted: float
    spec: Spec
    times: list[float] = field(default_factory=list)
    #: Head-to-head bursts against the screened fastest: (this run's, the fastest's).
    duel: tuple[list[float], list[float]] | None = None

    @property
    def measured(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def confirmed_regret(self, best: Run) -> float | None:
        """This run's time / ``best``'s - 1 from their head-to-head bursts alone (0 when
        this run measured as fast or faster); ``None`` when they were not timed so."""
        if self is best:
            return 0.0
        if self.duel is None or not self.duel[0] or not self.duel[1]:
            return None
        mine, theirs = (statistics.median(t) for t in self.duel)
        return max(mine / theirs - 1, 0.0)


def contenders(case: Case, devices: int) -> tuple[list[Run], str, Any]:
    """Every ranked candidate of auto's plan, the plain 1F1B pipeline and one device."""
    model, x = _case(case.name)
    pm = partition(copy.deepcopy(model), ["cpu"] * devices, example_inputs=(x,))
    out, picked = [], ""
    for record in sorted(pm.plan.candidates, key=lambda r: r["rank"]):
        out.append(Run(record["label"], _kind(record["config"]), record["step_time"],
                       Spec("regret", "candidate", (case.name, devices, record))))
        if record.get("chosen"):
            picked = record["label"]
    alone = pm.plan.candidates[0].get("search", {}).get("one_device", {})
    out.append(Run("one device (unpartitioned)", "one device",
                   alone.get("step_time", float("nan")),
                   Spec("regret", "unpartitioned", (case.name,))))
    chunks = min(x.shape[0], 2 * devices)
    out.append(Run(f"plain 1F1B pipeline m={chunks}", "pipeline", float("nan"),
                   Spec("regret", "plain_1f1b", (case.name, devices, chunks))))
    pm.close()
    return out, picked, (model, x)


def _burst(pool: Isolated, runs: list[Run], i: int, burst: float,
           max_foreign: float) -> float | None:
    """One burst of run ``i``: its median step, or ``None`` (failed, or other processes
    kept more than ``max_foreign`` of the cores busy)."""
    try:
        seconds, foreign = pool.step(i, burst)
    except RuntimeError as error:
        print(f"  {runs[i].label}: failed ({str(error).strip().splitlines()[-1]})")
        return None
    return None if foreign > max_foreign else seconds


def head_to_head(pool: Isolated, runs: list[Run], i: int, best: int, bursts: int,
                 burst: float, max_foreign: float, attempts: int) -> None:
    """Runs ``i`` and ``best`` timed head to head, ``bursts`` each, the first of each
    pair alternating (``runs[i].duel``)."""
    mine: list[float] = []
    theirs: list[float] = []
    for attempt in range(attempts):
        if min(len(mine), len(theirs)) >= bursts or not {i, best} <= set(pool.built):
            break
        for j in ((i, best) if attempt % 2 == 0 else (best, i)):
            times = mine if j == i else theirs
            seconds = _burst(pool, runs, j, burst, max_foreign) if len(times) < bursts else None
            if seconds is not None:
                times.append(seconds)
    runs[i].duel = (mine, theirs)


def time_all(runs: list[Run], rounds: int, warmup: int, max_foreign: float,
             attempts: int, burst: float = 0.2, picks: tuple[str, ...] = (),
             confirm: int = 0, confirm_above: float = 0.03, confirm_burst: float = 0.5
             ) -> tuple[list[Run], int]:
    """Time every run in its own process (``isolated.Isolated``), in rounds: each round a
    burst of steps back to back (``burst`` seconds) of each run in a rotating order, until
    each has ``rounds`` bursts (a run's time: the median of its bursts' median steps); the
    runs that could not be built are reported and dropped. Then each of ``picks`` (labels)
    measured more than ``confirm_above`` slower than the fastest partitioned run is timed
    head to head with it, ``confirm`` bursts of ``confirm_burst`` seconds each
    (:func:`head_to_head`)."""
    pool = Isolated([r.spec for r in runs], warmup=warmup)
    try:
        for i, error in sorted(pool.errors.items()):
            print(f"  {runs[i].label}: not built ({error.strip().splitlines()[-1]})")
        for i, predicted in pool.predicted.items():
            if predicted is not None:
                runs[i].predicted = predicted
        discarded = 0
        for attempt in range(attempts):
            waiting = [i for i in pool.built if len(runs[i].times) < rounds]
            if not waiting:
                break
            k = attempt % len(waiting)
            for i in waiting[k:] + waiting[:k]:
                seconds = _burst(pool, runs, i, burst, max_foreign)
                if seconds is None:
                    discarded += i in pool.built
                    continue
                runs[i].times.append(seconds)
        timed = [i for i in pool.built if runs[i].times and runs[i].kind != "one device"]
        if confirm and timed:
            best = min(timed, key=lambda i: runs[i].measured)
            for i in sorted({i for i in timed if runs[i].label in picks} - {best}):
                if runs[i].measured > runs[best].measured * (1 + confirm_above):
                    head_to_head(pool, runs, i, best, confirm, confirm_burst, max_foreign,
                                 attempts)
        built = [runs[i] for i in pool.built]
    finally:
        pool.close()
    return built, discarded


def report(case: Case, devices: int, runs: list[Run], picked: str,
           tuned: str) -> dict[str, Any]:
    partitioned = [r for r in runs if r.kind != "one device"]
    best = min(partitioned, key=lambda r: r.measured)
    by_label = {r.label: r for r in runs}
    print(f"\n{case.name} on {devices} devices: {case.kind}")
    print(f"  {'candidate':46} {'kind':28} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in runs:
        mark = (" <- auto" if r.label == picked else "") + (
            " <- tune" if r.label == tuned else "")
        print(f"  {r.label:46} {r.kind:28} {r.predicted * 1e3:8.2f}ms "
              f"{r.measured * 1e3:8.2f}ms {r.measured / r.predicted:6.2f}{mark}")
    auto = by_label[picked].measured if picked in by_label else float("nan")
    tune = by_label[tuned].measured if tuned in by_label else float("nan")
    confirmed = {}
    for key, label in (("auto", picked), ("tune", tuned)):
        regret = by_label[label].confirmed_regret(best) if label in by_label else None
        confirmed[key] = regret
        if regret is not None and by_label[label] is not best:
            mine, theirs = by_label[label].duel or ([], [])
            print(f"  head to head, {key}'s pick against the fastest: "
                  f"{statistics.median(mine) * 1e3:.2f} against "
                  f"{statistics.median(theirs) * 1e3:.2f} ms ({len(mine)} and {len(theirs)} "
                  f"bursts): confirmed regret {regret:+.1%}")
    pipe = next((r.measured for r in runs if r.label.startswith("plain 1F1B")), float("nan"))
    one = by_label["one device (unpartitioned)"].measured
    row = {"case": f"{case.name} x{devices}", "auto_regret": auto / best.measured - 1,
           "tune_regret": tune / best.measured - 1, "vs_1f1b": auto / pipe,
           "vs_one_device": auto / one, "best": best.label,
           "auto_confirmed": confirmed["auto"], "tune_confirmed": confirmed["tune"],
           "ratios": [(r.kind, r.measured / r.predicted) for r in runs]}
    print(f"  fastest: {best.label} ({best.measured * 1e3:.2f} ms); auto's regret "
          f"{row['auto_regret']:+.1%}, with tune=True {row['tune_regret']:+.1%}; auto / plain "
          f"1F1B = {row['vs_1f1b']:.2f}; auto / one device = {row['vs_one_device']:.2f}")
    return row


def _confirmed(row: dict[str, Any], key: str) -> float:
    """The head-to-head regret where one was timed, else the screening's."""
    value = row[f"{key}_confirmed"]
    return row[f"{key}_regret"] if value is None else value


def summary(rows: list[dict[str, Any]]) -> None:
    print("\n| case | auto's regret (confirmed) | tune=True regret (confirmed) | auto / 1F1B |"
          " auto / one device | measured fastest |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['case']} | {r['auto_regret']:+.1%} ({_confirmed(r, 'auto'):+.1%}) | "
              f"{r['tune_regret']:+.1%} ({_confirmed(r, 'tune'):+.1%}) | "
              f"{r['vs_1f1b']:.2f} | {r['vs_one_device']:.2f} | {r['best']} |")
    for key in ("auto", "tune"):
        for name, values in ((f"{key}_regret", [r[f"{key}_regret"] for r in rows]),
                             (f"{key}_regret confirmed", [_confirmed(r, key) for r in rows])):
            print(f"{name}: median {statistics.median(values):+.1%}, max {max(values):+.1%}")
    kinds: dict[str, list[float]] = {}
    for r in rows:
        for kind, ratio in r["ratios"]:
            kinds.setdefault(kind, []).append(ratio)
    print("\nmeasured / predicted, median over the candidates of each kind:")
    for kind, ratios in sorted(kinds.items()):
        print(f"  {kind:32} {statistics.median(ratios):5.2f}  ({len(ratios)} candidates, "
              f"{min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--devices", default="2,4", help="device counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5,
                        help="bursts of timed steps per candidate")
    parser.add_argument("--burst", type=float, default=0.2,
                        help="seconds of steps back to back in each burst (at least one "
                             "step): a step timed alone after its process sat idle ran "
                             "up to 1.5x slow")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate")
    parser.add_argument("--max-foreign", type=float, default=0.15,
                        help="discard a burst if other processes kept more than this share "
                             "of the cores busy during it (1 keeps every step)")
    parser.add_argument("--max-attempts", type=int, default=40)
    parser.add_argument("--confirm", type=int, default=8,
                        help="bursts each when auto's or tune's pick is timed head to head "
                             "with the fastest (0: never)")
    parser.add_argument("--confirm-burst", type=float, default=0.5,
                        help="seconds of steps in each head-to-head burst")
    parser.add_argument("--confirm-above", type=float, default=0.03,
                        help="time a pick head to head when its screened regret is above "
                             "this share")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    rows = []
    for case in [c for c in CASES if not names or c.name in names]:
        for devices in [int(d) for d in args.devices.split(",")]:
            runs, picked, (model, x) = contenders(case, devices)
            tuned = partition(copy.deepcopy(model), ["cpu"] * devices, example_inputs=(x,),
                              tune=True)
            tuned_label = next(r["label"] for r in tuned.plan.candidates if r.get("chosen"))
            said = next((n for n in tuned.plan.notes if n.startswith("tuned:")), "")
            tuned.close()
            del tuned
            gc.collect()
            release_host_memory()  # the contenders' processes start next: hand back the heap
            print(f"\n{case.name} x{devices}, tune=True in this process: {said}")
            runs, discarded = time_all(runs, args.rounds, args.warmup, args.max_foreign,
                                       args.max_attempts, args.burst, (picked, tuned_label),
                                       args.confirm, args.confirm_above,
                                       args.confirm_burst)
            rows.append(report(case, devices, runs, picked, tuned_label))
            if discarded:
                print(f"  ({discarded} bursts discarded: other processes were busy)")
            del runs, model, x
            gc.collect()
    summary(rows)


if __name__ == "__main__":
    main()
