"""One rank of the ``strategy="auto"`` tests: ``python auto_worker.py <scenario> <json args>``.

Launched by ``tests/distributed_harness.py`` with torchrun's variables set; prints
``RESULT {json}`` lines. Every case trains a float64 model from the whole batch of a step
(``example_inputs`` is that batch under ``strategy="auto"``; each replica steps on its
slice) and compares with full-batch training in this process.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import mlp
from tp_models import TinyGPT

import partitioner.distributed_plan as distributed_plan
from partitioner.cost.devices import Cluster
from partitioner.distributed import partition_distributed
from partitioner.errors import PartitionError
from partitioner.planning.simulate import simulate
from partitioner.runtime.distributed.failure import FailurePolicy

torch.set_num_threads(1)
POLICY = FailurePolicy(timeout=20.0, interval=0.5, exit_code=17)
LR = 0.05


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return mlp((8, 16, 16, 16, 16, 8)).double()
    if name == "gpt":
        return TinyGPT(n_layer=2).double()
    raise ValueError(name)


def data(name: str, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, ``steps`` times: its loss must fall step by step."""
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        x, y = (torch.randint(0, 64, (batch, 8), generator=g),
                torch.randint(0, 64, (batch, 8), generator=g))
    else:
        x, y = (torch.randn(batch, 8, generator=g, dtype=torch.float64),
                torch.randn(batch, 8, generator=g, dtype=torch.float64))
    return [(x, y)] * steps


def loss_for(name: str) -> Any:
    if name == "gpt":
        return lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
    return F.mse_loss


