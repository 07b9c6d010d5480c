"""How to partition, as values: :class:`Options` and the groups it holds.

``partition``, ``make_plan`` and ``partition_distributed`` take one ``options=`` value with
the same names and meanings. Each cross-cutting concern is a small frozen value, validated
when made (torch's ``fully_shard(mesh=, mp_policy=, offload_policy=)`` style):

- :class:`~partitioner.runtime.mesh.Mesh` (``dp``, ``pp``, ``tp``): the whole mesh, or
  :class:`~partitioner.planning.world.Degrees` for some axes (the rest searched, across
  processes);
- :class:`Schedule`: the pipeline schedule's ``name``, ``chunks`` (micro-batches per batch)
  and ``virtual_stages`` (model chunks per device);
- :class:`Precision`: the compute precision and fp16's loss scale;
- :class:`Sharding`: what is sharded over the data-parallel replicas (``"none"``,
  ``"optimizer"``: ZeRO-1, ``"fsdp"``: parameters too).

The keywords users already pass (``pp=``/``dp=``/``tp=``, ``mesh=``, ``chunks=``,
``schedule=``, ``virtual_stages=``, ``precision=``, ``loss_scale=``,
``optimizer_sharding=``, ``sharding=``, ``checkpoint=``, ``strategy=``, ``tune=``,
``init_fn=``, ``seed=``, ``sequence_parallel=``) are sugar: :func:`resolve_options`
folds them into one ``Options``, in this one place, and refuses the same thing given twice
in ways that disagree.

Example:
    >>> opts = resolve_options(Options(schedule=Schedule("1f1b", chunks=4)), pp=2, dp=2)
    >>> opts.mesh, opts.schedule.chunks
    (Degrees(pp=2, dp=2, tp=None), 4)
    >>> resolve_options(Options(mesh=Mesh(pp=4)), pp=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    partitioner.errors.MeshError: options.mesh=Mesh(dp=1, pp=4, tp=1) but pp=2 given; ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from partitioner.cost.llama_elementwise import compiled_problem
from partitioner.errors import (
    ChunksError,
    MeshError,
    OptionsError,
    PartitionError,
    PrecisionError,
    ScheduleError,
    StrategyError,
)
from partitioner.planning.tune import tune_count
from partitioner.planning.world import Degrees
from partitioner.runtime.checkpointing import (
    SELECTIVE,
    request_checkpoint_problem,
    runnable_checkpoint_problem,
)
from partitioner.runtime.mesh import Mesh
from partitioner.runtime.precision import loss_scale_problem, precision_problem
from partitioner.runtime.schedule_registry import name_problem

__all__ = ["Options", "Schedule", "Precision", "Sharding", "Mesh", "Degrees",
           "SHARDING_KINDS", "resolve_options", "one_process_options",
           "check_sequence_parallel"]

SHARDING_KINDS = ("none", "optimizer", "fsdp")
"""What ``Sharding.kind`` may say: nothing sharded, the optimizer state (ZeRO-1), or the
parameters, gradients and optimizer state (FSDP2)."""


@dataclass(frozen=True)
class Schedule:
    """The pipeline schedule (``None`` fields: chosen by ``"auto"`` or the front's default).

    Attributes:
        name: a registered schedule (``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
            ``"zero_bubble"``).
        chunks: micro-batches per batch (torchgpipe's ``chunks=``).
        virtual_stages: model chunks per pipeline device (interleaved schedules).

    Raises:
        ScheduleError: an unknown name or a virtual stage count that is not an int >= 1.
        ChunksError: ``chunks`` is not a positive int.
    """

    name: str | None = None
    chunks: int | None = None
    virtual_stages: int | None = None

    def __post_init__(self) -> None:
        if self.name is not None and name_problem(self.name) is not None:
            raise ScheduleError(str(name_problem(self.name)))
        if self.chunks is not None and not _positive(self.chunks):
            raise ChunksError(f"chunks={self.chunks!r}; pass a positive int (micro-batches "
                              "per batch)")
        if self.virtual_stages is not None and not _positive(self.virtual_stages):
            raise ScheduleError(f"virtual_stages={self.virtual_stages!r}; pass an int >= 1 "
                                "(model chunks per device)")


@dataclass(frozen=True)
class Precision:
    """The compute precision (``None``: a given plan's, else ``"fp32"``).

    Attributes:
        compute: ``"fp32"``, ``"bf16"`` or ``"fp16"``: stages compute under autocast to it,
            parameters, gradients and optimizer state stay fp32.
        loss_scale: fp16's loss scaling, ``"dynamic"`` or a float.

    Raises:
        PrecisionError: an unknown precision, or a loss scale that does not suit it.
    """

    compute: str | None = None
    loss_scale: float | str | None = None

    def __post_init__(self) -> None:
        problem = precision_problem(self.compute) if self.compute is not None else None
        if problem is None and self.compute is not None and self.loss_scale is not None:
            problem = loss_scale_problem(self.compute, self.loss_scale)
        if problem is not None:
            raise PrecisionError(problem)


@dataclass(frozen=True)
class Sharding:
    """What the data-parallel replicas shard (``None``: chosen; across processes auto shards
    the optimizer only when nothing fits without it).

    Attributes:
        kind: one of :data:`SHARDING_KINDS`.

    Raises:
        OptionsError: an unknown kind.
    """

    kind: str | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in SHARDING_KINDS:
            raise OptionsError(f"sharding={self.kind!r} is unknown; pass one of "
                               f"{SHARDING_KINDS}")

    @property
    def optimizer(self) -> bool | None:
        """``optimizer_sharding=``'s meaning: whether the optimizer state is sharded
        (``None``: chosen)."""
        return None if self.kind is None else self.kind != "none"


@dataclass(frozen=True)
class Options:
    """How to partition: the options ``partition``, ``make_plan`` and
    ``partition_distributed`` share (``None`` fields: chosen, or the front's default).

    Attributes:
        strategy: ``"auto"`` (search) or ``"pipeline"`` (the sizes as given).
        mesh: a :class:`Mesh` (all three axes fixed) or :class:`Degrees` (some fixed; across
            processes only).
        schedule: the pipeline schedule, micro-batches and virtual stages.
        precision: the compute precision.
        sharding: what the replicas shard.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``; ``"selective"``
            (torchtitan's per-op recomputation) only for ``make_plan`` on a cluster beyond
            this machine (``partitioner.planning.llama_plan``).
        tune: measured tuning: ``True`` (4 candidates), a count, or ``False``.
        init_fn: a meta-built model's initializer, ``init_fn(module)``.
        seed: the base seed of dropout generators and of a meta-built model's
            initialization.
        sequence_parallel: Megatron's sequence parallelism on the tensor-parallel stages
            (``partitioner.passes.tensor_parallel.sequence_parallel``): read by
            ``partition`` and ``partition_distributed``, which refuse it without a
            tensor-parallel degree of 2 or more; a :class:`Plan` does not record it, so
            ``make_plan`` plans alike with or without it.
        compiled: read by ``make_plan`` for a cluster beyond this machine: whether the
            model will run under ``torch.compile`` (a transformers Llama model's
            element-wise steps costed fused) or eagerly (``False``); ``None``: compiled.
            The runtimes here run eagerly, and their fronts refuse it.

    Raises:
        PartitionError: a subclass naming the bad value and the fix.
    """

    strategy: str | None = None
    mesh: Mesh | Degrees | None = None
    schedule: Schedule = field(default_factory=Schedule)
    precision: Precision = field(default_factory=Precision)
    sharding: Sharding = field(default_factory=Sharding)
    checkpoint: str | None = None
    tune: bool | int = False
    init_fn: Callable[..., Any] | None = field(default=None, compare=False)
    seed: int = 0
    sequence_parallel: bool = False
    compiled: bool | None = None

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in ("auto", "pipeline"):
            raise StrategyError(f"strategy={self.strategy!r} is unknown; pass 'auto' or "
                                "'pipeline'")
        if self.mesh is not None and not isinstance(self.mesh, (Mesh, Degrees)):
            raise MeshError(f"mesh={self.mesh!r} is a {type(self.mesh).__name__}; pass "
                               "partitioner.Mesh(dp=..., pp=..., tp=...)")
        for name, kind in (("schedule", Schedule), ("precision", Precision),
                           ("sharding", Sharding)):
            if not isinstance(getattr(self, name), kind):
                raise OptionsError(f"options.{name}={getattr(self, name)!r}; pass a "
                                   f"{kind.__name__}(...)")
        if self.checkpoint is not None and \
                request_checkpoint_problem(self.checkpoint) is not None:
            raise StrategyError(str(request_checkpoint_problem(self.checkpoint)))
        if compiled_problem(self.compiled) is not None:
            raise OptionsError(str(compiled_problem(self.compiled)))
        tune_count(self.tune)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise OptionsError(f"seed={self.seed!r}; pass an int")
        if not isinstance(self.sequence_parallel, bool):
            raise OptionsError(f"sequence_parallel={self.sequence_parallel!r}; pass True "
                               "(norms, dropout and residual adds on sequence shards) or False")

    def check_runnable(self, front: str) -> None:
        """Refuse, at a ``front`` that builds a runtime, what only ``make_plan`` reads for a
        cluster beyond this machine: ``checkpoint="selective"`` and ``compiled=``.

        Raises:
            StrategyError: naming the option and the fix.
        """
        if self.checkpoint == SELECTIVE:
            raise StrategyError(f"{front}: {runnable_checkpoint_problem(SELECTIVE)}")
        if compiled_problem(self.compiled, here=True) is not None:
            raise StrategyError(f"{front}: {compiled_problem(self.compiled, here=True)}")

    @property
    def whole_mesh(self) -> Mesh | None:
        """The mesh when every axis is fixed (``None`` otherwise)."""
        mesh = self.mesh
        if isinstance(mesh, Degrees) and None not in (mesh.pp, mesh.dp, mesh.tp):
            return Mesh(dp=mesh.dp, pp=mesh.pp, tp=mesh.tp)  # type: ignore[arg-type]
        return mesh if isinstance(mesh, Mesh) else None

    def sizes(self) -> tuple[int | None, int | None, int | None]:
        """``(pp, dp, tp)``, ``None`` where not fixed."""
        mesh = self.mesh
        if mesh is None:
            return None, None, None
        return mesh.pp, mesh.dp, mesh.tp


_UNSET: dict[str, Any] = {"tune": False, "seed": 0, "sequence_parallel": False}
"""Sugar keywords whose "not given" value is not ``None``."""

_WHERE = {
    "strategy": ("strategy",), "checkpoint": ("checkpoint",), "tune": ("tune",),
    "init_fn": ("init_fn",), "seed": ("seed",), "sequence_parallel": ("sequence_parallel",),
    "compiled": ("compiled",),
    "schedule": ("schedule", "name"), "chunks": ("schedule", "chunks"),
    "virtual_stages": ("schedule", "virtual_stages"),
    "precision": ("precision", "compute"), "loss_scale": ("precision", "loss_scale"),
}
"""Where each sugar keyword lives in :class:`Options` (mesh and sharding are folded apart)."""


def resolve_options(options: Options | None = None, **given: Any) -> Options:
    """``options`` with the keywords a front was called with folded in: the one place the
    sugar becomes the canonical value.

    Args:
        options: ``options=`` as the caller passed it (``None``: defaults).
        given: the front's keywords (``pp``, ``dp``, ``tp``, ``mesh``, ``chunks``,
            ``schedule``, ``virtual_stages``, ``precision``, ``loss_scale``,
            ``optimizer_sharding``, ``sharding``, ``checkpoint``, ``strategy``, ``tune``,
            ``init_fn``, ``seed``, ``sequence_parallel``, ``compiled``); ``None`` (``False``
            for ``tune``
            and ``sequence_parallel``, 0 for ``seed``) means not given.

    Raises:
        OptionsError: ``options`` is not an Options, a keyword is unknown, or a keyword and
            ``options`` (or two keywords) give one setting different values.
        MeshError: ``pp=``/``dp=``/``tp=`` disagree with ``mesh=`` or ``options.mesh``.
        PartitionError: a subclass, when a value is invalid.
    """
    if options is None:
        options = Options()
    if not isinstance(options, Options):
        raise OptionsError(f"options={options!r} is a {type(options).__name__}; pass "
                           "partitioner.Options(...)")
    unknown = sorted(set(given) - {*_WHERE, "pp", "dp", "tp", "mesh", "optimizer_sharding",
                                   "sharding"})
    if unknown:
        raise OptionsError(f"unknown option(s) {unknown}; see partitioner.Options")
    for key, path in _WHERE.items():
        value = given.get(key, _UNSET.get(key))
        if value is not _UNSET.get(key):
            options = _set(options, key, path, value)
    options = _with_sharding(options, given.get("optimizer_sharding"), given.get("sharding"))
    return _with_mesh(options, given.get("mesh"),
                      {k: given.get(k) for k in ("pp", "dp", "tp")})


def one_process_options(options: Options) -> Options:
    """``options`` checked for ``partition``/``make_plan``, which plan this process's devices
    (or a cluster) as one mesh and shard nothing over replicas.

    Raises:
        MeshError: a mesh with some axes left to search (``pp=`` alone).
        OptionsError: a sharding other than ``"none"``.
    """
    mesh = options.mesh
    if mesh is not None and options.whole_mesh is None:
        raise MeshError(f"mesh {mesh} leaves axes to search, which only partition_distributed "
                        "does; pass mesh=Mesh(dp=..., pp=..., tp=...) with every axis, or no "
                        "mesh (strategy='auto' searches them all)")
    if options.sharding.kind not in (None, "none"):
        raise OptionsError(f"sharding={options.sharding.kind!r}: the one-process runtimes "
                           "shard nothing over their replicas; use partition_distributed "
                           "for sharded replicas, or Sharding('none')")
    return replace(options, mesh=options.whole_mesh)


def check_sequence_parallel(options: Options, tp: int | None, keyword: str = "tp") -> None:
    """Refuse ``options.sequence_parallel`` without ``tp >= 2`` tensor-parallel ranks.

    Args:
        options: the resolved options.
        tp: the tensor-parallel degree the run will have (``None``: not known, e.g. left
            to ``strategy="auto"``).
        keyword: how the caller names the degree (``"tp"``, ``"tensor_parallel"``).

    Raises:
        StrategyError: ``sequence_parallel=True`` and ``tp`` is not 2 or more.
    """
    if options.sequence_parallel and (tp is None or tp < 2):
        raise StrategyError(
            f"sequence_parallel=True with {keyword}={tp!r}: sequence parallelism splits the "
            "sequence between the tensor-parallel ranks of a stage, and there are none to "
            f"split it between; pass {keyword}=2 (or more) with it, or drop "
            "sequence_parallel")


def _set(options: Options, key: str, path: tuple[str, ...], value: Any) -> Options:
    """``options`` with the field at ``path`` set to ``value``, refusing a different value
    already there."""
    if len(path) == 1:
        current, default = getattr(options, path[0]), _default(Options, path[0])
        if current != default and current != value:
            raise _clash(key, value, f"options.{path[0]}={current!r}")
        return replace(options, **{path[0]: value})
    group = getattr(options, path[0])
    current, default = getattr(group, path[1]), _default(type(group), path[1])
    if current != default and current != value:
        raise _clash(key, value, f"options.{path[0]}.{path[1]}={current!r}")
    return replace(options, **{path[0]: replace(group, **{path[1]: value})})


def _with_sharding(options: Options, optimizer_sharding: Any, sharding: Any) -> Options:
    """``optimizer_sharding=`` (a bool) and ``sharding=`` (a kind) folded into
    ``options.sharding``."""
    kinds: list[tuple[str, str]] = []
    if optimizer_sharding is not None:
        if not isinstance(optimizer_sharding, bool):
            raise StrategyError(f"optimizer_sharding={optimizer_sharding!r}; pass True (shard "
                                "the optimizer state over the data-parallel replicas) or "
                                "False")
        kinds.append(("optimizer_sharding", "optimizer" if optimizer_sharding else "none"))
    if sharding is not None:
        kinds.append(("sharding", Sharding(sharding).kind or ""))
    for key, kind in kinds:
        current = options.sharding.kind
        if current is not None and current != kind:
            given = optimizer_sharding if key == "optimizer_sharding" else sharding
            raise _clash(key, given, f"sharding {current!r}")
        options = replace(options, sharding=Sharding(kind))
    return options


def _with_mesh(options: Options, mesh: Any, sizes: dict[str, Any]) -> Options:
    """``mesh=`` and ``pp=``/``dp=``/``tp=`` folded into ``options.mesh``."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise MeshError(f"mesh={mesh!r} is a {type(mesh).__name__}; pass "
                               "partitioner.Mesh(dp=..., pp=..., tp=...)")
        if options.mesh is not None and options.mesh != mesh:
            raise _clash("mesh", mesh, f"options.mesh={options.mesh}")
        options = replace(options, mesh=mesh)
    given = {k: v for k, v in sizes.items() if v is not None}
    if not given:
        return options
    current = options.mesh
    if current is not None:
        clash = [f"{k}={v}" for k, v in given.items() if getattr(current, k) not in (None, v)]
        if clash:
            where = "mesh" if mesh is not None else "options.mesh"
            raise MeshError(f"{where}={current} but {', '.join(clash)} given; pass the "
                            f"degrees once, in {where}= or as pp=/dp=/tp=")
        if isinstance(current, Mesh):
            return options
    merged = {k: given.get(k, getattr(current, k) if current is not None else None)
              for k in ("pp", "dp", "tp")}
    return replace(options, mesh=Degrees(**merged))


def _default(kind: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``kind``."""
    found = next(f for f in fields(kind) if f.name == name)
    return found.default_factory() if callable(found.default_factory) else found.default


def _clash(key: str, value: Any, current: str) -> PartitionError:
    return OptionsError(f"{key}={value!r} and {current} given; pass it once, in options= or "
                        f"as {key}=")


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
