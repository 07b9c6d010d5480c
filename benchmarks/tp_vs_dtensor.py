"""Training step time: our tensor parallelism against DTensor's ``parallelize_module``.

The model is ``nn.Sequential`` of 16 x (Linear(1024, 1024), ReLU), batch 64 (the pipeline
benchmark's model). Both split it Megatron-style over 2 ranks on gloo, one process and one
intra-op thread per rank: even Linears column-parallel, odd ones row-parallel (ours finds
this pairing by itself; DTensor is given it as ``ColwiseParallel``/``RowwiseParallel``).
One step is an SGD step: ``zero_grad``, forward, MSE loss against a fixed random target,
backward, ``step``. Both contenders live in the same processes and start from copies of one
model; their steps are interleaved in rounds (every round times each once, in a rotating
order) so machine drift hits both alike. A step's time is the slowest rank's.

Run:
    python benchmarks/tp_vs_dtensor.py                       # 5 warm-up + 30 timed steps
    python benchmarks/tp_vs_dtensor.py --steps 60 --width 2048

The first-step losses and the gathered weights after the warm-up must agree between the two
contenders; the script stops if they do not.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ours and torch's contenders under one allocator setting: glibc's own (and the MALLOC_*
# variables set here), not the steady mode planning for CPU devices applies to its process
# (partitioner.runtime.host_memory), which torch's contenders would not get.
os.environ.setdefault("PARTITIONER_HOST_MEMORY", "system")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per contender")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16, help="(Linear, ReLU) pairs")
    parser.add_argument("--ranks", type=int, default=2)
    return parser.parse_args()


def build(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def ours(model: nn.Sequential, x: torch.Tensor) -> nn.Module:
    from partitioner.tensor_parallel import parallelize
    return parallelize(model, example_inputs=(x,))


def theirs(model: nn.Sequential, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (world,))
    linears = [k for k, m in enumerate(model) if isinstance(m, nn.Linear)]
    plan = {str(k): ColwiseParallel() if n % 2 == 0 else RowwiseParallel()
            for n, k in enumerate(linears)}
    return parallelize_module(model, mesh, plan)


def full_weight(module: nn.Module, key: str) -> torch.Tensor:
    if hasattr(module, "full_tensor"):
        return module.full_tensor(key)  # ours (a collective)
    value = module.state_dict()[key]
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = build(args.width, args.blocks)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    contenders = {"ours": ours(copy.deepcopy(model), x),
                  "dtensor": theirs(copy.deepcopy(model), world)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3)
                  for name, m in contenders.items()}

    def step(name: str) -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        optimizers[name].zero_grad()
        loss = F.mse_loss(contenders[name](x), y)
        loss.backward()
        optimizers[name].step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed), loss.item()

    first = {name: step(name)[1] for name in contenders}
    if abs(first["ours"] - first["dtensor"]) > 1e-5 * max(1.0, abs(first["dtensor"])):
        raise SystemExit(f"first-step losses differ: {first}")
    for _ in range(args.warmup - 1):
        for name in contenders:
            step(name)
    for key in ("0.weight", "2.weight"):
        a, b = full_weight(contenders["ours"], key), full_weight(contenders["dtensor"], key)
        if not torch.allclose(a, b, atol=1e-5):
            raise SystemExit(f"weights differ after warm-up: {key}")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    counts_before = dict(contenders["ours"].comm.counts)
    for k in range(args.steps):
        for name in names[k % 2:] + names[:k % 2]:
            times[name].append(step(name)[0])
    counts = {f"{op} {phase}": (n - counts_before.get((op, phase), 0)) / args.steps
              for (op, phase), n in contenders["ours"].comm.counts.items()
              if n != counts_before.get((op, phase), 0)}
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "first_losses": first,
                                         "collectives": counts}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "times.json")
        mp.spawn(worker, args=(args.ranks, free_port(), args, out), nprocs=args.ranks)
        data = json.loads(Path(out).read_text())
    medians = {name: statistics.median(t) for name, t in data["times"].items()}
    print(f"tensor parallel over {args.ranks} gloo ranks, 1 thread each; "
          f"{args.blocks} x (Linear({args.width}, {args.width}), ReLU), batch {args.batch}, "
          f"SGD step; {args.warmup} warm-up + {args.steps} timed steps, interleaved")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; load average (1 min) {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after (other processes share the cores when above "
          f"{args.ranks})")
    print(f"first-step losses: ours {data['first_losses']['ours']:.6f}, "
          f"DTensor {data['first_losses']['dtensor']:.6f}")
    print(f"{'contender':<10} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, t in data["times"].items():
        print(f"{name:<10} {medians[name] * 1e3:>10.2f} {min(t) * 1e3:>8.2f} "
              f"{max(t) * 1e3:>8.2f}")
    print(f"ours: collectives per step {data['collectives']}")
    print(f"ratio ours/DTensor (median step): {medians['ours'] / medians['dtensor']:.3f}")


if __name__ == "__main__":
    main()
