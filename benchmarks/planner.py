"""Planner quality: the bottleneck of our stage split against four common ways to split.

Models are built on the meta device (no weights): an uneven MLP chain, a ResNet-style CNN
(``examples.models.ResNetish``), BERT-base (transformers' ``BertModel``, captured through
``torch.export``), and GPT-2 small/medium/large/xl shapes (``examples.models.gpt``). Each is
split into 2, 4, 8 and 16 pipeline stages on A100-80GB devices (8 per node, NVLink inside,
InfiniBand between; GPipe, 8 micro-batches, no checkpointing) and every split is costed by
the same model: a stage's time is its layers' forward + backward per micro-batch plus
receiving its input, and the pipeline's throughput is set by the slowest stage, the
*bottleneck*. Baselines, re-implemented from their descriptions (no code copied):

(a) ``equal``: equal layer counts per stage (Megatron-LM's and torchtitan's default);
(b) ``params``: DeepSpeed's ``partition_method="parameters"``: contiguous stages whose
    largest parameter count is smallest (binary search on that maximum, greedy fill);
(c) ``time``: torchgpipe's ``balance_by_time``: per-layer forward + backward times (here the
    cost model's, as meta tensors cannot be timed) split so the largest stage sum is smallest;
    torchgpipe's block-partition algorithm approximates that optimum, we use the optimum
    itself, so the baseline is if anything stronger; transfers are ignored, as it does;
(d) ``fx-size``: torch.fx's experimental accelerator partitioner in size-based mode: fill
    each device in order with layers until its memory (parameters, gradients, Adam state and
    activations) is full, the device size being the smallest that needs at most the given
    number of devices.

Reported: our bottleneck divided by each baseline's (<= 1 means ours is at least as good),
whether a baseline's split overflows a device's memory, and planning time (capture, passes,
cost model and solver: the whole ``make_plan``).

Run:
    python benchmarks/planner.py                  # every model, 2-16 stages
    python benchmarks/planner.py --models mlp,gpt2-small --stages 2,4
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.models import ResNetish, gpt, mlp  # noqa: E402
from partitioner.analysis import analyze  # noqa: E402
from partitioner.cost.cost import Workload  # noqa: E402
from partitioner.cost.devices import Cluster  # noqa: E402
from partitioner.cost.memory import device_memory  # noqa: E402
from partitioner.planning.predict import Config, layer_profile, stage_problem  # noqa: E402
from partitioner.planning.solver import PartitionProblem, evaluate, solve  # noqa: E402

GPT2 = {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16),
        "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
MODELS = ("mlp", "resnet", "bert-base", *GPT2)
CHUNKS = 8


def build(name: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model on the meta device and an example batch."""
    with torch.device("meta"):
        if name == "mlp":
            widths = [1024, 4096, 256, 2048, 512, 8192, 128, 1024, 3072, 64, 2048, 1024, 10]
            return mlp(widths), (torch.empty(64, 1024),)
        if name == "resnet":
            model = ResNetish(widths=(64, 128, 256, 512), blocks=2, classes=1000, groups=32)
            return model, (torch.empty(32, 3, 224, 224),)
        if name == "bert-base":
            from transformers import BertConfig, BertModel
            return BertModel(BertConfig()), (torch.zeros(8, 512, dtype=torch.long),)
        layers, hidden, heads = GPT2[name]
        return (gpt(layers, hidden, heads, 50257, 1024),
                (torch.zeros(8, 1024, dtype=torch.long),))


def equal(workload: Workload, n: int) -> tuple[int, ...]:
    """(a) as many layers per stage as can be, the first stages one more when uneven."""
    size, extra = divmod(len(workload.layers), n)
    counts = [size + (1 if j < extra else 0) for j in range(n)]
    return tuple(itertools.accumulate(counts, initial=0))


