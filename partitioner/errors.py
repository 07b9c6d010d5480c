"""Every error the partitioner raises on purpose, in one place (this module imports nothing).

Every mistake a caller can make raises a subclass of :class:`PartitionError` that also
subclasses the matching built-in (``ValueError`` or ``TypeError``), so callers may catch
either. Messages state the problem, the offending value and a fix.
"""

from __future__ import annotations

__all__ = [
    "PartitionError",
    "TuneError",
    "DeviceError",
    "StrategyError",
    "BalanceError",
    "ChunksError",
    "MemoryLimitError",
    "ExampleInputsError",
    "StageCountError",
    "TraceError",
    "ModelError",
    "ScheduleError",
    "StageExecutionError",
    "BackwardError",
    "CallError",
    "PlanMismatchError",
    "CommandError",
    "CommError",
    "CostModelError",
    "CalibrationError",
    "MemoryModelError",
    "ConfigError",
    "SimulationError",
    "InfeasibleError",
    "ProblemError",
    "TensorParallelError",
    "TensorParallelRuleError",
    "PlanFormatError",
    "PlanWriteError",
    "SpecError",
    "SuffixError",
    "GraphvizNotFound",
    "VizError",
    "TimelineError",
    "PassError",
    "CheckpointError",
    "CheckpointWriteError",
    "PolicyError",
    "CommunicationError",
    "DistributedInitError",
    "MeshError",
    "OptionsError",
    "BoundaryMismatchError",
    "LossError",
    "SamplerError",
    "CollectiveAborted",
    "ShardSizeError",
    "TensorParallelExecutionError",
    "ClosedError",
    "ReplicaError",
    "OutputError",
    "SideEffectWarning",
    "PrecisionError",
    "InitError",
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


class ModelError(PartitionError, TypeError):
    """``model`` is not an ``nn.Module`` (``None``, a function, a class not instantiated)."""


class TraceError(PartitionError, TypeError):
    """Neither ``torch.fx.symbolic_trace`` nor ``torch.export`` could capture the model."""


class ScheduleError(PartitionError, ValueError):
    """A pipeline schedule breaks an ordering rule (see
    ``partitioner.runtime.schedule.validate``)."""


class CallError(PartitionError, TypeError):
    """A partitioned model called with arguments its ``forward`` does not take."""


class BackwardError(PartitionError, RuntimeError):
    """A backward through a partitioned model that its saved activations cannot serve."""


class StageExecutionError(PartitionError, RuntimeError):
    """An exception raised inside a pipeline stage, naming the stage, micro-batch and node.

    The original exception is kept as ``__cause__``.
    """

    def __init__(self, message: str, stage: int, microbatch: int, node: str | None) -> None:
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
        self.node = node


class PlanMismatchError(PartitionError, ValueError, RuntimeError):
    """A plan does not fit the model or the call it is applied with, or the ranks of one
    run built different plans (or models), so their stages would not fit together."""


# Raised by partitioner.runtime.distributed.failure.


class PolicyError(PartitionError, ValueError):
    """A failure policy with a timing that is not a positive number of seconds."""


class CommunicationError(PartitionError, RuntimeError):
    """A send, receive or collective failed, most likely because a peer rank died."""


# Raised by partitioner.cli.


class CommandError(PartitionError, ValueError):
    """A command-line argument that cannot be used."""


# Raised by partitioner.cost.comm.


class CommError(PartitionError, ValueError):
    """A communication cost was asked for a negative size or a group of fewer than 1 rank."""


# Raised by partitioner.cost.cost.


class CostModelError(PartitionError, ValueError):
    """A cost description is malformed (negative sizes, unknown op kind, wrong lengths)."""


# Raised by partitioner.cost.measure.


class CalibrationError(PartitionError, ValueError):
    """Layers cannot be timed (e.g. the model has no real weights)."""


# Raised by partitioner.cost.memory.


class MemoryModelError(PartitionError, ValueError):
    """A memory question with an unknown optimizer, schedule or checkpoint mode."""


# Raised by partitioner.planning.predict.


class ConfigError(PartitionError, ValueError):
    """A parallel configuration does not fit the cluster or the workload."""


# Raised by partitioner.planning.simulate.


class SimulationError(PartitionError, ValueError):
    """A plan cannot be simulated (no cost record, or an unknown schedule)."""


# Raised by partitioner.planning.solver.


class InfeasibleError(PartitionError, ValueError):
    """No partition into the requested stages exists: too many stages or too little memory.

    Attributes:
        min_devices: The fewest stages, each with the largest given capacity, that would hold
            the layers; ``None`` when a single layer exceeds that capacity.
    """

    def __init__(self, message: str, min_devices: int | None = None) -> None:
        super().__init__(message)
        self.min_devices = min_devices

    def __reduce__(self) -> tuple[type[InfeasibleError], tuple[str, int | None]]:
        return type(self), (str(self), self.min_devices)


class ProblemError(PartitionError, ValueError):
    """A :class:`PartitionProblem` has a wrong shape or an invalid number."""


# Raised by partitioner.runtime.tensor_parallel.sharding.


class TensorParallelError(PartitionError, ValueError):
    """A tensor-parallel request that cannot be carried out (rule, layer or state dict)."""


class ShardSizeError(TensorParallelError):
    """A dimension to be split does not divide by the tensor-parallel degree."""


# Raised by partitioner.planning.tp_rules.


class TensorParallelRuleError(TensorParallelError):
    """``tensor_parallel=`` rules are malformed or do not fit the model."""


# Raised by partitioner.plans.plan.


class PlanFormatError(PartitionError, ValueError):
    """A plan (or plan file) is malformed."""


class PlanWriteError(PartitionError, ValueError, OSError):
    """A plan file cannot be written (missing folder, no permission); also an ``OSError``,
    what ``Path.write_text`` raised before."""


# Raised by partitioner.plans.spec.


class SpecError(PartitionError, ValueError):
    """A hand-written spec is malformed or does not fit the model; names the wrong key."""


# Raised by partitioner.viz.


class SuffixError(PartitionError, ValueError):
    """A picture asked for in a format that cannot be written (the file's suffix)."""


# Raised by partitioner.viz.dot.


class GraphvizNotFound(PartitionError, RuntimeError):
    """Graphviz's programs are needed for PNG or PDF output and are not installed."""


# Raised by partitioner.viz.graph.


class VizError(PartitionError, ValueError):
    """A graph that cannot be drawn from what was given (no plan, unknown detail level)."""


# Raised by partitioner.viz.timeline.


class TimelineError(PartitionError, ValueError):
    """A timeline that cannot be drawn: empty, or entries that are not actions in time."""


# Raised by partitioner.passes.base.


class PassError(PartitionError, RuntimeError):
    """A pass found its precondition or postcondition broken, for example by example inputs
    the graph cannot run with."""


# Raised by partitioner.runtime.distributed.checkpoint_io.


class CheckpointError(PartitionError, ValueError):
    """A checkpoint that does not fit the run (wrong format, missing keys, other optimizer)."""


class CheckpointWriteError(CheckpointError, RuntimeError):
    """Writing a checkpoint failed (disk full, no permission); the previous file is intact."""


# Raised by partitioner.runtime.distributed.mesh.


class DistributedInitError(PartitionError, RuntimeError):
    """``torch.distributed`` cannot be started from what the environment gives."""


class MeshError(PartitionError, ValueError):
    """A mesh shape that does not fit the world, or an unknown axis."""


# Raised by partitioner.planning.options.


class OptionsError(PartitionError, ValueError):
    """An ``options=`` that is not an ``Options``, an unknown sharding kind, or one setting
    given twice with different values (``pp=2`` beside ``mesh=Mesh(pp=4)``)."""


# Raised by partitioner.runtime.distributed.p2p.


class BoundaryMismatchError(PartitionError, RuntimeError):
    """A stage produced values other than shape propagation predicted for its boundary."""


# Raised by partitioner.runtime.distributed.pipeline.


class LossError(PartitionError, TypeError):
    """``loss_fn`` returned something other than a scalar tensor."""


# Raised by partitioner.runtime.distributed.sampler.


class SamplerError(PartitionError, ValueError):
    """A sampler option that cannot work (replica out of range, batch size < 1, ...)."""


# Raised by partitioner.runtime.tensor_parallel.collectives.


class CollectiveAborted(PartitionError, RuntimeError):
    """A rank waited for its peers in a collective and was released without them."""


# Raised by partitioner.runtime.tensor_parallel.stage.


class TensorParallelExecutionError(PartitionError, RuntimeError):
    """An exception raised inside one tensor-parallel rank, naming the rank and node."""


# Raised by partitioner.runtime.wrapper.


class ClosedError(PartitionError, RuntimeError):
    """A partitioned model was run after ``close()`` released its threads or hooks."""


# Raised by partitioner.runtime.replicas.


class ReplicaError(PartitionError, ValueError):
    """A call that data-parallel replicas in one process cannot split or join (a batch
    smaller than the replicas, outputs without a batch dimension, an unknown loss
    reduction)."""


# Raised by partitioner.runtime.precision and the fronts taking precision=.


class PrecisionError(PartitionError, ValueError):
    """An unknown ``precision=``, fp16 without a loss scaler, a loss scale without fp16, or a
    precision a runtime or model cannot honour."""


# Raised by partitioner.runtime.materialize.


class InitError(PartitionError, TypeError):
    """A model built on the meta device that cannot be initialized: a module holding tensors
    without ``reset_parameters()`` and no ``init_fn``."""


# Raised by partitioner.planning.tune and the fronts taking tune=.


class TuneError(PartitionError, TypeError):
    """A ``tune=`` that is neither a bool nor a positive int, or tuning asked where nothing
    can be timed (no example inputs, a fixed split)."""


# Raised by partitioner.runtime.microbatch and partitioner.runtime.replicas.


class OutputError(PartitionError, ValueError):
    """An output leaf of a model that micro-batches or replicas cannot join into the whole
    batch's: no batch dimension and not a floating-point tensor to average, or shapes that
    differ between micro-batches."""


# Warned by partitioner.capture (partitioner.passes.python_state finds the changes).


class SideEffectWarning(UserWarning):
    """``forward`` changed Python state of a module while it was captured (a list grew, a
    counter moved): the captured graph holds tensor code only, so the partitioned model
    never repeats that change."""
