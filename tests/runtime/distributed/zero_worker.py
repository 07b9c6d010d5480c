"""One rank of the sharded-optimizer tests: ``python zero_worker.py <scenario> <json args>``.

Launched by ``tests/distributed_harness.py`` with torchrun's variables set; prints
``RESULT {json}`` lines for ``tests/runtime/distributed/test_zero.py``.
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
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import mlp

from partitioner.distributed import partition_distributed
from partitioner.errors import StrategyError
from partitioner.runtime.distributed.failure import FailurePolicy

torch.set_num_threads(1)
POLICY = FailurePolicy(timeout=8.0, interval=0.2, exit_code=17)
BATCH = 8  # rows of one step over all replicas


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def build() -> nn.Module:
    torch.manual_seed(0)
    return mlp((8, 16, 16, 16, 16, 8)).double()


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=generator, dtype=torch.float64),
             torch.randn(BATCH, 8, generator=generator, dtype=torch.float64))
            for _ in range(steps)]


def train(dpm: Any, optimizer: Any, data: list[tuple[torch.Tensor, torch.Tensor]], *,
          clip: float | None = None) -> tuple[list[float], list[float]]:
    """Steps over ``data``, each replica on its rows; the losses and gradient norms."""
    dp = dpm.mesh.shape.dp
    local = BATCH // dp
    rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
    losses, norms = [], []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x[rows], y[rows], F.mse_loss))
        if clip is not None:
            norms.append(float(dpm.clip_grad_norm_(clip)))
        optimizer.step()
    return losses, norms


def scenario_equal(args: dict[str, Any]) -> None:
    """Three steps with the sharded optimizer and with plain data parallelism, per optimizer."""
    model = build()
    data = batches(3)
    options = dict(pp=args["pp"], dp=args["dp"], tp=args.get("tp", 1), chunks=2,
                   failure=POLICY)
    example = (data[0][0][:BATCH // args["dp"]],)
    recipes: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    }
    for name, (cls, hyper) in recipes.items():
        plain = partition_distributed(copy.deepcopy(model), example, **options)
        sharded = partition_distributed(copy.deepcopy(model), example, **options,
                                        optimizer_sharding=True)
        plain_losses, plain_norms = train(plain, plain.make_optimizer(cls, **hyper), data,
                                          clip=0.01)
        if args.get("generic"):  # NCCL's collectives (in-place reduce-scatter, all-gather)
            sharded._sharded._gloo = False
        optimizer = sharded.make_optimizer(cls, **hyper)
        losses, norms = train(sharded, optimizer, data, clip=0.01)
        mine, theirs = sharded.stage.state_dict(), plain.stage.state_dict()
        state = sum(v.numel() for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        plain_state = sum(p.numel() for p in plain.parameters()) * (2 if name == "adamw" else 1)
        report(rank=dist.get_rank(), optimizer=name,
               weight_diff=max(float((mine[k] - theirs[k]).abs().max()) for k in mine),
               loss_diff=max(abs(a - b) for a, b in zip(losses, plain_losses)),
               norm_diff=max(abs(a - b) for a, b in zip(norms, plain_norms)),
               clipped=min(plain_norms) > 0.01,
               moved=max(float((mine[k] - v).abs().max())
                         for k, v in model.state_dict().items()
                         if k in mine and mine[k].shape == v.shape),
               grads_in_buffer=_grads_in_buffer(sharded),
               state_elements=state, plain_state_elements=plain_state)
        plain.close()
        sharded.close()


def _grads_in_buffer(dpm: Any) -> bool:
    """Whether every parameter and its ``.grad`` are views of the flat buffers."""
    data, grad = _storages(dpm, "data"), _storages(dpm, "grad")
    return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in grad
               and p.untyped_storage().data_ptr() in data for p in dpm.parameters())


def _storages(dpm: Any, buffer: str) -> set[int]:
    """Where the flat ``buffer`` (``"data"``, ``"grad"``) of each shard lives."""
    return {getattr(s, buffer).untyped_storage().data_ptr() for s in dpm._sharded.shards
            if hasattr(s, buffer)}


class Allocations(TorchDispatchMode):
    """The largest tensor any op makes in new memory (not in a known buffer) while active."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.largest = max(self.largest, t.numel())
        return out


