"""This rank's part of a model partitioned over processes: :class:`DistributedModel`.

``partitioner.distributed.partition_distributed`` decides the plan and cuts the stage graphs;
:func:`assemble` builds the rank from them: point-to-point links to the neighbouring stages
(``p2p``), the gradient all-reduce between replicas (``data_parallel``), one process group
per weight tied across stages, the predictor of what crosses each boundary
(``boundaries``), and the rank's pipeline (``pipeline``). The runtime knows nothing of the
planner: it receives the plan's settings as data (:class:`RunSettings`) and keeps the plan
itself only for the user.

What a :class:`DistributedModel` shares with the other wrappers (the original model's
state-dict keys with tensor-parallel slices gathered whole, ``clip_grad_norm_`` over the
whole model, ``close``, the model's train/eval mode) comes from
:class:`~partitioner.runtime.wrapper.ModelWrapper`.

Example:
    >>> import torch
    >>> a = torch.nn.Linear(2, 2)
    >>> find_ties([torch.fx.symbolic_trace(a), torch.fx.symbolic_trace(a)])
    [((0, 'weight'), (1, 'weight')), ((0, 'bias'), (1, 'bias'))]
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioner.errors import CheckpointError, StrategyError
from partitioner.runtime.deferred_init import DeferredInit
from partitioner.runtime.device import model_device
from partitioner.runtime.distributed.boundaries import BoundaryPredictor
from partitioner.runtime.distributed.checkpoint_io import load_checkpoint, save_checkpoint
from partitioner.runtime.distributed.data_parallel import (
    DEFAULT_BUCKET_BYTES,
    GradReducer,
    TiedGradients,
)
from partitioner.runtime.distributed.failure import Watchdog
from partitioner.runtime.distributed.fsdp import (
    FsdpGradients,
    axis_device_mesh,
    check_fsdp,
    cut_whole_entries,
    load_whole_into_fsdp,
    local_shard,
    release_replaced,
    shard_stage_fsdp,
    tp_dp_device_mesh,
)
from partitioner.runtime.distributed.mesh import Coords, Mesh
from partitioner.runtime.distributed.p2p import PipeLinks
from partitioner.runtime.distributed.pipeline import DistributedPipeline
from partitioner.runtime.distributed.sharded_checkpoint import (
    TpLayout,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
    writes_one_file,
)
from partitioner.runtime.distributed.stage_group import merge_stages
from partitioner.runtime.distributed.zero import ShardedGradients, ShardedOptimizer
from partitioner.runtime.host_memory import steady_host_memory
from partitioner.runtime.placement import Placement
from partitioner.runtime.schedule_registry import schedule_kind
from partitioner.runtime.stage import StageRunner
from partitioner.runtime.tensor_parallel.shard_state import ShardState
from partitioner.runtime.wrapper import GroupNorms, ModelWrapper

__all__ = ["DistributedModel", "RunSettings", "assemble", "find_ties",
           "sharding_problem"]

Binder = Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]


@dataclass(frozen=True)
class RunSettings:
    """How a rank runs its stage: the plan's pipeline settings and the call's options.

    Attributes:
        schedule: a schedule the multi-process runtime executes (any registered one).
        chunks: micro-batches per step.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        loss_reduction: how ``loss_fn`` reduces a micro-batch, ``"mean"`` or ``"sum"``.
        bucket_bytes: the data-parallel all-reduce bucket size.
        seed: base seed of the stages' dropout generators.
        plan_record: the plan as checkpoints store it (``Plan.to_dict()``).
        virtual: virtual stages per rank (``"interleaved"``: 2 or more).
        optimizer_sharding: shard the optimizer state over the replicas (ZeRO-1,
            :mod:`~partitioner.runtime.distributed.zero`); needs ``dp >= 2``.
        precision: ``"fp32"`` or ``"bf16"``: the stages' autocast (fp32 parameters).
        sharding: ``"none"``, ``"optimizer"`` (the same as ``optimizer_sharding``) or
            ``"fsdp"``: parameters, gradients and optimizer state sharded over the
            replicas by torch's FSDP2 (:mod:`~partitioner.runtime.distributed.fsdp`).
        fsdp_units: with ``"fsdp"``, the paths of the stage's layer modules, each its own
            FSDP unit (``passes/outline_layers.py``); ``()``: the stage is one unit.
    """

    schedule: str
    chunks: int
    checkpoint: str
    loss_reduction: str = "mean"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    seed: int = 0
    plan_record: Mapping[str, Any] = field(default_factory=dict)
    virtual: int = 1
    optimizer_sharding: bool = False
    precision: str = "fp32"
    sharding: str = "none"
    fsdp_units: tuple[str, ...] = ()


def assemble(model: nn.Module, plan: Any, graphs: Sequence[fx.GraphModule],
             stage: fx.GraphModule | Mapping[int, fx.GraphModule], mesh: Mesh,
             device: torch.device, settings: RunSettings, *, bind: Binder,
             restructure: Callable[[Any], Any], watchdog: Watchdog,
             shards: ShardState | None = None, batched: bool = False,
             ties: list[tuple[tuple[int, str], ...]] | None = None,
             deferred: DeferredInit | None = None) -> DistributedModel:
    """This rank's :class:`DistributedModel` (collective: every rank calls it).

    Args:
        model: the whole model (its other stages stay where they are).
        plan: the plan every rank runs (kept as ``.plan``; not read here).
        graphs: every (virtual) stage's graph (this rank's moved to ``device``).
        stage: this rank's stage graph (its tensor-parallel rank graph when split), or with
            ``settings.virtual`` stages per rank, its virtual stages ``j, j + P, ...`` by
            index.
        mesh: this rank's place in the (pp, dp, tp) mesh and its groups.
        device: where this rank computes.
        settings: the plan's pipeline settings and the call's options.
        bind: maps a call's ``(args, kwargs)`` to stage 0's placeholder values.
        restructure: maps the last stage's output to what the model returns.
        watchdog: this process's failure watchdog.
        shards: the stage's split entries when it is split over ``tp`` ranks.
        batched: batch the point-to-point transfers (NCCL).
        ties: :func:`find_ties` of ``graphs`` taken before this rank's stage got new
            tensors (a meta-built model's, materialized); default: found here.
        deferred: the stage's put-off initialization (:class:`DistributedModel`).

    Raises:
        StrategyError: If virtual stages are asked for with ``pp=1`` or tensor parallelism,
            or optimizer sharding with ``dp=1``.
    """
    if device.type == "cpu":  # on every CPU rank, whichever planned (runtime/host_memory.py)
        steady_host_memory()
    j, shape = mesh.stage, mesh.shape
    if settings.optimizer_sharding and shape.dp < 2:
        raise StrategyError(sharding_problem(shape.dp))
    stages = {j: stage} if isinstance(stage, fx.GraphModule) else dict(sorted(stage.items()))
    if settings.virtual > 1 and (shape.pp < 2 or shards is not None):
        raise StrategyError(f"virtual_stages={settings.virtual} with pp={shape.pp}, "
                            f"tp={shape.tp}: virtual stages run on a pipeline of 2 or more "
                            "ranks without tensor parallelism; pass pp >= 2 and tp=1, or "
                            "virtual_stages=1")
    home = model_device(model)
    # A meta-built model's stages (and a stage split over tp ranks, whose unsplit graph
    # stays on meta) are predicted on fake tensors on this rank's device.
    devices = [device if k in stages or home.type == "meta" else home
               for k in range(len(graphs))]
    placement = schedule_kind(settings.schedule).place(shape.pp, settings.virtual)
    line = mesh.ranks("pp")  # each virtual stage's neighbours are where the schedule put them
    links = PipeLinks(mesh.group("pp"), None, None, device, batched=batched,
                      stage_ranks=[line[placement[k]] for k in range(len(graphs))],
                      rank=mesh.rank, reverse_group=None if batched else mesh.reverse_group())
    # One module for all virtual stages: parameters, state dict and checkpoints see them all.
    held = stages[j] if len(stages) == 1 else merge_stages(stages)
    ties = find_ties(graphs) if ties is None else ties
    # A weight tied across ranks is counted by the rank of its first stage only in norms.
    not_first = frozenset(name for tie in ties if placement[tie[0][0]] != j
                          for k, name in tie if k in stages)
    tied = _tie_groups(ties, mesh, stages, placement)
    # The 1/dp of the replica average rides on the loss weights: the all-reduce just sums.
    reducer: GradReducer | ShardedGradients | FsdpGradients | None = None
    if settings.sharding == "fsdp":
        check_fsdp(graphs, held, dp=shape.dp, stage=j, virtual=settings.virtual,
                   split=shards is not None, tied=bool(ties))
        # After the tp cut, as torchtitan: each tp slice is sharded over its dp group.
        originals = list(held.parameters())
        reducer = shard_stage_fsdp(
            held, axis_device_mesh(mesh.group("dp"), mesh.ranks("dp"), device.type, "dp"),
            units=settings.fsdp_units, sync_each_backward=settings.chunks == 1
            and not schedule_kind(settings.schedule).splits_backward)
        release_replaced(model, originals, held)  # the model kept them whole
        del originals
    elif settings.optimizer_sharding:
        split = shards.shardings if shards is not None else {}
        reducer = ShardedGradients(held.named_parameters(), mesh.group("dp"), tied=tied,
                                   counts=lambda name: name not in not_first and (
                                       name in split or mesh.shard == 0))
        tied = None  # summed by the sharded gradients, before they are cut
    elif shape.dp > 1:
        reducer = GradReducer(list(held.parameters()), mesh.group("dp"),
                              settings.bucket_bytes, predivided=True)
    runners = {k: StageRunner(k, gm, device, shard=mesh.shard if shards is not None else None,
                              precision=settings.precision) for k, gm in stages.items()}
    pipeline = DistributedPipeline(
        runners, n_stages=len(graphs), links=links,
        interfaces=BoundaryPredictor(graphs, list(stages), devices, settings.precision),
        schedule=settings.schedule, chunks=settings.chunks, checkpoint=settings.checkpoint,
        restructure=restructure, reducer=reducer, tied=tied,
        dp_size=shape.dp, loss_rank=len(graphs) - 1 in stages and mesh.shard == 0,
        loss_reduction=settings.loss_reduction, grad_scale=1.0 / shape.dp,
        virtual=settings.virtual)
    return DistributedModel(model, plan, mesh, pipeline, held, bind=bind, seed=settings.seed,
                            watchdog=watchdog, shards=shards, norm_skip=not_first,
                            plan_record=settings.plan_record,
                            sharded=reducer if isinstance(reducer, ShardedGradients) else None,
                            fsdp=reducer if isinstance(reducer, FsdpGradients) else None,
                            deferred=deferred)


def sharding_problem(dp: int) -> str:
    """Why optimizer sharding cannot run on ``dp`` replicas (it needs two or more)."""
    return (f"optimizer_sharding=True with dp={dp}: the optimizer state is sharded over "
            "the data-parallel replicas, and one replica holds it whole anyway; pass dp=2 "
            "or more, or optimizer_sharding=False")


def find_ties(graphs: Sequence[fx.GraphModule]) -> list[tuple[tuple[int, str], ...]]:
    """Parameters used by more than one stage: per shared tensor, ``(stage, name)`` pairs."""
    users: dict[int, list[tuple[int, str]]] = {}
    for j, gm in enumerate(graphs):
        for name, param in gm.named_parameters():
            if all(stage != j for stage, _ in users.get(id(param), [])):
                users.setdefault(id(param), []).append((j, name))
    return [tuple(u) for u in users.values() if len(u) > 1]


def _tie_groups(ties: list[tuple[tuple[int, str], ...]], mesh: Mesh,
                stages: Mapping[int, fx.GraphModule], placement: Placement
                ) -> TiedGradients | None:
    """One process group per tie and replica over the ranks holding its stages (virtual
    stage ``k`` on pipeline rank ``placement[k]``; collective); this rank's parameters in
    them. A tie within one rank needs none: its stages share the one tensor."""
    mine = []
    for tie in ties:
        for replica in range(mesh.shape.dp):
            for shard in range(mesh.shape.tp):
                ranks = sorted({mesh.shape.rank_of(Coords(placement[k], replica, shard))
                                for k, _ in tie})
                if len(ranks) < 2:
                    continue
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    k, name = next((k, n) for k, n in tie if k in stages)
                    mine.append((stages[k].get_parameter(name), group))
    return TiedGradients(mine) if mine else None


class DistributedModel(ModelWrapper):
    """This rank's stage of a model partitioned over processes.

    ``parameters()`` are this rank's stage's (give them to any optimizer); ``state_dict()``
    is this stage's part with the original model's keys, whole tensors even when the stage
    is split over ``tp`` ranks (then it is a collective: every rank of the stage replica's
    tp group calls it, and ``load_state_dict`` keeps each rank's slice); ``train()``/
    ``eval()`` work as usual, and it starts in the model's mode. Calling it is not
    supported: a pipeline stage alone has no meaningful output, so training goes through
    :meth:`step` and evaluation through :meth:`evaluate`.

    Args:
        model: the whole model (not a submodule: its other stages are not this rank's).
        plan: the plan every rank runs (kept as ``.plan``).
        mesh: this rank's place in the mesh.
        pipeline: the runtime executing the stage.
        stage: this rank's stage graph (one module holding all its virtual stages' tensors
            under the model's names, with virtual stages).
        bind: maps a call's ``(args, kwargs)`` to stage 0's placeholder values.
        seed: base seed of the stages' dropout generators.
        watchdog: this process's failure watchdog.
        shards: the stage's split entries when it is split over ``tp`` ranks.
        norm_skip: parameters whose gradients another stage counts (tied weights).
        plan_record: the plan as checkpoints store it.
        sharded: the stage's gradients cut over the replicas, with optimizer sharding.
        fsdp: the stage's FSDP reducer, with ``sharding="fsdp"``.
        deferred: a meta-built stage's initialization, put off until its tensors are
            first used or :meth:`load` fills them
            (:mod:`~partitioner.runtime.deferred_init`).

    Attributes:
        plan: the plan every rank runs.
        mesh: this rank's place in the (pp, dp, tp) mesh and its groups.
        pipeline: the runtime executing the stage.
        steps: training steps run so far (saved in checkpoints; seeds dropout).
    """

    inner = "stage"
    _model: nn.Module

    def __init__(self, model: nn.Module, plan: Any, mesh: Mesh, pipeline: DistributedPipeline,
                 stage: nn.Module, *, bind: Binder, seed: int, watchdog: Watchdog,
                 shards: ShardState | None = None, norm_skip: frozenset[str] = frozenset(),
                 plan_record: Mapping[str, Any] | None = None,
                 sharded: ShardedGradients | None = None,
                 fsdp: FsdpGradients | None = None,
                 deferred: DeferredInit | None = None) -> None:
        # Replicas hold the same averaged gradients: the world's sum counts each dp times;
        # sharded, each replica holds its own slice of them.
        cut = sharded is not None or fsdp is not None
        norms = GroupNorms(None, copies=1 if cut else mesh.shape.dp,
                           device=pipeline.runner.device)
        super().__init__(plan, model.training, shards=shards, combine_norms=norms)
        self.stage = stage
        self.mesh = mesh
        self.pipeline = pipeline
        self.steps = 0
        self.__dict__["_model"] = model  # not a submodule: its other stages are not ours
        self._bind = bind
        self._seed = seed
        self._watchdog = watchdog
        self._norm_skip = norm_skip
        self._plan_record = dict(plan_record or {})
        self._sharded = sharded
        self._fsdp = fsdp
        self._deferred = deferred

    def initialize(self) -> None:
        """Fill the tensors of a meta-built stage whose initialization was put off (a no-op
        once done, or when :meth:`load` filled them). The first ``step``, ``evaluate``,
        ``save`` or ``state_dict`` does it; ``parameters()`` does not (an optimizer built
        before ``load(path, optimizer)`` holds the tensors ``load`` then fills), so their
        values read before either are NaN."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred.run(loaded=False)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.initialize()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        deferred, self._deferred = self._deferred, None
        if deferred is not None and not strict:
            deferred.run(loaded=False)  # what the call leaves out keeps its initial value
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if deferred is not None and strict:
            deferred.run(loaded=True)
        return result

    @property
    def stage_index(self) -> int:
        """The pipeline stage this rank runs."""
        return self.mesh.stage

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (it holds the last virtual stage: rank 0's
        in a V)."""
        return self.pipeline.is_last

    def _values(self, inputs: Any, kwargs: dict[str, Any] | None) -> list[Any]:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return self._bind(args, dict(kwargs or {}))

    def _step_seed(self) -> int:
        key = (self._seed, self.steps, self.mesh.replica, self.mesh.stage)
        return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little")

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             loss_reduction: str | None = None,
             kwargs: dict[str, Any] | None = None) -> float:
        """One training step's forward and backward over the pipeline; returns its loss.

        Every rank of a replica passes the same batch (stage 0 reads ``inputs``, the last
        stage ``targets``; the others use their shapes). Gradients accumulate into this
        stage's ``.grad`` exactly as full-batch training would produce them (averaged over
        replicas); then call your optimizer's ``step()``.

        Args:
            inputs: the model's positional input (a tensor) or a tuple of them.
            targets: what ``loss_fn`` compares with (any pytree split like the inputs).
            loss_fn: ``loss_fn(outputs, targets) -> scalar``, run per micro-batch.
            loss_reduction: ``None``, or the one given to ``partition_distributed`` (it is
                fixed there: every rank must weight micro-batch losses alike).
            kwargs: keyword inputs of the model.

        Returns:
            The loss of the whole batch, averaged over replicas, on every rank.

        Raises:
            ClosedError: after :meth:`close` (the replicas' gradient all-reduce is gone).
            StrategyError: with optimizer sharding, before ``make_optimizer`` or on a step
                not preceded by ``zero_grad`` (the last step's gradients are reduced).
        """
        self._ensure_open("train")
        self.initialize()
        if self._sharded is not None and not getattr(self, "_sharded_optimizer", False):
            # A plain optimizer over parameters() would step on unreduced gradients: only
            # this replica's slice of the flat gradients holds the average.
            raise StrategyError(
                f"this model shards the optimizer state over its dp={self.mesh.shape.dp} "
                "replicas (optimizer_sharding=True, or chosen by strategy='auto'), so the "
                "parameters keep no averaged gradients; build the optimizer with "
                "dpm.make_optimizer(torch.optim.AdamW, lr=...) before training, or pass "
                "optimizer_sharding=False")
        if self._sharded is not None:
            self._sharded.check_cleared()
        if loss_reduction is not None and loss_reduction != self.pipeline.loss_reduction:
            raise StrategyError(f"loss_reduction={loss_reduction!r} but this model was "
                                f"partitioned with loss_reduction="
                                f"{self.pipeline.loss_reduction!r}; pass that one (or none), "
                                "or partition_distributed(..., loss_reduction=...) again")
        with self._watchdog.guard():
            loss = self.pipeline.step(self._values(inputs, kwargs), targets, loss_fn,
                                      seed=self._step_seed())
        self.steps += 1
        return loss

    def evaluate(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                 *, kwargs: dict[str, Any] | None = None) -> float:
        """The loss of a batch without autograd (call ``eval()`` first for eval mode)."""
        self._ensure_open("evaluate")
        self.initialize()
        with self._watchdog.guard():
            loss = self.pipeline.evaluate(self._values(inputs, kwargs), targets, loss_fn,
                                          seed=self._step_seed())
        if self._fsdp is not None:
            self._fsdp.reshard()  # else the next step would run on the gathered, stale copy
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a DistributedModel runs one pipeline stage; train with "
                        "dpm.step(inputs, targets, loss_fn) and evaluate with dpm.evaluate(...)")

    def save(self, path: str | Path,
             optimizer: torch.optim.Optimizer | ShardedOptimizer | None = None) -> None:
        """Write a checkpoint (collective; all ranks call it): to a folder, every rank its
        own shards with ``torch.distributed.checkpoint``, nothing gathered
        (:mod:`~partitioner.runtime.distributed.sharded_checkpoint`;
        ``partitioner.checkpoint_to_state_dict(folder)`` gives the unpartitioned model's
        state dict); to a ``.pt``/``.pth`` file, one consolidated file from rank 0, which
        ``torch.load(path, weights_only=True)["model"]`` loads into the unpartitioned model.
        :meth:`load` resumes a partitioned run from either, on any mesh.

        Raises:
            CheckpointError: a one-file save with ``sharding="fsdp"`` (save to a folder).
        """
        self.initialize()
        if not writes_one_file(path):
            with self._watchdog.guard():
                save_sharded(path, self.stage, optimizer=optimizer, tp=self._tp_layout(),
                             extra={"steps": self.steps, "plan": self._plan_record},
                             base_state=self._model.state_dict)
            return
        if self._fsdp is not None:
            raise CheckpointError(f"save({str(path)!r}) writes one file gathered on rank 0, "
                                  "which sharding='fsdp' does not do; save to a folder "
                                  "(a path without .pt/.pth): every rank writes its shards")
        contributes = self.mesh.replica == 0 and self.mesh.shard == 0
        base = ({k: None if v.is_meta else v for k, v in self._model.state_dict().items()}
                if self.mesh.rank == 0 else {})
        same: dict[int, list[str]] = {}
        for key, tensor in self._model.state_dict(keep_vars=True).items():
            same.setdefault(id(tensor), []).append(key)
        with self._watchdog.guard():
            save_checkpoint(path, self.stage, contributes=contributes,
                            group=self.mesh.group("pp"), base_state=base, optimizer=optimizer,
                            extra={"steps": self.steps, "plan": self._plan_record},
                            aliases=[keys for keys in same.values() if len(keys) > 1],
                            shards=self._shards)

    def load(self, path: str | Path,
             optimizer: torch.optim.Optimizer | ShardedOptimizer | None = None, *,
             strict: bool = True) -> None:
        """Resume from a checkpoint written by :meth:`save`, or fill the stage from the
        whole model's state dict (a ``torch.save(model.state_dict())`` file or a
        ``.safetensors`` file): each rank reads only its stage's tensors (a sharded
        optimizer takes its replica's slice, for any number of replicas).

        Raises:
            CheckpointError: the file lacks a key of this stage or a shape differs, or (with
                ``strict``, as ``load_state_dict``) it holds keys the model lacks: another
                model's state dict (``strict=False`` ignores those keys).
        """
        keys = self._model.state_dict(keep_vars=True).keys()
        deferred, self._deferred = self._deferred, None
        try:
            extra = self._load(path, optimizer, keys, strict)
        except BaseException:
            self._deferred = deferred  # nothing usable was loaded: initialize on first use
            raise
        if deferred is not None:  # every key of the stage came from the file
            deferred.run(loaded=True)
        self.steps = int(extra.get("steps", 0))

    def _load(self, path: str | Path, optimizer: torch.optim.Optimizer | ShardedOptimizer | None,
              keys: Any, strict: bool) -> dict[str, Any]:
        if is_sharded_checkpoint(path):
            return load_sharded(path, self.stage, optimizer=optimizer, tp=self._tp_layout(),
                                model_keys=keys, aliases=self._aliases(), strict=strict)
        if self._fsdp is not None:
            return load_whole_into_fsdp(path, self.stage, optimizer=optimizer,
                                        model_keys=keys, strict=strict, shards=self._shards)
        return load_checkpoint(path, self.stage, optimizer=optimizer, shards=self._shards,
                               model_keys=keys, strict=strict)

    def _tp_layout(self) -> TpLayout | None:
        """How this rank's tensor-parallel slices (cut again by FSDP) are DTensors."""
        if self._shards is None:
            return None
        if getattr(self, "_tp_mesh", None) is None:
            kind, ranks = self.pipeline.runner.device.type, self.mesh.ranks("tp")
            self._tp_mesh = axis_device_mesh(self.mesh.group("tp"), ranks, kind, "tp")
            if self._fsdp is not None:  # the replicas of each tp rank, by tp rank
                self._tp_mesh = tp_dp_device_mesh(
                    self.mesh.group("tp"), self.mesh.group("dp"),
                    [self.mesh.shape.line("dp", rank) for rank in ranks], kind)
        return TpLayout(self._shards, self._tp_mesh)

    def _whole_shards(self, entries: dict[str, Any]) -> dict[str, Any]:
        """With FSDP, the tp slices' shards as DTensors of the whole tensors
        (:meth:`TpLayout.whole_entries`); without, the slices gathered."""
        layout = self._tp_layout()
        if self._fsdp is None or layout is None:
            return super()._whole_shards(entries)
        return layout.whole_entries(entries)

    def _cut_shards(self, entries: dict[str, Any]) -> dict[str, Any]:
        layout = self._tp_layout()
        if self._fsdp is None or layout is None:
            return super()._cut_shards(entries)
        return layout.cut_entries(entries, self.stage.state_dict())

    def _state_from_original(self, state_dict: dict[str, Any], prefix: str,
                             missing_keys: list[str]) -> None:
        super()._state_from_original(state_dict, prefix, missing_keys)
        if self._fsdp is not None:  # FSDP loads DTensors only
            cut_whole_entries(state_dict, self.stage.state_dict(), f"{prefix}{self.inner}.")

    def _aliases(self) -> dict[str, list[str]]:
        """The model's other keys of each tensor (tied weights), by key."""
        same: dict[int, list[str]] = {}
        for key, tensor in self._model.state_dict(keep_vars=True).items():
            same.setdefault(id(tensor), []).append(key)
        return {key: [k for k in keys if k != key] for keys in same.values() for key in keys}

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
                       ) -> torch.optim.Optimizer | ShardedOptimizer:
        """An optimizer over this rank's stage: with ``optimizer_sharding``, a
        :class:`~partitioner.runtime.distributed.zero.ShardedOptimizer` over this replica's
        slice of the parameters; otherwise ``optimizer_class(self.parameters(), **kwargs)``.

        Example:
            >>> optimizer = dpm.make_optimizer(torch.optim.AdamW, lr=1e-3)  # doctest: +SKIP
        """
        if self._sharded is not None:
            self._sharded_optimizer = True
            return ShardedOptimizer(self._sharded, optimizer_class, **kwargs)
        return optimizer_class(self.parameters(), **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (and, with optimizer sharding, the replica's slices of them)."""
        super().zero_grad(set_to_none)
        if self._sharded is not None:
            self._sharded.zero_grad()

    def _grads_to_scale(self) -> list[torch.Tensor]:
        if self._fsdp is not None:
            return self._fsdp.local_grads()
        return self._sharded.grads() if self._sharded is not None else super()._grads_to_scale()

    def _norm_grads(self) -> list[torch.Tensor]:
        """This rank's share of the model's gradients, each counted once over the world:
        replicas hold the same averaged gradients (:class:`GroupNorms` divides by their
        number), a replicated parameter of a split stage counts on tp rank 0, a split one by
        all its slices, a weight tied across stages on its first stage."""
        if self._sharded is not None:  # each element of the slices counts on one rank
            return self._sharded.norm_grads()
        # FSDP's shards (no ties): each element on one replica, a tp slice's on its tp rank.
        split = self._shards.shardings if self._shards is not None else {}
        return [local_shard(p.grad).detach() for name, p in self.stage.named_parameters()
                if p.grad is not None and name not in self._norm_skip
                and (name in split or self.mesh.shard == 0)]

    def _release(self) -> None:
        """Remove the data-parallel hooks and destroy the mesh's axis groups (the world's
        process group stays up)."""
        if self.pipeline.reducer is not None:
            self.pipeline.reducer.close()
        self.mesh.release()
