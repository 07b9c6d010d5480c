"""The partitioned model the user holds: an ``nn.Module`` that runs a plan.

It owns the user's model as ``.module`` (the seeds' habit from ``DataParallel``), so
``parameters()``, ``train()``/``eval()`` and optimizers work as before, and its
``state_dict()`` carries the original model's keys, so a state dict moves freely between the
partitioned and the unpartitioned model (the :class:`~partitioner.runtime.wrapper.ModelWrapper`
base strips and adds the ``module.`` prefix). It starts in the model's train/eval mode;
calling it runs the pipeline built for the current mode (built once per mode, on first use).
The stages compute with the model's own parameters: weights loaded into the model after
partitioning are used, and an optimizer over ``model.parameters()`` steps what trains.
Calls from several threads run one after another.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> gm = torch.fx.symbolic_trace(model)
    >>> pm = PartitionedModule(model, plan=None, stage_factory=lambda training: [gm],
    ...                        devices=[torch.device("cpu")])
    >>> sorted(pm.state_dict())
    ['bias', 'weight']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.runtime.local import LocalPipeline
from partitioner.runtime.microbatch import OutputHint
from partitioner.runtime.precision import LossScaler, make_scaler
from partitioner.runtime.wrapper import BUILD_LOCK, ModelWrapper

__all__ = ["PartitionedModule"]


def _bind_positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    if kwargs:
        raise TypeError("this partitioned module takes positional arguments only; its "
                        "partitioner supplies a binder for keyword arguments")
    return list(args)


class PartitionedModule(ModelWrapper):
    """A model split into pipeline stages over devices.

    Args:
        module: the user's model (its parameters are the stages' parameters; its train/eval
            mode is the wrapper's first).
        plan: the plan it runs (kept as ``.plan``; the runtime does not read it).
        stage_factory: given the training flag, returns one graph per stage.
        devices: one device per stage.
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        bind: maps a call's ``(args, kwargs)`` to stage 0's placeholder values.
        restructure: maps the last stage's output to what the model returns.
        schedule: the plan's schedule, which :meth:`step` runs (any registered name).
        virtual: virtual stages per device (``stage_factory`` then returns ``P v`` graphs).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast in every stage, fp32
            parameters; ``partitioner.runtime.precision``).
        loss_scale: with fp16, ``"dynamic"`` or a fixed float: :meth:`step` scales the
            gradients by ``self.scaler.scale``; step the optimizer with
            ``pm.scaler.step(optimizer)`` then ``pm.scaler.update()``.
        output_rows: per leaf of the last stage's output, the rows of dim 0 per sample the
            capture found (``0``: no batch dimension), which decides how a call joins the
            micro-batches' outputs: batched leaves are concatenated, floating-point ones
            without a batch dimension (an ``aux_loss``) averaged weighted by the
            micro-batches' samples, others refused
            (``partitioner.runtime.microbatch.join_rules``).
    """

    inner = "module"

    def __init__(self, module: nn.Module, plan: Any,
                 stage_factory: Callable[[bool], Sequence[fx.GraphModule]],
                 devices: Sequence[torch.device], chunks: int = 1, checkpoint: str = "never",
                 bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]] = _bind_positional,
                 restructure: Callable[[Any], Any] = lambda out: out,
                 schedule: str = "gpipe", virtual: int = 1, precision: str = "fp32",
                 loss_scale: float | str | None = None,
                 output_rows: Sequence[OutputHint] | None = None) -> None:
        super().__init__(plan, module.training)
        self.output_rows = output_rows
        #: The loss scaler of fp16 training (``None`` otherwise).
        self.scaler: LossScaler | None = make_scaler(precision, loss_scale)
        self.precision = precision
        self.schedule = schedule
        self.virtual = virtual
        self.module = module
        self.devices = list(devices)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self._stage_factory = stage_factory
        self._bind = bind
        self._restructure = restructure
        self._pipelines: dict[bool, LocalPipeline] = {}

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
        stages = self._stage_factory(mode)
        return LocalPipeline(stages, self.devices, self.chunks, self.checkpoint,
                             schedule=self.schedule, virtual=self.virtual,
                             precision=self.precision, output_rows=self.output_rows)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._bind(args, kwargs)
        return self._restructure(self.pipeline().run(values))

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Any], *,
             loss_reduction: str = "mean", kwargs: dict[str, Any] | None = None) -> float:
        """One training step in the plan's schedule; returns the batch's loss.

        The loss is computed per micro-batch on the last stage and each micro-batch's
        backward starts there, in the order the plan's schedule gives (GPipe, 1F1B,
        interleaved, zero-bubble); the gradients accumulate into ``.grad`` as
        ``loss_fn`` over the whole batch would give them. Then call your optimizer's
        ``step()`` (with fp16: ``pm.scaler.step(optimizer)``, ``pm.scaler.update()``:
        the gradients are scaled by ``pm.scaler.scale``). ``pm(x)`` followed by
        ``loss.backward()`` keeps working too (all forwards, then all backwards).

        Args:
            inputs: the model's positional input (a tensor) or a tuple of them.
            targets: what ``loss_fn`` compares with, split into micro-batches like the
                inputs.
            loss_fn: ``loss_fn(outputs, targets)`` returning a scalar tensor, run per
                micro-batch on what the model returns.
            loss_reduction: ``"mean"`` if ``loss_fn`` averages over its samples (micro-batch
                losses are weighted by their share of the batch) or ``"sum"``.
            kwargs: keyword inputs of the model.

        Returns:
            The batch's loss.

        Raises:
            StrategyError: If ``loss_reduction`` is neither ``"mean"`` nor ``"sum"``.
            StageExecutionError: If a stage or ``loss_fn`` raised, naming where.
        """
        return self._pipeline_step(self.pipeline(), self._bind, self._restructure, inputs,
                                   targets, loss_fn, loss_reduction, kwargs,
                                   grad_scale=self.scaler.scale if self.scaler else 1.0)

    def _release(self) -> None:
        """Stop the worker threads (they also stop when the module is collected)."""
        for pipe in self._pipelines.values():
            pipe.close()
        self._pipelines.clear()