def scenario_lean(args: dict[str, Any]) -> None:
    """The largest new tensor of a training step (after one to warm up) against the stage's
    parameter count, and whether the gradients stay views of the flat buffer."""
    dp = args["dp"]
    data = batches(2)
    example = (data[0][0][:BATCH // dp],)
    dpm = partition_distributed(build(), example, pp=1, dp=dp, failure=POLICY,
                                optimizer_sharding=True)
    optimizer = dpm.make_optimizer(torch.optim.Adam, lr=0.01)
    train(dpm, optimizer, data[:1], clip=1.0)
    mode = Allocations(_storages(dpm, "data") | _storages(dpm, "grad"))
    with mode:
        train(dpm, optimizer, data[1:], clip=1.0)
    x, y = data[1]
    rows = slice(dpm.mesh.replica * (BATCH // dp), (dpm.mesh.replica + 1) * (BATCH // dp))
    try:  # a second step onto the reduced gradients, without zero_grad
        dpm.step(x[rows], y[rows], F.mse_loss)
        error = ""
    except StrategyError as caught:
        error = str(caught)
    report(rank=dist.get_rank(), largest=mode.largest,
           params=sum(p.numel() for p in dpm.parameters()),
           grads_in_buffer=_grads_in_buffer(dpm), error=error)


def scenario_resume(args: dict[str, Any]) -> None:
    """Train (or load) and report the losses of steps 3 and 4 (and save after step 2)."""
    data = batches(4)
    dp, path = args["dp"], Path(args["path"])
    sharding = dp > 1
    example = (data[0][0][:BATCH // dp],)
    if args["write"]:
        model = build()
    else:
        torch.manual_seed(7)  # another initialisation: everything must come from the file
        model = mlp((8, 16, 16, 16, 16, 8)).double()
    dpm = partition_distributed(model, example, pp=1, dp=dp, failure=POLICY,
                                optimizer_sharding=sharding)
    optimizer = dpm.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    if args["write"]:
        train(dpm, optimizer, data[:2])
        dpm.save(path, optimizer)
    else:
        dpm.load(path, optimizer)
    losses, _ = train(dpm, optimizer, data[2:])
    report(rank=dist.get_rank(), losses=losses, steps=dpm.steps)
    if dp == 1:
        try:
            partition_distributed(build(), example, pp=1, dp=1, optimizer_sharding=True)
        except StrategyError as error:
            report(rank=dist.get_rank(), error=str(error))


def scenario_resume_tp(args: dict[str, Any]) -> None:
    """tp=2 x dp=2, sharded: four steps saving after the second, then a fresh model of
    other weights loads that checkpoint and runs the last two; both losses reported."""
    data = batches(4)
    path = Path(args["path"])

    def run(seed: int, load: bool) -> list[float]:
        torch.manual_seed(seed)
        model = mlp((8, 16, 16, 16, 8)).double()
        dpm = partition_distributed(model, (data[0][0][:BATCH // 2],), pp=1, dp=2, tp=2,
                                    failure=POLICY, optimizer_sharding=True)
        optimizer = dpm.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        if load:
            dpm.load(path, optimizer)
            losses, _ = train(dpm, optimizer, data[2:])
        else:
            train(dpm, optimizer, data[:2])
            dpm.save(path, optimizer)
            losses, _ = train(dpm, optimizer, data[2:])
        dpm.close()
        return losses

    written = run(0, load=False)
    report(rank=dist.get_rank(), written=written, resumed=run(7, load=True))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](json.loads(sys.argv[2]))
    dist.destroy_process_group()
