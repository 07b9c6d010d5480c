"""The main job: partition a model over 4 CPU devices and train it.

Builds a plain residual MLP classifier, lets ``partition`` choose from the layers' costs how
to spread it over the devices (pipeline stages and their schedule, tensor parallelism or
data-parallel replicas: whatever it predicts fastest here), trains it for a few hundred
steps on a synthetic task (labels from a fixed random "teacher" network, so there is
something to learn) with ``pm.step``, prints the loss as it falls and the plan as a table,
and writes the plan to ``out/plan.json``.

Run: ``python examples/train_pipeline.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from partitioner import partition

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, for examples.models
from examples.models import classifier


def synthetic_batch(teacher: nn.Module, batch: int, features: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, features, generator=generator)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="number of CPU devices")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--checkpoint", default="except_last",
                        choices=["always", "except_last", "never"])
    parser.add_argument("--out", default="out/plan.json", help="where the plan is written")
    args = parser.parse_args()

    torch.manual_seed(0)
    features, classes = 32, 8
    teacher = nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, classes))
    model = classifier(features, width=128, depth=6, classes=classes)
    data = torch.Generator().manual_seed(1)
    example, _ = synthetic_batch(teacher, args.batch, features, data)

    pm = partition(model, devices=["cpu"] * args.devices, strategy="auto",
                   example_inputs=(example,), chunks=args.chunks, checkpoint=args.checkpoint)
    print(pm.plan.table())
    print(pm.plan.explain().splitlines()[-1], end="\n\n")

    optimizer = torch.optim.Adam(pm.parameters(), lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    start, running = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        x, y = synthetic_batch(teacher, args.batch, features, data)
        optimizer.zero_grad()
        loss = pm.step(x, y, loss_fn)  # forward and backward in the plan's schedule
        optimizer.step()
        running.append(loss)
        if step == 1 or step % 50 == 0:
            recent = sum(running[-50:]) / len(running[-50:])
            print(f"step {step:4d}  loss {recent:.4f}")
    elapsed = time.perf_counter() - start
    first, last = running[0], sum(running[-20:]) / 20
    print(f"\n{args.steps} steps in {elapsed:.1f} s ({elapsed / args.steps * 1e3:.1f} ms/step); "
          f"loss {first:.3f} -> {last:.3f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pm.plan.save(out)
    print(f"plan written to {out}")
    pm.close()


if __name__ == "__main__":
    main()
