"""Tensor parallelism from the public API: validate, capture, choose, plan, hand off.

``partition(model, devices, tensor_parallel=...)`` comes here (one process, every rank a
thread with its own device); :func:`parallelize` is the same for one rank of a
``torch.distributed`` process group. Both capture the model, resolve the rules and the
automatic choice into a shard plan (``partitioner.tp_rules``), and build the runtime module
from rank graphs (``passes.tensor_parallel``). :func:`shard_stage` gives one rank's graph of
one pipeline stage, for runtimes that place stages and ranks themselves.

Devices: ``tensor_parallel=n`` groups ``devices`` by ``n`` consecutive entries, one group
per pipeline stage (``devices=["cpu"] * 4, tensor_parallel=2``: two stages of two ranks);
a nested list says the same explicitly (``devices=[["cpu", "cpu"], ["cpu", "cpu"]]``). With
rules (``tensor_parallel={...}``) the degree is the length of each inner list, or of the
whole (flat) list: one stage.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    >>> x = torch.randn(4, 8)
    >>> tm = partition_tensor_parallel(model, ["cpu", "cpu"], 2, example_inputs=(x,))
    >>> torch.allclose(tm(x), model(x), atol=1e-6)
    True
    >>> tm.plan.mesh
    Mesh(dp=1, pp=1, tp=2)
    >>> sorted(tm.state_dict()) == sorted(model.state_dict())
    True
    >>> tm.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioner import api
from partitioner.devices import parse_devices
from partitioner.errors import DeviceError, ExampleInputsError
from partitioner.plan import Mesh, Plan, ShardSpec
from partitioner.tp_rules import ShardPlan, TensorParallelRules, resolve_shardings
from passes.group_layers import Layer
from passes.private_rng import route_dropout
from passes.tensor_parallel import merge_split_layers, shard_graph
from runtime.collectives import ProcessGroupCommunicator
from runtime.sharding import Sharding, TensorParallelError
from runtime.tp_distributed import DistributedTensorParallel
from runtime.tp_module import ShardStore, Source, TensorParallelModule
from runtime.tp_stage import TensorParallelStage

__all__ = ["partition_tensor_parallel", "plan_tensor_parallel", "TensorParallelSetup",
           "parallelize", "shard_stage", "stage_shardings", "device_groups"]

TensorParallelOption = int | Mapping[str, str]


def device_groups(devices: Any, tensor_parallel: TensorParallelOption
                  ) -> tuple[list[list[torch.device]], TensorParallelRules]:
    """Devices per stage (one per rank) and the rules, from ``devices=`` and
    ``tensor_parallel=`` (see the module docstring).

    Raises:
        DeviceError: if the devices do not split into groups of the degree.
        TensorParallelError: if ``tensor_parallel`` is neither an int >= 1 nor a mapping.
    """
    nested = isinstance(devices, (list, tuple)) and bool(devices) and all(
        isinstance(d, (list, tuple)) for d in devices)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, (int, Mapping)):
        raise TensorParallelError(
            f"tensor_parallel={tensor_parallel!r}; pass a degree (tensor_parallel=2) or rules "
            "({'blocks.*.mlp.fc1': 'colwise', 'blocks.*.mlp.fc2': 'rowwise'})")
    rules = (TensorParallelRules.parse(tensor_parallel)
             if isinstance(tensor_parallel, Mapping) else TensorParallelRules())
    if nested:
        groups = [parse_devices(list(group)) for group in devices]
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise DeviceError(f"devices={devices!r}: every stage needs the same number of "
                              f"tensor-parallel devices, got {[len(g) for g in groups]}")
        tp = sizes.pop()
        if isinstance(tensor_parallel, int) and tensor_parallel != tp:
            raise DeviceError(f"tensor_parallel={tensor_parallel} but each stage lists {tp} "
                              f"devices; list {tensor_parallel} per stage or pass "
                              f"tensor_parallel={tp}")
        return groups, rules
    flat = parse_devices(devices)
    tp = tensor_parallel if isinstance(tensor_parallel, int) else len(flat)
    if tp < 1:
        raise TensorParallelError(f"tensor_parallel={tensor_parallel}; pass a degree >= 1")
    if len(flat) % tp:
        raise DeviceError(f"{len(flat)} devices do not make groups of tensor_parallel={tp}; "
                          f"pass a multiple of {tp} devices (one group per pipeline stage)")
    return [flat[k:k + tp] for k in range(0, len(flat), tp)], rules


@dataclass(frozen=True)
class TensorParallelSetup:
    """What planning decided, before any runtime is built.

    Attributes:
        analysis: the captured model, its layers merged so no stage boundary cuts a
            Megatron region.
        plan: the plan (mesh, stages, shard specs of the split parameters).
        shard_plan: the sharding of every parameter (``partitioner.tp_rules``).
        groups: per stage, one device per tensor-parallel rank.
        layer_names: per merged layer, the original layer names it holds.
    """

    analysis: api.Analysis
    plan: Plan
    shard_plan: ShardPlan
    groups: list[list[torch.device]]
    layer_names: list[list[str]]


def plan_tensor_parallel(
        model: nn.Module, devices: Any, tensor_parallel: TensorParallelOption, *,
        strategy: str = "auto", example_inputs: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None, chunks: int | None = None,
        checkpoint: str | None = None, balance: Sequence[int] | None = None,
        split_points: Sequence[str] | None = None,
        memory_limit: float | Sequence[float] | None = None) -> TensorParallelSetup:
    """Capture, choose the shardings and plan the stages (``partition``'s first half).

    Runtimes that place stages and ranks themselves (one process per rank) build from the
    result with ``partitioner.api.build_stage_graphs`` and :func:`shard_stage`.

    Raises:
        ExampleInputsError: without ``example_inputs`` (shapes decide the splits).
        PartitionError: a subclass naming the offending value and a fix.
    """
    groups, rules = device_groups(devices, tensor_parallel)
    tp = len(groups[0])
    if example_inputs is None:
        raise ExampleInputsError("tensor parallelism needs example_inputs: the shapes decide "
                                 "what splits; pass example_inputs=(x,) with one batch")
    # The stages' split is planned as a pipeline of the groups (each group one stage).
    options = api._validate([g[0] for g in groups], "pipeline" if strategy == "auto"
                            else strategy, 1 if chunks is None else chunks,
                            checkpoint or "except_last", balance, split_points, memory_limit)
    found: dict[str, Any] = {}

    def regroup(gm: fx.GraphModule, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
        found["plan"] = resolve_shardings(gm, model, tp, rules)
        merged = merge_split_layers(gm, layers, found["plan"].choice.propagation)
        found["names"] = _merged_names(layers, merged)
        return merged

    analysis = api.analyze(model, example_inputs, example_kwargs, need_costs=False,
                           regroup=regroup)
    shard_plan: ShardPlan = found["plan"]
    plan = _record(api._plan(analysis, options), model, analysis, options, example_inputs,
                   shard_plan, groups)
    return TensorParallelSetup(analysis, plan, shard_plan, groups, found["names"])


def partition_tensor_parallel(
        model: nn.Module, devices: Any, tensor_parallel: TensorParallelOption, *,
        strategy: str = "auto", example_inputs: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None, chunks: int | None = None,
        checkpoint: str | None = None, balance: Sequence[int] | None = None,
        split_points: Sequence[str] | None = None,
        memory_limit: float | Sequence[float] | None = None) -> TensorParallelModule:
    """``partition()`` with tensor parallelism: pipeline stages of ``tp`` ranks each.

    Args: as :func:`partitioner.partition`; ``tensor_parallel`` is the degree or rules.
    ``strategy="auto"`` plans the pipeline of the device groups (each group one stage).

    Returns:
        A :class:`runtime.tp_module.TensorParallelModule`; ``.plan`` records the mesh and
        the shard spec of every split parameter.

    Raises:
        ExampleInputsError: without ``example_inputs`` (shapes decide the splits).
        PartitionError: a subclass naming the offending value and a fix.
    """
    setup = plan_tensor_parallel(model, devices, tensor_parallel, strategy=strategy,
                                 example_inputs=example_inputs, example_kwargs=example_kwargs,
                                 chunks=chunks, checkpoint=checkpoint, balance=balance,
                                 split_points=split_points, memory_limit=memory_limit)
    return _build(model, setup, example_inputs, example_kwargs)


def _merged_names(layers: tuple[Layer, ...], merged: tuple[Layer, ...]) -> list[list[str]]:
    """The original layer names inside each merged layer."""
    of_node = {n: layer.name for layer in layers for n in layer.nodes}
    return [list(dict.fromkeys(of_node[n] for n in layer.nodes)) for layer in merged]


def _record(plan: Plan, model: nn.Module, analysis: api.Analysis, options: Any,
            example_inputs: tuple[Any, ...] | None, shard_plan: ShardPlan,
            groups: list[list[torch.device]]) -> Plan:
    recorded = getattr(api, "_recorded", None)
    if recorded is not None:
        plan = recorded(plan, model, analysis, options, example_inputs)
    specs = {name: ShardSpec(int(s.dim or 0), s.kind) for name, s in shard_plan.split().items()}
    notes = [*shard_plan.notes(),
             *(f"stage {j}: tensor-parallel devices {[str(d) for d in g]}"
               for j, g in enumerate(groups))]
    return replace(plan, mesh=Mesh(1, len(groups), shard_plan.tp), shard_specs=specs,
                   notes=(*plan.notes, *notes))


def _build(model: nn.Module, setup: TensorParallelSetup, example_inputs: tuple[Any, ...] | None,
           example_kwargs: dict[str, Any] | None) -> TensorParallelModule:
    analysis, plan, shard_plan = setup.analysis, setup.plan, setup.shard_plan
    groups, names = setup.groups, setup.layer_names
    store = ShardStore(shard_plan.shardings)
    ids = _first_names(model)

    def stage_factory(training: bool) -> list[TensorParallelStage]:
        current = analysis
        if training != analysis.training and analysis.captured.method != "fx":
            current = _recapture(model, training, names, example_inputs, example_kwargs)
        stages = []
        for j, gm in enumerate(api.build_stage_graphs(current, plan)):
            shardings = _attr_shardings(gm, ids, shard_plan.shardings)
            ranks = [shard_graph(gm, shardings, r, check=r == 0,
                                 make_tensor=store.factory(r, groups[j][r], ids)).graph_module
                     for r in range(len(groups[j]))]
            stages.append(TensorParallelStage(ranks, groups[j]))
        return stages

    stages = stage_factory(analysis.training)
    sources, unused = _sources(model, store, stages)
    captured = analysis.captured
    return TensorParallelModule(plan, stages, analysis.training, stage_factory,
                                shard_plan.shardings, sources, unused, plan.chunks,
                                plan.checkpoint, bind=captured.placeholder_values,
                                restructure=captured.restructure)


def _recapture(model: nn.Module, training: bool, names: list[list[str]],
               example_inputs: tuple[Any, ...] | None,
               example_kwargs: dict[str, Any] | None) -> api.Analysis:
    """The model captured in the other train/eval mode, its layers merged the same way."""
    def regroup(gm: fx.GraphModule, layers: tuple[Layer, ...]) -> tuple[Layer, ...]:
        by_name = {layer.name: layer for layer in layers}
        if sorted(by_name) != sorted(n for group in names for n in group):
            raise TensorParallelError(
                f"capturing {type(model).__name__} in {'train' if training else 'eval'} mode "
                "gave other layers; partition the model again in the mode you will run it in")
        return tuple(Layer(group[0], by_name[group[0]].path,
                           tuple(n for name in group for n in by_name[name].nodes))
                     for group in names)
    previous = model.training
    model.train(training)
    try:
        return api.analyze(model, example_inputs, example_kwargs, need_costs=False,
                           regroup=regroup)
    finally:
        model.train(previous)


def _first_names(model: nn.Module) -> dict[int, str]:
    """The first state-dict name of every tensor of ``model``, by tensor id."""
    names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def _attr_shardings(gm: fx.GraphModule, ids: dict[int, str],
                    shardings: dict[str, Sharding]) -> dict[str, Sharding]:
    """The shardings by ``gm``'s own attribute paths (stage graphs keep the model's)."""
    out = {}
    for path, tensor in [*gm.named_parameters(remove_duplicate=False),
                         *gm.named_buffers(remove_duplicate=False)]:
        name = ids.get(id(tensor))
        if name is not None and name in shardings and shardings[name].is_split:
            out[path] = shardings[name]
    return out


def _sources(model: nn.Module, store: ShardStore, stages: list[TensorParallelStage]
             ) -> tuple[dict[str, Source], dict[str, torch.Tensor]]:
    """Where each original state-dict entry lives (stage, path in rank 0's graph)."""
    where: dict[int, Source] = {}
    for j, stage in enumerate(stages):
        rank0 = stage.ranks[0]
        for path, tensor in [*rank0.named_parameters(remove_duplicate=False),
                             *rank0.named_buffers(remove_duplicate=False)]:
            where.setdefault(id(tensor), (j, path))
    sources: dict[str, Source] = {}
    unused: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        made = store.made(tensor, 0)
        if made is not None and id(made) in where:
            sources[key] = where[id(made)]
        else:
            unused[key] = tensor
    return sources, unused


def parallelize(model: nn.Module, group: Any = None, *,
                tensor_parallel: Mapping[str, str] | None = None,
                example_inputs: tuple[Any, ...] | None = None,
                example_kwargs: dict[str, Any] | None = None,
                device: torch.device | str | None = None) -> DistributedTensorParallel:
    """This process's rank of ``model`` split over the process group ``group``.

    Call it on every rank of the group with the same model (same initial weights) and
    example inputs; the degree is the group's size.

    Args:
        model: the model (each rank keeps only its slices in the result).
        group: the tensor-parallel process group (default: the whole world).
        tensor_parallel: rules overriding the automatic choice.
        example_inputs: one batch (the shapes decide the splits).
        example_kwargs: its keyword inputs.
        device: where the rank's tensors live (default: CPU, or the current CUDA device
            under NCCL).

    Returns:
        A :class:`runtime.tp_distributed.DistributedTensorParallel` (``.plan`` is the
        :class:`~partitioner.tp_rules.ShardPlan`).

    Raises:
        ExampleInputsError: without ``example_inputs``.
        PartitionError: a subclass naming the offending value and a fix.
    """
    if not dist.is_initialized():
        raise TensorParallelError("parallelize needs torch.distributed initialized; call "
                                  "torch.distributed.init_process_group first (or use "
                                  "partition(..., tensor_parallel=n) in one process)")
    if example_inputs is None:
        raise ExampleInputsError("tensor parallelism needs example_inputs: the shapes decide "
                                 "what splits; pass example_inputs=(x,) with one batch")
    comm = ProcessGroupCommunicator(group)
    target = torch.device(device) if device is not None else _default_device(group)
    rules = TensorParallelRules.parse(tensor_parallel)
    analysis = api.analyze(model, example_inputs, example_kwargs, need_costs=False)
    shard_plan = resolve_shardings(analysis.captured.graph_module, model, comm.size, rules)
    store = ShardStore(shard_plan.shardings)
    ids = _first_names(model)

    def graph_factory(training: bool) -> fx.GraphModule:
        current = analysis
        if training != analysis.training and analysis.captured.method != "fx":
            previous = model.training
            model.train(training)
            try:
                current = api.analyze(model, example_inputs, example_kwargs, need_costs=False)
            finally:
                model.train(previous)
        gm = current.captured.graph_module
        route_dropout(gm)
        shardings = _attr_shardings(gm, ids, shard_plan.shardings)
        out = shard_graph(gm, shardings, comm.rank,
                          make_tensor=store.factory(comm.rank, target, ids)).graph_module
        return out.train(training)

    first = graph_factory(model.training)
    where = {id(t): path for path, t in [*first.named_parameters(remove_duplicate=False),
                                         *first.named_buffers(remove_duplicate=False)]}
    sources: dict[str, str] = {}
    unused: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        made = store.made(tensor, comm.rank)
        if made is not None and id(made) in where:
            sources[key] = where[id(made)]
        else:
            unused[key] = tensor
    built = {model.training: first}

    def factory(training: bool) -> fx.GraphModule:
        return built.pop(training) if training in built else graph_factory(training)

    captured = analysis.captured
    module = DistributedTensorParallel(factory, comm, shard_plan.shardings, sources, unused,
                                       bind=captured.placeholder_values,
                                       restructure=captured.restructure, plan=shard_plan)
    return module.train(model.training)


def _default_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_stage(stage: fx.GraphModule, model: nn.Module, shard_plan: ShardPlan, rank: int,
                device: torch.device | str = "cpu") -> fx.GraphModule:
    """Rank ``rank``'s graph of one pipeline stage (for runtimes placing stages themselves).

    Args:
        stage: a stage graph of ``model`` (``partitioner.api.build_stage_graphs``), whose
            boundaries carry whole values (merge layers with ``merge_split_layers``).
        model: the model the stage graph was cut from (names its tensors).
        shard_plan: from :func:`partitioner.tp_rules.resolve_shardings`.
        rank: the tensor-parallel rank.
        device: where the rank's tensors go.

    Returns:
        The rank's graph; set its ``_tp_comm`` attribute to the rank's communicator
        (``runtime.collectives.ProcessGroupCommunicator(tp_group)``).
    """
    ids = _first_names(model)
    store = ShardStore(shard_plan.shardings)
    shardings = _attr_shardings(stage, ids, shard_plan.shardings)
    return shard_graph(stage, shardings, rank, make_tensor=store.factory(
        rank, torch.device(device), ids)).graph_module


def stage_shardings(stage: fx.GraphModule, model: nn.Module, shard_plan: ShardPlan
                    ) -> dict[str, Sharding]:
    """How each split tensor of an (unsplit) stage graph is split, by the stage's own
    state-dict keys: what a rank running :func:`shard_stage`'s graph holds a slice of."""
    return _attr_shardings(stage, _first_names(model), shard_plan.shardings)
