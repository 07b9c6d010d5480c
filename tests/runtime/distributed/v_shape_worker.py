"""One rank of the multi-process V tests: ``python v_shape_worker.py '{"dir": ...}'``.

Launched by ``tests/distributed_harness.py`` with two ranks. Trains float64 models with
``schedule="v_shape"`` (rank 0 holds the first and the last virtual stage, rank 1 the turn),
with 1F1B and in one process, saves, loads and resumes a V run, and lets
``strategy="auto"`` choose one; prints ``RESULT {json}`` lines for ``test_v_shape_ranks.py``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import LongSkip

from partitioner import Options, Schedule
from partitioner.distributed import partition_distributed
from partitioner.runtime.distributed.failure import FailurePolicy

torch.set_num_threads(1)
POLICY = FailurePolicy(timeout=4.0, interval=0.2, exit_code=17)
Data = list[tuple[torch.Tensor, torch.Tensor]]


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


class TiedEnds(nn.Module):
    """Four layers, the first and the last sharing one weight: in a V of 2 ranks both land
    on rank 0 (virtual stages 0 and 3), so the tie never crosses a rank."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.third, self.last = nn.Linear(8, 8), nn.Linear(8, 8)
        self.last.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.second(torch.tanh(self.first(x))))
        return self.last(torch.tanh(self.third(x)))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return (LongSkip(8) if name == "longskip" else TiedEnds()).double()


def batches(steps: int) -> Data:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g, dtype=torch.float64),
             torch.randn(8, 8, generator=g, dtype=torch.float64)) for _ in range(steps)]


def reference_run(model: nn.Module, data: Data) -> tuple[nn.Module, list[float]]:
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return reference, losses


def train(dpm: Any, optimizer: torch.optim.Optimizer, data: Data) -> list[float]:
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x, y, F.mse_loss))
        optimizer.step()
    return losses


def diff(dpm: Any, expected: dict[str, torch.Tensor]) -> float:
    return max(float((v - expected[k]).abs().max()) for k, v in dpm.state_dict().items())


def scenario_train(name: str) -> None:
    """The V, 1F1B and the whole model: same losses, same weights."""
    model, data = build(name), batches(3)
    reference, ref_losses = reference_run(model, data)
    record: dict[str, Any] = {"case": f"train-{name}", "ref_losses": ref_losses}
    for schedule, virtual in (("v_shape", 2), ("1f1b", None)):
        dpm = partition_distributed(copy.deepcopy(model), example_inputs=(data[0][0],), pp=2,
                                    chunks=4, schedule=schedule, virtual_stages=virtual,
                                    failure=POLICY)
        sgd = torch.optim.SGD(list(dpm.parameters()), lr=0.05, momentum=0.9)
        record[schedule] = {"losses": train(dpm, sgd, data),
                            "diff": diff(dpm, reference.state_dict()),
                            "keys": sorted(dpm.state_dict()),
                            "stages": sorted(dpm.pipeline.runners),
                            "last": dpm.is_last_stage}
        record["rank"] = dist.get_rank()
        dpm.close()
    report(**record)


def scenario_resume(folder: Path) -> None:
    """Save a V run mid-way to a file and to a folder; resume from the file under the V and
    from the folder under 1F1B (a checkpoint holds the model's keys, not the schedule's
    stages), each from another initialization, and end where the straight run ends."""
    data = batches(4)

    def partitioned(seed: int, options: Options) -> tuple[Any, torch.optim.Optimizer]:
        dpm = partition_distributed(build("longskip", seed), example_inputs=(data[0][0],),
                                    pp=2, options=options, failure=POLICY)
        return dpm, torch.optim.Adam(dpm.parameters(), lr=0.01)

    v = Options(schedule=Schedule("v_shape", chunks=4, virtual_stages=2))
    first, adam = partitioned(0, v)
    train(first, adam, data[:2])
    first.save(folder / "mid.pt", adam)
    first.save(folder / "mid", adam)
    straight = train(first, adam, data[2:])
    first.save(folder / "straight.pt", adam)
    first.close()
    record: dict[str, Any] = {"case": "resume", "rank": dist.get_rank(), "straight": straight}
    for where, options in (("mid.pt", v), ("mid", Options(schedule=Schedule("1f1b", 4)))):
        second, adam2 = partitioned(123, options)
        second.load(folder / where, adam2)
        steps = second.steps
        losses = train(second, adam2, data[2:])
        second.save(folder / f"resumed-{where}.pt", adam2)
        second.close()
        record[where] = {"losses": losses, "steps": steps, "diff": None}
        if dist.get_rank() == 0:
            ended = torch.load(folder / "straight.pt")["model"]
            resumed = torch.load(folder / f"resumed-{where}.pt")["model"]
            record[where]["diff"] = max(float((resumed[k] - t).abs().max())
                                        for k, t in ended.items())
    report(**record)


def scenario_auto() -> None:
    """``strategy="auto"`` across processes, asked for the V: it chooses the chunks and
    virtual stages and runs the V it chose."""
    model, (x, y) = build("longskip"), batches(1)[0]
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), y).backward()
    dpm = partition_distributed(copy.deepcopy(model), example_inputs=(x,), pp=2,
                                strategy="auto", schedule="v_shape", failure=POLICY)
    dpm.step(x, y, F.mse_loss)
    want = dict(reference.named_parameters())
    grads = {k: float((p.grad - want[k].grad).abs().max())
             for k, p in dpm.stage.named_parameters()}
    report(case="auto", rank=dist.get_rank(), schedule=dpm.plan.schedule,
           virtual=dpm.plan.virtual_stages, grads=grads,
           labels=[c["label"] for c in dpm.plan.candidates])
    dpm.close()


def main() -> None:
    args = json.loads(sys.argv[1])  # {"dir": a folder every rank sees}
    for name in ("longskip", "tied"):
        scenario_train(name)
    scenario_resume(Path(args["dir"]))
    scenario_auto()
    dist.barrier()


if __name__ == "__main__":
    main()
