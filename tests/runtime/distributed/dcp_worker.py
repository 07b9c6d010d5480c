"""One rank of the sharded-checkpoint tests: ``python dcp_worker.py <json args>``.

Trains two steps on one mesh and saves to a folder (``write``), or builds the model with
other weights on another mesh and loads the folder; then trains two more steps and prints
their losses (``RESULT {json}``) for ``tests/runtime/distributed/test_sharded_checkpoint.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import mlp

from partitioner.distributed import partition_distributed
from partitioner.runtime.distributed.failure import FailurePolicy

torch.set_num_threads(1)
POLICY = FailurePolicy(timeout=8.0, interval=0.2, exit_code=17)
BATCH = 8
WIDTHS = (8, 16, 16, 16, 16, 8)


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return mlp(WIDTHS).double()


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=generator, dtype=torch.float64),
             torch.randn(BATCH, 8, generator=generator, dtype=torch.float64))
            for _ in range(steps)]


def train(dpm: Any, optimizer: Any, data: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> list[float]:
    local = BATCH // dpm.mesh.shape.dp
    rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x[rows], y[rows], F.mse_loss))
        optimizer.step()
    return losses


def main(args: dict[str, Any]) -> None:
    data = batches(4)
    mesh = args["mesh"]
    model = build(0 if args["write"] else 7)  # a reader's weights must all come from disk
    dpm = partition_distributed(model, (data[0][0][:BATCH // mesh.get("dp", 1)],),
                                chunks=2, failure=POLICY, sharding=args.get("sharding"),
                                **mesh)
    optimizer = dpm.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    if args["write"]:
        train(dpm, optimizer, data[:2])
        dpm.save(args["folder"], optimizer)
        if args.get("one_file"):
            dpm.save(args["one_file"], optimizer)
    else:
        dpm.load(args["folder"], optimizer)
    losses = train(dpm, optimizer, data[2:])
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "losses": losses,
                                  "steps": dpm.steps}), flush=True)
    dpm.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    dist.destroy_process_group()
