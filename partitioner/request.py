"""What a caller asks the planner for: one frozen :class:`PlanRequest`, validated once.

``partition``, ``make_plan``, the tensor-parallel front, the plan-file path and the CLI all
take the same planning options. They build a ``PlanRequest`` from their keywords at the
door; everything behind the door (analysis, planning, applying a plan) reads the request
and never validates an option again.

Example:
    >>> request = PlanRequest.make(["cpu", "cpu"], chunks=4, balance=[3, 2])
    >>> request.n_devices, request.chunks, request.balance, request.fixes_split
    (2, 4, (3, 2), True)
    >>> PlanRequest.make(["cpu", "cpu"], chunks=0)
    Traceback (most recent call last):
    ...
    partitioner.errors.ChunksError: chunks=0; pass a positive int (micro-batches per batch)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from partitioner.cost.devices import Cluster, parse_devices
from partitioner.cost.llama_elementwise import compiled_problem
from partitioner.errors import (
    BalanceError,
    ChunksError,
    DeviceError,
    ExampleInputsError,
    MemoryLimitError,
    MeshError,
    PartitionError,
    PrecisionError,
    ScheduleError,
    StrategyError,
)
from partitioner.planning.given_mesh import mesh_problems
from partitioner.planning.reserve import MEMORY_RESERVE, reserve_problem
from partitioner.plans.plan import Mesh
from partitioner.runtime.checkpointing import (
    SELECTIVE,
    request_checkpoint_problem,
    runnable_checkpoint_problem,
)
from partitioner.runtime.precision import loss_scale_problem, precision_problem
from partitioner.runtime.schedule_registry import name_problem, schedule_kind, schedule_names

__all__ = ["PlanRequest", "STRATEGIES"]

STRATEGIES = ("auto", "pipeline")


@dataclass(frozen=True)
class PlanRequest:
    """The planning options of one call, checked together.

    Attributes:
        devices: the local devices, one per pipeline stage (empty when planning for a
            :class:`~partitioner.cost.devices.Cluster` that is not this machine, or when a
            plan file names them).
        strategy: ``"auto"`` or ``"pipeline"``.
        example_inputs: one batch of positional inputs (``None``: no costs).
        example_kwargs: keyword inputs of that batch.
        chunks: micro-batches per batch (``None``: the planner chooses, or 1).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (``None``: chosen);
            ``"selective"`` (torchtitan's per-op recomputation) only for a cluster beyond
            this machine, where a transformers Llama model is costed as such runs train it
            (``partitioner.planning.llama_plan``).
        balance: layers per stage (torchgpipe's), or ``None``.
        split_points: module names at which a stage begins, or ``None``.
        memory_limit: bytes per device, one per device, or ``None``.
        cluster: the cluster planned for, when ``devices=`` was one.
        calibrate: time the layers and the optimizer step on this machine before planning
            (``True``); ``None``: do so when the devices are this machine's CPU planned
            with its measured spec and a training step is cheap
            (``partitioner.planning.calibrated``); ``False``: never.
        schedule: the pipeline schedule, a registered name (``None``: ``"auto"`` searches
            every schedule, ``"pipeline"`` runs GPipe).
        virtual_stages: model chunks per device for the interleaved schedule (``None``:
            chosen).
        memory_reserve: the share of each device's memory plans leave unused
            (``partitioner.planning.reserve``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``partitioner.runtime.precision``).
        loss_scale: fp16's loss scaling, ``"dynamic"`` or a float (``None`` otherwise).
        mesh: the data x pipeline x tensor mesh to plan exactly (``None``: chosen);
            ``partitioner.planning.given_mesh``.
        compiled: for a cluster beyond this machine, whether the model will run under
            ``torch.compile`` (a Llama model's element-wise steps costed fused, one kernel
            each) or eagerly (``False``: PyTorch's kernels one by one); ``None``: compiled,
            as torchtitan's published runs. The runtimes here run eagerly: on this
            machine's devices it must stay ``None``.
    """

    devices: tuple[torch.device, ...] = ()
    strategy: str = "auto"
    example_inputs: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)
    example_kwargs: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    chunks: int | None = None
    checkpoint: str | None = None
    balance: tuple[int, ...] | None = None
    split_points: tuple[str, ...] | None = None
    memory_limit: tuple[float, ...] | None = None
    cluster: Cluster | None = None
    calibrate: bool | None = False
    schedule: str | None = None
    virtual_stages: int | None = None
    memory_reserve: float = MEMORY_RESERVE
    precision: str = "fp32"
    loss_scale: float | str | None = None
    mesh: Mesh | None = None
    compiled: bool | None = None

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            kind = problems[0][0]
            raise kind("; ".join(message for _, message in problems))

    def _problems(self) -> list[tuple[type[PartitionError], str]]:
        found: list[tuple[type[PartitionError], str]] = []
        if self.strategy not in STRATEGIES:
            found.append((StrategyError, f"strategy={self.strategy!r} is unknown; pass one of "
                                         f"{STRATEGIES}"))
        if self.chunks is not None and (isinstance(self.chunks, bool)
                                        or not isinstance(self.chunks, int) or self.chunks < 1):
            found.append((ChunksError, f"chunks={self.chunks!r}; pass a positive int "
                                       "(micro-batches per batch)"))
        unknown = request_checkpoint_problem(self.checkpoint) if self.checkpoint is not None \
            else None
        if unknown is not None:
            found.append((StrategyError, unknown))
        found += self._beyond_problems()
        if self.calibrate is not None and not isinstance(self.calibrate, bool):
            found.append((StrategyError, f"calibrate={self.calibrate!r}; pass True, False "
                                         "or None (when the spec is this machine's)"))
        found += self._schedule_problems() + self._mesh_problems()
        reserve = reserve_problem(self.memory_reserve)
        if reserve is not None:
            found.append((MemoryLimitError, reserve))
        precision = precision_problem(self.precision) or (
            loss_scale_problem(self.precision, self.loss_scale)
            if self.loss_scale is not None else None)
        if precision is not None:
            found.append((PrecisionError, precision))
        if self.balance is not None and self.split_points is not None:
            found.append((BalanceError, "pass balance= or split_points=, not both"))
        n = self.n_devices
        if self.split_points is not None and n and len(self.split_points) != n - 1:
            found.append((BalanceError, f"{len(self.split_points)} split points make "
                                        f"{len(self.split_points) + 1} stages but there are {n} "
                                        f"devices; pass {n - 1} split points"))
        if self.memory_limit is not None and n and len(self.memory_limit) != n:
            found.append((MemoryLimitError, f"memory_limit has {len(self.memory_limit)} entries "
                                            f"for {n} devices; pass one number or {n} of them"))
        return found

    @property
    def beyond_this_machine(self) -> bool:
        """Whether the request plans for a cluster that is not this machine."""
        return self.cluster is not None and not self.cluster.is_local

    def _beyond_problems(self) -> list[tuple[type[PartitionError], str]]:
        """``checkpoint="selective"`` and ``compiled=`` are costs of a cluster beyond this
        machine: the runtimes here replay whole stages and run eagerly."""
        found: list[tuple[type[PartitionError], str]] = []
        if self.checkpoint == SELECTIVE and not self.beyond_this_machine:
            found.append((StrategyError, str(runnable_checkpoint_problem(SELECTIVE))))
        compiled = compiled_problem(self.compiled, here=not self.beyond_this_machine)
        if compiled is not None:
            found.append((StrategyError, compiled))
        return found

    def _mesh_problems(self) -> list[tuple[type[PartitionError], str]]:
        """``mesh=`` a Mesh over all the devices, ``tp`` inside a node; a fixed split or
        ``strategy="pipeline"`` (every device a stage) only with ``dp = tp = 1``."""
        if self.mesh is None:
            return []
        per_node = self.cluster.devices_per_node if self.cluster is not None else None
        found: list[tuple[type[PartitionError], str]] = [
            (MeshError, m) for m in mesh_problems(self.mesh, self.n_devices, per_node)]
        if not found and isinstance(self.mesh, Mesh) and (self.mesh.dp, self.mesh.tp) != (1, 1) \
                and (self.strategy != "auto" or self.fixes_split):
            given = "balance=/split_points=" if self.fixes_split else \
                f"strategy={self.strategy!r}"
            found.append((MeshError, f"mesh={self.mesh} with {given}: that makes every device "
                                     "a pipeline stage (dp = tp = 1); use strategy='auto' "
                                     "without a fixed split to plan this mesh, or pass "
                                     f"mesh=Mesh(pp={self.n_devices})"))
        return found

    def _schedule_problems(self) -> list[tuple[type[PartitionError], str]]:
        """``schedule=`` registered, ``virtual_stages=`` an int >= 1 that suits it."""
        found: list[tuple[type[PartitionError], str]] = []
        if self.schedule is not None and name_problem(self.schedule) is not None:
            found.append((ScheduleError, str(name_problem(self.schedule))))
        v = self.virtual_stages
        if v is None:
            return found
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            found.append((ScheduleError, f"virtual_stages={v!r}; pass an int >= 2 (model "
                                         "chunks per device) with schedule='interleaved', or "
                                         "omit it"))
        elif self.schedule is None or name_problem(self.schedule) is None:
            virtual = self.schedule is not None and schedule_kind(self.schedule).virtual
            if v > 1 and not virtual:
                found.append((ScheduleError, f"virtual_stages={v} needs a schedule with model "
                                             f"chunks, got schedule={self.schedule!r}; pass "
                                             f"schedule= one of "
                                             f"{list(schedule_names(virtual=True))} or omit "
                                             "virtual_stages"))
            elif v == 1 and virtual:
                found.append((ScheduleError, f"virtual_stages=1 but schedule="
                                             f"{self.schedule!r} needs 2 or more model chunks "
                                             "per device; pass virtual_stages >= 2 or omit it"))
        return found

    @classmethod
    def make(cls, devices: Any, strategy: str = "auto", *,
             example_inputs: tuple[Any, ...] | None = None,
             example_kwargs: Mapping[str, Any] | None = None, chunks: int | None = None,
             checkpoint: str | None = None, balance: Sequence[int] | None = None,
             split_points: Sequence[str] | None = None,
             memory_limit: float | Sequence[float] | None = None,
             calibrate: bool | None = False, local: bool = False, schedule: str | None = None,
             virtual_stages: int | None = None,
             memory_reserve: float | None = None, precision: str | None = None,
             loss_scale: float | str | None = None, mesh: Mesh | None = None,
             compiled: bool | None = None) -> PlanRequest:
        """A request from a public function's keywords (see :func:`partitioner.partition`).

        Args:
            devices: ``devices=`` as the user gave it; ``None`` when a plan names them.
            local: the devices must be this machine's (a remote :class:`Cluster` is refused).

        Raises:
            PartitionError: a subclass naming the first bad option (every problem listed).
        """
        remote = isinstance(devices, Cluster) and not devices.is_local and not local
        parsed = () if remote or devices is None else tuple(parse_devices(devices))
        if local and any(d.type == "meta" for d in parsed):
            raise DeviceError(f"devices={[str(d) for d in parsed]}: a module on 'meta' devices "
                              "cannot run; plan a meta model with make_plan(), or pass 'cpu' or "
                              "'cuda:N' devices")
        inputs = _inputs(example_inputs)
        if inputs == () and not example_kwargs:
            raise ExampleInputsError("example_inputs=() holds no inputs; pass one batch, e.g. "
                                     "example_inputs=(x,), or its keyword inputs as "
                                     "example_kwargs={...}")
        n = devices.size if isinstance(devices, Cluster) else len(parsed)
        return cls(parsed, strategy, inputs, _kwargs(example_kwargs), chunks,
                   checkpoint, _ints("balance", balance), _names(split_points),
                   _limits(memory_limit, n), devices if isinstance(devices, Cluster) else None,
                   calibrate, schedule, virtual_stages,
                   MEMORY_RESERVE if memory_reserve is None else memory_reserve,
                   "fp32" if precision is None else precision, loss_scale, mesh, compiled)

    @property
    def n_devices(self) -> int:
        """How many devices (stages of a pipeline plan) the request plans for."""
        return self.cluster.size if self.cluster is not None else len(self.devices)

    @property
    def fixes_split(self) -> bool:
        """Whether ``balance=`` or ``split_points=`` fixes the split (no costs needed)."""
        return self.balance is not None or self.split_points is not None

    @property
    def kwargs(self) -> dict[str, Any]:
        """``example_kwargs`` as a fresh dict."""
        return dict(self.example_kwargs or {})

    def asked(self) -> dict[str, Any]:
        """The settings the caller gave explicitly (a plan file must not be overridden)."""
        given = dict(strategy=self.strategy, chunks=self.chunks, checkpoint=self.checkpoint,
                     balance=self.balance, split_points=self.split_points,
                     memory_limit=self.memory_limit, schedule=self.schedule,
                     virtual_stages=self.virtual_stages)
        return {k: v for k, v in given.items() if v is not None}

    def with_changes(self, **changes: Any) -> PlanRequest:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)


def _inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    if example_inputs is None:
        return None
    if not isinstance(example_inputs, (tuple, list)):
        raise ExampleInputsError(f"example_inputs must be a tuple of positional inputs, got "
                                 f"{type(example_inputs).__name__}; pass example_inputs=(x,)")
    return tuple(example_inputs)


def _kwargs(example_kwargs: Any) -> Mapping[str, Any] | None:
    if example_kwargs is None:
        return None
    if not isinstance(example_kwargs, Mapping) or not all(isinstance(k, str)
                                                          for k in example_kwargs):
        raise ExampleInputsError(f"example_kwargs={example_kwargs!r}; pass a dict of keyword "
                                 "inputs, e.g. example_kwargs={'attention_mask': mask}")
    return dict(example_kwargs)


def _ints(key: str, values: Any) -> tuple[int, ...] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise BalanceError(f"{key}={values!r}; pass a list of layer counts, one per stage, "
                           "e.g. balance=[3, 2]")
    return tuple(values)


def _names(values: Any) -> tuple[str, ...] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
            isinstance(v, str) for v in values):
        raise BalanceError(f"split_points={values!r}; pass a list of module names at which a "
                           "stage begins, e.g. split_points=['layer2']")
    return tuple(values)


def _limits(memory_limit: Any, n_devices: int) -> tuple[float, ...] | None:
    if memory_limit is None:
        return None
    number = (int, float)
    if isinstance(memory_limit, number) and not isinstance(memory_limit, bool):
        values: tuple[Any, ...] = (memory_limit,) * max(n_devices, 1)
    elif isinstance(memory_limit, Sequence) and not isinstance(memory_limit, (str, bytes)):
        values = tuple(memory_limit)
    else:
        values = ("?",)
    if not values or any(isinstance(v, bool) or not isinstance(v, number) or not v > 0
                         for v in values):
        raise MemoryLimitError(f"memory_limit={memory_limit!r}; pass bytes per device as one "
                               f"positive number (memory_limit=8 * 2**30) or {n_devices or 'one'}"
                               " per device")
    return tuple(float(v) for v in values)