def reference(model: nn.Module, batches: list[Any], loss_fn: Any
              ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Full-batch SGD in this process: what every partitioned run must reproduce."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def _key(plan: Any) -> tuple[Any, ...]:
    mesh = plan.mesh
    return (mesh.dp, mesh.pp, mesh.tp, plan.chunks, plan.schedule, plan.checkpoint)


@contextlib.contextmanager
def overruled_ranking() -> Iterator[None]:
    """Tuning's clock made to read the ranking's pick (the first candidate tuning times)
    slower than every other candidate, so the best-ranked of the others wins; the steps
    still run, on every rank alike."""
    real = distributed_plan.time_training_steps
    picks: list[tuple[Any, ...]] = []

    def timed(module: Any, *args: Any, **kwargs: Any) -> float:
        real(module, *args, **kwargs)
        picks.append(_key(module.plan))
        return 2.0 if _key(module.plan) == picks[0] else 1.0

    distributed_plan.time_training_steps = timed
    try:
        yield
    finally:
        distributed_plan.time_training_steps = real


def train(case: dict[str, Any]) -> dict[str, Any]:
    """Partition with ``strategy="auto"`` (and the sizes ``case`` fixes), train, compare."""
    name, batch, steps = case["model"], case["batch"], case.get("steps", 3)
    model, loss_fn, batches = build(name), loss_for(name), data(case["model"], batch, steps)
    expected, ref_losses = reference(model, batches, loss_fn)
    said = io.StringIO()
    given = case.get("given")  # sizes given without strategy="auto": one replica's batch
    with contextlib.ExitStack() as stack:
        if case.get("overrule"):
            stack.enter_context(overruled_ranking())
        stack.enter_context(contextlib.redirect_stderr(said))  # what calibration timed
        if given is not None:
            example = batches[0][0][: batch // given.get("dp", 1)]
            dpm = partition_distributed(model, (example,), failure=POLICY, **given)
        else:
            dpm = partition_distributed(model, (batches[0][0],), strategy="auto",
                                        failure=POLICY, tune=case.get("tune", False),
                                        calibrate=case.get("calibrate"),
                                        **case.get("fixed", {}))
    mesh = dpm.plan.mesh
    local = batch // mesh.dp
    rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
    params = list(dpm.parameters())
    optimizer = torch.optim.SGD(params or [torch.zeros(0)], lr=LR)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        losses.append(dpm.step(x[rows], y[rows], loss_fn))
        optimizer.step()
    diffs = [float((v - expected[k]).abs().max()) for k, v in dpm.state_dict().items()]
    plan = dpm.plan.to_dict()
    record = dict(case=case, rank=dist.get_rank(), losses=losses, ref_losses=ref_losses,
                  max_diff=max(diffs, default=0.0), mesh=[mesh.dp, mesh.pp, mesh.tp],
                  schedule=dpm.plan.schedule, chunks=dpm.plan.chunks,
                  checkpoint=dpm.plan.checkpoint, balance=list(dpm.plan.balance),
                  plan_hash=hashlib.sha256(json.dumps(plan, sort_keys=True, default=repr)
                                           .encode()).hexdigest(),
                  explain=dpm.plan.explain().splitlines()[-1],
                  measured=[r.get("measured_step_time") for r in dpm.plan.candidates],
                  predicted=[r.get("step_time") for r in dpm.plan.candidates],
                  chosen=[bool(r.get("chosen")) for r in dpm.plan.candidates],
                  labels=[r.get("label") for r in dpm.plan.candidates],
                  ranks=[r.get("rank") for r in dpm.plan.candidates],
                  processes=[r.get("cluster", {}).get("processes") for r in dpm.plan.candidates],
                  step=dpm.plan.predicted_step_time, simulated=simulate(dpm.plan).step_time,
                  timed="in training passes of the whole model" in said.getvalue())
    dpm.close()
    return record


def scenario_auto(cases: list[dict[str, Any]]) -> None:
    for case in cases:
        report(**train(case))


def scenario_enumerate(args: dict[str, Any]) -> None:
    """Every configuration the multi-process search marks executable for ``args["model"]``
    on this world, each fixed through ``strategy="auto"`` and trained one step."""
    from partitioner.analysis import analyze
    from partitioner.distributed_plan import tensor_parallel_check
    from partitioner.planning.auto import MULTI_PROCESS_RUNTIME, configurations, executable
    from partitioner.planning.world import world_cluster

    name, batch = args["model"], args["batch"]
    x = data(name, batch, 1)[0][0]
    model = build(name)
    analysis = analyze(model, (x,))
    check = tensor_parallel_check(model, analysis)
    cluster = world_cluster(["here"] * int(os.environ["WORLD_SIZE"]), "cpu")
    seen, skipped = {}, []
    for c in configurations(analysis.workload, cluster):
        why = executable(c, cluster, MULTI_PROCESS_RUNTIME) or check(c)
        if why is not None:
            skipped.append([c.label(), why])
            continue
        key = (c.dp, c.pp, c.tp, c.chunks, c.schedule, c.checkpoint)
        seen.setdefault(key, c.label())
    report(kind="space", executable=sorted(seen.values()), skipped=skipped)
    mesh = args.get("mesh")  # one launch per mesh: a world's runs share no state
    for (dp, pp, tp, chunks, schedule, checkpoint), label in seen.items():
        if mesh is not None and [dp, pp, tp] != mesh:
            continue
        case = dict(model=name, batch=batch, steps=1, fixed=dict(
            dp=dp, pp=pp, tp=tp, chunks=chunks, schedule=schedule, checkpoint=checkpoint))
        try:
            record = train(case)
        except PartitionError as error:  # reported, so the test names the configuration
            record = dict(case=case, rank=int(os.environ["RANK"]), error=f"{type(error).__name__}: "
                                                                 f"{error}")
        report(kind="run", label=label, **record)


def scenario_errors(args: dict[str, Any]) -> None:
    """User mistakes under ``strategy="auto"``: each a PartitionError naming a fix."""
    x = data("mlp", 8, 1)[0][0]

    def attempt(case: str, **kwargs: Any) -> None:
        try:
            partition_distributed(build("mlp"), (x,), failure=POLICY, **kwargs).close()
        except Exception as error:
            report(case=case, type=type(error).__name__, message=str(error),
                   partition_error=isinstance(error, PartitionError))
        else:
            report(case=case, type=None, message="", partition_error=False)

    world = int(os.environ["WORLD_SIZE"])
    attempt("product", strategy="auto", pp=3)
    attempt("all_three", strategy="auto", pp=world, dp=2, tp=1)
    attempt("balance", strategy="auto", balance=[5, 4])
    attempt("cluster_size", strategy="auto", cluster=Cluster.preset("A100-80GB"))
    attempt("no_fit", strategy="auto", memory_limit=1000.0)
    attempt("cluster_without_auto", cluster="A100-80GB")
    attempt("strategy", strategy="fastest")


def main() -> None:
    scenario, raw = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    {"auto": scenario_auto, "enumerate": scenario_enumerate,
     "errors": scenario_errors}[scenario](json.loads(raw))


if __name__ == "__main__":
    main()
