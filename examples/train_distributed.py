"""Train a model partitioned over processes: pipeline stages x data-parallel replicas
(x tensor-parallel shards of each stage's weight matrices, with ``--tp``).

Run with 4 processes (2 pipeline stages x 2 replicas by default):

    torchrun --nproc-per-node 4 examples/train_distributed.py
    python -m partitioner.launch --nproc-per-node 4 examples/train_distributed.py --pp 4
    torchrun --nproc-per-node 4 examples/train_distributed.py --pp 2 --tp 2   # pp x tp

Every rank builds the same plain model and the same plan, keeps its own stage, and reads
its replica's shard of each epoch (``ReplicaSampler``). Rank 0 prints the plan, the loss as
it falls, and finally writes one consolidated checkpoint, which it loads back into an
ordinary, unpartitioned copy of the model to measure its accuracy on held-out data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from partitioner.distributed import partition_distributed
from partitioner.runtime.distributed.sampler import ReplicaSampler

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, for examples.models
from examples.models import classifier


def synthetic(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Random inputs and the labels one fixed random teacher network gives them."""
    teacher_g, data_g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, classes))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=teacher_g) * 0.5)
        x = torch.randn(samples, features, generator=data_g)
        return TensorDataset(x, teacher(x).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2,
                        help="pipeline stages (dp = world / (pp * tp))")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel shards of each stage (Megatron column/row pairs)")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="clip gradients to this total norm (0: no clipping)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--checkpoint", default="never",
                        choices=["never", "except_last", "always"])
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many (0: all)")
    parser.add_argument("--out", default="out/distributed.pt", help="checkpoint path")
    args = parser.parse_args()

    features, classes = 32, 8
    torch.manual_seed(0)    # the same initial model on every rank
    model = classifier(features, width=128, depth=6, classes=classes)
    train = synthetic(args.samples, features, classes, seed=1)
    held_out = synthetic(1024, features, classes, seed=2)

    dpm = partition_distributed(model, example_inputs=(train.tensors[0][:args.batch],),
                                pp=args.pp, tp=args.tp, chunks=args.chunks,
                                schedule=args.schedule,
                                checkpoint=args.checkpoint)
    leader = dist.get_rank() == 0
    if leader:
        print(dpm.plan.table())
        shape = dpm.mesh.shape
        print(f"{dist.get_world_size()} ranks: pp={shape.pp} x dp={shape.dp} x tp={shape.tp}"
              f", {args.batch} samples per replica per step\n")

    sampler = ReplicaSampler.from_mesh(train, dpm.mesh, batch_size=args.batch, seed=0,
                                       drop_last=True)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True)
    optimizer = torch.optim.Adam(dpm.parameters(), lr=2e-3)
    start, step, first = time.perf_counter(), 0, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = dpm.step(x, y, F.cross_entropy)
            if args.clip > 0:  # the whole model's norm, each gradient counted once
                dpm.clip_grad_norm_(args.clip)
            optimizer.step()
            step += 1
            first = loss if first is None else first
            if leader and (step == 1 or step % 20 == 0):
                print(f"epoch {epoch}  step {step:4d}  loss {loss:.4f}")
            if step == args.steps:
                break
        if step == args.steps:
            break
    elapsed = time.perf_counter() - start
    dpm.eval()
    held_loss = dpm.evaluate(held_out.tensors[0], held_out.tensors[1], F.cross_entropy)
    if leader:
        print(f"\n{step} steps in {elapsed:.1f} s ({elapsed / max(step, 1) * 1e3:.1f} ms/step);"
              f" loss {first:.3f} -> {loss:.3f}; held-out loss {held_loss:.3f}")

    dpm.save(args.out, optimizer)
    if leader:
        plain = classifier(features, width=128, depth=6, classes=classes)
        plain.load_state_dict(torch.load(args.out, weights_only=True)["model"])
        with torch.no_grad():
            logits = plain(held_out.tensors[0])
        accuracy = (logits.argmax(dim=1) == held_out.tensors[1]).float().mean().item()
        print(f"checkpoint written to {args.out}; the unpartitioned model loaded from it "
              f"scores {accuracy:.1%} on held-out data "
              f"(loss {F.cross_entropy(logits, held_out.tensors[1]).item():.3f})")


if __name__ == "__main__":
    main()
