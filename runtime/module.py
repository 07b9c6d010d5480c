"""The partitioned model the user holds: an ``nn.Module`` that runs a plan.

It owns the user's model as ``.module`` (the seeds' habit from ``DataParallel``), so
``parameters()``, ``train()``/``eval()`` and optimizers work as before, and its
``state_dict()`` carries the original model's keys, so a state dict moves freely between the
partitioned and the unpartitioned model. Calling it runs the pipeline built for the current
train/eval mode (built once per mode, on first use).

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

__all__ = ["PartitionedModule"]

_PREFIX = "module."


def _bind_positional(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    if kwargs:
        raise TypeError("this partitioned module takes positional arguments only; its "
                        "partitioner supplies a binder for keyword arguments")
    return list(args)


class PartitionedModule(nn.Module):
    """A model split into pipeline stages over devices.

    Args:
        module: the user's model (its parameters are the stages' parameters).
        plan: the plan it runs (kept as ``.plan``; the runtime does not read it).
        stage_factory: given the training flag, returns one graph per stage.
        devices: one device per stage.
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        bind: maps a call's ``(args, kwargs)`` to stage 0's placeholder values.
        restructure: maps the last stage's output to what the model returns.
    """

    def __init__(self, module: nn.Module, plan: Any,
                 stage_factory: Callable[[bool], Sequence[fx.GraphModule]],
                 devices: Sequence[torch.device], chunks: int = 1, checkpoint: str = "never",
                 bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]] = _bind_positional,
                 restructure: Callable[[Any], Any] = lambda out: out) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.devices = list(devices)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self._stage_factory = stage_factory
        self._bind = bind
        self._restructure = restructure
        self._pipelines: dict[bool, LocalPipeline] = {}
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def pipeline(self, training: bool | None = None) -> LocalPipeline:
        """The pipeline for train (or eval) mode, built on first use."""
        mode = self.training if training is None else training
        if mode not in self._pipelines:
            stages = self._stage_factory(mode)
            self._pipelines[mode] = LocalPipeline(stages, self.devices, self.chunks,
                                                  self.checkpoint)
        return self._pipelines[mode]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._bind(args, kwargs)
        return self._restructure(self.pipeline().run(values))

    def close(self) -> None:
        """Stop the worker threads (they also stop when the module is collected)."""
        for pipe in self._pipelines.values():
            pipe.close()
        self._pipelines.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + _PREFIX):
            state_dict[prefix + key[len(prefix) + len(_PREFIX):]] = state_dict.pop(key)
    metadata: dict[str, Any] = getattr(state_dict, "_metadata", None) or {}
    for key in list(metadata):
        if key.startswith(prefix + "module"):
            metadata[prefix + key[len(prefix) + len("module"):].lstrip(".")] = metadata.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + _PREFIX):
            state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)
