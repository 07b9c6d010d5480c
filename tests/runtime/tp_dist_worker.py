"""One rank of the multi-process tensor-parallel tests: ``python tp_dist_worker.py <scenario>``.

Launched by ``tests/distributed_harness.py`` with torchrun's variables set, one thread per
rank. Every rank also trains the unsplit model itself (same seed, same data) and compares:
a mismatch raises, so the rank exits non-zero and the test shows its output. Results are
printed as ``RESULT {json}`` lines.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tp_models import Block, TinyGPT, batch_for, gpt2, mlp_pair

from partitioner.tensor_parallel import parallelize

torch.set_num_threads(1)


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"mlp": mlp_pair, "block": Block, "gpt2": gpt2}[name]()


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
    finally:
        dist.destroy_process_group()


def scenario_mesh(cfg: dict[str, Any]) -> None:
    """dp x pp x tp: the distributed pipeline runtime (P2P between stages, gradient
    all-reduce between replicas) running tensor-parallel stage graphs; after 3 steps every
    weight, gathered over its tensor-parallel group, equals full-batch training."""
    import torch.nn.functional as F

    from partitioner.api import build_stage_graphs
    from partitioner.distributed import BoundaryPredictor
    from partitioner.tensor_parallel import plan_tensor_parallel, shard_stage
    from runtime.collectives import ProcessGroupCommunicator
    from runtime.data_parallel import GradReducer
    from runtime.distributed import DistributedPipeline
    from runtime.mesh import Mesh, MeshShape, init_distributed
    from runtime.p2p import PipeLinks
    from runtime.sharding import unshard
    from runtime.stage import StageRunner

    pp, dp, tp, local = cfg["pp"], cfg["dp"], cfg["tp"], cfg["batch"]
    info = init_distributed("gloo")
    mesh = Mesh(MeshShape(pp=pp, dp=dp, tp=tp))
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (dp * local, 8), generator=g),
             torch.randint(0, 64, (dp * local, 8), generator=g)) for _ in range(3)]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    setup = plan_tensor_parallel(model, ["cpu"] * (pp * tp), tp,
                                 example_inputs=(data[0][0][:local],), chunks=cfg["chunks"])
    graphs = build_stage_graphs(setup.analysis, setup.plan)
    j = mesh.stage
    stage = shard_stage(graphs[j], model, setup.shard_plan, mesh.shard)
    comm = ProcessGroupCommunicator(mesh.group("tp"))
    stage._tp_comm = comm
    links = PipeLinks(mesh.group("pp"), mesh.neighbour("pp", -1), mesh.neighbour("pp", 1),
                      info.device)
    reducer = GradReducer(list(stage.parameters()), mesh.group("dp")) if dp > 1 else None
    pipeline = DistributedPipeline(
        StageRunner(j, stage, info.device), n_stages=pp, links=links,
        interfaces=BoundaryPredictor(graphs, j, [info.device] * pp), schedule=cfg["schedule"],
        chunks=cfg["chunks"], checkpoint=cfg["checkpoint"],
        restructure=setup.analysis.captured.restructure, reducer=reducer, dp_size=dp,
        loss_rank=j == pp - 1 and mesh.shard == 0)
    ours = torch.optim.SGD(stage.parameters(), lr=0.5)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.5)
    rows = slice(mesh.replica * local, (mesh.replica + 1) * local)
    losses, expected_losses = [], []
    for step, (x, y) in enumerate(data):
        ours.zero_grad()
        losses.append(pipeline.step(setup.analysis.captured.placeholder_values((x[rows],), {}),
                                    y[rows], loss_fn, seed=step))
        ours.step()
        theirs.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        theirs.step()
        expected_losses.append(loss.item())
    names = {id(t): n for n, t in model.named_parameters()}
    graph_names = {path: names[id(t)] for path, t in graphs[j].named_parameters()}
    worst, checked = 0.0, []
    for path, tensor in stage.named_parameters():
        key = graph_names[path]
        sharding = setup.shard_plan.shardings[key]
        whole = (unshard(comm.all_gather(tensor.detach(), "check"), sharding)
                 if sharding.is_split else tensor.detach())
        expected = reference.get_parameter(key).detach()
        torch.testing.assert_close(whole, expected, msg=lambda m, k=key: f"{k}: {m}")
        worst = max(worst, float((whole - expected).abs().max()))
        checked.append(key)
    report(rank=info.rank, coords=[mesh.stage, mesh.replica, mesh.shard], worst=worst,
           losses=losses, expected_losses=expected_losses, checked=sorted(checked),
           mesh=[setup.plan.mesh.pp, setup.plan.mesh.tp], layers=list(setup.plan.layers))
    dist.barrier()
    if reducer is not None:
        reducer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        scenario_mesh(json.loads(sys.argv[2]))
    else:
        scenario_transparency(json.loads(sys.argv[2]) if len(sys.argv) > 2 else [sys.argv[1]])
