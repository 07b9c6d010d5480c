"""The tensor-parallel model the user holds, in one process: pipeline stages of rank graphs.

:class:`TensorParallelModule` runs ``pp`` stages, each a
:class:`~partitioner.runtime.tensor_parallel.stage.
TensorParallelStage` of ``tp`` rank graphs, through the one-process pipeline
(``partitioner.runtime.local``), so ``chunks`` and checkpoint modes work as for any plan. Its
parameters
are the ranks' slices (what an optimizer steps); its ``state_dict()`` has the original
model's keys and full, unsplit tensors, gathered from the slices, and ``load_state_dict``
takes such a state dict and splits it (the hooks of
:mod:`partitioner.runtime.tensor_parallel.state`, shared with the
multi-process runtime). Both work when the module is nested in another.

:class:`ShardStore` makes each rank's tensors once, so the graphs built for train and eval
mode (``torch.export`` captures each mode on its own) share the same parameters.

Example:
    >>> import torch
    >>> from partitioner.runtime.tensor_parallel.sharding import Sharding
    >>> store = ShardStore({"w": Sharding("colwise", 0, 2)})
    >>> w = torch.nn.Parameter(torch.arange(4.0))
    >>> store.tensor("w", w, rank=1, device=torch.device("cpu")).tolist()
    [2.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.runtime.local import LocalPipeline
from partitioner.runtime.microbatch import OutputHint
from partitioner.runtime.originals import Originals
from partitioner.runtime.tensor_parallel.sharding import (
    Sharding,
    TensorParallelError,
    shard_tensor,
    unshard,
)
from partitioner.runtime.tensor_parallel.stage import TensorParallelStage
from partitioner.runtime.tensor_parallel.state import TensorParallelState
from partitioner.runtime.worker import shared_threads
from partitioner.runtime.wrapper import BUILD_LOCK

__all__ = ["TensorParallelModule", "ShardStore", "Source"]

#: Where one state-dict entry lives in a rank graph: (stage index, attribute path).
Source = tuple[int, str]


class ShardStore:
    """Each rank's copy or slice of each original tensor, made once.

    Args:
        shardings: by original name (any alias of a tied tensor); others are replicated.
        source: the whole value of an original tensor (a meta-built model's layer,
            materialized: ``partitioner.runtime.materialize.Materializer.tensor``); default:
            the tensor itself.
        derive: instead of ``source``, given an original and how a rank's tensor is cut
            from its whole value, the rank's tensor made later
            (``partitioner.runtime.deferred_init.DeferredInit.derived``).
    """

    def __init__(self, shardings: dict[str, Sharding],
                 source: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 derive: Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                                  torch.Tensor] | None = None) -> None:
        self.shardings = shardings
        self._source = source
        self._derive = derive
        self._made: dict[tuple[int, int], torch.Tensor] = {}
        self._devices: dict[tuple[int, int], torch.device] = {}

    def tensor(self, name: str, original: torch.Tensor, rank: int,
               device: torch.device) -> torch.Tensor:
        """Rank ``rank``'s tensor for ``original`` (called ``name``), on ``device``.

        Raises:
            TensorParallelError: if one tensor is asked for on two devices by one rank (a
                weight tied across stages on different devices).
        """
        key = (id(original), rank)
        if key not in self._made:
            sharding = self.shardings.get(name)

            def cut(whole: torch.Tensor) -> torch.Tensor:
                return (shard_tensor(whole, sharding, rank) if sharding is not None
                        else whole.detach().clone())
            if self._derive is not None:  # put off: runtime/deferred_init.py
                data = self._derive(original, cut).to(device)
            else:
                data = cut(original if self._source is None else self._source(original)
                           ).to(device)
            self._made[key] = (nn.Parameter(data, original.requires_grad)
                               if isinstance(original, nn.Parameter) else data)
            self._devices[key] = device
        elif self._devices[key] != device:
            raise TensorParallelError(
                f"{name} is used by stages on {self._devices[key]} and on {device} (rank "
                f"{rank}); tied weights across devices are not supported: keep their layers "
                "on one device")
        return self._made[key]

    def made(self, original: torch.Tensor, rank: int) -> torch.Tensor | None:
        """Rank ``rank``'s tensor for ``original``, if one was made."""
        return self._made.get((id(original), rank))

    def factory(self, rank: int, device: torch.device,
                names: dict[int, str]) -> Callable[[str, torch.Tensor, Sharding | None],
                                                   torch.Tensor]:
        """A ``make_tensor`` for ``partitioner.passes.tensor_parallel.rewrite.rewrite_rank``
        (``names``: original
        name by tensor id, so shardings are looked up by the model's names)."""
        def make(path: str, tensor: torch.Tensor, sharding: Sharding | None) -> torch.Tensor:
            return self.tensor(names.get(id(tensor), path), tensor, rank, device)
        return make


