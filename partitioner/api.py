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

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

import torch
import torch.fx as fx
from torch import nn

from partitioner.capture import Captured, capture, module_paths
from partitioner.cost import LayerCost, Workload, boundary_bytes, workload_from_graph
from partitioner.devices import Cluster, parse_devices
from partitioner.errors import (
    BalanceError,
    ChunksError,
    ExampleInputsError,
    MemoryLimitError,
    PartitionError,
    StageCountError,
    StrategyError,
)
from partitioner.manual import boundaries_from_balance, boundaries_from_split_points
from partitioner.plan import Plan, Stage
from partitioner.spec import Spec
from passes.annotate_cost import annotate_cost
from passes.dead_code import eliminate_dead_code
from passes.flatten_sequential import assign_layer_paths
from passes.fuse_weight_grads import fuse_weight_grads
from passes.group_layers import Layer, group_layers
from passes.private_rng import route_dropout
from passes.protect_inputs import protect_inputs
from passes.shape_prop import propagate_shapes
from passes.split_stages import split_stages
from runtime.local import CHECKPOINT_MODES
from runtime.microbatch import batch_size
from runtime.module import PartitionedModule
from runtime.tp_module import TensorParallelModule

__all__ = ["partition", "make_plan", "analyze", "build_stage_graphs", "Analysis",
           "STRATEGIES"]

STRATEGIES = ("auto", "pipeline")


@dataclass
class Analysis:
    """A captured model after the analysis passes."""

    captured: Captured
    layers: tuple[Layer, ...]
    costs: list[LayerCost] | None
    boundaries: list[int] | None
    training: bool
    workload: Workload | None = None
    inputs: list[Any] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Options:
    devices: tuple[torch.device, ...]
    strategy: str
    chunks: int | None
    checkpoint: str | None
    balance: tuple[int, ...] | None
    split_points: tuple[str, ...] | None
    memory_limit: tuple[float, ...] | None
    cluster: Cluster | None = None
    calibrate: bool = False


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
            :class:`~partitioner.devices.Cluster`.
        strategy: ``"auto"`` (search data x tensor x pipeline parallelism, micro-batches,
            schedule and checkpoint mode, keeping what this runtime executes: pipeline
            plans, ``partitioner.auto``) or ``"pipeline"`` (every device a stage).
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
        A :class:`runtime.module.PartitionedModule` (with ``tensor_parallel``, a
        :class:`runtime.tp_module.TensorParallelModule`); its ``.plan`` says what was done
        (``pm.plan.explain()``: the candidates and why this one won).

    Raises:
        PartitionError: a subclass naming the offending value and a fix.
    """
    if tensor_parallel is not None:
        if plan is not None or calibrate:
            raise StrategyError(f"pass {'plan=' if plan is not None else 'calibrate=True'} or "
                                "tensor_parallel=, not both (tensor-parallel plans are made "
                                "from the uncalibrated cost model)")
        from partitioner.tensor_parallel import partition_tensor_parallel
        return partition_tensor_parallel(
            model, devices, tensor_parallel, strategy=strategy, example_inputs=example_inputs,
            example_kwargs=example_kwargs, chunks=chunks, checkpoint=checkpoint,
            balance=balance, split_points=split_points, memory_limit=memory_limit)
    if plan is not None:
        from partitioner.apply import resolve_plan
        asked = {k: v for k, v in dict(strategy=strategy, chunks=chunks, checkpoint=checkpoint,
                                       balance=balance, split_points=split_points,
                                       memory_limit=memory_limit).items() if v is not None}
        analysis, made, options = resolve_plan(model, plan, devices, asked=asked,
                                               example_inputs=example_inputs,
                                               example_kwargs=example_kwargs)
        return _build(model, analysis, made, options, example_inputs, example_kwargs)
    options = _validate(devices, strategy, chunks, checkpoint, balance, split_points,
                        memory_limit, calibrate=calibrate, local=True)
    analysis = analyze(model, example_inputs, example_kwargs,
                       need_costs=options.balance is None and options.split_points is None)
    made = _recorded(_plan(analysis, options), model, analysis, options, example_inputs)
    return _build(model, analysis, made, options, example_inputs, example_kwargs)


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
    ``devices`` may also be a :class:`~partitioner.devices.Cluster` beyond this machine
    (``Cluster.preset("A100-80GB", nodes=4)``): ``"auto"`` then plans any mix of data,
    tensor and pipeline parallelism for it.
    """
    if plan is not None:
        from partitioner.apply import resolve_plan
        asked = {k: v for k, v in dict(strategy=strategy, chunks=chunks, checkpoint=checkpoint,
                                       balance=balance, split_points=split_points,
                                       memory_limit=memory_limit).items() if v is not None}
        return resolve_plan(model, plan, devices, asked=asked, example_inputs=example_inputs,
                            example_kwargs=example_kwargs)[1]
    options = _validate(devices, strategy, chunks, checkpoint, balance, split_points,
                        memory_limit, calibrate=calibrate)
    analysis = analyze(model, example_inputs, example_kwargs,
                       need_costs=options.balance is None and options.split_points is None)
    return _recorded(_plan(analysis, options), model, analysis, options, example_inputs)


