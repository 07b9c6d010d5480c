"""One rank of the multi-process tests: ``python dist_worker.py <scenario> <json args>``.

Launched by ``tests/distributed_harness.py`` (or torchrun) with torchrun's variables set.
Each scenario prints ``RESULT {json}`` lines that the tests read; a scenario may run several
checks in one world, so the processes start once per test module.
"""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import LongSkip, gpt2, mlp

from partitioner.distributed import partition_distributed
from partitioner.runtime.distributed.failure import FailurePolicy

torch.set_num_threads(1)
POLICY = FailurePolicy(timeout=4.0, interval=0.2, exit_code=17)


def report(**record: Any) -> None:
    print("RESULT " + json.dumps(record), flush=True)


class TiedMLP(nn.Module):
    """Its first and last layers share one weight, so two stages hold copies of it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.last.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "longskip":
        return LongSkip(8).double()
    if name == "mlp":
        return mlp((8, 16, 16, 16, 16, 8)).double()
    if name == "tied":
        return TiedMLP().double()
    if name == "gpt2":   # transformers' GPT-2: export capture, tied embedding and head
        return gpt2().double()
    raise ValueError(name)


def batches(dp: int, local: int, steps: int = 3, model: str = "longskip"
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if model == "gpt2":
        ids = [torch.randint(0, 64, (local * dp, 16), generator=g) for _ in range(steps)]
        return [(x, x) for x in ids]
    return [(torch.randn(local * dp, 8, generator=g, dtype=torch.float64),
             torch.randn(local * dp, 8, generator=g, dtype=torch.float64)) for _ in range(steps)]


def loss_for(model: str) -> Any:
    if model == "gpt2":
        return lambda out, ids: F.cross_entropy(out.logits[:, :-1].reshape(-1, 64),
                                                ids[:, 1:].reshape(-1))
    return F.mse_loss


def reference_run(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: Any = F.mse_loss, clip: float | None = None,
                  norms: list[float] | None = None) -> tuple[nn.Module, list[float]]:
    """Single-process, full-batch training: what every distributed run must reproduce
    (with ``clip``, gradients clipped to that norm; the norms go to ``norms``)."""
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
        losses.append(loss.item())
    return reference, losses


def scenario_train(configs: list[dict[str, Any]]) -> None:
    for cfg in configs:
        name = cfg.get("model", "longskip")
        model, loss_fn = build(name), loss_for(name)
        local = cfg.get("batch", 10)
        data = batches(cfg["dp"], local, model=name)
        ref_norms: list[float] = []
        reference, ref_losses = reference_run(model, data, loss_fn, cfg.get("clip"), ref_norms)
        dpm = partition_distributed(
            model, example_inputs=(data[0][0][:local],), pp=cfg["pp"], dp=cfg["dp"],
            chunks=cfg["chunks"], schedule=cfg["schedule"], checkpoint=cfg["checkpoint"],
            balance=cfg.get("balance"), failure=POLICY, bucket_mb=cfg.get("bucket_mb", 25.0),
            fuse_weight_grads=cfg.get("fuse", True), virtual_stages=cfg.get("virtual"))
        # A costed plan may give a stage no parameters (only activations, say).
        params = list(dpm.parameters())
        optimizer = torch.optim.SGD(params or [torch.zeros(0)], lr=0.05, momentum=0.9)
        rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
        losses, peaks, norms = [], [], []
        for x, y in data:
            optimizer.zero_grad()
            losses.append(dpm.step(x[rows], y[rows], loss_fn))
            peaks.append(dpm.pipeline.peak_in_flight)
            if cfg.get("clip") is not None:
                norms.append(float(dpm.clip_grad_norm_(cfg["clip"])))
            optimizer.step()
        expected = reference.state_dict()
        # Tied weights are one tensor under several keys; a stage may hold it by any of them.
        same: dict[int, list[str]] = {}
        for key, tensor in reference.state_dict(keep_vars=True).items():
            same.setdefault(id(tensor), []).append(key)
        diffs = {k: float((v - expected[k]).abs().max()) for k, v in dpm.state_dict().items()}
        diffs = diffs or {"": 0.0}
        # The consolidated checkpoint loads into a fresh unpartitioned model: same weights.
        path = Path(tempfile.mkdtemp()) / "ckpt.pt"
        dpm.save(path)
        checkpoint_diff = None
        if dist.get_rank() == 0:
            plain = build(name)
            plain.load_state_dict(torch.load(path)["model"])
            checkpoint_diff = max(float((v - expected[k]).abs().max())
                                  for k, v in plain.state_dict().items())
        report(config=cfg, rank=dist.get_rank(), stage=dpm.stage_index,
               checkpoint_diff=checkpoint_diff,
               replica=dpm.mesh.replica, losses=losses, ref_losses=ref_losses,
               max_diff=max(diffs.values()), keys=sorted(k for k in diffs if k),
               all_keys=sorted(expected), aliases=[k for k in same.values() if len(k) > 1],
               peak_in_flight=max(peaks), plan_balance=list(dpm.plan.balance),
               norms=norms, ref_norms=ref_norms)
        dpm.close()


def scenario_checkpoint(args: dict[str, Any]) -> None:
    """Save mid-run, resume in a fresh partitioned model, compare with the uninterrupted run."""
    directory = Path(args["dir"])
    model = build("longskip")
    data = batches(args["dp"], 6, steps=4)
    local = 6
    options = dict(pp=args["pp"], dp=args["dp"], chunks=3, schedule="1f1b", failure=POLICY)

    def train(dpm: Any, optimizer: torch.optim.Optimizer, steps: list[int]) -> None:
        rows = slice(dpm.mesh.replica * local, (dpm.mesh.replica + 1) * local)
        for k in steps:
            x, y = data[k]
            optimizer.zero_grad()
            dpm.step(x[rows], y[rows], F.mse_loss)
            optimizer.step()

    first = partition_distributed(copy.deepcopy(model), example_inputs=(data[0][0][:local],),
                                  **options)
    adam = torch.optim.Adam(first.parameters(), lr=0.01)
    train(first, adam, [0, 1])
    first.save(directory / "mid.pt", adam)
    train(first, adam, [2, 3])
    first.save(directory / "straight.pt", adam)

    torch.manual_seed(123)  # a differently initialised model: everything must come from the file
    fresh_model = LongSkip(8).double()
    second = partition_distributed(fresh_model, example_inputs=(data[0][0][:local],), **options)
    adam2 = torch.optim.Adam(second.parameters(), lr=0.01)
    second.load(directory / "mid.pt", adam2)
    steps_after_load = second.steps
    train(second, adam2, [2, 3])
    second.save(directory / "resumed.pt", adam2)
    if dist.get_rank() == 0:
        straight = torch.load(directory / "straight.pt")
        resumed = torch.load(directory / "resumed.pt")
        mid = torch.load(directory / "mid.pt")
        model_equal = all(torch.equal(straight["model"][k], resumed["model"][k])
                          for k in straight["model"])
        state_equal = all(
            torch.equal(torch.as_tensor(straight["optimizer"]["state"][n][key]),
                        torch.as_tensor(resumed["optimizer"]["state"][n][key]))
            for n in straight["optimizer"]["state"] for key in straight["optimizer"]["state"][n])
        reference, _ = reference_run_adam(model, data[:2])
        plain = LongSkip(8).double()
        plain.load_state_dict(mid["model"])
        unpartitioned = max(float((plain.state_dict()[k] - v).abs().max())
                            for k, v in reference.state_dict().items())
        leftovers = [p.name for p in directory.iterdir() if p.suffix == ".tmp"]
        report(model_equal=model_equal, optimizer_equal=state_equal,
               same_keys=sorted(straight["model"]) == sorted(model.state_dict()),
               optimizer_params=sorted(straight["optimizer"]["state"]),
               unpartitioned_diff=unpartitioned, steps_after_load=steps_after_load,
               leftovers=leftovers, saved_steps=straight["extra"]["steps"])
    dist.barrier()


def scenario_save_dies(args: dict[str, Any]) -> None:
    """Save once; then rank 0 is killed while writing the second checkpoint to that path."""
    model = build("mlp")
    x = batches(1, 8, steps=1)[0][0]
    dpm = partition_distributed(model, example_inputs=(x,), pp=2, chunks=2, failure=POLICY)
    path = Path(args["dir"]) / "ckpt.pt"
    dpm.save(path)
    if dist.get_rank() == 0:
        real_save = torch.save

        def killed_mid_write(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(handle, io.BufferedWriter):  # pickling for a collective
                return real_save(obj, handle, *args, **kwargs)
            handle.write(b"half a checkpoint")
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = killed_mid_write  # type: ignore[assignment]
    dpm.steps = 1
    dpm.save(path)
    report(rank=dist.get_rank(), saved=True)


def reference_run_adam(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[nn.Module, list[float]]:
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for x, y in data:
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
    return reference, []


def scenario_fail(args: dict[str, Any]) -> None:
    """Train until the victim fails at its ``at``-th step: raises, kills itself (in a
    forward; ``where="reduce"``: just before the loss all-reduce; ``where="start"``: in the
    forwards partition_distributed runs to capture the model), or ``mode="exit"``: ends its
    program cleanly after ``at`` steps while the others go on."""
    victim, mode, at = args["victim"], args["mode"], args["at"]
    where = args.get("where", "forward")
    model = build("mlp")
    # Armed once partitioned, unless the failure is to come while partitioning (``"start"``).
    state = {"step": 0, "armed": where == "start"}
    rank = int(os.environ["RANK"])

    def inject(module: nn.Module | None, inputs: Any) -> None:
        if rank == victim and state["step"] == at and state["armed"] and (
                module is None or where in ("forward", "start")):
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {rank}")

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(inject)
    data = batches(args["dp"], 8, steps=args["steps"])
    dpm = partition_distributed(model, example_inputs=(data[0][0][:8],), pp=args["pp"],
                                dp=args["dp"], chunks=4, balance=args.get("balance"),
                                schedule="1f1b", failure=POLICY)
    if where == "reduce" and rank == victim:
        reduce_loss = dpm.pipeline._reduce_loss

        def dying_reduce(local: float) -> float:
            if state["step"] == at:
                inject(None, ())
            return reduce_loss(local)

        dpm.pipeline._reduce_loss = dying_reduce  # type: ignore[method-assign]
    state["armed"] = True
    optimizer = torch.optim.SGD(dpm.parameters(), lr=0.01)
    rows = slice(dpm.mesh.replica * 8, (dpm.mesh.replica + 1) * 8)
    for x, y in data:
        if mode == "exit" and rank == victim and state["step"] == at:
            break
        optimizer.zero_grad()
        dpm.step(x[rows], y[rows], F.mse_loss)
        optimizer.step()
        state["step"] += 1
    report(rank=rank, finished=True)


def scenario_mismatch(args: dict[str, Any]) -> None:
    from partitioner.runtime.distributed.failure import PlanMismatchError

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    width = args.get("widths", [16, 16])[rank]   # another model on each rank, same options
    model = mlp((8, width, 16, 16, 16, 8)).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    balance = args["balances"][rank]
    try:
        partition_distributed(model, example_inputs=(x,), pp=2, balance=balance, failure=POLICY)
    except PlanMismatchError as error:
        report(rank=rank, error=str(error), type=type(error).__name__)
        return
    report(rank=rank, error=None)


def scenario_settings(args: dict[str, Any]) -> None:
    """Each rank passes its own options (``args["per_rank"][rank]``); all must be refused."""
    from partitioner.errors import PartitionError

    rank = int(os.environ["RANK"])
    options = {"pp": None, **args["per_rank"][rank]}
    try:
        partition_distributed(build("mlp"), example_inputs=(torch.randn(8, 8).double(),),
                              failure=POLICY, **options)
    except PartitionError as error:
        report(rank=rank, error=str(error), type=type(error).__name__)
        return
    report(rank=rank, error=None)


def scenario_mesh_mismatch(args: dict[str, Any]) -> None:
    """Each rank makes the mesh ``args["shapes"][rank]``: all must be refused, none wait."""
    from partitioner.runtime.distributed.failure import PlanMismatchError
    from partitioner.runtime.distributed.mesh import Mesh, MeshShape, init_distributed

    info = init_distributed()
    try:
        Mesh(MeshShape(*args["shapes"][info.rank]))
    except PlanMismatchError as error:
        report(rank=info.rank, error=str(error), type=type(error).__name__)
        return
    report(rank=info.rank, error=None)


def scenario_mesh(args: dict[str, Any]) -> None:
    from partitioner.runtime.distributed.mesh import AXES, Mesh, MeshShape, init_distributed

    info = init_distributed()
    mesh = Mesh(MeshShape(pp=args["pp"], dp=args["dp"]))
    sums = {}
    for axis in AXES:
        value = torch.tensor([float(info.rank)])
        dist.all_reduce(value, group=mesh.group(axis))
        sums[axis] = float(value)
    device_mesh = mesh.to_device_mesh()
    report(rank=info.rank, coords=[mesh.stage, mesh.replica, mesh.shard],
           ranks={a: list(mesh.ranks(a)) for a in AXES}, sums=sums,
           prev=mesh.neighbour("pp", -1), next=mesh.neighbour("pp", 1),
           device_mesh_shape=list(device_mesh.shape),
           device_mesh_dp_is_ours=device_mesh.get_group("dp") is mesh.group("dp"))


def scenario_p2p(args: dict[str, Any]) -> None:
    """Boundaries with constants, ints, bools, empty tensors, sent out of order, in every mode:
    one group, batched, and one group per direction (gloo's two pipeline groups)."""
    from partitioner.runtime.distributed.mesh import Mesh, MeshShape, init_distributed
    from partitioner.runtime.distributed.p2p import Boundary, PipeLinks

    info = init_distributed()
    mesh = Mesh(MeshShape(pp=2))
    records = {}
    modes = {"eager": {}, "batched": {"batched": True},
             "directions": {"rank": info.rank, "reverse_group": mesh.reverse_group()}}
    for mode, kwargs in modes.items():
        links = PipeLinks(mesh.group("pp"), mesh.neighbour("pp", -1), mesh.neighbour("pp", 1),
                          info.device, **kwargs)

        def values(i: int) -> Any:
            g = torch.Generator().manual_seed(i)
            return ({"h": torch.randn(3, 4, generator=g), "n": 7},
                    torch.arange(5) * i, torch.tensor([True, i % 2 == 0]), torch.empty(0, 4),
                    torch.randn(2, generator=g, dtype=torch.float64))

        boundaries = [Boundary.of(values(i)) for i in range(3)]
        ok = True
        if mesh.stage == 0:
            for i in (2, 0, 1):
                tensors = boundaries[i].check(values(i), f"micro-batch {i}")
                links.send_activations(0, i, boundaries[i], tensors)
            pending = {i: links.recv_grads(0, i, boundaries[i]) for i in range(3)}
            for i in range(3):
                grads = pending[i].wait()
                ok &= all(torch.equal(g, torch.full_like(g, float(i)))
                          for g in grads if g.numel())
        else:
            pending = {i: links.recv_activations(0, i, boundaries[i]) for i in range(3)}
            for i in (1, 0, 2):
                got = boundaries[i].assemble(pending[i].wait())
                want = values(i)
                ok &= got[0]["n"] == 7
                ok &= all(torch.equal(a, b) for a, b in zip(
                    torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))
                    if isinstance(a, torch.Tensor))
                metas = boundaries[i].metas(boundaries[i].grad_positions)
                links.send_grads(0, i, boundaries[i],
                                 [torch.full(m.shape, float(i), dtype=m.dtype) for m in metas])
        links.finish()
        records[mode] = bool(ok)
    report(rank=info.rank, reverse_group=mesh.reverse_group() is not None, **records)


