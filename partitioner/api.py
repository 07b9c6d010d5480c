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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.capture import Captured, capture, module_paths
from partitioner.cost import LayerCost, boundary_bytes, build_problem, layer_costs
from partitioner.devices import parse_devices, spec_for
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
from partitioner.solver import InfeasibleError, PartitionSolution, evaluate, solve
from passes.annotate_cost import annotate_cost
from passes.dead_code import eliminate_dead_code
from passes.flatten_sequential import assign_layer_paths
from passes.group_layers import Layer, group_layers
from passes.private_rng import route_dropout
from passes.protect_inputs import protect_inputs
from passes.shape_prop import propagate_shapes
from passes.split_stages import split_stages
from runtime.local import CHECKPOINT_MODES
from runtime.module import PartitionedModule

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


@dataclass(frozen=True)
class _Options:
    devices: tuple[torch.device, ...]
    strategy: str
    chunks: int
    checkpoint: str
    balance: tuple[int, ...] | None
    split_points: tuple[str, ...] | None
    memory_limit: tuple[float, ...] | None


def partition(model: nn.Module, devices: Any, strategy: str = "auto", *,
              example_inputs: tuple[Any, ...] | None = None,
              example_kwargs: dict[str, Any] | None = None, chunks: int = 1,
              checkpoint: str = "except_last", balance: Sequence[int] | None = None,
              split_points: Sequence[str] | None = None,
              memory_limit: float | Sequence[float] | None = None) -> PartitionedModule:
    """Partition ``model`` into pipeline stages over ``devices``.

    Args:
        model: any ``nn.Module`` that ``torch.fx`` or ``torch.export`` can capture.
        devices: device strings, ``torch.device`` objects, or a count.
        strategy: ``"auto"`` or ``"pipeline"`` (auto picks among pipeline plans for now).
        example_inputs: one batch of positional inputs; needed to cost the layers (so always,
            unless ``balance`` or ``split_points`` fixes the split) and for export capture.
        example_kwargs: keyword inputs of that batch.
        chunks: micro-batches per mini-batch (split along dim 0).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's meaning).
        balance: layers per stage, torchgpipe style; one entry per device.
        split_points: module names at which a new stage begins.
        memory_limit: bytes per device (one number for all, or one per device); defaults to
            each device's memory.

    Returns:
        A :class:`runtime.module.PartitionedModule`; its ``.plan`` says what was done.

    Raises:
        PartitionError: a subclass naming the offending value and a fix.
    """
    options = _validate(devices, strategy, chunks, checkpoint, balance, split_points,
                        memory_limit)
    analysis = analyze(model, example_inputs, example_kwargs,
                       need_costs=options.balance is None and options.split_points is None)
    plan = _plan(analysis, options)
    return _build(model, analysis, plan, options, example_inputs, example_kwargs)


def make_plan(model: nn.Module, devices: Any, strategy: str = "auto", *,
              example_inputs: tuple[Any, ...] | None = None,
              example_kwargs: dict[str, Any] | None = None, chunks: int = 1,
              checkpoint: str = "except_last", balance: Sequence[int] | None = None,
              split_points: Sequence[str] | None = None,
              memory_limit: float | Sequence[float] | None = None) -> Plan:
    """Plan like :func:`partition` without building the runtime (works on meta models)."""
    options = _validate(devices, strategy, chunks, checkpoint, balance, split_points,
                        memory_limit)
    analysis = analyze(model, example_inputs, example_kwargs,
                       need_costs=options.balance is None and options.split_points is None)
    return _plan(analysis, options)


