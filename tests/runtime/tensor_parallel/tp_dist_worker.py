"""One rank of the multi-process tensor-parallel tests: ``python tp_dist_worker.py <scenario>``.

Launched by ``tests/distributed_harness.py`` with torchrun's variables set, one thread per
rank. Every rank also trains the unsplit model itself (same seed, same data) and compares:
a mismatch raises, so the rank exits non-zero and the test shows its output. Results are
printed as ``RESULT {json}`` lines.
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tp_models import Block, TinyGPT, batch_for, gpt2, mlp_pair

from partitioner.tensor_parallel import parallelize

torch.set_num_threads(1)


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"mlp": mlp_pair, "block": Block, "gpt2": gpt2, "encoder": encoder}[name]()


def encoder() -> nn.Module:
    """torch's own attention (split by heads) and feed-forward; biases away from zero."""
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "bias" in name:
                param.normal_(0.0, 0.1)
    return layer


def transparency(name: str) -> None:
    """Outputs, gradients and 3 SGD steps of ``name`` split over the world equal the unsplit
    model's; a block's forward runs exactly two all-reduces."""
    model = build(name)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    data = [batch_for(model) for _ in range(3)]
    tpm = parallelize(model, example_inputs=(data[0],))
    ours = torch.optim.SGD(tpm.parameters(), lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    worst = {"output": 0.0, "grad": 0.0, "weight": 0.0}
    forward_counts = None
    for step, x in enumerate(data):
        before = dict(tpm.comm.counts)
        out, expected = logits(tpm(x)), logits(reference(x))
        if step == 0:
            forward_counts = {f"{k[0]}/{k[1]}": v - before.get(k, 0)
                              for k, v in tpm.comm.counts.items()}
        torch.testing.assert_close(out, expected)
        worst["output"] = max(worst["output"], float((out - expected).abs().max()))
        out.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        if step == 0:
            for key, param in reference.named_parameters():
                grad = tpm.full_tensor(key, grad=True)
                torch.testing.assert_close(grad, param.grad, msg=lambda m, k=key: f"{k}: {m}")
                worst["grad"] = max(worst["grad"], float((grad - param.grad).abs().max()))
        # the unsplit model's norm (slices once, replicated copies once), then clipped alike
        norm = tpm.clip_grad_norm_(0.05)
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch.testing.assert_close(norm.float(), expected_norm)
        worst["norm"] = max(worst.get("norm", 0.0), abs(float(norm - expected_norm)))
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    state, expected_state = tpm.state_dict(), reference.state_dict()
    if list(state) != list(expected_state):
        raise AssertionError(f"keys {list(state)[:4]} != {list(expected_state)[:4]}")
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")
        worst["weight"] = max(worst["weight"], float((state[key] - value).abs().max()))
    local = sum(p.numel() for p in tpm.parameters())
    report(model=name, rank=dist.get_rank(), tp=tpm.tp, worst=worst,
           forward_counts=forward_counts, local_params=local,
           full_params=sum(p.numel() for p in reference.parameters()))


def scenario_transparency(names: list[str]) -> None:
    dist.init_process_group("gloo")
    try:
        for name in names:
            transparency(name)
        dist.barrier()  # every rank done with its collectives before any tears gloo down
    finally:
        dist.destroy_process_group()
    # Every result is printed: leave without the interpreter's finalization. In 2 of about 7
    # slow-tier runs (two sessions) both ranks aborted there after correct results ("terminate
    # called without an active exception"; gloo's threads outliving the interpreter is one cause:
    # pytorch/pytorch#179291); not reproduced in 12 runs of this worker alone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def scenario_mesh(cfg: dict[str, Any]) -> None:
    """dp x pp x tp through ``partition_distributed(..., tp=)``: P2P between stages, the
    gradient all-reduce between replicas, tensor-parallel stage graphs. After 3 SGD steps
    (with momentum) the stage's ``state_dict()`` (gathered whole over its tp group) equals
    full-batch training; a consolidated checkpoint holds the whole model; loading it back
    (weights and the split momentum buffers) and taking a 4th step still matches."""
    import torch.nn.functional as F

    from partitioner import partition_distributed

    pp, dp, tp, local = cfg["pp"], cfg["dp"], cfg["tp"], cfg["batch"]
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (dp * local, 8), generator=g),
             torch.randint(0, 64, (dp * local, 8), generator=g)) for _ in range(4)]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # With a plan file, its mesh gives pp and tp (and the split and shard specs).
    sizes = {"plan": cfg["plan"]} if cfg.get("plan") else {"pp": pp, "dp": dp, "tp": tp}
    dpm = partition_distributed(model, (data[0][0][:local],), **sizes, chunks=cfg["chunks"],
                                schedule=cfg["schedule"], checkpoint=cfg["checkpoint"],
                                backend="gloo")
    mesh = dpm.mesh
    ours = torch.optim.SGD(dpm.parameters(), lr=0.5, momentum=0.9)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    rows = slice(mesh.replica * local, (mesh.replica + 1) * local)
    losses, expected_losses, norms, expected_norms = [], [], [], []
    clip = cfg.get("clip")

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        ours.zero_grad()
        losses.append(dpm.step(x[rows], y[rows], loss_fn))
        if clip is not None:
            norms.append(float(dpm.clip_grad_norm_(clip)))
        ours.step()
        theirs.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        if clip is not None:
            expected_norms.append(float(torch.nn.utils.clip_grad_norm_(
                reference.parameters(), clip)))
        theirs.step()
        expected_losses.append(loss.item())

    def worst_difference() -> tuple[float, list[str]]:
        state, expected = dpm.state_dict(), reference.state_dict()  # collective over tp
        worst = 0.0
        for key, whole in state.items():
            torch.testing.assert_close(whole, expected[key], msg=lambda m, k=key: f"{k}: {m}")
            worst = max(worst, float((whole - expected[key]).abs().max()))
        return worst, sorted(state)

    for x, y in data[:3]:
        train(x, y)
    worst, checked = worst_difference()
    local_numel = sum(p.numel() for p in dpm.parameters())
    whole_numel = sum(reference.get_parameter(k).numel() for k in checked
                      if k in dict(reference.named_parameters()))
    path = Path(cfg["dir"]) / "ckpt.pt"
    dpm.save(path, ours)
    saved = torch.load(path, weights_only=True)
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(saved["model"][key], tensor, msg=lambda m, k=key: f"{k}: {m}")
    with torch.no_grad():  # spoil this rank's slices, then resume from the file
        for p in dpm.parameters():
            p.add_(1.0)
    for state in ours.state.values():
        state["momentum_buffer"].zero_()
    dpm.load(path, ours)
    train(*data[3])
    resumed, _ = worst_difference()
    report(rank=dist.get_rank(), coords=[mesh.stage, mesh.replica, mesh.shard], worst=worst,
           resumed=resumed, losses=losses, expected_losses=expected_losses, checked=checked,
           mesh=[dpm.plan.mesh.pp, dpm.plan.mesh.tp], shard_specs=len(dpm.plan.shard_specs),
           local_numel=local_numel, whole_numel=whole_numel, balance=list(dpm.plan.balance),
           norms=norms, expected_norms=expected_norms)
    dist.barrier()
    dpm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        scenario_mesh(json.loads(sys.argv[2]))
    else:
        scenario_transparency(json.loads(sys.argv[2]) if len(sys.argv) > 2 else [sys.argv[1]])
