"""One rank of the FSDP sharding tests: ``python fsdp_worker.py <scenario> <json args>``.

Launched by ``tests/distributed_harness.py`` with torchrun's variables set; prints
``RESULT {json}`` lines for ``tests/runtime/distributed/test_fsdp.py``.
"""

from __future__ import annotations

import copy
import json
import os
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
    local = BATCH // dpm.mesh.shape.dp
    rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
    losses, norms = [], []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x[rows], y[rows], F.mse_loss))
        if clip is not None:
            norms.append(float(dpm.clip_grad_norm_(clip)))
        optimizer.step()
    return losses, norms


def whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def local_elements(tensor: torch.Tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    return int((to_local() if to_local is not None else tensor).numel())


def scenario_equal(args: dict[str, Any]) -> None:
    """Three steps with FSDP and with plain data parallelism, per optimizer (float64, or
    float32 with ``"dtype": "float32"``: FSDP's fp32 reduce-scatter is another code path)."""
    dtype = getattr(torch, args.get("dtype", "float64"))
    model = build().to(dtype)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(3)]
    options = dict(pp=args["pp"], dp=args["dp"], chunks=args.get("chunks", 2),
                   failure=POLICY)
    example = (data[0][0][:BATCH // args["dp"]],)
    recipes: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    }
    for name, (cls, hyper) in recipes.items():
        plain = partition_distributed(copy.deepcopy(model), example, **options)
        sharded = partition_distributed(copy.deepcopy(model), example, **options,
                                        sharding="fsdp")
        plain_optimizer = cls(plain.parameters(), **hyper)
        plain_losses, plain_norms = train(plain, plain_optimizer, data, clip=0.01)
        optimizer = sharded.make_optimizer(cls, **hyper)
        losses, norms = train(sharded, optimizer, data, clip=0.01)
        # An evaluation gathers the parameters; the step after it must not run on them.
        local = BATCH // args["dp"]
        rows = slice(sharded.mesh.replica * local, (sharded.mesh.replica + 1) * local)
        x, y = data[0][0][rows], data[0][1][rows]
        eval_diff = abs(sharded.evaluate(x, y, F.mse_loss) - plain.evaluate(x, y, F.mse_loss))
        plain_optimizer.step()  # the optimizers step again on the gradients they hold
        optimizer.step()
        mine = {n: whole(p.detach()) for n, p in sharded.stage.named_parameters()}
        theirs = dict(plain.stage.named_parameters())
        state = sum(local_elements(v) for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        params = sum(p.numel() for p in plain.parameters())
        report(rank=dist.get_rank(), optimizer=name, eval_diff=eval_diff,
               weight_diff=max(float((mine[k] - theirs[k]).abs().max()) for k in mine),
               loss_diff=max(abs(a - b) for a, b in zip(losses, plain_losses)),
               norm_diff=max(abs(a - b) for a, b in zip(norms, plain_norms)),
               clipped=min(plain_norms) > 0.01,
               moved=max(float((mine[k] - v).abs().max())
                         for k, v in model.state_dict().items()
                         if k in mine and mine[k].shape == v.shape),
               param_elements=sum(local_elements(p) for p in sharded.parameters()),
               grad_elements=sum(local_elements(p.grad) for p in sharded.parameters()
                                 if p.grad is not None),
               plain_param_elements=params, state_elements=state,
               plain_state_elements=params * (2 if name == "adamw" else 1))
        plain.close()
        sharded.close()


def _gathered_counter(units: list[nn.Module]) -> list[int]:
    """Record, as each layer's forward begins (after FSDP's own hook has gathered it), how
    many of the layers are gathered whole."""
    seen: list[int] = []

    def count(*_: Any) -> None:
        seen.append(sum(u._get_fsdp_state()._fsdp_param_groups[0].is_unsharded
                        for u in units))

    for unit in units:
        unit.register_forward_pre_hook(count)
    return seen


def scenario_layers(args: dict[str, Any]) -> None:
    """Each layer its own FSDP unit (outlined for a torch.export capture): two steps of SGD
    equal plain data parallelism, and how many layers a rank holds gathered at once."""
    import hf_models

    family, chunks, dp = args["model"], args["chunks"], args["dp"]
    if family == "mlp":
        torch.manual_seed(0)
        model = mlp((8,) + (16,) * 8 + (8,)).double()
        data = batches(2)
        loss_fn = F.mse_loss
    else:
        torch.manual_seed(0)
        model = hf_models.build(family).double()
        data = hf_models.batches(2)
        loss_fn = hf_models.loss_fn
    rows_all = data[0][0].shape[0]
    options = dict(pp=args.get("pp", 1), dp=dp, chunks=chunks, failure=POLICY)
    example = (data[0][0][:rows_all // dp],)
    plain = partition_distributed(copy.deepcopy(model), example, **options)
    sharded = partition_distributed(copy.deepcopy(model), example, **options, sharding="fsdp")
    units = list(sharded._fsdp.units)
    seen = _gathered_counter(units)
    local = rows_all // dp
    rows = slice(sharded.mesh.replica * local, (sharded.mesh.replica + 1) * local)
    results = []
    for dpm in (plain, sharded):
        optimizer = torch.optim.SGD(dpm.parameters(), lr=0.1)
        losses = []
        for x, y in data:
            optimizer.zero_grad()
            losses.append(dpm.step(x[rows], y[rows], loss_fn))
            optimizer.step()
        results.append(losses)
    mine = {n: whole(p.detach()) for n, p in sharded.stage.named_parameters()}
    theirs = dict(plain.stage.named_parameters())
    report(rank=dist.get_rank(), units=len(units), seen=seen,
           names_equal=sorted(mine) == sorted(theirs),
           loss_diff=max(abs(a - b) for a, b in zip(*results)),
           weight_diff=max(float((mine[k] - theirs[k]).abs().max()) for k in mine),
           param_elements=sum(local_elements(p) for p in sharded.parameters()),
           plain_param_elements=sum(p.numel() for p in plain.parameters()))
    plain.close()
    sharded.close()


def scenario_refuse(args: dict[str, Any]) -> None:
    """A model too small for the mesh: every rank refuses, naming the sizes."""
    tiny = nn.Sequential(nn.Linear(4, 1), nn.Tanh(), nn.Linear(1, 1))
    try:
        partition_distributed(tiny, (torch.randn(2, 4),), pp=1, dp=int(os.environ["WORLD_SIZE"]),
                              sharding="fsdp", failure=POLICY)
        report(rank=dist.get_rank(), error=None)
    except StrategyError as error:
        report(rank=dist.get_rank(), error=str(error))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](json.loads(sys.argv[2]))
    dist.destroy_process_group()