class TensorParallelModule(TensorParallelState):
    """A model split into pipeline stages of tensor-parallel ranks, in one process.

    Args:
        plan: the plan it runs (kept as ``.plan``; the runtime does not read it).
        stages: one :class:`TensorParallelStage` per stage, built for ``training`` mode.
        training: the mode ``stages`` were built for (the model's when it was partitioned:
            the module starts in it).
        stage_factory: given the other training flag, its stages (sharing the tensors).
        shardings: by original state-dict key; keys not named are replicated.
        sources: by original state-dict key, the stage and rank-graph attribute holding it.
        unused: original entries no graph uses (kept whole, so the state dict is complete).
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        bind: maps a call's ``(args, kwargs)`` to stage 0's placeholder values.
        restructure: maps the last stage's output to what the model returns.
        schedule: the plan's schedule, which :meth:`step` runs (one virtual stage per
            device: the tensor-parallel front cuts no model chunks).
        output_rows: how the micro-batches' outputs join, per output leaf (as
            :class:`~partitioner.runtime.module.PartitionedModule`'s).
        originals: by state-dict key, the original model's tensors the ranks copied: a
            write to them after partitioning, or an optimizer stepping them, is refused
            (``partitioner.runtime.originals``).

    Unlike a pipeline, this module does not compute with the original model's tensors: its
    parameters are the ranks' slices (and copies), which ``parameters()``,
    ``state_dict()``/``load_state_dict()`` and ``clip_grad_norm_`` work on. Build the
    optimizer over ``tp.parameters()`` and load weights with ``tp.load_state_dict``;
    loading into the original model afterwards, or an optimizer over
    ``model.parameters()``, raises a
    :class:`~partitioner.errors.TensorParallelError` (the next call, or that optimizer's
    ``step()``) instead of being silently ignored. Calls from several threads run one after
    another.
    """

    def __init__(self, plan: Any, stages: list[TensorParallelStage], training: bool,
                 stage_factory: Callable[[bool], list[TensorParallelStage]],
                 shardings: dict[str, Sharding], sources: dict[str, Source],
                 unused: dict[str, torch.Tensor], chunks: int = 1, checkpoint: str = "never",
                 bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]] | None = None,
                 restructure: Callable[[Any], Any] = lambda out: out,
                 schedule: str = "gpipe",
                 output_rows: Sequence[OutputHint] | None = None,
                 originals: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__(shardings, sources, plan=plan, training=training)
        self.output_rows = output_rows
        self._originals = (Originals(originals, type(self).__name__) if originals
                           else None)
        self.schedule = schedule
        self.chunks = chunks
        self.checkpoint = checkpoint
        self._factory = stage_factory
        self._bind = bind or (lambda args, kwargs: list(args))
        self._restructure = restructure
        self._pipelines: dict[bool, LocalPipeline] = {}
        self.stages = nn.ModuleDict()
        self._keep_unused(unused)
        self.stages["train_mode" if training else "eval_mode"] = nn.ModuleList(stages)
        self.train(training)

    def _build(self, training: bool) -> list[TensorParallelStage]:
        mode = "train_mode" if training else "eval_mode"
        if mode not in self.stages:
            self.stages[mode] = nn.ModuleList(self._factory(training)).train(training)
        return self._stages(mode)

    def _stages(self, mode: str) -> list[TensorParallelStage]:
        return [s for s in self.stages[mode].children()
                if isinstance(s, TensorParallelStage)]

    @property
    def tp(self) -> int:
        """The tensor-parallel degree."""
        return self._build(self.training)[0].tp

    @property
    def devices(self) -> list[list[torch.device]]:
        """Per stage, one device per rank."""
        return [stage.devices for stage in self._build(self.training)]

    def pipeline(self, training: bool | None = None) -> LocalPipeline:
        """The pipeline for train (or eval) mode, built on first use.

        Raises:
            ClosedError: after :meth:`close`.
        """
        mode = self.training if training is None else training
        if mode not in self._pipelines:
            self._ensure_open("run the pipeline")
            with BUILD_LOCK:  # two threads' first calls: one pipeline
                if mode not in self._pipelines:
                    self._pipelines[mode] = self._make_pipeline(mode)
        return self._pipelines[mode]

    def _make_pipeline(self, mode: bool) -> LocalPipeline:
        stages = self._build(mode)
        graphs: list[fx.GraphModule] = stages  # type: ignore[assignment]
        # Every rank of every stage computes on its own thread: they share the cores.
        threads = shared_threads([d for s in stages for d in s.devices])
        for stage in stages:
            stage.threads = threads
        return LocalPipeline(graphs, [s.devices[0] for s in stages], self.chunks,
                             self.checkpoint, threads, schedule=self.schedule,
                             output_rows=self.output_rows)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_originals()
        return self._restructure(self.pipeline().run(self._bind(args, kwargs)))

    def _check_originals(self) -> None:
        """Raises a ``TensorParallelError`` if the original model's weights were written."""
        if self._originals is not None:
            self._originals.check()

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Any], *,
             loss_reduction: str = "mean", kwargs: dict[str, Any] | None = None) -> float:
        """One training step in the plan's schedule, as
        :meth:`partitioner.runtime.module.PartitionedModule.step`; returns the loss."""
        self._check_originals()
        return self._pipeline_step(self.pipeline(), self._bind, self._restructure, inputs,
                                   targets, loss_fn, loss_reduction, kwargs)

    def local_tensors(self, key: str) -> list[torch.Tensor]:
        """Every rank's slice (or copy) of the original entry ``key``, in rank order."""
        kept = self._unused_tensor(key)
        if kept is not None:
            return [kept]
        j, attr = self._sources[key]
        stage = self._build(self.training)[j]
        return [_get(rank, attr) for rank in stage.ranks]

    def full_tensor(self, key: str, grad: bool = False) -> torch.Tensor | None:
        """The original entry ``key`` (or, with ``grad``, its gradient), whole: gathered
        from the ranks. ``None`` for a gradient not computed yet."""
        parts = self.local_tensors(key)
        if grad:
            grads = [p.grad for p in parts]
            if any(g is None for g in grads):
                return None
            parts = grads  # type: ignore[assignment]
        sharding = self._split_sharding(key)
        if sharding is None:
            return parts[0].detach().clone()
        return unshard([p.detach().to(parts[0].device) for p in parts], sharding)

    def _rank_tensors(self, key: str) -> list[tuple[int, torch.Tensor]]:
        return list(enumerate(self.local_tensors(key)))

    def _release(self) -> None:
        """Stop the worker threads (they also stop when the module is collected)."""
        for pipe in self._pipelines.values():
            pipe.close()
        self._pipelines.clear()
        if self._originals is not None:
            self._originals.release()
        for mode in list(self.stages):
            for stage in self._stages(mode):
                stage.close()


def _get(module: nn.Module, path: str) -> torch.Tensor:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]
