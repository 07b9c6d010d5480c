"""One rank of the mixed-precision test: ``python precision_worker.py``.

Trains the same small transformer with ``partition_distributed(pp=2, precision=...)`` in
fp32 and in bf16, in one world, and prints ``RESULT {json}`` with the losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from partitioner.distributed import partition_distributed

torch.set_num_threads(1)
VOCAB = 50


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, 32),
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        nn.Linear(32, VOCAB))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def main() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (8, 12), generator=g)
    y = torch.randint(0, VOCAB, (8, 12), generator=g)
    record: dict[str, object] = {}
    for precision in ("fp32", "bf16"):
        dpm = partition_distributed(transformer(), (x,), pp=2, chunks=2, schedule="1f1b",
                                    balance=[2, 2], precision=precision)
        opt = torch.optim.Adam(dpm.parameters(), lr=1e-2)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            losses.append(dpm.step(x, y, loss_fn))
            opt.step()
        record[precision] = losses
        record[f"{precision}_plan"] = dpm.plan.precision
        record[f"{precision}_grads"] = sorted({str(p.dtype) for p in dpm.parameters()})
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **record}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
