"""What ``strategy="auto"`` searches, as one value: :class:`SearchSpace`.

The search (``partitioner.planning.auto.search``), its enumeration (``configurations``),
the plan it records (``partitioner.planning.planner.auto_plan``), a given mesh
(``given_mesh_plan``) and the multi-process search (``partitioner.planning.world``) all
read the same frozen value: each choice is either fixed (a value) or searched (``None``),
and the costs the configurations carry (optimizer, overlaps) are stated once. The request
(``partitioner.request.PlanRequest``) says what the user fixed; :meth:`SearchSpace.of_request`
turns it into the space, and the planner narrows it with :meth:`SearchSpace.fixing`.

The keywords ``search(w, cluster, chunks=4)`` and ``configurations(w, cluster, tp=2)``
still take are sugar over :meth:`fixing`.

Example:
    >>> space = SearchSpace(chunks=4).fixing(dp=2, schedules=["1f1b"])
    >>> space.dp, space.chunks, space.schedules
    (2, 4, ('1f1b',))
    >>> space.without_mesh().dp is None
    True
    >>> SearchSpace(tp=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    partitioner.errors.StrategyError: tp=0; pass a positive int ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

from partitioner.cost.memory import OPTIMIZERS
from partitioner.errors import ChunksError, ScheduleError, StrategyError
from partitioner.runtime.checkpointing import SELECTIVE, checkpoint_problem
from partitioner.runtime.schedule_registry import name_problem


class _Asked(Protocol):
    """What :meth:`SearchSpace.of_request` reads (a ``partitioner.request.PlanRequest``)."""

    @property
    def chunks(self) -> int | None: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def schedule(self) -> str | None: ...
    @property
    def virtual_stages(self) -> int | None: ...

__all__ = ["SearchSpace", "space_of"]


@dataclass(frozen=True)
class SearchSpace:
    """The choices of a search: each fixed to a value, or ``None`` to be searched.

    Attributes:
        dp: data-parallel replicas.
        tp: tensor-parallel degree.
        pp: pipeline stages (devices of one replica's pipeline).
        chunks: micro-batches per replica.
        checkpoint: activation checkpoint mode (``"never"``, ``"except_last"``, ``"always"``).
        schedules: the schedules tried (``None``: every one ``strategy="auto"`` searches).
        virtual: model chunks per device (interleaved schedules).
        tp_degrees: the tensor-parallel degrees > 1 the model's layers divide by (``None``:
            every power of two inside a node).
        optimizer_sharding: ``None`` tries sharding the optimizer state when ``dp > 1``;
            ``True``/``False`` fixes it.
        optimizer: the optimizer whose state is held (``partitioner.cost.memory.OPTIMIZERS``).
        overlap_grad_reduce: whether gradient all-reduces overlap the last backward.
        overlap_p2p: whether sends between stages overlap compute.
        max_microbatches: the most micro-batches tried per replica (more only when each
            would hold 8 samples or fewer).

    Raises:
        StrategyError: a degree or count that is not a positive int, an unknown optimizer or
            checkpoint mode.
        ScheduleError: an unknown schedule.
        ChunksError: ``chunks`` is not a positive int.
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    chunks: int | None = None
    checkpoint: str | None = None
    schedules: tuple[str, ...] | None = None
    virtual: int | None = None
    tp_degrees: tuple[int, ...] | None = None
    optimizer_sharding: bool | None = False
    optimizer: str = "adam"
    overlap_grad_reduce: bool = True
    overlap_p2p: bool = True
    max_microbatches: int = 64

    def __post_init__(self) -> None:
        for name in ("schedules", "tp_degrees"):  # any sequence given is kept as a tuple
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        for name in ("dp", "tp", "pp", "virtual", "max_microbatches"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise StrategyError(f"{name}={value!r}; pass a positive int (or None to "
                                    "search it)")
        if self.chunks is not None and not _positive(self.chunks):
            raise ChunksError(f"chunks={self.chunks!r}; pass a positive int (micro-batches "
                              "per replica)")
        self._check_names()

    def _check_names(self) -> None:
        problem = checkpoint_problem(self.checkpoint) if self.checkpoint is not None else None
        if problem is not None:
            raise StrategyError(problem)
        for name in self.schedules or ():
            if name_problem(name) is not None:
                raise ScheduleError(str(name_problem(name)))
        if self.optimizer not in OPTIMIZERS:
            raise StrategyError(f"optimizer={self.optimizer!r} is unknown; pass one of "
                                f"{sorted(OPTIMIZERS)}")
        if self.optimizer_sharding not in (None, True, False):
            raise StrategyError(f"optimizer_sharding={self.optimizer_sharding!r}; pass True, "
                                "False or None (searched)")

    def fixing(self, **changes: Any) -> SearchSpace:
        """This space with ``changes`` (field names) set; ``None`` frees a choice again.

        Raises:
            TypeError: a name that is not a field, listing the fields.
        """
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise TypeError(f"{', '.join(unknown)} is not a search choice; pass one of "
                            f"{sorted(_FIELDS)}")
        return replace(self, **changes) if changes else self

    def without_mesh(self) -> SearchSpace:
        """The same choices with ``dp``, ``tp`` and ``pp`` searched (what a given mesh's
        plan compares itself with: auto's best)."""
        return replace(self, dp=None, tp=None, pp=None)

    @classmethod
    def of_request(cls, request: _Asked,
                   tp_degrees: Sequence[int] | None = None) -> SearchSpace:
        """What ``request`` fixes: micro-batches, checkpoint mode, schedule and virtual
        stages (the mesh is the planner's: it is fixed where the plan asks for one).
        ``checkpoint="selective"`` recomputes inside each layer (the Llama workload's,
        ``partitioner.planning.llama_plan``), so the stage-level mode stays open here."""
        checkpoint = None if request.checkpoint == SELECTIVE else request.checkpoint
        return cls(chunks=request.chunks, checkpoint=checkpoint,
                   schedules=(request.schedule,) if request.schedule else None,
                   virtual=request.virtual_stages,
                   tp_degrees=tuple(tp_degrees) if tp_degrees is not None else None)


_FIELDS = frozenset(f.name for f in fields(SearchSpace))


def space_of(space: SearchSpace | None, fixed: dict[str, Any]) -> SearchSpace:
    """``space`` (default: nothing fixed) with the keyword sugar ``fixed`` applied."""
    return (space if space is not None else SearchSpace()).fixing(**fixed)


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
