"""One rank of a run that torchrun restarts: ``restart_worker.py <folder> <steps> <crash>``.

Every step ends with ``dpm.save`` to ``<folder>/last.pt``. In torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT == 0``) rank 1 dies after step ``crash`` (before its save), so
torchrun stops the world and starts it again; the new world loads the last checkpoint with
``dpm.load`` and trains the remaining steps. Rank 0 finally writes ``<folder>/final.pt``
and reports the largest difference to the same steps run uninterrupted on one unpartitioned
model, and which step each attempt started from.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partitioner.distributed import partition_distributed

torch.set_num_threads(1)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 8)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 8, generator=g, dtype=torch.float64),
            torch.randn(8, 8, generator=g, dtype=torch.float64))


def uninterrupted(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def main() -> None:
    folder, steps, crash = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = build()
    reference = copy.deepcopy(model)
    dpm = partition_distributed(model, batch(0)[:1], pp=2, chunks=2, schedule="1f1b")
    optimizer = dpm.make_optimizer(torch.optim.Adam, lr=0.01)
    last = folder / "last.pt"
    if last.exists():
        dpm.load(last, optimizer)
    start = dpm.steps
    rank = dist.get_rank()
    record = dict(rank=rank, attempt=attempt, start=start,
                  agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
                  port=os.environ.get("MASTER_PORT"))
    print("ATTEMPT " + json.dumps(record), flush=True)
    for step in range(start, steps):
        x, y = batch(step)
        optimizer.zero_grad()
        dpm.step(x, y, F.mse_loss)
        optimizer.step()
        if attempt == 0 and rank == 1 and step == crash:
            os._exit(3)   # a crash: no save, no clean shutdown
        dpm.save(last, optimizer)
    dpm.save(folder / "final.pt")
    if rank == 0:
        final = torch.load(folder / "final.pt", weights_only=True)["model"]
        expected = uninterrupted(reference, steps)
        diff = max((final[k] - expected[k]).abs().max().item() for k in expected)
        print("RESULT " + json.dumps(dict(attempt=attempt, start=start, steps=dpm.steps,
                                          max_diff=diff)), flush=True)
    dpm.close()


if __name__ == "__main__":
    main()