def _validate(devices: Any, strategy: str, chunks: Any, checkpoint: str,
              balance: Sequence[int] | None, split_points: Sequence[str] | None,
              memory_limit: float | Sequence[float] | None) -> _Options:
    parsed = tuple(parse_devices(devices))
    if strategy not in STRATEGIES:
        raise StrategyError(f"strategy={strategy!r} is unknown; pass one of {STRATEGIES}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ChunksError(f"chunks={chunks!r}; pass a positive int (micro-batches per batch)")
    if checkpoint not in CHECKPOINT_MODES:
        raise StrategyError(f"checkpoint={checkpoint!r}; pass one of {CHECKPOINT_MODES}")
    if balance is not None and split_points is not None:
        raise BalanceError("pass balance= or split_points=, not both")
    if split_points is not None and len(split_points) != len(parsed) - 1:
        raise BalanceError(f"{len(split_points)} split points make {len(split_points) + 1} "
                           f"stages but there are {len(parsed)} devices; pass "
                           f"{len(parsed) - 1} split points")
    limits = None
    if memory_limit is not None:
        limits = (tuple(float(memory_limit) for _ in parsed)
                  if isinstance(memory_limit, (int, float)) else tuple(map(float, memory_limit)))
        if len(limits) != len(parsed) or any(x <= 0 for x in limits):
            raise MemoryLimitError(f"memory_limit={memory_limit!r}; pass one positive number "
                                   f"or {len(parsed)} of them")
    return _Options(parsed, strategy, chunks, checkpoint,
                    tuple(balance) if balance is not None else None,
                    tuple(split_points) if split_points is not None else None, limits)


def analyze(model: nn.Module, example_inputs: tuple[Any, ...] | None,
            example_kwargs: dict[str, Any] | None = None, *, need_costs: bool = True) -> Analysis:
    """Capture ``model`` and run the analysis passes (costs only with example inputs).

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
    costs = bounds = None
    if example_inputs is not None:
        values = captured.placeholder_values(tuple(example_inputs), dict(example_kwargs or {}))
        propagate_shapes(gm, values)
        annotate_cost(gm)
        costs = layer_costs(gm, layers)
        bounds = boundary_bytes(gm, layers)
    return Analysis(captured, layers, costs, bounds, model.training)


def _plan(analysis: Analysis, options: _Options) -> Plan:
    names = [layer.name for layer in analysis.layers]
    n_stages = len(options.devices)
    if n_stages > len(names):
        raise StageCountError(f"{n_stages} devices but the model has only {len(names)} layers "
                              f"({names[:8]}{' ...' if len(names) > 8 else ''}); pass at most "
                              f"{len(names)} devices")
    if options.balance is not None:
        cuts = boundaries_from_balance(options.balance, len(names), n_stages)
        strategy = "balance"
    elif options.split_points is not None:
        cuts = boundaries_from_split_points(options.split_points, names)
        strategy = "split_points"
    else:
        cuts, strategy = None, "pipeline"
    solution = _costed(analysis, options, cuts)
    if solution is not None:
        cuts = solution.boundaries
    assert cuts is not None
    return _make_plan(analysis, options, strategy, cuts, solution)


def _costed(analysis: Analysis, options: _Options,
            cuts: tuple[int, ...] | None) -> PartitionSolution | None:
    if analysis.costs is None or analysis.boundaries is None:
        return None
    specs = [spec_for(d) for d in options.devices]
    problem = build_problem(analysis.costs, analysis.boundaries, options.devices, specs,
                            options.chunks, options.checkpoint != "never", options.memory_limit)
    if cuts is not None:
        return evaluate(problem, cuts)
    try:
        return solve(problem)
    except InfeasibleError as error:
        raise MemoryLimitError(str(error)) from error


def _make_plan(analysis: Analysis, options: _Options, strategy: str, cuts: Sequence[int],
               solution: PartitionSolution | None) -> Plan:
    names = [layer.name for layer in analysis.layers]
    stages = []
    for j, device in enumerate(options.devices):
        a, b = cuts[j], cuts[j + 1]
        params = (sum(c.param_bytes for c in analysis.costs[a:b])
                  if analysis.costs is not None else None)
        stages.append(Stage(j, str(device), tuple(names[a:b]),
                            solution.stage_times[j] if solution else None,
                            int(solution.stage_memory[j]) if solution else None, params))
    m, p = options.chunks, len(stages)
    step = solution.bottleneck * (m + p - 1) if solution else None
    return Plan(strategy, tuple(str(d) for d in options.devices), tuple(stages), m,
                options.checkpoint, "gpipe", analysis.captured.method, step,
                (p - 1) / (m + p - 1) if solution else None)


def _build(model: nn.Module, analysis: Analysis, plan: Plan, options: _Options,
           example_inputs: tuple[Any, ...] | None,
           example_kwargs: dict[str, Any] | None) -> PartitionedModule:
    cache = {analysis.training: build_stage_graphs(analysis, plan)}
    devices = list(options.devices)

    def stage_factory(training: bool) -> list[fx.GraphModule]:
        if training not in cache:
            fresh = _recapture(model, analysis, training, example_inputs, example_kwargs)
            cache[training] = build_stage_graphs(fresh, plan)
        return cache[training]

    captured = analysis.captured
    return PartitionedModule(model, plan, stage_factory, devices, plan.chunks, plan.checkpoint,
                             bind=captured.placeholder_values, restructure=captured.restructure)


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
