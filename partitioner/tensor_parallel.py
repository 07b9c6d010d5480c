"""Tensor parallelism from the public API: validate, capture, choose, plan, hand off.

``partition(model, devices, tensor_parallel=...)`` comes here (one process, every rank a
thread with its own device); :func:`parallelize` is the same for one rank of a
``torch.distributed`` process group. Both capture the model, resolve the rules and the
automatic choice into a shard plan (``partitioner.planning.tp_rules``), and build the runtime module
from rank graphs (``partitioner.passes.tensor_parallel.shard_graph``). :func:`shard_stage` gives
one rank's graph of
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

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioner.analysis import Analysis, analyze, recapture
from partitioner.build import (
    TensorParallelSetup,
    attr_shardings,
    build_tensor_parallel,
    first_names,
)
from partitioner.cost.devices import parse_devices
from partitioner.cost.sequence_cost import sequence_parallel_workload
from partitioner.errors import DeviceError, ExampleInputsError, MemoryLimitError, ScheduleError
from partitioner.passes.place_graph import place_graph
from partitioner.passes.private_rng import route_dropout, route_module_randomness
from partitioner.passes.tensor_parallel.sequence_parallel import (
    sequence_parallel as apply_sequence_parallel,
)
from partitioner.passes.tensor_parallel.shard_graph import shard_graph
from partitioner.planning.compile import split_layers, tensor_parallel_record
from partitioner.planning.planner import plan_request, tensor_parallel_plan
from partitioner.planning.tp_rules import ShardPlan, TensorParallelRules, resolve_shardings
from partitioner.request import PlanRequest
from partitioner.runtime import device as accelerators
from partitioner.runtime.checkpointing import EXCEPT_LAST
from partitioner.runtime.tensor_parallel.collectives import ProcessGroupCommunicator
from partitioner.runtime.tensor_parallel.module import ShardStore, TensorParallelModule
from partitioner.runtime.tensor_parallel.multiprocess import DistributedTensorParallel
from partitioner.runtime.tensor_parallel.sharding import Sharding, TensorParallelError

__all__ = ["partition_tensor_parallel", "plan_tensor_parallel", "plan_groups",
           "TensorParallelSetup", "parallelize", "shard_stage", "stage_shardings",
           "device_groups", "stage_request"]

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


def plan_tensor_parallel(model: nn.Module, devices: Any, tensor_parallel: TensorParallelOption,
                         request: PlanRequest | None = None, *,
                         sequence_parallel: bool = False, **fields: Any
                         ) -> TensorParallelSetup:
    """Capture, choose the shardings and plan the stages (``partition``'s first half).

    Args:
        model: the model.
        devices: the devices, grouped by ``tensor_parallel`` (see the module docstring).
        tensor_parallel: the degree, or rules.
        request: the planning options (``partitioner.request.PlanRequest``; its devices
            are replaced by each group's first). ``fields`` are the same options as
            ``PlanRequest.make``'s keywords (``strategy=``, ``example_inputs=``,
            ``chunks=``, ...), for a caller without a request; not both. Besides them,
            ``sequence_parallel=True`` costs the split layers as sequence parallelism runs
            them (:func:`plan_groups`).

    ``strategy="auto"`` searches the micro-batches, checkpoint mode and stage split for the
    groups (``partitioner.planning.planner.tensor_parallel_plan``); ``"pipeline"`` plans
    GPipe with ``chunks`` (default 1) and ``checkpoint`` (default ``"except_last"``).

    Runtimes that place stages and ranks themselves (one process per rank) build from the
    result with ``partitioner.analysis.build_stage_graphs`` and :func:`shard_stage`.

    Raises:
        ExampleInputsError: without ``example_inputs`` (shapes decide the splits).
        PartitionError: a subclass naming the offending value and a fix.
    """
    groups, rules = device_groups(devices, tensor_parallel)
    stages = stage_request(groups, request, fields)
    if stages.example_inputs is None:
        raise ExampleInputsError("tensor parallelism needs example_inputs: the shapes decide "
                                 "what splits; pass example_inputs=(x,) with one batch")
    # The stages' split is planned as a pipeline of the groups (each group one stage).
    search = stages.strategy == "auto" and not stages.fixes_split
    if not search:
        stages = stages.with_changes(chunks=stages.chunks or 1,
                                     checkpoint=stages.checkpoint or EXCEPT_LAST)
    return plan_groups(model, groups, rules, stages, search=search,
                       sequence_parallel=sequence_parallel)


def stage_request(groups: Sequence[Sequence[torch.device]], request: PlanRequest | None,
                  fields: Mapping[str, Any]) -> PlanRequest:
    """The request for the pipeline of ``groups``: one device per stage (each group's
    first), from ``request`` or from ``PlanRequest.make``'s keywords ``fields``.

    Raises:
        TypeError: both a request and keywords.
        MemoryLimitError: per-device limits that are neither one number nor one per stage.
        ScheduleError: virtual stages (the tensor-parallel pipeline runs one chunk a stage).
    """
    heads = tuple(g[0] for g in groups)
    if request is None:
        request = PlanRequest.make(heads, **fields)
    elif fields:
        raise TypeError(f"pass request= or its fields ({', '.join(sorted(fields))}), not both")
    limit = request.memory_limit
    if limit is not None and len(limit) not in (1, len(heads)):
        raise MemoryLimitError(f"memory_limit has {len(limit)} entries for {len(heads)} "
                               "tensor-parallel stages; pass one number, or one per stage")
    if request.virtual_stages not in (None, 1):
        raise ScheduleError(f"virtual_stages={request.virtual_stages} with tensor "
                            "parallelism: the tensor-parallel pipeline runs one model chunk "
                            "per stage; omit virtual_stages= or tensor_parallel=")
    return request.with_changes(devices=heads, memory_limit=None if limit is None else
                                (min(limit),) * len(heads))


def plan_groups(model: nn.Module, groups: list[list[torch.device]],
                rules: TensorParallelRules, request: PlanRequest, *,
                search: bool = False, analysis: Analysis | None = None,
                sequence_parallel: bool = False) -> TensorParallelSetup:
    """:func:`plan_tensor_parallel` for device groups and a request already validated.

    Args:
        model: the model.
        groups: per pipeline stage, one device per tensor-parallel rank.
        rules: rules overriding the automatic choice of splits.
        request: the planning options, one device per stage (``groups``' first ones).
        search: search micro-batches, checkpoint mode and schedule for the groups
            (``strategy="auto"``) instead of planning ``request``'s pipeline.
        analysis: the model already captured from ``request``'s example inputs (default:
            captured here).
        sequence_parallel: cost the split layers as sequence parallelism runs them
            (``partitioner.cost.sequence_cost``): the plan's memory and time are those of
            the run that uses it.
    """
    if analysis is None:
        analysis = analyze(model, request.example_inputs, request.kwargs, need_costs=False)
    merged, split = split_layers(analysis, model, len(groups[0]), rules)
    if sequence_parallel and merged.workload is not None:
        merged = dataclasses.replace(merged, workload=sequence_parallel_workload(
            merged.workload))
    made = tensor_parallel_plan(merged, request, groups) if search else \
        plan_request(merged, request, groups=groups)
    plan = tensor_parallel_record(made, model, merged, request, split.shard_plan, groups)
    return TensorParallelSetup(merged, plan, split.shard_plan, groups, split.layer_names,
                               request)


def partition_tensor_parallel(model: nn.Module, devices: Any,
                              tensor_parallel: TensorParallelOption,
                              request: PlanRequest | None = None, *,
                              sequence_parallel: bool = False, **fields: Any
                              ) -> TensorParallelModule:
    """``partition()`` with tensor parallelism: pipeline stages of ``tp`` ranks each.

    Args: as :func:`plan_tensor_parallel`; ``sequence_parallel`` runs Megatron's sequence
    parallelism between each stage's ranks. ``strategy="auto"`` keeps the degree (and
    rules) and searches the rest for the device groups (each group one pipeline stage):
    micro-batches, checkpoint mode, split.

    Returns:
        A :class:`partitioner.runtime.tensor_parallel.module.TensorParallelModule`; ``.plan``
        records the mesh and
        the shard spec of every split parameter.

    Raises:
        ExampleInputsError: without ``example_inputs`` (shapes decide the splits).
        PartitionError: a subclass naming the offending value and a fix.
    """
    setup = plan_tensor_parallel(model, devices, tensor_parallel, request,
                                 sequence_parallel=sequence_parallel, **fields)
    if sequence_parallel:  # recorded: the plan, saved and applied again, runs it too
        setup = dataclasses.replace(setup, plan=dataclasses.replace(
            setup.plan, sequence_parallel=True))
    return build_tensor_parallel(model, setup)


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
        A :class:`partitioner.runtime.tensor_parallel.multiprocess.DistributedTensorParallel`
        (``.plan`` is the
        :class:`~partitioner.planning.tp_rules.ShardPlan`).

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
    analysis = analyze(model, example_inputs, example_kwargs, need_costs=False)
    shard_plan = resolve_shardings(analysis.captured.graph_module, model, comm.size, rules)
    store = ShardStore(shard_plan.shardings)
    ids = first_names(model)

    def graph_factory(training: bool) -> fx.GraphModule:
        current = analysis
        if training != analysis.training:
            current = recapture(model, analysis, training, example_inputs, example_kwargs)
        gm = current.captured.graph_module
        route_dropout(gm)
        shardings = attr_shardings(gm, ids, shard_plan.shardings)
        out = shard_graph(gm, shardings, comm.rank,
                          make_tensor=store.factory(comm.rank, target, ids)).graph_module
        return route_module_randomness(out).graph_module.train(training)

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
                                       restructure=captured.restructure, plan=shard_plan,
                                       training=model.training)
    return module.train(model.training)


def _default_device(group: Any) -> torch.device:
    return accelerators.collective_device(str(dist.get_backend(group)))


def shard_stage(stage: fx.GraphModule, model: nn.Module, shard_plan: ShardPlan, rank: int,
                device: torch.device | str = "cpu",
                source: Callable[[torch.Tensor], torch.Tensor] | None = None,
                sequence_parallel: bool = False,
                derive: Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                                 torch.Tensor] | None = None,
                origin: torch.device | None = None) -> fx.GraphModule:
    """Rank ``rank``'s graph of one pipeline stage (for runtimes placing stages themselves).

    Args:
        stage: a stage graph of ``model`` (``partitioner.analysis.build_stage_graphs``), whose
            boundaries carry whole values (merge layers with ``merge_split_layers``).
        model: the model the stage graph was cut from (names its tensors).
        shard_plan: from :func:`partitioner.planning.tp_rules.resolve_shardings`.
        rank: the tensor-parallel rank.
        device: where the rank's tensors go.
        source: the whole value of a stage tensor, when the model is on the meta device
            (``partitioner.runtime.materialize.Materializer.tensor``).
        sequence_parallel: run the replicated region on sequence shards (dim 1), as the
            one-process runtime's rank graphs do
            (``partitioner.passes.tensor_parallel.sequence_parallel``); the graph's outputs
            stay whole sequences, so pipeline boundaries are unchanged.
        derive: instead of ``source``, the rank's tensors put off until first use
            (``partitioner.runtime.deferred_init.DeferredInit.derived``: placeholders of
            the slices' shapes, filled by slicing the whole values later).
        origin: the device the stage graph's arguments name (where it was cut; by default
            where its first tensor is): it becomes ``device`` in the rank's graph.

    Returns:
        The rank's graph; set its ``_tp_comm`` attribute to the rank's communicator
        (``partitioner.runtime.tensor_parallel.collectives.ProcessGroupCommunicator(tp_group)``):
        every collective, the sequence-parallel ones too, goes through it.
    """
    ids = first_names(model)
    store = ShardStore(shard_plan.shardings, source, derive)
    shardings = attr_shardings(stage, ids, shard_plan.shardings)
    origin = origin or accelerators.model_device(stage)
    out = shard_graph(stage, shardings, rank, make_tensor=store.factory(
        rank, torch.device(device), ids)).graph_module
    place_graph(out, device, origin)  # the capture's device in its arguments: the rank's
    if sequence_parallel:  # shapes only, on fake tensors: no collective runs here
        apply_sequence_parallel(out, stage, shard_plan.tp)
    return out


def stage_shardings(stage: fx.GraphModule, model: nn.Module, shard_plan: ShardPlan
                    ) -> dict[str, Sharding]:
    """How each split tensor of an (unsplit) stage graph is split, by the stage's own
    state-dict keys: what a rank running :func:`shard_stage`'s graph holds a slice of."""
    return attr_shardings(stage, first_names(model), shard_plan.shardings)
