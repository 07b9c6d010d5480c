"""torch.distributed.pipelining contenders of ``distributed_vs_torch.py`` part (a).

For each of our schedules, the closest schedule torch ships, on the same split of the same
``nn.Sequential`` into ``P v`` equal pieces (``P`` ranks, ``v`` pieces per rank, piece
``k`` on rank ``k % P``: Megatron's interleaved placement, which is ours too):

=============  ===================================  ================================
ours           torch                                stages per rank
=============  ===================================  ================================
gpipe          ``ScheduleGPipe``                    1
1f1b           ``Schedule1F1B``                     1
interleaved    ``ScheduleInterleaved1F1B``          ``v`` (``--virtual``)
zero_bubble    ``ScheduleInterleavedZeroBubble``    1 (``--their-zero-bubble``)
=============  ===================================  ================================

torch has no single-stage zero-bubble class: ``ScheduleInterleavedZeroBubble`` (ZB1P, its
"interleaved zero bubble") given one stage per rank is the ZB-H1 schedule ours runs, on the
same split; ``--their-zero-bubble interleaved2`` gives it ``v`` stages per rank and
``zbv`` runs ``ScheduleZBVZeroBubble`` (two stages per rank in a V: rank ``r`` holds pieces
``r`` and ``2P - 1 - r``), both on a ``2P``-piece split.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["THEIR_ZERO_BUBBLE", "their_label", "torch_pipeline_step"]

THEIR_ZERO_BUBBLE = ("interleaved1", "interleaved2", "zbv")


def their_label(kind: str, zero_bubble: str) -> str:
    """The torch class (and stages per rank) standing in for our schedule ``kind``."""
    return {
        "gpipe": "ScheduleGPipe",
        "1f1b": "Schedule1F1B",
        "interleaved": "ScheduleInterleaved1F1B",
        "zero_bubble": {"interleaved1": "ScheduleInterleavedZeroBubble (1 stage/rank)",
                        "interleaved2": "ScheduleInterleavedZeroBubble (2+ stages/rank)",
                        "zbv": "ScheduleZBVZeroBubble (V, 2 stages/rank)"}[zero_bubble],
    }[kind]


def _placement(kind: str, zero_bubble: str, rank: int, world: int, virtual: int
               ) -> tuple[int, list[int]]:
    """(pieces in all, the pieces this rank holds, in stage order)."""
    if kind in ("gpipe", "1f1b") or (kind == "zero_bubble" and zero_bubble == "interleaved1"):
        return world, [rank]
    if kind == "zero_bubble" and zero_bubble == "zbv":
        return 2 * world, [rank, 2 * world - 1 - rank]
    return world * virtual, [rank + c * world for c in range(virtual)]


def _schedule_class(kind: str, zero_bubble: str) -> type:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )
    if kind == "zero_bubble":
        return ScheduleZBVZeroBubble if zero_bubble == "zbv" else ScheduleInterleavedZeroBubble
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
            "interleaved": ScheduleInterleaved1F1B}[kind]


def torch_pipeline_step(kind: str, base: nn.Sequential, rank: int, world: int, chunks: int,
                        x: torch.Tensor, y: torch.Tensor, *, virtual: int = 2,
                        zero_bubble: str = "interleaved1") -> Callable[[], float]:
    """An SGD step of torch's pipeline for our schedule ``kind`` on ``world`` ranks.

    Every rank calls it (collective); the step returns the batch's mean loss on every rank,
    as ours does.
    """
    from torch.distributed.pipelining import PipelineStage

    n, mine = _placement(kind, zero_bubble, rank, world, virtual)
    if len(base) % n:
        raise ValueError(f"{len(base)} modules do not split into {n} equal pieces; pass "
                         f"--blocks a multiple of {n // 2 or 1}")
    size = len(base) // n
    pieces = [copy.deepcopy(base[k * size:(k + 1) * size]) for k in mine]
    stages = [PipelineStage(piece, k, n, torch.device("cpu")) for k, piece in zip(mine, pieces)]
    cls = _schedule_class(kind, zero_bubble)
    single = kind in ("gpipe", "1f1b")
    schedule = cls(stages[0] if single else stages, n_microbatches=chunks, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD([p for piece in pieces for p in piece.parameters()], lr=1e-3)
    first, last = 0 in mine, n - 1 in mine
    owner = _last_rank(kind, zero_bubble, world)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        inputs = (x,) if first else ()
        if last:
            schedule.step(*inputs, target=y, losses=losses)
        else:
            schedule.step(*inputs)
        optimizer.step()
        value = torch.tensor([sum(float(v.detach()) for v in losses) / chunks])
        dist.broadcast(value, src=owner)  # the loss on every rank, as ours returns it
        return float(value)
    return step


def _last_rank(kind: str, zero_bubble: str, world: int) -> int:
    """The rank holding the last piece (it computes the loss)."""
    return 0 if kind == "zero_bubble" and zero_bubble == "zbv" else world - 1
