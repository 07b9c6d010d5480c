"""Memory per device: parameters, gradients, optimizer state and activations.

For the layers a device holds (``tp``-way split where they can be):

* parameters and their gradients, in the parameters' dtype;
* optimizer state (:data:`OPTIMIZERS`): Adam keeps two moments, SGD with momentum one,
  plain SGD none; with mixed precision the states are fp32 and an fp32 master copy of the
  weights is added;
* activations: one micro-batch's worth times the micro-batches *in flight* (forward run,
  backward not yet): ``m`` on every stage for GPipe, ``min(p - j, m)`` on stage ``j`` of
  ``p`` for 1F1B, and for Megatron's interleaved 1F1B with ``v`` chunks per device
  ``min(2 (p - j - 1) + (v - 1) p + 1, m v)`` chunk-micro-batches;
* checkpointing keeps only each in-flight micro-batch's stage *input* and replays the
  forward, so the full activations of one micro-batch are alive at a time (``always``);
  ``except_last`` keeps the last micro-batch's in full (torchgpipe's modes).

Example:
    >>> in_flight("gpipe", 4, 8), in_flight("1f1b", 4, 8), in_flight("1f1b", 4, 8, stage=3)
    (8, 4, 1)
    >>> per_parameter_bytes("adam", 4, mixed_precision=False)  # weight, grad, 2 moments
    16
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.errors import MemoryModelError
from partitioner.runtime.checkpointing import ALWAYS, NEVER, checkpoint_problem
from partitioner.runtime.schedule_registry import SCHEDULES, ScheduleKind, name_problem

__all__ = ["MemoryModelError", "OPTIMIZERS", "MemoryBreakdown", "in_flight", "held_by_stage",
           "per_parameter_bytes", "optimizer_traffic", "optimizer_temporaries",
           "activation_memory", "activation_peak", "device_memory"]

OPTIMIZERS: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2,
                               "fused_adam": 2}
"""Optimizer state tensors kept per parameter (``"adam"`` is PyTorch's default
implementation, one element-wise pass per operation; ``"fused_adam"`` one pass in all, as
apex's FusedAdam or ``torch.optim.Adam(fused=True)``)."""


def _check(name: str, value: str, known: tuple[str, ...] | dict[str, int]) -> None:
    if value not in known:
        raise MemoryModelError(f"{name}={value!r} is unknown; use one of {sorted(known)}")


def in_flight(schedule: str, n_stages: int, n_microbatches: int, stage: int = 0,
              virtual: int = 1) -> int:
    """Peak micro-batches (chunk-micro-batches when interleaved) a stage holds activations of.

    Args:
        schedule: a name of ``partitioner.runtime.schedule_registry.SCHEDULES``, whose entry
            knows its peak (``"gpipe"``, ``"1f1b"`` or ``"interleaved"``).
        n_stages: ``p``, devices in the pipeline.
        n_microbatches: ``m``.
        stage: ``j``, the device's position.
        virtual: ``v``, model chunks per device (interleaved only).

    Raises:
        MemoryModelError: for an unknown schedule.
    """
    return _kind(schedule).in_flight(n_stages, n_microbatches, stage, virtual)


def held_by_stage(schedule: str, n_stages: int, n_microbatches: int, stage: int = 0,
                  virtual: int = 1) -> tuple[tuple[int, ...], ...]:
    """Micro-batches a stage holds per virtual stage at each moment that can be its peak.

    One entry per virtual stage of device ``stage`` (in stage order) in each tuple: what
    :func:`activation_peak` weighs by each chunk's bytes, since an interleaved device's
    chunks need not keep alike (the last holds the head's logits).

    Example:
        >>> held_by_stage("1f1b", 4, 8), held_by_stage("interleaved", 2, 4, 1, virtual=2)
        (((4,),), ((2, 1), (3, 0)))

    Raises:
        MemoryModelError: for an unknown schedule.
    """
    return _kind(schedule).held_by_stage(n_stages, n_microbatches, stage, virtual)


def _kind(schedule: str) -> ScheduleKind:
    unknown = name_problem(schedule)
    if unknown is not None:
        raise MemoryModelError(unknown)
    return SCHEDULES[schedule]


def per_parameter_bytes(optimizer: str, element: int, mixed_precision: bool) -> int:
    """Bytes per parameter of weights, gradients and optimizer state.

    Example:
        >>> per_parameter_bytes("adam", 2, mixed_precision=True)  # bf16 w, g; fp32 m, v, master
        16
    """
    _check("optimizer", optimizer, OPTIMIZERS)
    state = 4 if mixed_precision else element
    master = 4 if mixed_precision else 0
    return 2 * element + OPTIMIZERS[optimizer] * state + master


def optimizer_traffic(optimizer: str, element: int, mixed_precision: bool) -> int:
    """Bytes the optimizer step moves per parameter.

    With ``e`` bytes per weight or gradient and ``s`` per state value: SGD reads the weight
    and gradient and writes the weight (``3e``); with momentum its buffer is updated and
    read again (``+5s``). PyTorch's Adam runs seven element-wise passes (``lerp_``, ``mul_``,
    ``addcmul_``, ``sqrt``, a division, ``add_``, ``addcdiv_``: ``4e + 14s``) and touches two
    fresh temporaries (``2s``); a fused Adam reads and writes each tensor once (``3e + 4s``).
    Mixed precision adds reading and writing the fp32 master weights.

    Example:
        >>> optimizer_traffic("sgd", 4, False), optimizer_traffic("adam", 4, False)
        (12, 80)
        >>> optimizer_traffic("fused_adam", 4, False), optimizer_traffic("fused_adam", 2, True)
        (28, 30)
    """
    _check("optimizer", optimizer, OPTIMIZERS)
    e, s = element, (4 if mixed_precision else element)
    master = 8 if mixed_precision else 0
    traffic = {"sgd": 3 * e, "momentum": 3 * e + 5 * s, "adam": 4 * e + 16 * s,
               "adamw": 4 * e + 16 * s + 2 * e, "fused_adam": 3 * e + 4 * s}
    return traffic[optimizer] + master


def optimizer_temporaries(optimizer: str) -> int:
    """Parameter-sized temporaries the optimizer step allocates, per parameter tensor.

    PyTorch's (unfused) Adam allocates two: the square root of the second moment and its
    quotient by the bias correction; SGD and fused Adam work in place.

    Example:
        >>> optimizer_temporaries("adam"), optimizer_temporaries("momentum")
        (2, 0)
    """
    _check("optimizer", optimizer, OPTIMIZERS)
    return 2 if optimizer in ("adam", "adamw") else 0


def activation_memory(checkpoint: str, held: int, full: float, stage_input: float) -> float:
    """Activation bytes of a stage holding ``held`` micro-batches.

    Args:
        checkpoint: ``"never"``, ``"always"`` or ``"except_last"``.
        held: micro-batches in flight (:func:`in_flight`).
        full: bytes one micro-batch's forward keeps for the backward.
        stage_input: bytes of one micro-batch's stage input (what a checkpoint keeps).

    Example:
        >>> activation_memory("never", 4, 100.0, 10.0), activation_memory("always", 4, 100.0, 10.0)
        (400.0, 140.0)
    """
    return activation_peak(checkpoint, ((held,),), (full,), (stage_input,))


def activation_peak(checkpoint: str, held: Sequence[Sequence[int]], full: Sequence[float],
                    stage_input: Sequence[float]) -> float:
    """Activation bytes of a device whose virtual stages keep different amounts.

    For each moment of ``held`` (:func:`held_by_stage`), chunk ``k`` keeps ``full[k]`` per
    micro-batch in flight, or ``stage_input[k]`` when checkpointed, plus what a replay
    holds (``always``: one micro-batch's ``full[k]``; ``except_last``: its ``full[k]``
    instead of its input); the largest of them, the chunk whose replay adds most being the
    one replayed at the peak. One chunk: :func:`activation_memory`.

    Example:
        >>> activation_peak("never", [(2, 1), (3, 0)], [10.0, 30.0], [1.0, 1.0])
        50.0
        >>> activation_peak("always", [(2, 1), (3, 0)], [10.0, 30.0], [1.0, 1.0])
        33.0
        >>> activation_peak("never", [(4,)], [100.0], [10.0]) == activation_memory(
        ...     "never", 4, 100.0, 10.0)
        True
    """
    unknown = checkpoint_problem(checkpoint)
    if unknown is not None:
        raise MemoryModelError(unknown)
    peak = 0.0
    for counts in held:
        kept = [k for k, c in enumerate(counts) if c]
        if not kept:
            continue
        if checkpoint == NEVER:
            peak = max(peak, sum(counts[k] * full[k] for k in kept))
            continue
        inputs = sum(counts[k] * stage_input[k] for k in kept)
        # ``always``: every held micro-batch keeps its input, one is replayed in full;
        # ``except_last``: the replayed one is the last, kept whole instead of its input.
        extra = full if checkpoint == ALWAYS else [f - i for f, i in zip(full, stage_input)]
        peak = max(peak, inputs + max(extra[k] for k in kept))
    return peak


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one device holds at its peak, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float = 0.0

    @property
    def total(self) -> float:
        """All of it."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def device_memory(param_bytes: float, buffer_bytes: float, activations: float, *,
                  optimizer: str, element: int, mixed_precision: bool,
                  shards: int = 1, param_shards: int = 1) -> MemoryBreakdown:
    """The breakdown for a device holding ``param_bytes`` of parameters (its TP share).

    ``shards``: replicas the optimizer state (and fp32 master weights) is divided over
    (ZeRO-1, ``optimizer_sharding``: the data-parallel degree); weights and gradients stay
    whole. ``param_shards``: replicas weights, gradients and optimizer state are all divided
    over (FSDP, ``Workload.fsdp``: the data-parallel degree).

    Example:
        >>> device_memory(400.0, 0.0, 50.0, optimizer="sgd", element=4,
        ...               mixed_precision=False).total
        850.0
        >>> device_memory(400.0, 0.0, 0.0, optimizer="adam", element=4,
        ...               mixed_precision=False, shards=4).optimizer
        200.0
        >>> device_memory(400.0, 0.0, 0.0, optimizer="adam", element=4,
        ...               mixed_precision=False, param_shards=4).total
        400.0
    """
    _check("optimizer", optimizer, OPTIMIZERS)
    count = param_bytes / element
    state = 4 if mixed_precision else element
    master = 4 * count if mixed_precision else 0.0
    whole = param_bytes / param_shards
    return MemoryBreakdown(whole, whole,
                           (OPTIMIZERS[optimizer] * state * count + master)
                           / max(shards, param_shards), activations, buffer_bytes)
