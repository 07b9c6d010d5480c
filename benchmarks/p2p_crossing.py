"""Messages crossing between two gloo ranks: one group for both ways against one per direction.

Two ranks post their receives, compute 4 ms, then send each other one message at the same
moment (a pipeline's ranks do whenever their stages end together: an interleaved schedule's
ring, a 1F1B rank's activations passing the next rank's gradients). Timed per rank: from
posting its send to holding the other's message. On one gloo group for both directions
(``PipeLinks`` before the mesh had a second pipeline group) against one group per
direction (what ``ProcessMesh.reverse_group`` gives the runtime on gloo), round-robin in one
world; then the same pipeline, a small GPT in an interleaved schedule (``pp=2``, 3 virtual
stages each, 2 micro-batches, Adam), stepped with each layout in turn.

Run (a quiet machine; about a minute):
    python benchmarks/p2p_crossing.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = (64 << 10, 512 << 10, 2 << 20)


def _busy(seconds: float) -> None:
    import torch
    a = torch.randn(128, 128)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a


def crossing(groups: tuple[Any, Any], nbytes: int, rounds: int) -> list[float]:
    """Seconds from posting this rank's send to holding the peer's message, per round."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    peer = 1 - rank
    send_on, recv_on = groups if rank == 0 else groups[::-1]
    out = torch.randn(nbytes // 4)
    times = []
    for k in range(rounds):
        buf = torch.empty(nbytes // 4)
        dist.barrier()
        pending = dist.irecv(buf, peer, group=recv_on, tag=k)
        _busy(0.004)
        start = time.perf_counter()
        sent = dist.isend(out, peer, group=send_on, tag=k)
        pending.wait()
        times.append(time.perf_counter() - start)
        sent.wait()
    return times


def _slowest(values: list[float]) -> list[float]:
    """Each round's time on the rank that waited longer."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


PIPELINES: dict[str, dict[str, Any]] = {
    "gpt": {"pp": 2, "schedule": "interleaved", "chunks": 2, "virtual_stages": 3},
    "mlp": {"pp": 2, "schedule": "zero_bubble", "chunks": 1},
}


def _pipeline_case(case: str) -> tuple[Any, Any, Any]:
    import torch
    sys.path.insert(0, str(ROOT))
    from examples.models import classifier, gpt
    if case == "gpt":
        return (gpt(4, 256, 4, 2048, 64), torch.randint(0, 2048, (8, 64)),
                torch.randn(8, 64, 2048))
    return classifier(32, width=128, depth=6, classes=8), torch.randn(64, 32), torch.randn(64, 8)


def pipeline_steps(case: str, rounds: int) -> dict[str, list[float]]:
    """A pipeline stepped with one pipeline group, then with two, in turn."""
    import torch
    import torch.distributed as dist

    from partitioner.distributed import partition_distributed
    from partitioner.runtime.distributed import mesh as process_mesh
    torch.manual_seed(0)
    built: dict[str, Any] = {}
    original = process_mesh.ProcessMesh.reverse_group
    for layout in ("one group", "a group per direction"):
        if layout == "one group":
            process_mesh.ProcessMesh.reverse_group = lambda self: None  # type: ignore[method-assign]
        else:
            process_mesh.ProcessMesh.reverse_group = original  # type: ignore[method-assign]
        model, x, target = _pipeline_case(case)
        dpm = partition_distributed(model, (x,), backend="gloo", calibrate=False,
                                    **PIPELINES[case])
        built[layout] = (dpm, torch.optim.Adam(dpm.parameters(), lr=1e-4))
    process_mesh.ProcessMesh.reverse_group = original  # type: ignore[method-assign]
    times: dict[str, list[float]] = {k: [] for k in built}
    for k in range(rounds):
        for layout, (dpm, opt) in built.items():
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            dpm.step(x, target, torch.nn.functional.mse_loss)
            opt.step()
            if k >= 5:  # warm-up
                times[layout].append(time.perf_counter() - start)
    for dpm, _ in built.values():
        dpm.close()
    return {k: _slowest(v) for k, v in times.items()}


def rank_main(rounds: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layouts = {"one group": (dist.new_group([0, 1]),) * 2,
               "a group per direction": (dist.new_group([0, 1]), dist.new_group([0, 1]))}
    rows = []
    for nbytes in SIZES:
        times: dict[str, list[float]] = {k: [] for k in layouts}
        for _ in range(4):  # round-robin in blocks
            for layout, groups in layouts.items():
                times[layout] += crossing(groups, nbytes, rounds // 4)[2:]
        rows.append((nbytes, {k: _slowest(v) for k, v in times.items()}))
    steps = {case: pipeline_steps(case, max(rounds // 2, 20) * (10 if case == "mlp" else 1))
             for case in PIPELINES}
    if dist.get_rank() == 0:
        def cell(v: list[float]) -> str:
            return f"{statistics.median(v) * 1e3:.2f} / {statistics.fmean(v) * 1e3:.2f}"
        print("| message | one group: median / mean ms | a group per direction | "
              "ratio of means |")
        print("|---:|---:|---:|---:|")
        for nbytes, t in rows:
            one, two = t["one group"], t["a group per direction"]
            print(f"| {nbytes >> 10} KiB | {cell(one)} | {cell(two)} | "
                  f"{statistics.fmean(two) / statistics.fmean(one):.2f} |")
        print()
        for case, times in steps.items():
            one, two = times["one group"], times["a group per direction"]
            print(f"{case} {PIPELINES[case]}, Adam: one group {cell(one)} ms a step, a group "
                  f"per direction {cell(two)} ms (ratio of medians "
                  f"{statistics.median(two) / statistics.median(one):.2f})")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--rank-of", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(args.rounds)
        return
    import subprocess
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-of",
                                       "--rounds", str(args.rounds)], env=env))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