def _recorded(plan: Plan, model: nn.Module, analysis: Analysis, options: _Options,
              example_inputs: tuple[Any, ...] | None) -> Plan:
    from partitioner.apply import record
    return record(plan, model, analysis, options, example_inputs, options.strategy)


def _validate(devices: Any, strategy: str, chunks: Any, checkpoint: str | None,
              balance: Sequence[int] | None, split_points: Sequence[str] | None,
              memory_limit: float | Sequence[float] | None, *, calibrate: bool = False,
              local: bool = False) -> _Options:
    remote = isinstance(devices, Cluster) and not devices.is_local and not local
    parsed = () if remote else tuple(parse_devices(devices))
    cluster = devices if isinstance(devices, Cluster) else None
    n_devices = cluster.size if cluster is not None else len(parsed)
    if strategy not in STRATEGIES:
        raise StrategyError(f"strategy={strategy!r} is unknown; pass one of {STRATEGIES}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < 1):
        raise ChunksError(f"chunks={chunks!r}; pass a positive int (micro-batches per batch)")
    if checkpoint is not None and checkpoint not in CHECKPOINT_MODES:
        raise StrategyError(f"checkpoint={checkpoint!r}; pass one of {CHECKPOINT_MODES}")
    if balance is not None and split_points is not None:
        raise BalanceError("pass balance= or split_points=, not both")
    if split_points is not None and len(split_points) != n_devices - 1:
        raise BalanceError(f"{len(split_points)} split points make {len(split_points) + 1} "
                           f"stages but there are {n_devices} devices; pass "
                           f"{n_devices - 1} split points")
    limits = None
    if memory_limit is not None:
        limits = (tuple(float(memory_limit) for _ in range(n_devices))
                  if isinstance(memory_limit, (int, float)) else tuple(map(float, memory_limit)))
        if len(limits) != n_devices or any(x <= 0 for x in limits):
            raise MemoryLimitError(f"memory_limit={memory_limit!r}; pass one positive number "
                                   f"or {n_devices} of them")
    return _Options(parsed, strategy, chunks, checkpoint,
                    tuple(balance) if balance is not None else None,
                    tuple(split_points) if split_points is not None else None, limits,
                    cluster, calibrate)


def analyze(model: nn.Module, example_inputs: tuple[Any, ...] | None,
            example_kwargs: dict[str, Any] | None = None, *, need_costs: bool = True,
            regroup: Callable[[fx.GraphModule, tuple[Layer, ...]], tuple[Layer, ...]] | None
            = None) -> Analysis:
    """Capture ``model`` and run the analysis passes (costs only with example inputs).

    ``regroup``, if given, may join layers once shapes are known and before they are costed
    (tensor parallelism keeps Megatron regions inside one layer).

    Raises:
        ExampleInputsError: when costs are needed and ``example_inputs`` is missing.
    """
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise ExampleInputsError(f"example_inputs must be a tuple of positional inputs, got "
                                 f"{type(example_inputs).__name__}; pass example_inputs=(x,)")
    if need_costs and example_inputs is None:
        raise ExampleInputsError("planning needs example_inputs to cost the layers; pass "
                                 "example_inputs=(x,) with one batch, or fix the split with "
                                 "balance= or split_points=")
    captured = capture(model, tuple(example_inputs) if example_inputs is not None else None,
                       example_kwargs)
    gm = captured.graph_module
    eliminate_dead_code(gm)
    assign_layer_paths(gm, model, {n: module_paths(n) for n in gm.graph.nodes})
    layers = group_layers(gm).layers
    costs = bounds = workload = values = None
    if example_inputs is not None:
        values = captured.placeholder_values(tuple(example_inputs), dict(example_kwargs or {}))
        propagate_shapes(gm, values)
        annotate_cost(gm)
        if regroup is not None:
            layers = regroup(gm, layers)
        workload = workload_from_graph(gm, layers, batch_size(values) or 1,
                                       type(model).__name__)
        costs = list(workload.layers)
        bounds = boundary_bytes(gm, layers)
    return Analysis(captured, layers, costs, bounds, model.training, workload,
                    list(values) if values is not None else None)


def _plan(analysis: Analysis, options: _Options) -> Plan:
    names = [layer.name for layer in analysis.layers]
    n_stages = options.cluster.size if options.cluster is not None else len(options.devices)
    if n_stages > len(names) and options.devices:
        raise StageCountError(f"{n_stages} devices but the model has only {len(names)} layers "
                              f"({names[:8]}{' ...' if len(names) > 8 else ''}); pass at most "
                              f"{len(names)} devices")
    if options.balance is not None:
        cuts: tuple[int, ...] | None = boundaries_from_balance(options.balance, len(names),
                                                               n_stages)
        strategy = "balance"
    elif options.split_points is not None:
        cuts = boundaries_from_split_points(options.split_points, names)
        strategy = "split_points"
    else:
        cuts, strategy = None, "pipeline"
    if analysis.workload is None:
        assert cuts is not None
        return _make_plan(analysis, options, strategy, cuts)
    return _costed_plan(analysis, options, strategy, cuts, names)


def _costed_plan(analysis: Analysis, options: _Options, strategy: str,
                 cuts: tuple[int, ...] | None, names: list[str]) -> Plan:
    from partitioner.planner import auto_plan, pipeline_plan
    cluster = options.cluster or Cluster.local_devices(list(options.devices))
    workload = analysis.workload
    assert workload is not None
    if options.calibrate:
        from partitioner.calibrate import calibrate_layers
        layers = calibrate_layers(analysis.captured.graph_module, analysis.layers,
                                  workload.layers, analysis.inputs or [], cluster.spec(0),
                                  workload.batch)
        workload = replace(workload, layers=tuple(layers))
    capacity = min(options.memory_limit) if options.memory_limit else None
    method = analysis.captured.method
    if cuts is None and options.strategy == "auto":
        plan = auto_plan(workload, names, cluster, chunks=options.chunks,
                         checkpoint=options.checkpoint, capacity=capacity, capture=method)
    else:
        plan = pipeline_plan(workload, names, cluster, strategy=strategy,
                             chunks=options.chunks or 1,
                             checkpoint=options.checkpoint or "except_last", boundaries=cuts,
                             capacity=capacity, capture=method)
    return _check_host_memory(plan, cluster)


def _check_host_memory(plan: Plan, cluster: Cluster) -> Plan:
    """Note (and warn) when stages on ``"cpu"`` devices need more than the machine has.

    Each ``"cpu"`` device may use all of the machine's memory (``memory_limit=`` lowers
    that), but its stages share it: a plan whose stages together need more would run out
    of memory here, though it is a valid plan for a machine per stage.
    """
    on_host = [s for s in plan.stages
               if str(s.device).startswith("cpu") and s.predicted_memory is not None]
    if len(on_host) < 2 or not cluster.is_local:
        return plan
    total = sum(int(s.predicted_memory or 0) for s in on_host)
    machine = cluster.spec(0).memory_bytes
    if total <= machine:
        return plan
    note = (f"the {len(on_host)} 'cpu' stages share this machine's {machine / 2**30:.1f} GiB "
            f"but need {total / 2**30:.1f} GiB together: this plan runs out of memory here "
            f"(pass memory_limit={int(machine // len(on_host))} to plan within the machine)")
    warnings.warn(note, UserWarning, stacklevel=4)
    return replace(plan, notes=(*plan.notes, note))


def _make_plan(analysis: Analysis, options: _Options, strategy: str,
               cuts: Sequence[int]) -> Plan:
    """A plan without predictions (the split is fixed and no example inputs were given)."""
    names = [layer.name for layer in analysis.layers]
    stages = [Stage(j, str(device), tuple(names[cuts[j]:cuts[j + 1]]))
              for j, device in enumerate(options.devices)]
    return Plan(strategy, tuple(str(d) for d in options.devices), tuple(stages),
                options.chunks or 1, options.checkpoint or "except_last", "gpipe",
                analysis.captured.method)


def _build(model: nn.Module, analysis: Analysis, plan: Plan, options: _Options,
           example_inputs: tuple[Any, ...] | None,
           example_kwargs: dict[str, Any] | None) -> PartitionedModule:
    cache = {analysis.training: _local_stage_graphs(analysis, plan)}
    devices = list(options.devices)

    def stage_factory(training: bool) -> list[fx.GraphModule]:
        if training not in cache:
            fresh = _recapture(model, analysis, training, example_inputs, example_kwargs)
            cache[training] = _local_stage_graphs(fresh, plan)
        return cache[training]

    captured = analysis.captured
    pm = PartitionedModule(model, plan, stage_factory, devices, plan.chunks, plan.checkpoint,
                           bind=captured.placeholder_values, restructure=captured.restructure)
    # What partitioner.viz draws: the captured graph, its shapes and layers.
    pm.analysis = analysis  # type: ignore[assignment]
    return pm


def _local_stage_graphs(analysis: Analysis, plan: Plan) -> list[fx.GraphModule]:
    """Stage graphs for the one-process runtime: Linear weight gradients added in place
    (``passes/fuse_weight_grads.py``; small micro-batches make the separate gradient tensor
    and its accumulation a large share of a Linear's backward)."""
    graphs = build_stage_graphs(analysis, plan)
    for graph in graphs:
        fuse_weight_grads(graph)
    return graphs


def _recapture(model: nn.Module, analysis: Analysis, training: bool,
               example_inputs: tuple[Any, ...] | None,
               example_kwargs: dict[str, Any] | None) -> Analysis:
    """The same layers captured in the other train/eval mode (export bakes the mode in)."""
    if analysis.captured.method == "fx":
        return analysis
    previous = model.training
    model.train(training)
    try:
        fresh = analyze(model, example_inputs, example_kwargs, need_costs=False)
    finally:
        model.train(previous)
    if [layer.name for layer in fresh.layers] != [layer.name for layer in analysis.layers]:
        raise PartitionError(f"capturing {type(model).__name__} in "
                             f"{'train' if training else 'eval'} mode gave other layers; "
                             "partition the model again in the mode you will run it in")
    return fresh


def build_stage_graphs(analysis: Analysis, plan: Plan) -> list[fx.GraphModule]:
    """One graph per stage of ``plan``, rewritten for the runtime and moved to its device."""
    layer_stage = {name: stage.index for stage in plan.stages for name in stage.layers}
    gm = analysis.captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_of = {nodes[name]: layer_stage[layer.name]
                for layer in analysis.layers for name in layer.nodes}
    split = split_stages(gm, stage_of, len(plan.stages))
    graphs = [stage.graph_module for stage in split.stages]
    _check_tied_parameters(graphs, plan.devices)
    for gm_j, device in zip(graphs, plan.devices):
        route_dropout(gm_j)
        protect_inputs(gm_j)
        gm_j.to(torch.device(device))
    return graphs


def _check_tied_parameters(graphs: list[fx.GraphModule], devices: Sequence[str]) -> None:
    owner: dict[int, int] = {}
    for j, gm in enumerate(graphs):
        for tensor in list(gm.parameters()) + list(gm.buffers()):
            first = owner.setdefault(id(tensor), j)
            if devices[first] != devices[j]:
                raise PartitionError(
                    f"a parameter of shape {tuple(tensor.shape)} is used by stage {first} on "
                    f"{devices[first]} and stage {j} on {devices[j]}; tied weights across "
                    "devices are not supported: keep their layers on one device with "
                    "split_points=")
