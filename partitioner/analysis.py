"""From a model to what planning and the runtimes need: capture, analysis passes, stage graphs.

:func:`analyze` captures the model (``partitioner.capture``) and runs the analysis passes:
dead code, layer labels, layer grouping and, with example inputs, shapes and costs.
:func:`build_stage_graphs` cuts the captured graph along a plan's stages and prepares each
stage for a runtime. :func:`recapture` captures the same layers in the other train/eval mode
(``torch.export`` bakes the mode into the graph).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> analysis = analyze(model, (torch.randn(4, 8),))
    >>> [layer.name for layer in analysis.layers]
    ['0', '1', '2']
    >>> analysis.workload.batch
    4
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from partitioner.capture import Captured, capture, example_error, module_paths
from partitioner.cost.cost import LayerCost, Workload, boundary_bytes, workload_from_graph
from partitioner.cost.llama_model import LlamaModel, recognise_llama
from partitioner.errors import ChunksError, ExampleInputsError, PartitionError, PassError
from partitioner.passes import python_state
from partitioner.passes.annotate_cost import annotate_cost
from partitioner.passes.dead_code import eliminate_dead_code
from partitioner.passes.flatten_sequential import assign_layer_paths
from partitioner.passes.group_layers import Layer, group_layers
from partitioner.passes.guard_inputs import guard_inputs
from partitioner.passes.place_graph import place_graph
from partitioner.passes.private_rng import route_dropout
from partitioner.passes.protect_inputs import protect_inputs
from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.split_stages import split_stages
from partitioner.plans.plan import Plan
from partitioner.runtime.device import model_device
from partitioner.runtime.materialize import MaterializerFactory, materialize_module
from partitioner.runtime.microbatch import MEAN, SUM, OutputHint, batch_size, scatter
from partitioner.runtime.sample_mixing import mixes_samples

__all__ = ["Analysis", "analyze", "regrouped", "merge_like", "recapture", "build_stage_graphs",
           "output_rows"]


@dataclass
class Analysis:
    """A captured model after the analysis passes.

    Attributes:
        captured: the capture (graph, method, how to bind call arguments).
        layers: the layers, in order: the units a stage boundary may fall between.
        costs: each layer's predicted cost (with example inputs).
        boundaries: bytes crossing each boundary between layers (with example inputs).
        training: the model's mode when it was captured.
        workload: the costed layers as the planner reads them (with example inputs).
        inputs: the graph's placeholder values for the example batch.
        llama: a transformers Llama model's shape (``partitioner.cost.llama_model``), from
            which the planner costs its training on clusters; else ``None``.
        mixing: how splitting the example batch changed the model's outputs
            (``partitioner.runtime.sample_mixing``); ``None`` if it did not, or was not
            tried (no example inputs, a meta-built model).
    """

    captured: Captured
    layers: tuple[Layer, ...]
    costs: list[LayerCost] | None
    boundaries: list[int] | None
    training: bool
    workload: Workload | None = None
    inputs: list[Any] | None = field(default=None, repr=False)
    llama: LlamaModel | None = None
    mixing: str | None = None

    @property
    def layer_names(self) -> list[str]:
        """The layers' names, in order."""
        return [layer.name for layer in self.layers]


