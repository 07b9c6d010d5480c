"""What the ranks of one host get done stepping their optimizers at once, measured.

Every rank of a ``partition_distributed`` world steps its own optimizer, all at the same
time (after the step's loss all-reduce). On a CPU host those steps share its cores and its
memory. The calibration's element-wise row (``DeviceSpec.shared_speedup`` of 0 FLOPs: a
stream of adds over 64 MiB tensors, which one thread of the 2-core CI VM already holds to the
memory's speed) said four one-thread ranks get 1.02 steps done in the time of one; Adam is
not that stream (why it shares the host better was not measured). Timed on that VM
(2026-12-05, ``gpt`` and ``wide`` of ``benchmarks/regret_distributed.py``, 4 ranks of one
thread): every rank's Adam step measured 16-18 ms at once where the prediction said 35 for
all four (``gpt``, ``dp=4``), and separate processes stepping 16 MiB of weights at once got
1.7-2.9 steps done in the time of one alone.

:func:`probe_optimizer_gain` measures it in the world that will run the plan: each rank
times an Adam step over its own :data:`WEIGHTS` weights of :data:`WEIGHT` x :data:`WEIGHT`
alone (the others wait in a barrier), then every rank at once; the ranks' steps alone over
the slowest rank's step at once is the gain (``LinkSpec.optimizer_gain``), never more than
the world's size.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> w.grad = torch.ones(4)
    >>> adam_update([w], [(torch.zeros(4), torch.zeros(4))], 1, lr=0.1)
    >>> round(float(w[0]), 4)  # Adam's first step moves a weight by lr
    0.9
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from partitioner.runtime.distributed.comm_failure import communicating

__all__ = ["adam_update", "probe_optimizer_gain", "ranks_gain", "WEIGHT", "WEIGHTS", "ROUNDS"]

WEIGHT = 1024
"""The side of each weight the probe steps (4 MiB in fp32: the calibration's Adam weights)."""
WEIGHTS = 4
"""Weights per rank (16 MiB of parameters: 10-20 ms a step on one thread of the CI VM)."""
ROUNDS = 5
"""Steps timed alone and at once (the median counts), after 3 not timed (the allocator
reuses the step's temporaries from the second step on)."""


@torch.no_grad()
def adam_update(weights: list[torch.nn.Parameter],
                state: list[tuple[torch.Tensor, torch.Tensor]], step: int,
                lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8) -> None:
    """One step of ``torch.optim.Adam``'s single-tensor path (its default on CPU), op for op:
    ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, a division, ``add_``, ``addcdiv_`` (without
    importing ``torch.optim``, whose first step imports about 800 modules)."""
    beta1, beta2 = betas
    correction1, correction2 = 1 - beta1**step, 1 - beta2**step
    for w, (exp_avg, exp_avg_sq) in zip(weights, state):
        grad = w.grad
        assert grad is not None
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2**0.5).add_(eps)
        w.addcdiv_(exp_avg, denom, value=-lr / correction1)


def probe_optimizer_gain() -> float:
    """How many ranks' optimizer steps the world's ranks get done at once in the time of one
    rank's step alone (collective: every rank calls it). 1.0 in a world of one.

    Raises:
        CommunicationError: a rank stopped answering (``communicating``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        return 1.0
    generator = torch.Generator().manual_seed(rank)
    weights = [torch.nn.Parameter(torch.randn(WEIGHT, WEIGHT, generator=generator))
               for _ in range(WEIGHTS)]
    for w in weights:
        w.grad = torch.randn(WEIGHT, WEIGHT, generator=generator)
    state = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]
    count = [0]

    def timed() -> float:
        count[0] += 1
        start = time.perf_counter()
        adam_update(weights, state, count[0])
        return time.perf_counter() - start

    with communicating("timing the ranks' optimizer steps (barriers)"):
        alone = 0.0
        for turn in range(world):  # one rank at a time: the others wait
            if turn == rank:
                for _ in range(3):
                    timed()
                alone = statistics.median(timed() for _ in range(ROUNDS))
            dist.barrier()
        together = []
        for _ in range(ROUNDS):
            dist.barrier()
            together.append(timed())
        figures = torch.tensor([alone, statistics.median(together)], dtype=torch.float64)
        summed, slowest = figures.clone(), figures.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return ranks_gain(float(summed[0]), float(slowest[1]), world)


def ranks_gain(alone: float, together: float, world: int) -> float:
    """Steps done at once in the time of one alone: ``alone``, the ranks' steps alone
    summed, over ``together``, the slowest rank's step with all of them stepping; between
    one rank's step shared by all (``1 / world``) and every rank as fast as alone (``world``).

    Example:
        >>> ranks_gain(4 * 0.010, 0.020, 4)  # four 10 ms steps done in 20 ms
        2.0
        >>> ranks_gain(4 * 0.010, 0.005, 4), ranks_gain(4 * 0.010, 1.0, 4)  # noise: clamped
        (4.0, 0.25)
    """
    return min(max(alone / max(together, 1e-9), 1.0 / world), float(world))
