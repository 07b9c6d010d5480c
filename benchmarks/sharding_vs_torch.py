"""Data-parallel sharding on gloo (CPU): ours against torch's DDP, ZeRO and FSDP2.

One MLP (default 8 x Linear(1792, 1792) with ReLU between: 25.7 M parameters, 103 MB of
fp32), Adam, ``--batch`` rows per rank, on each of ``--ranks`` (default 2 and 4) ranks, every
contender in a fresh world of processes (so peaks do not mix):

- ``ddp``: ``DistributedDataParallel`` and ``torch.optim.Adam``;
- ``zero``: ``DistributedDataParallel`` and torch's ``ZeroRedundancyOptimizer`` (Adam);
- ``fsdp2``: torch's ``fully_shard`` on every Linear, then on the root (torchtitan's way);
- ``ours``: ``partition_distributed(model, pp=1, dp=W)`` and Adam (no sharding);
- ``ours-fsdp``: the same with ``sharding="fsdp"``;
- ``ours-optim``: the same with ``optimizer_sharding=True`` (our ZeRO-1);
- ``ours-tp2``, ``ours-tp2-fsdp`` (asked for by name): ``partition_distributed(model, pp=1,
  dp=W/2, tp=2)``, every Linear pair split over two ranks, without sharding and with
  ``sharding="fsdp"`` (each tp slice cut again over its replicas); a replica's two ranks
  take ``2 x --batch`` rows, so the global batch is the other contenders'.

Per contender and rank it reports:

- ``state MB``: bytes this rank holds in parameters, gradients and optimizer state after
  a step (tracked exactly: the local shards of DTensors; for ``ours-optim`` also its
  master slices where they are not views of the parameters, i.e. below fp32), the memory
  sharding is meant to save;
- ``peak RSS MB``: the peak resident memory of the process (VmHWM) minus its resident
  memory before the model was built (after ``import torch`` and starting the process
  group): everything, temporaries and communication buffers included; with glibc's mmap
  threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, set for the ranks unless given),
  so a freed large buffer leaves the resident set at once;
- ``step s``: the median step time (forward, backward, optimizer step), timed on rank 0
  from a barrier before the step to one after it; with ``--repeats``, the median over the
  rounds (each round runs every contender once, in turn), each round's figure printed.

Every contender starts from the same weights and batch: the first losses must agree (the
script prints them). ``ours-*`` plan with the reference CPU spec
(``PARTITIONER_CPU_SPEC=reference``), so no rank measures the CPU inside the peak. One
intra-op thread per rank; on a machine shared with other work the times are noisy (the
script prints the load seen while it ran).

Run:
    python benchmarks/sharding_vs_torch.py                        # 2 and 4 ranks
    python benchmarks/sharding_vs_torch.py --ranks 2 --steps 5 --width 1024
    python benchmarks/sharding_vs_torch.py --contenders ddp zero ours-optim --repeats 3
    python benchmarks/sharding_vs_torch.py --ranks 4 --contenders ddp ours-tp2 ours-tp2-fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# glibc serves a freed block above its dynamic mmap threshold from the heap next time and
# keeps those pages resident: the peak RSS would count buffers long freed (FSDP's per-layer
# gathers most). A fixed threshold (read when each spawned rank starts) returns every large
# block to the kernel at free, so the peak is what was live, for every contender alike.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Ours and torch's contenders under one allocator setting: glibc's own (and the MALLOC_*
# variables set here), not the steady mode planning for CPU devices applies to its process
# (partitioner.runtime.host_memory), which torch's contenders would not get.
os.environ.setdefault("PARTITIONER_HOST_MEMORY", "system")
# Plan "cpu" devices with the fixed reference spec: a machine whose calibration cache holds
# no quiet run (a loaded one) would measure its CPU in every ours-* process, a few seconds
# and a few hundred MB of peak that belong to the planner, not to what is compared here.
os.environ.setdefault("PARTITIONER_CPU_SPEC", "reference")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

CONTENDERS = ("ddp", "zero", "fsdp2", "ours", "ours-fsdp", "ours-optim")
TP_CONTENDERS = ("ours-tp2", "ours-tp2-fsdp")  # run when named: tp=2 x dp=W/2
Step = Callable[[], float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=CONTENDERS + TP_CONTENDERS)
    parser.add_argument("--width", type=int, default=1792)
    parser.add_argument("--layers", type=int, default=8, help="Linear layers")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds, each a fresh world per contender, run round-robin")
    return parser.parse_args()


def make_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for k in range(layers):
        modules.append(nn.Linear(width, width))
        if k < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def batch(rank: int, world: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of one global batch (the same for every contender)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows * world, width, generator=g), torch.randn(rows * world, width,
                                                                      generator=g)
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def state_bytes(params: list[torch.Tensor], optimizer_state: Any, extra: list[torch.Tensor]
                ) -> int:
    """Bytes of parameters, gradients, optimizer state and ``extra`` tensors on this rank."""
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer_state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return _nbytes(params) + _nbytes(grads) + _nbytes(state) + _nbytes(extra)


def torch_step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> float:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return step


def build(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, world: int
          ) -> tuple[Step, Callable[[], int]]:
    """The contender's step and the count of its state's bytes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name in ("ddp", "zero"):
        ddp = DDP(model)
        if name == "ddp":
            opt: Any = torch.optim.Adam(ddp.parameters(), lr=1e-4)
            count = lambda: state_bytes(list(model.parameters()), opt.state, [])
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-4)
            count = lambda: state_bytes(list(model.parameters()), opt.optim.state, [])
        return torch_step(ddp, opt, x, y), count
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for module in model:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        return torch_step(model, opt, x, y), lambda: state_bytes(
            list(model.parameters()), opt.state, [])
    return ours(name, model, x, y, world)