def analyze(model: nn.Module, example_inputs: tuple[Any, ...] | None,
            example_kwargs: dict[str, Any] | None = None, *,
            need_costs: bool = True) -> Analysis:
    """Capture ``model`` and run the analysis passes (costs only with example inputs).

    Layers joined later (tensor parallelism keeps Megatron regions inside one layer) are
    costed again on the same capture by :func:`regrouped`.

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
    if example_inputs is not None and batch_size((tuple(example_inputs), example_kwargs)) == 0:
        raise ExampleInputsError("example_inputs hold an empty batch (dim 0 of the first "
                                 "tensor has size 0); pass one real batch, with at least as "
                                 "many samples as chunks")
    captured = capture(model, tuple(example_inputs) if example_inputs is not None else None,
                       example_kwargs)
    gm = captured.graph_module
    eliminate_dead_code(gm)
    assign_layer_paths(gm, model, {n: module_paths(n) for n in gm.graph.nodes})
    layers = group_layers(gm).layers
    values = None
    if example_inputs is not None:
        values = captured.placeholder_values(tuple(example_inputs), dict(example_kwargs or {}))
        _propagate_shapes(model, gm, values, tuple(example_inputs), dict(example_kwargs or {}))
        annotate_cost(gm)
    mixing = (_mixing(model, tuple(example_inputs), example_kwargs)
              if need_costs and example_inputs is not None else None)
    analysis = Analysis(captured, layers, None, None, model.training, None,
                        list(values) if values is not None else None,
                        recognise_llama(model, example_inputs), mixing)
    return regrouped(analysis, layers, type(model).__name__)


def regrouped(analysis: Analysis, layers: tuple[Layer, ...],
              name: str | None = None) -> Analysis:
    """``analysis`` with its layers replaced by ``layers`` (the same nodes, grouped
    otherwise) and costed again on the same capture: no second capture.

    Tensor parallelism merges layers so that no stage boundary cuts a column/row pair
    (``partitioner.planning.compile.split_layers``); the planner then splits the merged
    layers.
    """
    if analysis.inputs is None:
        return replace(analysis, layers=layers)
    gm = analysis.captured.graph_module
    values = analysis.inputs
    label = name or (analysis.workload.name if analysis.workload is not None else "model")
    workload = _mark_unsplittable(analysis.captured, values, workload_from_graph(
        gm, layers, batch_size(values) or 1, label), analysis.mixing)
    return replace(analysis, layers=layers, costs=list(workload.layers),
                   boundaries=boundary_bytes(gm, layers), workload=workload)


def _mark_unsplittable(captured: Captured, values: list[Any], workload: Workload,
                       mixing: str | None = None) -> Workload:
    """The workload, marked unsafe to micro-batch when the capture does not hold for halves
    of the example batch, ``forward`` updates a counter, or splitting the batch changed the
    model's outputs (``mixing``): the planner then keeps chunks=1 and one replica."""
    note = None
    batch = batch_size(values) or 1
    if mixing is not None:
        note = mixing
    elif captured.writes:
        note = f"forward updates buffer {captured.writes[0]}: micro-batches would repeat it"
    elif captured.rules is not None and batch > 1:
        rules = captured.rules
        found = [p for micro in scatter(list(values), 2) for p in rules.problems(micro)]
        note = f"the captured graph does not hold for micro-batches: {found[0]}" if found else None
        # Which splits into micro-batches (times replicas) the graph holds for.
        splits = tuple(k for k in range(1, min(batch, _MAX_SPLIT) + 1)
                       if not any(rules.problems(micro) for micro in scatter(list(values), k)))
        workload = replace(workload, splits=splits)
    if note is None:
        return workload
    return replace(workload, notes=(*workload.notes, note), microbatch_safe=False)


_MAX_SPLIT = 256
"""The most pieces a batch is checked for against the captured graph's guards."""


def _mixing(model: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any] | None) -> str | None:
    """``runtime.sample_mixing.mixes_samples``, the model's Python attributes put back after
    (its forwards may count calls or keep what they saw, as under capture)."""
    before = python_state.snapshot(model)
    try:
        return mixes_samples(model, args, kwargs)
    finally:
        python_state.restore(model, before)


