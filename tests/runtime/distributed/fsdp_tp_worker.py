"""One rank of the FSDP-over-tensor-parallelism tests: ``python fsdp_tp_worker.py <scenario>
<json args>``.

Launched by ``tests/distributed_harness.py`` with torchrun's variables set; prints
``RESULT {json}`` lines for ``tests/runtime/distributed/test_fsdp_tensor_parallel.py``.
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
from models import mlp
from tp_models import TinyGPT

from partitioner import checkpoint_to_state_dict
from partitioner.distributed import partition_distributed
from partitioner.errors import CheckpointError
from partitioner.runtime.distributed.failure import FailurePolicy

torch.set_num_threads(1)
POLICY = FailurePolicy(timeout=20.0, interval=0.2, exit_code=17)
BATCH = 8  # rows of one step over all replicas
CLIP = 0.01  # below every step's norm: clipping bites
HYPER = {"lr": 0.01, "weight_decay": 0.1}


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


KIND = "mlp"  # or "gpt": a TinyGPT, whose fused qkv is split over tp ranks in blocks
SEQ = 8


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if KIND == "gpt":
        return TinyGPT(n_layer=2, seq=SEQ).double()
    return mlp((8, 16, 16, 16, 16, 8)).double()


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    if KIND == "gpt":
        return [(torch.randint(0, 64, (BATCH, SEQ), generator=generator),
                 torch.randint(0, 64, (BATCH, SEQ), generator=generator)) for _ in range(steps)]
    return [(torch.randn(BATCH, 8, generator=generator, dtype=torch.float64),
             torch.randn(BATCH, 8, generator=generator, dtype=torch.float64))
            for _ in range(steps)]


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if KIND == "gpt":
        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())
    return F.mse_loss(outputs, targets)


def train(dpm: Any, optimizer: Any, data: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[list[float], list[float]]:
    """Steps over ``data``, each replica on its rows, clipped; the losses and norms."""
    local = BATCH // dpm.mesh.shape.dp
    rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
    losses, norms = [], []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x[rows], y[rows], loss_fn))
        norms.append(float(dpm.clip_grad_norm_(CLIP)))
        optimizer.step()
    return losses, norms


def train_whole(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[list[float], list[float]]:
    """The unpartitioned model on the whole batches, clipped alike."""
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    losses, norms = [], []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        losses.append(float(loss))
    return losses, norms


def whole(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict's entries whole (a DTensor's ``full_tensor()``: a collective)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def local_elements(tensors: Any) -> int:
    return sum(int((t.to_local() if hasattr(t, "to_local") else t).numel()) for t in tensors)


def state_elements(optimizer: torch.optim.Optimizer) -> int:
    return local_elements(v for s in optimizer.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def scenario_equal(args: dict[str, Any]) -> None:
    """Three clipped AdamW steps: FSDP over tp slices, plain tp x dp (both with sequence
    parallelism with ``"sp"``), the whole model."""
    model, data = build(), batches(3)
    options = dict(pp=args.get("pp", 1), dp=2, tp=2, chunks=2, failure=POLICY,
                   sequence_parallel=args.get("sp", False))
    example = (data[0][0][:BATCH // 2],)
    plain = partition_distributed(copy.deepcopy(model), example, **options)
    sharded = partition_distributed(copy.deepcopy(model), example, **options, sharding="fsdp")
    plain_optimizer = plain.make_optimizer(torch.optim.AdamW, **HYPER)
    optimizer = sharded.make_optimizer(torch.optim.AdamW, **HYPER)
    plain_losses, plain_norms = train(plain, plain_optimizer, data)
    losses, norms = train(sharded, optimizer, data)
    reference = copy.deepcopy(model)
    expected, expected_norms = train_whole(reference, data)
    # An evaluation gathers the parameters; they are resharded after it.
    x, y = data[0]
    local = BATCH // 2
    rows = slice(sharded.mesh.replica * local, (sharded.mesh.replica + 1) * local)
    eval_diff = abs(sharded.evaluate(x[rows], y[rows], loss_fn)
                    - plain.evaluate(x[rows], y[rows], loss_fn))
    mine, theirs = whole(sharded.state_dict()), plain.state_dict()
    truth = {k: v for k, v in reference.state_dict().items() if k in mine}
    report(rank=dist.get_rank(), stage=sharded.stage_index, shard=sharded.mesh.shard,
           losses=losses, plain_losses=plain_losses, expected=expected,
           norms=norms, plain_norms=plain_norms, expected_norms=expected_norms,
           eval_diff=eval_diff, weight_diff_plain=worst(mine, theirs),
           weight_diff_whole=worst(mine, truth),
           moved=worst(mine, {k: v for k, v in model.state_dict().items() if k in mine}),
           dtensors=sorted(k for k, v in sharded.state_dict().items()
                           if hasattr(v, "full_tensor")),
           param_elements=local_elements(sharded.parameters()),
           plain_param_elements=local_elements(plain.parameters()),
           grad_elements=local_elements(p.grad for p in sharded.parameters()
                                        if p.grad is not None),
           state_elements=state_elements(optimizer),
           plain_state_elements=state_elements(plain_optimizer))
    plain.close()
    sharded.close()


def scenario_resume(args: dict[str, Any]) -> None:
    """Two steps, a folder save, two more; then models of other weights load the folder
    (with FSDP, and without: another layout of the same mesh) and run the last two. Rank 0
    converts the folder to the whole model's state dict and writes it as one file, which an
    FSDP model loads too."""
    data, path = batches(4), Path(args["path"])
    pp = args.get("pp", 1)

    def run(seed: int, load: Path | None, sharding: str | None = "fsdp"
            ) -> tuple[list[float], dict[str, torch.Tensor], str | None]:
        dpm = partition_distributed(build(seed), (data[0][0][:BATCH // 2],), pp=pp, dp=2,
                                    tp=2, chunks=2, failure=POLICY, sharding=sharding)
        optimizer = dpm.make_optimizer(torch.optim.AdamW, **HYPER)
        error = None
        if load is not None:
            dpm.load(load, optimizer if load.is_dir() else None)
        else:
            train(dpm, optimizer, data[:2])
            dpm.save(path, optimizer)
            try:
                dpm.save(path.with_suffix(".pt"), optimizer)
            except CheckpointError as refused:
                error = str(refused)
        saved = whole(dpm.state_dict())
        if load is not None and not load.is_dir():  # load_state_dict: DTensors, whole tensors
            for state in ({k: v.clone() for k, v in dpm.state_dict().items()}, saved):
                with torch.no_grad():
                    for param in dpm.parameters():
                        param.zero_()
                dpm.load_state_dict(state)
                error = error or ("" if worst(whole(dpm.state_dict()), saved) == 0.0
                                  else "load_state_dict differs")
        losses = train(dpm, optimizer, data[2:])[0] if load is None or load.is_dir() else []
        dpm.close()
        return losses, saved, error

    written, saved, error = run(0, None)
    resumed, loaded, _ = run(7, path)
    plain, _, _ = run(7, path, None)
    file = path.with_name("whole.pt")
    record: dict[str, Any] = dict(rank=dist.get_rank(), written=written, resumed=resumed,
                                  plain=plain, load_diff=worst(saved, loaded),
                                  one_file_error=error)
    if dist.get_rank() == 0:
        reference = build()
        train_whole(reference, data[:2])
        converted = checkpoint_to_state_dict(path)
        record["converted_diff"] = worst(converted, reference.state_dict())
        build(3).load_state_dict(converted, strict=True)
        torch.save(converted, file)
    dist.barrier()
    _, from_file, record["state_dict_error"] = run(5, file)
    record["file_diff"] = worst(from_file, saved)
    report(**record)


if __name__ == "__main__":
    KIND = json.loads(sys.argv[2]).get("model", "mlp")
    globals()[f"scenario_{sys.argv[1]}"](json.loads(sys.argv[2]))
    dist.destroy_process_group()