def ours(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, world: int
         ) -> tuple[Step, Callable[[], int]]:
    from partitioner.distributed import partition_distributed

    sharding = {"ours": None, "ours-fsdp": "fsdp", "ours-optim": "optimizer",
                "ours-tp2": None, "ours-tp2-fsdp": "fsdp"}[name]
    tp = 2 if name in TP_CONTENDERS else 1
    dpm = partition_distributed(model, (x,), pp=1, dp=world // tp, tp=tp, sharding=sharding)
    opt: Any = dpm.make_optimizer(torch.optim.Adam, lr=1e-4)

    def step() -> float:
        opt.zero_grad()
        loss = dpm.step(x, y, F.mse_loss)
        opt.step()
        return loss

    def count() -> int:
        # A sharded stage's parameters and .grad are views of its flat buffers (counted as
        # the parameters and gradients); its master slices are views too unless below fp32.
        masters: list[torch.Tensor] = []
        if dpm._sharded is not None:
            masters = [m for s in dpm._sharded.shards if not s.shares_master
                       for m in s.masters]
        return state_bytes(list(dpm.parameters()), opt.state, masters)

    return step, count


def contender(rank: int, name: str, args: argparse.Namespace, world: int) -> dict[str, Any]:
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # restart the kernel's peak (VmHWM)
    model = make_model(args.width, args.layers)
    tp = 2 if name in TP_CONTENDERS else 1  # a replica's tp ranks share its rows
    x, y = batch(rank // tp, world // tp, args.batch * tp, args.width)
    step, count = build(name, model, x, y, world)
    times, losses = [], []
    for k in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step())
        dist.barrier()
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"state_mb": count() / 2**20, "peak_rss_mb": (_status("VmHWM") - before) / 2**20,
            "step_s": statistics.median(times), "first_loss": losses[0]}


def _status(field: str) -> int:
    """Bytes of a field of /proc/self/status (VmRSS: now; VmHWM: peak since reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _entry(rank: int, name: str, args: argparse.Namespace, world: int, port: int,
           out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result = contender(rank, name, args, world)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def spawn(name: str, args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    out = Path(tempfile.mkdtemp())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.spawn(_entry, (name, args, world, port, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    args = parse_args()
    params = args.layers * (args.width ** 2 + args.width)
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.1f} M "
          f"parameters ({params * 4 / 2**20:.0f} MiB fp32); Adam; {args.batch} rows per rank; "
          f"{args.steps} timed steps after {args.warmup}, {args.repeats} round(s); torch "
          f"{torch.__version__}; load at start {os.getloadavg()[0]:.2f}")
    for world in args.ranks:
        print(f"\n{world} ranks (gloo, one thread each)")
        print(f"{'contender':<13} {'state MB':>9} {'peak RSS MB':>12} {'step s':>8} "
              f"{'vs ddp':>7} {'first loss':>12}  steps s per round")
        # Round-robin: each round runs every contender once, so a burst of other load
        # falls on all of them rather than on whichever ran then.
        rounds: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in args.contenders}
        for _ in range(args.repeats):
            for name in args.contenders:
                rounds[name].append(spawn(name, args, world))
        anchor = None
        for name, runs in rounds.items():
            state = max(r["state_mb"] for ranks in runs for r in ranks)
            peak = max(r["peak_rss_mb"] for ranks in runs for r in ranks)
            times = [ranks[0]["step_s"] for ranks in runs]
            seconds = statistics.median(times)
            anchor = seconds if name == "ddp" else anchor
            ratio = f"{seconds / anchor:7.2f}" if anchor else f"{'-':>7}"
            loss = statistics.mean(r["first_loss"] for r in runs[0])  # ours: already the mean
            print(f"{name:<13} {state:>9.1f} {peak:>12.1f} {seconds:>8.3f} {ratio} "
                  f"{loss:>12.6f}  {' '.join(f'{t:.3f}' for t in times)}", flush=True)
    print(f"\nload at end {os.getloadavg()[0]:.2f} (state and peak RSS: the largest rank's "
          "in any round; step s: the median over rounds of rank 0's median step)")


if __name__ == "__main__":
    main()
