"""``partition()``: validate, capture, run the passes, plan, and hand off to the runtime.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> x = torch.randn(4, 8)
    >>> pm = partition(model, devices=["cpu", "cpu"], example_inputs=(x,), chunks=2)
    >>> torch.allclose(pm(x), model(x))
    True
    >>> pm.plan.balance
    (2, 1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from torch import nn

from partitioner.analysis import Analysis, analyze
from partitioner.apply import resolve_plan
from partitioner.build import build_pipeline
from partitioner.errors import DeviceError, ModelError, StrategyError
from partitioner.planning.planner import plan_request, record
from partitioner.plans.plan import Plan
from partitioner.plans.spec import Spec
from partitioner.request import STRATEGIES, PlanRequest
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.tensor_parallel.module import TensorParallelModule
from partitioner.tensor_parallel import partition_tensor_parallel

__all__ = ["partition", "make_plan", "STRATEGIES"]


@overload
def partition(model: nn.Module, devices: Any, strategy: str = ..., *,
              example_inputs: tuple[Any, ...] | None = ...,
              example_kwargs: dict[str, Any] | None = ..., chunks: int | None = ...,
              checkpoint: str | None = ..., balance: Sequence[int] | None = ...,
              split_points: Sequence[str] | None = ...,
              memory_limit: float | Sequence[float] | None = ...,
              plan: str | Path | Plan | Spec | dict[str, Any] | None = ...,
              calibrate: bool = ...,
              tensor_parallel: None = ...) -> PartitionedModule: ...


@overload
def partition(model: nn.Module, devices: Any, strategy: str = ..., *,
              example_inputs: tuple[Any, ...] | None = ...,
              example_kwargs: dict[str, Any] | None = ..., chunks: int | None = ...,
              checkpoint: str | None = ..., balance: Sequence[int] | None = ...,
              split_points: Sequence[str] | None = ...,
              memory_limit: float | Sequence[float] | None = ...,
              plan: None = ...,
              calibrate: bool = ...,
              tensor_parallel: int | Mapping[str, str]) -> TensorParallelModule: ...


def partition(model: nn.Module, devices: Any, strategy: str = "auto", *,
              example_inputs: tuple[Any, ...] | None = None,
              example_kwargs: dict[str, Any] | None = None, chunks: int | None = None,
              checkpoint: str | None = None, balance: Sequence[int] | None = None,
              split_points: Sequence[str] | None = None,
              memory_limit: float | Sequence[float] | None = None,
              plan: str | Path | Plan | Spec | dict[str, Any] | None = None,
              calibrate: bool = False,
              tensor_parallel: int | Mapping[str, str] | None = None
              ) -> PartitionedModule | TensorParallelModule:
    """Partition ``model`` into pipeline stages over ``devices``.

    Args:
        model: any ``nn.Module`` that ``torch.fx`` or ``torch.export`` can capture.
        devices: device strings, ``torch.device`` objects, a count, or a local
            :class:`~partitioner.cost.devices.Cluster`.
        strategy: ``"auto"`` (search data x tensor x pipeline parallelism, micro-batches,
            schedule and checkpoint mode, keeping what this runtime executes: pipeline
            plans, ``partitioner.planning.auto``) or ``"pipeline"`` (every device a stage).
        example_inputs: one batch of positional inputs; needed to cost the layers (so always,
            unless ``balance`` or ``split_points`` fixes the split) and for export capture.
        example_kwargs: keyword inputs of that batch.
        chunks: micro-batches per mini-batch (split along dim 0); ``"auto"`` chooses when
            omitted, otherwise 1.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's meaning);
            ``"auto"`` chooses when omitted, otherwise ``"except_last"``.
        balance: layers per stage, torchgpipe style; one entry per device.
        split_points: module names at which a new stage begins.
        memory_limit: bytes per device (one number for all, or one per device); defaults to
            each device's memory.
        plan: a saved :class:`Plan` (or its file) to apply exactly, after checking the model
            is the one it was made for; or a hand-written spec (file, dict or ``Spec``) to
            compile (``partitioner.apply``). ``devices`` may then be ``None``.
        calibrate: time each distinct layer once on this machine (repeated blocks once, a
            progress bar on stderr) and scale the cost model to match.

        tensor_parallel: split weight matrices too (Megatron-style): a degree ``n`` groups
            ``devices`` by ``n`` per pipeline stage and chooses the splits; a mapping of
            module globs to ``"colwise"``/``"rowwise"``/``"vocab"``/``"replicate"``
            overrides the choice (``devices`` is then one stage's list, or a list of them).
            See ``docs/design/005-tensor-parallel.md``.

    Returns:
        A :class:`partitioner.runtime.module.PartitionedModule` (with ``tensor_parallel``, a
        :class:`partitioner.runtime.tensor_parallel.module.TensorParallelModule`); its ``.plan``
        says what was done
        (``pm.plan.explain()``: the candidates and why this one won).

    Raises:
        PartitionError: a subclass naming the offending value and a fix.
    """
    _check_model(model)
    if tensor_parallel is not None:
        if plan is not None or calibrate:
            raise StrategyError(f"pass {'plan=' if plan is not None else 'calibrate=True'} or "
                                "tensor_parallel=, not both (tensor-parallel plans are made "
                                "from the uncalibrated cost model)")
        return partition_tensor_parallel(
            model, devices, tensor_parallel, strategy=strategy, example_inputs=example_inputs,
            example_kwargs=example_kwargs, chunks=chunks, checkpoint=checkpoint,
            balance=balance, split_points=split_points, memory_limit=memory_limit)
    if devices is None and plan is None:
        raise DeviceError("devices=None; pass the devices to partition over, e.g. "
                          "devices=['cpu', 'cpu'], or plan= a saved plan that names them")
    request = PlanRequest.make(devices, strategy, example_inputs=example_inputs,
                               example_kwargs=example_kwargs, chunks=chunks,
                               checkpoint=checkpoint, balance=balance,
                               split_points=split_points, memory_limit=memory_limit,
                               calibrate=calibrate, local=True)
    if plan is not None:
        analysis, made, request = resolve_plan(model, plan, request)
        return build_pipeline(model, analysis, made, request)
    analysis, made = _planned(model, request)
    return build_pipeline(model, analysis, made, request)


def make_plan(model: nn.Module, devices: Any, strategy: str = "auto", *,
              example_inputs: tuple[Any, ...] | None = None,
              example_kwargs: dict[str, Any] | None = None, chunks: int | None = None,
              checkpoint: str | None = None, balance: Sequence[int] | None = None,
              split_points: Sequence[str] | None = None,
              memory_limit: float | Sequence[float] | None = None,
              plan: str | Path | Plan | Spec | dict[str, Any] | None = None,
              calibrate: bool = False) -> Plan:
    """Plan like :func:`partition` without building the runtime (works on meta models).

    With ``plan=`` a hand-written spec is compiled (or a saved plan checked) for ``model``.
    ``devices`` may also be a :class:`~partitioner.cost.devices.Cluster` beyond this machine
    (``Cluster.preset("A100-80GB", nodes=4)``): ``"auto"`` then plans any mix of data,
    tensor and pipeline parallelism for it.
    """
    _check_model(model)
    if devices is None and plan is None:
        raise DeviceError("devices=None; pass the devices (or a Cluster) to plan for, e.g. "
                          "devices=['cpu', 'cpu'], or plan= a spec that names them")
    request = PlanRequest.make(devices, strategy, example_inputs=example_inputs,
                               example_kwargs=example_kwargs, chunks=chunks,
                               checkpoint=checkpoint, balance=balance,
                               split_points=split_points, memory_limit=memory_limit,
                               calibrate=calibrate)
    if plan is not None:
        return resolve_plan(model, plan, request)[1]
    return _planned(model, request)[1]


def _planned(model: nn.Module, request: PlanRequest) -> tuple[Analysis, Plan]:
    """The model analysed and planned as ``request`` asks, the plan recorded."""
    analysis = analyze(model, request.example_inputs, request.kwargs,
                       need_costs=not request.fixes_split)
    return analysis, record(plan_request(analysis, request), model, analysis, request,
                            request.strategy)


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        hint = (" (a class: pass an instance, e.g. Model())" if isinstance(model, type)
                else " (a function: wrap it in an nn.Module)" if callable(model) else "")
        raise ModelError(f"model={model!r} is a {type(model).__name__}, not an nn.Module"
                         f"{hint}; pass the nn.Module to partition")