def _propagate_shapes(model: nn.Module, gm: fx.GraphModule, values: list[Any],
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Shape propagation; when it fails because the model rejects the example inputs
    themselves, an :class:`ExampleInputsError` naming them (not a pass's failure)."""
    try:
        propagate_shapes(gm, values)
    except PassError as error:
        wrong = example_error(model, args, kwargs)
        if wrong is not None:
            raise wrong from error
        raise


def output_rows(analysis: Analysis) -> list[OutputHint] | None:
    """Per leaf of the captured graph's output, what joining micro-batches' and replicas'
    outputs needs to know (``partitioner.runtime.microbatch.join_rules``): the rows of dim 0
    per sample of the example batch, or for a tensor without a batch dimension (an
    auxiliary loss, a per-expert load) ``"sum"`` if a ``sum`` over the batch made it, else
    ``"mean"``; ``None`` where unknown (a non-tensor, no shapes). ``None`` without example
    inputs or with a batch of one, where every dim 0 would count as batched.

    A leaf whose dim 0 divides by the example batch by chance is caught by the runtime, as
    it does not scale with the micro-batches.
    """
    batch = batch_size(analysis.inputs) if analysis.inputs is not None else None
    if not batch or batch < 2:
        return None
    output = next(n for n in analysis.captured.graph_module.graph.nodes if n.op == "output")
    rows: list[OutputHint] = []
    for leaf in pytree.tree_leaves(output.args[0]):
        value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            rows.append(None)
        elif value.dim() > 0 and int(value.shape[0]) % batch == 0:
            rows.append(int(value.shape[0]) // batch)
        else:
            rows.append(SUM if _sums_over_batch(leaf) else MEAN)
    return rows


_SUMS = {torch.sum, torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList}


def _sums_over_batch(node: fx.Node) -> bool:
    """Whether ``node`` is a ``sum`` over dim 0 (all dims, or a list holding 0)."""
    if not (node.target in _SUMS or (node.op == "call_method" and node.target == "sum")):
        return False
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dims is None:
        return True
    return 0 in (dims if isinstance(dims, (list, tuple)) else [dims])


def recapture(model: nn.Module, analysis: Analysis, training: bool,
              example_inputs: tuple[Any, ...] | None, example_kwargs: dict[str, Any] | None,
              merged: Sequence[Sequence[str]] | None = None) -> Analysis:
    """The same layers captured in the other train/eval mode (export bakes the mode in).

    A ``torch.fx`` capture holds for both modes and is returned as it is. ``merged``: per
    layer of ``analysis``, the fresh capture's layer names it joins (tensor parallelism's
    merged layers, :func:`merge_like`).

    Raises:
        PartitionError: the other mode's capture gives other layers.
    """
    if analysis.captured.method == "fx":
        return analysis
    previous = model.training
    model.train(training)
    try:
        fresh = analyze(model, example_inputs, example_kwargs, need_costs=False)
    finally:
        model.train(previous)
    if merged is not None:
        fresh = regrouped(fresh, merge_like(fresh.layers, merged))
    if fresh.layer_names != analysis.layer_names:
        raise PartitionError(f"capturing {type(model).__name__} in "
                             f"{'train' if training else 'eval'} mode gave other layers; "
                             "partition the model again in the mode you will run it in")
    return fresh


def merge_like(layers: tuple[Layer, ...], names: Sequence[Sequence[str]]
               ) -> tuple[Layer, ...]:
    """``layers`` joined as ``names`` says (per merged layer, the layer names it holds).

    Raises:
        PartitionError: ``layers`` are not the layers ``names`` lists.
    """
    by_name = {layer.name: layer for layer in layers}
    if sorted(by_name) != sorted(n for group in names for n in group):
        raise PartitionError("capturing the model in the other train/eval mode gave other "
                             "layers; partition the model again in the mode you will run "
                             "it in")
    return tuple(Layer(group[0], by_name[group[0]].path,
                       tuple(n for name in group for n in by_name[name].nodes))
                 for group in names)


def build_stage_graphs(analysis: Analysis, plan: Plan,
                       materializer: MaterializerFactory | None = None
                       ) -> list[fx.GraphModule]:
    """One graph per stage of ``plan``, rewritten for the runtime and moved to its device.

    ``materializer`` (a meta-built model, ``partitioner.runtime.materialize``) builds each
    stage's tensors on its device instead (and puts them in the model and the captured
    graph, so that graphs cut again later share them)."""
    layer_stage = {name: stage.index for stage in plan.stages for name in stage.layers}
    gm = analysis.captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_of = {nodes[name]: layer_stage[layer.name]
                for layer in analysis.layers for name in layer.nodes}
    _check_microbatches(analysis, plan)
    split = split_stages(gm, stage_of, len(plan.stages))
    graphs = [stage.graph_module for stage in split.stages]
    # Virtual stage k runs on devices[k % P] (one stage per device unless interleaved).
    devices = [stage.device for stage in plan.stages]
    _check_tied_parameters(graphs, devices)
    if analysis.captured.rules is not None:
        # Every micro-batch passes stage 0 first: refuse sizes the capture does not hold for.
        guard_inputs(graphs[0], analysis.captured.rules)
    origin = model_device(gm)  # before the first stage moves the model's tensors
    for gm_j, device in zip(graphs, devices):
        route_dropout(gm_j)
        protect_inputs(gm_j)
        if materializer is not None and torch.device(device).type != "meta":
            made = materializer(torch.device(device))
            materialize_module(gm_j, made, everywhere=(made.model, gm))
        place_graph(gm_j, torch.device(device), origin)
    return graphs


def _check_microbatches(analysis: Analysis, plan: Plan) -> None:
    """Refuse a plan whose micro-batches the captured graph does not hold for.

    Warns (``UserWarning``) when ``plan.chunks`` splits the batch of a model whose outputs
    splitting changed (``Analysis.mixing``).

    Raises:
        ChunksError: the example batch split ``plan.chunks`` ways gives micro-batches outside
            what ``torch.export`` recorded, or ``forward`` updates a buffer (other than batch
            norm statistics) that micro-batches or checkpoint replays would update more often.
    """
    captured = analysis.captured
    if analysis.mixing is not None and plan.chunks > 1:
        # The user fixed it so: the search never splits such a model's batch. Batch norm's
        # per-micro-batch statistics are GPipe's, documented (README) and a plan note.
        warnings.warn(f"chunks={plan.chunks} splits each batch, but {analysis.mixing}: the "
                      "partitioned model computes other outputs and gradients than the "
                      "model; pass chunks=1 to keep them", UserWarning, stacklevel=4)
    counters = captured.writes
    replays = {"always": plan.chunks, "except_last": plan.chunks - 1}.get(plan.checkpoint, 0)
    if counters and (plan.chunks > 1 or replays):
        raise ChunksError(
            f"forward updates buffer {counters[0]} in place; with chunks={plan.chunks} and "
            f"checkpoint={plan.checkpoint!r} the pipeline would run that update "
            f"{plan.chunks + replays} times per call where the model runs it once: pass "
            "chunks=1 and checkpoint='never' (or 'except_last'), or update it outside forward")
    if captured.rules is None or analysis.inputs is None:
        return
    batch = batch_size(analysis.inputs)
    if batch is None or plan.chunks > batch:
        return
    for micro in scatter(list(analysis.inputs), plan.chunks):
        found = captured.rules.problems(micro)
        if found:
            raise ChunksError(f"chunks={plan.chunks} splits the example batch of {batch} into "
                              f"micro-batches the captured graph does not hold for: {found[0]}")


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