def scenario_dp(args: dict[str, Any]) -> None:
    """GradReducer: averages, bucket order, launch during backward, unused parameters."""
    from partitioner.runtime.distributed.data_parallel import GradReducer
    from partitioner.runtime.distributed.mesh import Mesh, MeshShape, init_distributed

    info = init_distributed()
    mesh = Mesh(MeshShape(dp=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                          nn.Linear(6, 3)).double()
    unused = nn.Parameter(torch.zeros(4, dtype=torch.float64))   # no replica reaches it
    partly = nn.Parameter(torch.ones(2, dtype=torch.float64))    # only replica 0 does
    # Buckets go last parameter first: the model's last layers fill the first buckets, which
    # start during the backward; the parameters that may get no gradient come last.
    params = [unused, partly, *model.parameters()]
    reducer = GradReducer(params, mesh.group("dp"), bucket_bytes=6 * 6 * 8,
                          last_bucket_bytes=6 * 8)
    xs = [torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r in range(2)]

    def loss_of(r: int, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        return loss + (partly.sum() if r == 0 else 0)

    # Reference: each replica's accumulated gradients over its two micro-batches, computed
    # here for both replicas; the reducer must leave their average on every replica.
    expected = []
    for r in range(2):
        for p in params:
            p.grad = None
        for part in xs[r].tensor_split(2):
            loss_of(r, part).backward()
        expected.append([p.grad.clone() if p.grad is not None else None for p in params])
    for p in params:
        p.grad = None
    first, second = xs[info.rank].tensor_split(2)
    loss_of(info.rank, first).backward()        # an earlier micro-batch: no all-reduce
    events_before_arm = list(reducer.events)
    reducer.arm()
    loss_of(info.rank, second).backward()       # the last micro-batch of the step
    events = list(reducer.events)
    reducer.finish()
    diffs: list[float | None] = []
    for k, p in enumerate(params):
        present = [e[k] for e in expected if e[k] is not None]
        if not present:
            diffs.append(None if p.grad is None else -1.0)
        else:
            average = sum(present) / 2
            diffs.append(float((p.grad - average).abs().max()) if p.grad is not None else -1.0)
    launches = [b for kind, b in events if kind == "launch"]
    last_ready = max(k for k, (kind, _) in enumerate(events) if kind == "ready")
    first_launch = min(k for k, (kind, _) in enumerate(events) if kind == "launch")
    report(rank=info.rank, n_buckets=len(reducer.buckets), launches=launches,
           launched_before_backward_ended=first_launch < last_ready,
           events_before_arm=events_before_arm, diffs=diffs,
           unused_grad_is_none=unused.grad is None)


def scenario_errors(args: dict[str, Any]) -> None:
    """User mistakes in a world of one: each must raise a PartitionError naming a fix."""
    from partitioner.errors import PartitionError
    from partitioner.plans.plan import Plan

    x = torch.randn(8, 8, dtype=torch.float64)

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as error:
            report(case=name, type=type(error).__name__, message=str(error),
                   partition_error=isinstance(error, PartitionError))
        else:
            report(case=name, type=None, message="", partition_error=False)

    attempt("tp", lambda: partition_distributed(build("mlp"), (x,), tp=0, failure=POLICY))
    attempt("tp_rules", lambda: partition_distributed(
        build("mlp"), (x,), tensor_parallel={"*": "colwise"}, failure=POLICY))
    attempt("tp_world", lambda: partition_distributed(build("mlp"), (x,), tp=2,
                                                      failure=POLICY))
    attempt("dp", lambda: partition_distributed(build("mlp"), (x,), dp=3, failure=POLICY))

    # Virtual stages: a world of one has no ring to run them on; the schedule needs v >= 2;
    # balance lists one entry per virtual stage.
    attempt("virtual_pp1", lambda: partition_distributed(
        build("mlp"), (x,), schedule="interleaved", virtual_stages=2, failure=POLICY))
    attempt("virtual_schedule", lambda: partition_distributed(
        build("mlp"), (x,), schedule="interleaved", failure=POLICY))
    attempt("virtual_type", lambda: partition_distributed(
        build("mlp"), (x,), virtual_stages=0, failure=POLICY))
    attempt("virtual_balance", lambda: partition_distributed(
        build("mlp"), (x,), schedule="interleaved", virtual_stages=2, balance=[9],
        failure=POLICY))
    attempt("virtual_layers", lambda: partition_distributed(
        build("mlp"), (x,), schedule="interleaved", virtual_stages=12, chunks=1,
        failure=POLICY))
    # A world of one runs one stage; a plan of two stages cannot fit it.
    attempt("mesh", lambda: partition_distributed(build("mlp"), (x,), pp=2, failure=POLICY))
    other = build("mlp")
    dpm = partition_distributed(other, (x,), failure=POLICY)
    plan_path = Path(tempfile.mkdtemp()) / "plan.json"
    dpm.plan.save(plan_path)
    attempt("call", lambda: dpm(x))
    attempt("wrong_model", lambda: partition_distributed(
        LongSkip(8).double(), (x,), plan=plan_path, failure=POLICY))
    attempt("loss", lambda: dpm.pipeline.step([x], x, lambda out, y: out - y, seed=0))
    same = partition_distributed(build("mlp"), (x,), plan=Plan.load(plan_path), failure=POLICY)
    report(case="plan_file", balance=list(same.plan.balance), schedule=same.plan.schedule)
    gpipe = partition_distributed(build("mlp"), (x,), plan=plan_path, schedule="gpipe",
                                  chunks=2, failure=POLICY)
    report(case="plan_override", schedule=gpipe.plan.schedule, chunks=gpipe.plan.chunks)
    # The model's train/eval mode is the wrapper's first; a closed wrapper refuses to train.
    evaluating = partition_distributed(build("mlp").eval(), (x,), failure=POLICY)
    report(case="mode", evaluating=evaluating.training, training=same.training)
    evaluating.close()
    evaluating.close()
    attempt("closed", lambda: evaluating.step(x, x, F.mse_loss))


def main() -> None:
    scenario, raw = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    args = json.loads(raw)
    if scenario == "checkpoint" and "dir" not in args:
        args["dir"] = tempfile.mkdtemp()
    {"train": scenario_train, "checkpoint": scenario_checkpoint, "fail": scenario_fail,
     "mismatch": scenario_mismatch, "settings": scenario_settings,
     "mesh_mismatch": scenario_mesh_mismatch,
     "save_dies": scenario_save_dies, "mesh": scenario_mesh, "p2p": scenario_p2p,
     "dp": scenario_dp, "errors": scenario_errors}[scenario](args)


if __name__ == "__main__":
    main()