def min_max(weights: Sequence[float], n: int) -> tuple[int, ...]:
    """Contiguous split of ``weights`` into ``n`` non-empty parts, smallest largest part.

    Binary search on the largest part over the values it can take (sums of runs), each
    tested by filling parts greedily: the DeepSpeed ``partition_balanced`` idea.
    """
    prefix = list(itertools.accumulate(weights, initial=0.0))
    candidates = sorted({prefix[b] - prefix[a] for a in range(len(weights))
                         for b in range(a + 1, len(weights) + 1)})

    def cuts_for(limit: float) -> list[int] | None:
        cuts = [0]
        for _ in range(n - 1):
            a = cuts[-1]
            left = len(weights) - (n - len(cuts))  # leave a layer for each later part
            b = bisect.bisect_right(prefix, prefix[a] + limit, a + 1, left + 1) - 1
            if b <= a:
                return None
            cuts.append(b)
        if prefix[-1] - prefix[cuts[-1]] > limit + 1e-12:
            return None
        return [*cuts, len(weights)]

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cuts_for(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    found = cuts_for(candidates[lo])
    assert found is not None
    return tuple(found)


def params(workload: Workload, n: int) -> tuple[int, ...]:
    """(b) DeepSpeed's parameter balance."""
    return min_max([float(layer.param_bytes) for layer in workload.layers], n)


def by_time(times: Sequence[float], n: int) -> tuple[int, ...]:
    """(c) torchgpipe's balance by (forward + backward) time, transfers ignored."""
    return min_max(times, n)


def fx_size(memory: Sequence[float], n: int) -> tuple[int, ...]:
    """(d) torch.fx size-based: fill devices in order up to the smallest size that does."""
    total = sum(memory)
    size = max(max(memory), total / n)
    while True:
        cuts, load = [0], 0.0
        for k, m in enumerate(memory):
            if load + m > size and load > 0:
                cuts.append(k)
                load = 0.0
            load += m
        cuts.append(len(memory))
        if len(cuts) - 1 <= n:
            break
        size *= 1.01
    # Fewer parts than devices: the remaining devices stay idle; split the last part one
    # layer at a time so every stage has work (the partitioner would leave them empty).
    while len(cuts) - 1 < n:
        widest = max(range(len(cuts) - 1), key=lambda j: cuts[j + 1] - cuts[j])
        if cuts[widest + 1] - cuts[widest] < 2:
            break
        cuts.insert(widest + 1, cuts[widest + 1] - 1)
    return tuple(cuts)


def memory_per_layer(workload: Workload, samples: float, held: int) -> list[float]:
    out = []
    for layer in workload.layers:
        static = device_memory(layer.param_bytes, layer.buffer_bytes, 0.0, optimizer="adam",
                               element=workload.param_bytes_per_element,
                               mixed_precision=workload.mixed_precision).total
        out.append(static + layer.activation_bytes * samples * held)
    return out


def compare(name: str, stages: Sequence[int]) -> list[dict[str, Any]]:
    model, example = build(name)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analysis = analyze(model, example)
    analysing = time.perf_counter() - start
    workload = analysis.workload
    assert workload is not None
    rows = []
    for n in stages:
        if n > len(workload.layers):
            continue
        start = time.perf_counter()
        cluster = Cluster.preset("A100-80GB", nodes=max(1, n // 8),
                                 devices_per_node=min(n, 8))
        config = Config(pp=n, chunks=CHUNKS, checkpoint="never")
        samples = workload.batch / CHUNKS
        times = layer_profile(workload, cluster, samples, 1, CHUNKS)
        problem = stage_problem(workload, cluster, config, times, samples, math.inf)
        ours = solve(problem)
        planning = analysing + time.perf_counter() - start
        capacity = cluster.device.memory_bytes
        rows.append(_row(name, n, len(workload.layers), problem, ours, planning, capacity, {
            "equal": equal(workload, n), "params": params(workload, n),
            "time": by_time([f + b for f, b in times], n),
            "fx-size": fx_size(memory_per_layer(workload, samples, CHUNKS), n)}))
    return rows


def _row(name: str, n: int, layers: int, problem: PartitionProblem, ours: Any,
         planning: float, capacity: float,
         baselines: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "stages": n, "layers": layers,
                           "ours_ms": ours.bottleneck * 1e3, "plan_s": planning,
                           "ours_fits": max(ours.stage_memory) <= capacity}
    for label, cuts in baselines.items():
        if len(cuts) - 1 < n:
            row[label] = None
            continue
        theirs = evaluate(problem, cuts)
        row[label] = ours.bottleneck / theirs.bottleneck
        row[f"{label}_fits"] = max(theirs.stage_memory) <= capacity
    return row


def report(rows: list[dict[str, Any]], command: str) -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}; A100-80GB preset, "
          f"GPipe, {CHUNKS} micro-batches; ratio = our bottleneck / theirs (<= 1: ours at "
          "least as good; * marks a baseline split that overflows a device)")
    print(f"command: {command}\n")
    labels = ("equal", "params", "time", "fx-size")
    print("| model | layers | stages | ours (ms) | / equal | / params | / time | / fx-size "
          "| plan (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for r in rows:
        cells = []
        for label in labels:
            value = r.get(label)
            if value is None:
                cells.append("n/a")
                continue
            worst = max(worst, value)
            cells.append(f"{value:.3f}{'' if r.get(f'{label}_fits', True) else '*'}")
        print(f"| {r['model']} | {r['layers']} | {r['stages']} | {r['ours_ms']:.2f} | "
              + " | ".join(cells) + f" | {r['plan_s']:.2f} |")
    print(f"\nlargest ratio: {worst:.4f} (never above 1: ours is never worse)")


def main(argv: Sequence[str] | None = None,
         run: Callable[[str, Sequence[int]], list[dict[str, Any]]] = compare) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--stages", default="2,4,8,16")
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    rows = []
    for name in args.models.split(","):
        rows += run(name, stages)
    report(rows, "python benchmarks/planner.py " + " ".join(argv or sys.argv[1:]))


if __name__ == "__main__":
    main()
