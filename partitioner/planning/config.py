"""How a workload is spread over a cluster: the configuration every prediction is of.

``Config`` names the mesh (``dp x tp x pp``), the micro-batches, the schedule and its
virtual stages, the recomputation, the optimizer and how its state and the gradients'
reduction are laid out; it refuses an inconsistent one when built (``ConfigError``).
``partitioner.planning.predict`` costs it, the search (``auto``) enumerates it, plan
records keep it as a dict.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.cost.memory import OPTIMIZERS
from partitioner.errors import ConfigError
from partitioner.runtime.checkpointing import checkpoint_problem
from partitioner.runtime.schedule_registry import name_problem, schedule_kind

__all__ = ["Config", "ConfigError"]


@dataclass(frozen=True)
class Config:
    """How a workload is spread over a cluster.

    Attributes:
        dp: data-parallel replicas.
        tp: tensor-parallel ranks per stage (inside one node).
        pp: pipeline stages (devices along the pipeline).
        chunks: micro-batches per replica per step (``m``).
        schedule: a name of ``partitioner.runtime.schedule_registry.SCHEDULES``:
            ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        virtual: model chunks per device (``v``; interleaved only, else 1).
        checkpoint: ``"never"``, ``"always"`` or ``"except_last"``.
        optimizer: a key of :data:`partitioner.cost.memory.OPTIMIZERS`.
        overlap_grad_reduce: whether the gradient all-reduce overlaps the last backward.
        overlap_p2p: whether sending activations and gradients between stages overlaps
            compute; when not (Megatron-LM 2021's blocking send/receive), a stage waits for
            its sends.
        optimizer_sharding: ZeRO-1 (``partition_distributed(optimizer_sharding=True)``):
            each replica holds and steps ``1 / dp`` of the optimizer state; the gradients
            are reduce-scattered and the weights all-gathered (the bytes of one ring
            all-reduce), after the last backward rather than overlapping it.
        overlap_param_gather: with ``optimizer_sharding``, the gradients' reduce-scatter
            overlaps the last backward and the weights' all-gather the next step's first
            forward, as Megatron-LM's distributed optimizer runs them
            (``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather``);
            no runtime here runs it (a configuration for published runs).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    chunks: int = 1
    schedule: str = "gpipe"
    virtual: int = 1
    checkpoint: str = "never"
    optimizer: str = "adam"
    overlap_grad_reduce: bool = True
    overlap_p2p: bool = True
    optimizer_sharding: bool = False
    overlap_param_gather: bool = False

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}" for k in ("dp", "tp", "pp", "chunks", "virtual")
                    if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int)
                    or getattr(self, k) < 1]
        unknown = name_problem(self.schedule)
        if unknown is not None:
            problems.append(unknown)
        elif not problems:
            problems += schedule_kind(self.schedule).problems(self.pp, self.chunks, self.virtual)
        unfit = checkpoint_problem(self.checkpoint)
        if unfit is not None:
            problems.append(unfit)
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer={self.optimizer!r} (use one of {sorted(OPTIMIZERS)})")
        if self.optimizer_sharding and self.dp < 2:
            problems.append(f"optimizer_sharding=True with dp={self.dp} (shards the optimizer "
                            "state over 2 or more replicas; pass dp >= 2 or False)")
        if self.overlap_param_gather and not (self.optimizer_sharding
                                              and self.overlap_grad_reduce):
            problems.append("overlap_param_gather=True without optimizer_sharding=True and "
                            "overlap_grad_reduce=True (it overlaps the sharded optimizer's "
                            "reduce-scatter and all-gather; pass both, or False)")
        if problems:
            raise ConfigError("bad Config: " + "; ".join(problems))

    @property
    def devices(self) -> int:
        """``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def stages(self) -> int:
        """Virtual stages: ``pp * virtual``."""
        return self.pp * self.virtual

    def label(self) -> str:
        """A short description: ``"dp=2 tp=1 pp=4 m=8 1f1b ckpt=always"``."""
        schedule = self.schedule + (f"(v={self.virtual})" if self.virtual > 1 else "")
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} m={self.chunks} {schedule} "
                f"ckpt={self.checkpoint}" + (" zero1" if self.optimizer_sharding else "")
                + (" overlapped" if self.overlap_param_gather else ""))

    @property
    def reduces_in_backward(self) -> bool:
        """Whether the gradients' reduction may start during the backward (not the
        runtime's sharded optimizer, which starts it after the last)."""
        return not self.optimizer_sharding or self.overlap_param_gather

    @property
    def optimizer_shards(self) -> int:
        """Replicas the optimizer state is divided over: ``dp`` when sharded, else 1."""
        return self.dp if self.optimizer_sharding else 1
