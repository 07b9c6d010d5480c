"""What the one-process runtimes pay beyond the layers' compute, measured on this machine.

Several ``"cpu"`` devices in one process are worker threads. Two of the runtime's paths cost
far more than bytes over memory bandwidth, and the cost model charges what these functions
time (``partitioner.cost.measure`` runs them in each calibration):

* a tensor-parallel collective between threads (``runtime/tensor_parallel/collectives.py``,
  :class:`~partitioner.runtime.tensor_parallel.collectives.ThreadGroup`) is a rendezvous:
  every rank deposits its tensor, waits for the others, sums, and waits again. Its fixed
  cost is two thread wake-ups per rank, tens to hundreds of microseconds on a busy host,
  where a copy of a small activation takes a few;
* data-parallel replicas (``runtime/replicas.py``) split the batch, hand each share to a
  worker thread, run the backward there, add the copies' gradients into the master's and
  compare and copy the weights back before the next call: a fixed cost per replica and per
  step, and one per parameter tensor (a comparison, a copy, a sum: each an op and its
  Python), besides the bytes.

The optimizer has a fixed cost per parameter tensor too (``torch.optim.Adam``'s loop over
the tensors: about ten kernel calls and Python bookkeeping each), which for a model of many
small tensors outweighs the bytes it streams: :func:`optimizer_tensor_seconds`.

Example:
    >>> optimizer_tensor_seconds(rounds=5) > 0
    True
    >>> thread_collective_seconds(rounds=20) > 0
    True
    >>> replica_step_seconds(rounds=5) >= 0
    True
    >>> replica_tensor_seconds(layers=4, rounds=3) > 0
    True
    >>> fused_linear_seconds(rounds=3) >= 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.runtime import fused_linear
from partitioner.runtime.replica_copy import GraphReplica, ReplicaTensors
from partitioner.runtime.replicas import ReplicatedModule
from partitioner.runtime.tensor_parallel.collectives import ThreadCommunicator, ThreadGroup
from partitioner.runtime.worker import Worker, shared_threads

__all__ = ["thread_collective_seconds", "replica_step_seconds", "replica_tensor_seconds",
           "fused_linear_seconds", "optimizer_tensor_seconds"]


def thread_collective_seconds(ranks: int = 2, rounds: int = 200) -> float:
    """Seconds per all-reduce of a tiny tensor among ``ranks`` worker threads (the median of
    three runs of ``rounds`` back-to-back collectives), as the tensor-parallel runtime runs
    them."""
    cpu = torch.device("cpu")
    group = ThreadGroup([cpu] * ranks, timeout=60.0)
    threads = shared_threads([cpu] * ranks)
    workers = [Worker(cpu, threads) for _ in range(ranks)]
    comms = [ThreadCommunicator(group, r) for r in range(ranks)]
    x = torch.ones(16)

    def loop(comm: ThreadCommunicator) -> None:
        for _ in range(rounds):
            comm.all_reduce(x, "forward")
    times = []
    try:
        for _ in range(4):
            start = time.perf_counter()
            for future in [w.submit(lambda c=c: loop(c)) for w, c in zip(workers, comms)]:
                future.result()
            times.append((time.perf_counter() - start) / rounds)
    finally:
        for w in workers:
            w.close()
    return statistics.median(times[1:])


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _graph_of(graph: fx.GraphModule) -> Callable[[bool], fx.GraphModule]:
    return lambda training: graph


def _positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    return list(args)


def _same(out: Any) -> Any:
    return out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def replica_step_seconds(rounds: int = 30) -> float:
    """Seconds two replicas of a tiny model add to a training step over the model called
    directly, per replica: the split, the hand-off to and back from each worker thread, the
    gradient sum and the weight check before the call (the median of ``rounds`` steps)."""
    torch.manual_seed(0)
    model, copy = _Tiny(), _Tiny()
    graphs = [fx.symbolic_trace(m) for m in (model, copy)]
    replicas = [GraphReplica(m, _graph_of(g), _positional, _same)
                for m, g in zip((model, copy), graphs)]
    pm = ReplicatedModule(None, replicas, [torch.device("cpu")] * 2)
    x, target = torch.randn(8, 8), torch.zeros(8)

    def replicated() -> None:
        pm.step((x,), target, _loss)
        model.zero_grad(set_to_none=True)

    def direct() -> None:
        _loss(model(x), target).backward()
        model.zero_grad(set_to_none=True)
    try:
        together: list[float] = []
        alone: list[float] = []
        for _ in range(rounds + 3):  # in turn: load drifting skews neither
            for fn, times in ((replicated, together), (direct, alone)):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        return max(statistics.median(together[3:]) - statistics.median(alone[3:]), 0.0) / 2
    finally:
        pm.close()


def replica_tensor_seconds(layers: int = 32, rounds: int = 20) -> float:
    """Seconds two replicas add per parameter tensor to a step, beyond the bytes: the weight
    check before the call (a comparison, and a copy when the optimizer changed the master)
    and the gradient sum after it, each one op and its Python per tensor (the median of
    ``rounds`` steps over ``2 * layers`` tiny tensors, divided by their count)."""
    torch.manual_seed(0)
    master = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    copy = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    tensors = ReplicaTensors(master, [copy])
    params = list(master.parameters())
    times = []
    for _ in range(rounds + 3):
        with torch.no_grad():
            for p in params:  # what an optimizer step does between two calls
                p.add_(1e-3)
        for p, q in zip(params, copy.parameters()):
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        start = time.perf_counter()
        tensors.refresh()
        tensors.sum_grads()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) / len(params)


def fused_linear_seconds(rounds: int = 30) -> float:
    """Seconds a Linear routed through ``partitioner.runtime.fused_linear`` (a Python
    autograd function: what a split backward needs to queue its weight products) adds to a
    forward and backward over ``F.linear`` (the median of ``rounds`` alternate timings of
    16 tiny layers, divided by their count)."""
    weights = [nn.Parameter(torch.randn(8, 8)) for _ in range(16)]
    x = torch.randn(4, 8, requires_grad=True)

    def chain(linear: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            y = x
            for w in weights:
                y = linear(y, w)
            y.sum().backward()
        return run
    fused, plain = chain(fused_linear.linear), chain(torch.nn.functional.linear)
    times: dict[Callable[[], None], list[float]] = {fused: [], plain: []}
    for _ in range(rounds + 3):
        for run in (fused, plain):
            start = time.perf_counter()
            run()
            times[run].append(time.perf_counter() - start)
    extra = statistics.median(times[fused][3:]) - statistics.median(times[plain][3:])
    return max(extra, 0.0) / len(weights)


def optimizer_tensor_seconds(tensors: int = 32, rounds: int = 20) -> float:
    """Seconds ``torch.optim.Adam`` (its default, single-tensor path on CPU) spends per
    parameter tensor beyond the bytes it streams: the median step over ``tensors`` tiny
    tensors, divided by their count."""
    weights = [nn.Parameter(torch.randn(64)) for _ in range(tensors)]
    for w in weights:
        w.grad = torch.randn(64)
    optimizer = torch.optim.Adam(weights, lr=1e-6)
    times = []
    for _ in range(rounds + 3):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) / tensors
