"""The errors a user of the partitioner can meet.

Every mistake a caller can make raises a subclass of :class:`PartitionError` that also
subclasses the matching built-in (``ValueError`` or ``TypeError``), so callers may catch
either. Messages state the problem, the offending value and a fix.
"""

from __future__ import annotations

__all__ = [
    "PartitionError",
    "DeviceError",
    "StrategyError",
    "BalanceError",
    "ChunksError",
    "MemoryLimitError",
    "ExampleInputsError",
    "StageCountError",
    "TraceError",
    "ScheduleError",
    "StageExecutionError",
]


class PartitionError(Exception):
    """Base class of every error the partitioner raises on purpose."""


class DeviceError(PartitionError, ValueError):
    """``devices=`` is empty or names a device that cannot be used."""


class StrategyError(PartitionError, ValueError):
    """An unknown ``strategy=`` or an option that does not fit it."""


class BalanceError(PartitionError, ValueError):
    """``balance=`` or ``split_points=`` does not describe a partition of the layers."""


class ChunksError(PartitionError, ValueError):
    """``chunks=`` (micro-batches) is not a positive integer, or the batch is too small."""


class MemoryLimitError(PartitionError, ValueError):
    """No partition of the model fits the devices' memory."""


class ExampleInputsError(PartitionError, TypeError):
    """``example_inputs`` are missing where capture or planning needs them, or are malformed."""


class StageCountError(PartitionError, ValueError):
    """More stages were asked for than the model has layers."""


class TraceError(PartitionError, TypeError):
    """Neither ``torch.fx.symbolic_trace`` nor ``torch.export`` could capture the model."""


class ScheduleError(PartitionError, ValueError):
    """A pipeline schedule breaks an ordering rule (see
    ``partitioner.runtime.schedule.validate``)."""


class StageExecutionError(PartitionError, RuntimeError):
    """An exception raised inside a pipeline stage, naming the stage, micro-batch and node.

    The original exception is kept as ``__cause__``.
    """

    def __init__(self, message: str, stage: int, microbatch: int, node: str | None) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.node = node
