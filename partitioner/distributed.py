"""``partition_distributed()``: run a plan with one process per device, on torch.distributed.

Every rank runs the same program (launched by torchrun): it builds the *same* plan, the
same stage graphs, keeps only its own stage, and trains with :meth:`DistributedModel.step`::

    torchrun --nproc-per-node 4 train.py           # in train.py:
    dpm = partition_distributed(model, example_inputs=(x,), pp=2, dp=2, chunks=8,
                                schedule="1f1b")
    optimizer = torch.optim.Adam(dpm.parameters())  # this rank's stage only
    for x, y in loader:                              # every rank of a replica: same batch
        optimizer.zero_grad()
        loss = dpm.step(x, y, loss_fn)               # the full-batch loss, on every rank
        optimizer.step()
    dpm.save("ckpt.pt", optimizer)                   # one file; ["model"] loads into `model`

With ``strategy="auto"`` the mesh sizes, schedule, micro-batches and checkpoint mode not
given are searched for this world (``partitioner.distributed_plan``, rank 0 plans; design
004, "Choosing the mesh"); ``example_inputs`` is then the whole batch of a step.

This front validates, plans and hands off: it starts torch.distributed and the watchdog
(``partitioner.runtime.distributed``), makes the plan from one ``PlanRequest`` (every rank
adopts rank 0's, its step predicted for these ranks), checks all ranks agree on it, cuts the
stage graphs (a rank's slice when ``tp > 1``) and hands them to the runtime (``model.
assemble``: links, reducer, tied weights, pipeline). Design: ``docs/design/004``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioner.analysis import Analysis, analyze, build_stage_graphs
from partitioner.apply import layers_problem
from partitioner.cost.devices import Cluster
from partitioner.distributed_plan import (
    AutoOptions,
    auto_options,
    check_sharding,
    checked_counts,
    choose_plan,
    describe_cluster,
    local_batch,
    mesh_sizes,
    on_mesh,
    plan_digest,
    predicted_for_world,
    run_settings,
    tuned_choice,
    virtual_stages_of,
    with_calibration,
)
from partitioner.errors import StageCountError, StrategyError, TuneError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads as fuse_linear_grads
from partitioner.passes.fuse_weight_grads import fusion_threshold
from partitioner.passes.non_persistent import keep_non_persistent, non_persistent_names
from partitioner.passes.outline_layers import outline_layers
from partitioner.passes.place_graph import place_graph
from partitioner.passes.private_rng import route_module_randomness
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.passes.unbake_meta import unbake_meta
from partitioner.planning.compile import shard_specs, split_layers
from partitioner.planning.options import Options, check_sequence_parallel, resolve_options
from partitioner.planning.planner import plan_request, record
from partitioner.planning.tp_rules import ShardPlan
from partitioner.planning.tune import tune_count
from partitioner.plans.plan import Plan
from partitioner.plans.plan_precision import distributed_precision
from partitioner.request import PlanRequest
from partitioner.runtime.deferred_init import DeferredInit
from partitioner.runtime.device import batches_sends, model_device
from partitioner.runtime.distributed.agreement import check_same_settings
from partitioner.runtime.distributed.boundaries import BoundaryPredictor
from partitioner.runtime.distributed.data_parallel import DEFAULT_BUCKET_BYTES
from partitioner.runtime.distributed.failure import (
    FailurePolicy,
    check_same_plan,
    start_watchdog,
)
from partitioner.runtime.distributed.mesh import DistInfo, ProcessMesh, init_distributed
from partitioner.runtime.distributed.model import (
    DistributedModel,
    RunSettings,
    assemble,
    find_ties,
)
from partitioner.runtime.materialize import (
    InitFn,
    Materializer,
    MaterializerFactory,
    materialize_module,
    materializer_for,
)
from partitioner.runtime.mesh import Mesh
from partitioner.runtime.placement import stages_on
from partitioner.runtime.schedule_registry import schedule_kind
from partitioner.runtime.tensor_parallel.collectives import ProcessGroupCommunicator
from partitioner.runtime.tensor_parallel.shard_state import ShardState
from partitioner.tensor_parallel import device_groups, plan_groups, shard_stage, stage_shardings

__all__ = ["partition_distributed", "DistributedModel", "BoundaryPredictor", "find_ties",
           "check_sharding"]


def partition_distributed(
        model: nn.Module, example_inputs: tuple[Any, ...] | None = None, *,
        example_kwargs: dict[str, Any] | None = None, pp: int | None = None,
        dp: int | None = None, tp: int | None = None,
        tensor_parallel: Mapping[str, str] | None = None, chunks: int | None = None,
        schedule: str | None = None, checkpoint: str | None = None,
        balance: Sequence[int] | None = None, split_points: Sequence[str] | None = None,
        plan: Plan | str | Path | None = None, memory_limit: float | None = None,
        loss_reduction: str = "mean", bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        seed: int = 0, failure: FailurePolicy | None = None, fuse_weight_grads: bool = True,
        backend: str | None = None, strategy: str | None = None,
        cluster: Cluster | str | None = None,
        memory_reserve: float | None = None,
        virtual_stages: int | None = None,
        optimizer_sharding: bool | None = None, precision: str | None = None,
        mesh: Mesh | None = None, init_fn: InitFn | None = None,
        tune: bool | int = False, sharding: str | None = None,
        sequence_parallel: bool = False, calibrate: bool | None = None,
        options: Options | None = None) -> DistributedModel:
    """Partition ``model`` over the ranks of this torch.distributed run; keep this rank's stage.

    Call it on every rank with the same arguments (collective). Starts torch.distributed
    from torchrun's environment when it is not started yet.

    Args:
        model: the whole model, built identically on every rank (same seed or weights), or
            built on the meta device (``with torch.device("meta"):``) when it does not fit
            one device: each rank then materializes only its stage (or its slice of it, one
            layer at a time) on its device, initialized deterministically whatever the mesh
            (``partitioner.runtime.materialize``); fill it from a file with
            :meth:`DistributedModel.load`. Design: ``docs/design/009-meta-models.md``.
        example_inputs: one local batch (what one replica's ``step`` receives); needed to
            cost the layers unless the split is fixed, and for ``torch.export`` capture.
        example_kwargs: keyword inputs of that batch.
        pp: pipeline stages; default: what the world leaves after ``dp`` and ``tp``.
        dp: data-parallel replicas of each stage; default: what the world leaves after ``pp``.
        tp: tensor-parallel shards of each stage (Megatron-style column/row splits found by
            the tensor-parallel pass, ``partitioner.tensor_parallel``); default: the plan's,
            else 1. Each stage's ranks form a ``tp`` process group.
        tensor_parallel: rules overriding the automatic splits, glob patterns over module
            names (``{"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}``).
        chunks: micro-batches per step (default: the plan's, else 1).
        schedule: any registered schedule, ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or
            ``"v_shape"`` (with ``virtual_stages >= 2``) or ``"zero_bubble"`` (default: the
            plan's, else 1f1b).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"`` (default: the plan's, else
            never: 1F1B already bounds the activations a stage holds).
        balance: layers per stage (torchgpipe's ``balance``).
        split_points: module names at which a new stage begins.
        plan: a :class:`Plan` or plan file to run as written (its split, chunks, mesh).
        memory_limit: bytes per stage for the planner.
        loss_reduction: how ``loss_fn`` reduces a micro-batch, ``"mean"`` or ``"sum"``.
        bucket_mb: data-parallel all-reduce bucket size, in MiB.
        seed: base seed of the stages' dropout generators (and of a meta-built model's
            initialization).
        failure: the watchdog's timings (see
        ``partitioner.runtime.distributed.failure.FailurePolicy``).
        fuse_weight_grads: add Linear layers' weight gradients into ``.grad`` in place, one
            product per micro-batch instead of a new tensor plus a sum, where that pays
            (``partitioner.passes.fuse_weight_grads.fusion_threshold``; Linear modules with
            hooks, and weights with tensor hooks, are left to autograd).
        backend: ``"gloo"`` or ``"nccl"`` if torch.distributed must be started.
        strategy: ``"auto"``: search the mesh sizes not given (``pp``, ``dp``, ``tp``), the
            schedule, ``chunks`` and ``checkpoint`` not given, for this world's devices
            (``partitioner.planning.world``); ``example_inputs`` is then the whole batch of
            a step (every replica's rows: replica ``r`` of ``dp`` steps on the ``r``-th of
            ``dp`` equal slices). ``None`` or ``"pipeline"``: the sizes as given, ``pp``
            filling the world.
        cluster: with ``"auto"``: the devices to plan for, a
            :class:`~partitioner.cost.devices.Cluster` of the world's size or a preset name
            (default: inferred from the ranks' hosts and device kind).
        memory_reserve: with ``"auto"``: the share of each device's memory the plan leaves
            unused (default 0.10); ``memory_limit`` overrides it.
        virtual_stages: model chunks per pipeline rank ``v`` (``"interleaved"``,
            ``"v_shape"``): the model is cut into ``pp * v`` stages, rank ``j`` runs those
            the schedule places on it (``j, j + pp, ...``; in a V ``j`` and
            ``2 pp - 1 - j``) (default: the plan's, else 1).
        optimizer_sharding: shard the optimizer state over the ``dp`` replicas (ZeRO-1,
            ``partitioner.runtime.distributed.zero``): build the optimizer with
            ``dpm.make_optimizer(torch.optim.AdamW, lr=...)``; needs ``dp >= 2``. Default
            ``None``: off, except that ``strategy="auto"`` turns it on when no
            configuration fits memory without it (training then refuses to start until
            the optimizer comes from ``dpm.make_optimizer``).
        precision: ``"fp32"`` or ``"bf16"`` (default: the plan's, else fp32): every stage
            computes under autocast to bf16, the values crossing ranks are bf16, the
            parameters, their gradients (reduced over replicas in fp32) and the optimizer
            state stay fp32, the loss is computed in fp32; the plan records it and the
            planner costs it (``partitioner.runtime.precision``). ``"fp16"`` (which needs
            loss scaling) is not run across processes yet.
        mesh: ``Mesh(dp=, pp=, tp=)``, the same as passing ``dp=``, ``pp=`` and ``tp=``
            (refused beside ones that disagree).
        init_fn: for a meta-built model: ``init_fn(module)`` fills one module's own
            tensors (default: the module's ``reset_parameters()``), run with the random
            generator seeded from ``seed`` and the module's name.
        tune: with ``strategy="auto"``: ``True`` builds 4 best-ranked candidates of rank 0's search
            (each mesh's best first; ``n``: that many) on every rank, times 0.3 s of training steps
            of each (the slowest rank's median), restores the model's tensors and runs the measured
            fastest (a better-ranked one within 10% of it: a tie); ``plan.candidates`` and
            ``plan.explain()`` show the predicted and measured step times (``planning.tune``).
        sharding: what the ``dp`` replicas cut among them (``partitioner.sharding``):
            ``None``/``"none"``, ``"optimizer"`` (``optimizer_sharding=True``) or
            ``"fsdp"``: parameters, gradients and optimizer state by torch's FSDP2, the
            parameters ``DTensor``s (build the optimizer over ``dpm.parameters()`` or with
            ``dpm.make_optimizer``); needs ``dp >= 2`` and one stage per rank; with
            ``tp >= 2`` each tp slice is cut again over its replicas.
        sequence_parallel: with ``tp >= 2``, Megatron's sequence parallelism on every
            stage's tp slice (``partitioner.tensor_parallel.shard_stage``): norms, dropout
            and residual adds between the column/row pairs on ``seq / tp`` tokens per
            rank, a reduce-scatter and an all-gather in place of each all-reduce; stage
            boundaries stay whole. Refused with ``tp=1`` or ``virtual_stages > 1``.
        calibrate: with ``"auto"``: rank 0 times the model's layers and Adam step on the
            example batch, at the ranks' thread count, and plans with those times
            (``partitioner.planning.calibrated``). ``None`` (default): when the world is this
            host's CPU planned with its measured spec and the step is cheap; ``False``: never.
        options: the same settings as one :class:`partitioner.Options` value, shared with
            ``partition`` and ``make_plan`` (``mesh`` a ``Mesh`` or ``Degrees(pp=...)``,
            ``Schedule``, ``Precision``, ``Sharding``, ``checkpoint``, ``strategy``,
            ``tune``, ``init_fn``, ``seed``, ``sequence_parallel``); the keywords above are
            sugar for it, and one setting given both ways with different values is refused
            (``OptionsError``).

    Returns:
        This rank's :class:`DistributedModel`.

    Raises:
        PartitionError: a subclass naming the bad value and a fix; ``PlanMismatchError``
            (on every rank) when ranks built different plans.

    Example:
        >>> dpm = partition_distributed(model, example_inputs=(x,), pp=2, dp=2, chunks=8,
        ...                             schedule="1f1b", checkpoint="never")  # doctest: +SKIP
    """
    opts = resolve_options(options, **checked_counts(
        pp=pp, dp=dp, tp=tp, mesh=mesh, chunks=chunks, schedule=schedule,
        virtual_stages=virtual_stages, checkpoint=checkpoint, precision=precision,
        optimizer_sharding=optimizer_sharding, sharding=sharding, strategy=strategy,
        tune=tune, init_fn=init_fn, seed=seed, sequence_parallel=sequence_parallel))
    call = _parse(model, opts, plan, Fixed(tensor_parallel, balance, split_points,
                                           memory_limit, cluster, memory_reserve, calibrate),
                  Running(loss_reduction, bucket_mb, fuse_weight_grads, failure, backend))
    info = init_distributed(backend)
    watchdog = start_watchdog(failure)
    _agree(call)
    planned = _plan(model, call, info, example_inputs, example_kwargs)
    return _build(model, planned, call, info, watchdog)


@dataclass(frozen=True)
class Fixed:
    """What only the multi-process front takes besides :class:`Options`: tensor-parallel
    rules, a fixed split, the memory limit, the cluster and reserve the search plans for."""

    rules: Mapping[str, str] | None = None
    balance: Sequence[int] | None = None
    split_points: Sequence[str] | None = None
    memory_limit: float | None = None
    cluster: Cluster | str | None = None
    memory_reserve: float | None = None
    calibrate: bool | None = None


@dataclass(frozen=True)
class Running:
    """How the ranks run (read by the build, not the plan)."""

    loss_reduction: str = "mean"
    bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    fuse_weight_grads: bool = True
    failure: FailurePolicy | None = None
    backend: str | None = None


@dataclass(frozen=True)
class Parsed:
    """One call checked before anything collective (options, plan, search, sizes)."""

    options: Options
    fixed: Fixed
    running: Running
    given: Plan | None
    auto: AutoOptions | None
    sizes: tuple[int | None, int | None, int | None]
    precision: str
    sharding: str
    count: int
    materializer: MaterializerFactory | None


@dataclass(frozen=True)
class Planned:
    """The plan every rank runs, this rank's capture of the model, the mesh."""

    plan: Plan
    analysis: Analysis
    shard_plan: ShardPlan | None
    shape: Mesh
    virtual: int
    optimizer_sharding: bool


def _parse(model: nn.Module, opts: Options, plan: Plan | str | Path | None, fixed: Fixed,
           running: Running) -> Parsed:
    """The call checked and completed (no collective): tuning only with ``"auto"``, the
    sharding, a given plan loaded, the precision settled, the search's options."""
    opts.check_runnable("partition_distributed")
    count = tune_count(opts.tune)
    if count and opts.strategy != "auto":
        raise TuneError(f"tune={opts.tune!r} with strategy={opts.strategy!r}: tuning times "
                        "the candidates of strategy='auto'; pass strategy='auto' or drop tune=")
    given = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
    precision = distributed_precision(model, given, opts.precision.compute)
    (pp, dp, tp), schedule = opts.sizes(), opts.schedule
    auto = auto_options(opts.strategy, given, pp, dp, tp, fixed.rules, schedule.chunks,
                        schedule.name, opts.checkpoint, fixed.balance, fixed.split_points,
                        fixed.memory_limit, fixed.cluster, fixed.memory_reserve)
    auto = with_calibration(auto, fixed.calibrate)
    if auto is None:
        pp, dp, tp = mesh_sizes(given, pp, dp, tp)
        if fixed.rules is not None and tp == 1:
            raise StrategyError("tensor_parallel= rules split layers over the tp shards of a "
                                "stage, but tp=1; pass tp=2 (or more) with them")
    check_sequence_parallel(opts, tp)
    return Parsed(opts, fixed, running, given, auto, (pp, dp, tp), precision,
                  opts.sharding.kind or "none", count,
                  materializer_for(model, opts.init_fn, opts.seed))


def _agree(call: Parsed) -> None:
    """Every rank asked for the same (before anything collective: ranks asked for other
    meshes would wait in each other's groups)."""
    opts, fixed, running, given = call.options, call.fixed, call.running, call.given
    pp, dp, tp = call.sizes
    check_same_settings(dict(
        pp=pp, dp=dp, tp=tp, tensor_parallel=fixed.rules, chunks=opts.schedule.chunks,
        schedule=opts.schedule.name, checkpoint=opts.checkpoint, balance=fixed.balance,
        split_points=fixed.split_points,
        plan=given.to_dict() if given is not None else None, memory_limit=fixed.memory_limit,
        loss_reduction=running.loss_reduction, bucket_mb=running.bucket_mb, seed=opts.seed,
        fuse_weight_grads=running.fuse_weight_grads, strategy=opts.strategy,
        cluster=describe_cluster(fixed.cluster), memory_reserve=fixed.memory_reserve,
        virtual_stages=opts.schedule.virtual_stages,
        optimizer_sharding=opts.sharding.optimizer, precision=call.precision,
        tune=call.count, sharding=call.sharding, sequence_parallel=opts.sequence_parallel,
        calibrate=fixed.calibrate))


def _chosen(model: nn.Module, call: Parsed, info: DistInfo, inputs: tuple[Any, ...] | None,
            kwargs: dict[str, Any] | None) -> Plan:
    """Rank 0's search for this world (tuned when asked), on every rank."""
    assert call.auto is not None
    running, opts = call.running, call.options
    zero = False if call.sharding == "fsdp" else opts.sharding.optimizer
    auto = replace(call.auto, precision=call.precision, optimizer_sharding=zero,
                   sequence_parallel=opts.sequence_parallel)
    auto.degrees.check(info.world_size)
    chosen = choose_plan(model, inputs, kwargs, auto, info.device)
    if call.count:
        rules = call.fixed.rules
        chosen = tuned_choice(model, chosen, call.count, lambda fixed: partition_distributed(
            model, **fixed, tensor_parallel=rules if fixed["tp"] > 1 else None,
            loss_reduction=running.loss_reduction, bucket_mb=running.bucket_mb,
            seed=opts.seed, failure=running.failure,
            fuse_weight_grads=running.fuse_weight_grads, backend=running.backend,
            precision=call.precision, init_fn=opts.init_fn,
            sequence_parallel=opts.sequence_parallel), inputs, kwargs)
    assert chosen.mesh is not None, "the search records the mesh it chose"
    return chosen


def _plan(model: nn.Module, call: Parsed, info: DistInfo, inputs: tuple[Any, ...] | None,
          kwargs: dict[str, Any] | None) -> Planned:
    """The plan every rank runs: rank 0's search (``"auto"``), a given plan, or the split
    planned for the sizes given; and this rank's capture of the model."""
    opts, fixed, given = call.options, call.fixed, call.given
    (pp, dp, tp), chosen = call.sizes, None
    chunks, schedule, checkpoint = opts.schedule.chunks, opts.schedule.name, opts.checkpoint
    virtual_stages, sharded = opts.schedule.virtual_stages, opts.sharding.optimizer
    if call.auto is not None:
        chosen = _chosen(model, call, info, inputs, kwargs)
        assert chosen.mesh is not None
        pp, dp, tp = chosen.mesh.pp, chosen.mesh.dp, chosen.mesh.tp
        chunks, schedule, checkpoint = chosen.chunks, chosen.schedule, chosen.checkpoint
        virtual_stages, sharded = chosen.virtual_stages, chosen.optimizer_sharding
        inputs, kwargs = local_batch(inputs, kwargs, dp)
        given = chosen  # a tensor-parallel one already cut from merged layers by rank 0
    assert tp is not None
    shape = Mesh.infer(info.world_size, pp=pp, dp=dp, tp=tp)
    check_sharding(bool(sharded) and call.sharding != "fsdp", shape.dp)  # fsdp: assemble's
    chunks, schedule, checkpoint = run_settings(model, given, chunks, schedule, checkpoint,
                                                fixed.balance, fixed.split_points)
    virtual = virtual_stages_of(given, virtual_stages, schedule, shape, chunks, fixed.balance)
    # Asked for, or recorded in the given plan (run as saved); tp > 1 has no virtual stages.
    sequence = opts.sequence_parallel or (given is not None and given.sequence_parallel)
    balance = given.balance if given is not None and shape.tp > 1 else fixed.balance
    request = PlanRequest.make([info.device.type] * (shape.pp * virtual), "pipeline",
                               example_inputs=inputs, example_kwargs=kwargs, chunks=chunks,
                               checkpoint=checkpoint, balance=balance,
                               split_points=fixed.split_points,
                               memory_limit=fixed.memory_limit, precision=call.precision)
    made, analysis, shard_plan = _agreed_plan(model, given, request, shape, virtual,
                                              fixed.rules, sequence)
    if given is not None:
        made = replace(made, chunks=chunks, checkpoint=checkpoint)
    made = on_mesh(replace(made, schedule=schedule, precision=call.precision,
                           sequence_parallel=sequence), shape, virtual)
    if given is None:  # sizes given: the step predicted as these ranks run it, not one process
        made = predicted_for_world(made, analysis.workload, info.device, call.precision)
    if chosen is not None and made is not chosen:  # keep the search's record for explain()
        notes = tuple(dict.fromkeys((*chosen.notes, *made.notes)))  # each line once
        made = replace(made, candidates=chosen.candidates, notes=notes)
    _check_layers(analysis, made, given is not None)
    return Planned(made, analysis, shard_plan, shape, virtual, bool(sharded))


def _agreed_plan(model: nn.Module, given: Plan | None, request: PlanRequest, shape: Mesh,
                 virtual: int, rules: Mapping[str, str] | None, sequence: bool = False
                 ) -> tuple[Plan, Analysis, ShardPlan | None]:
    """:func:`_agree_on_split_plan` for ``tp > 1``, else :func:`_agree_on_plan` (a model
    too small for ``pp x virtual`` stages named as such)."""
    analysis = analyze(model, request.example_inputs, request.kwargs,
                       need_costs=given is None and not request.fixes_split)
    if shape.tp > 1:
        return _agree_on_split_plan(model, analysis, given, request, shape, rules, sequence)
    try:
        made = _agree_on_plan(model, analysis, given, request)
    except StageCountError as error:
        if virtual == 1:
            raise
        raise StrategyError(
            f"pp={shape.pp} x virtual_stages={virtual} needs {shape.pp * virtual} stages, "
            f"but the model cannot be cut so ({error}); pass a smaller virtual_stages or "
            "pp") from error
    return made, analysis, None


def _build(model: nn.Module, planned: Planned, call: Parsed, info: DistInfo,
           watchdog: Any) -> DistributedModel:
    """This rank's model: the stage graphs cut, every rank checked to hold the same, this
    rank's stage (or its tensor-parallel slice) on its device, handed to the runtime."""
    made, shape, virtual, running = planned.plan, planned.shape, planned.virtual, call.running
    graphs = _stage_graphs(model, planned, info)
    origin = model_device(model)  # the device the graphs name, before a stage moves
    sharded = planned.optimizer_sharding and call.sharding != "fsdp"  # FSDP cuts it itself
    settings = RunSettings(made.schedule, made.chunks, made.checkpoint,
                           running.loss_reduction, int(running.bucket_mb * 2**20),
                           call.options.seed, made.to_dict(), virtual, sharded,
                           call.precision, "optimizer" if sharded else call.sharding)
    ranks = ProcessMesh(shape)
    check_same_plan(*plan_digest(made, graphs, shape, settings))
    ties = find_ties(graphs)  # before a meta model's stage gets new, real tensors
    real = call.materializer(info.device) if call.materializer is not None else None
    fsdp = call.sharding == "fsdp"  # deferred init (runtime/deferred_init.py) unless sharded
    deferred = DeferredInit(real) if real is not None and not fsdp and not sharded else None
    source = deferred if deferred is not None else real
    if virtual > 1:
        placement = schedule_kind(made.schedule).place(shape.pp, virtual)
        stages = {k: _rank_stage(graphs[k], model, None, ranks, info.device, origin, source)[0]
                  for k in stages_on(placement, ranks.stage)}
        shards = None
    else:
        stage, shards = _rank_stage(graphs[ranks.stage], model, planned.shard_plan, ranks,
                                    info.device, origin, source, made.sequence_parallel)
        stages = {ranks.stage: stage}
    fusing = fusion_threshold(made.chunks, made.schedule, info.device.type)
    for graph in stages.values() if running.fuse_weight_grads else ():
        fuse_linear_grads(graph, fusing)
    if fsdp and virtual == 1:  # each layer its own FSDP unit
        settings = replace(settings, fsdp_units=outline_layers(stages[ranks.stage]).units)
    captured = planned.analysis.captured
    return assemble(model, made, graphs, stages if virtual > 1 else stages[ranks.stage],
                    ranks, info.device, settings,
                    bind=captured.placeholder_values, restructure=captured.restructure,
                    watchdog=watchdog, shards=shards, batched=batches_sends(info.backend),
                    ties=ties, deferred=deferred)


def _stage_graphs(model: nn.Module, planned: Planned, info: DistInfo) -> list[fx.GraphModule]:
    """The plan's stage graphs, cut as a flat pipeline of ``P v`` stages (virtual stage
    ``k`` is graph ``k``) where the model's tensors are."""
    made, shape = planned.plan, planned.shape
    home = model_device(model)
    here = tuple(replace(s, device=str(home)) for s in made.stages)  # as devices must say
    graphs = build_stage_graphs(planned.analysis, replace(
        made, devices=(str(home),) * len(here), stages=here, virtual_stages=1,
        mesh=Mesh(dp=shape.dp, pp=len(here), tp=shape.tp)))
    for graph in graphs if home.type == "meta" else ():  # captured on meta; runs here
        unbake_meta(graph, info.device)
    return graphs


def _agree_on_plan(model: nn.Module, analysis: Analysis, given: Plan | None,
                   request: PlanRequest) -> Plan:
    """The plan every rank runs (a given plan as it is), from this rank's capture.

    A given plan, ``balance=`` or ``split_points=`` is deterministic. The costed planner
    measures this machine, so near-equal splits could come out differently on two ranks:
    every rank plans, then all adopt rank 0's plan (the hash check that follows still
    compares the graphs and parameters every rank built).
    """
    if given is not None:
        return given
    made = record(plan_request(analysis, request), model, analysis, request, request.strategy)
    return made if request.fixes_split else _rank0_plan(made)


def _rank0_plan(made: Plan) -> Plan:
    """Rank 0's costed plan, on every rank (costs measured per machine may differ)."""
    box: list[Any] = [made.to_dict()]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def _agree_on_split_plan(model: nn.Module, analysis: Analysis, given: Plan | None,
                         request: PlanRequest, shape: Mesh,
                         rules: Mapping[str, str] | None, sequence: bool = False
                         ) -> tuple[Plan, Analysis, ShardPlan]:
    """The plan every rank runs when stages are split over ``tp`` ranks, with the capture
    (layers merged so that no stage boundary cuts a column/row pair) and the shard plan.

    The tensor-parallel pass decides the splits from the model alone, so every rank finds
    the same; the stage split follows :func:`_agree_on_plan`'s rules. A given plan (a file,
    or rank 0's search, already cut from merged layers) is not planned again: it must name
    the layers and shard specs this rank's capture, merged for ``tp``, gives (and is
    returned as it is).
    """
    groups, parsed = device_groups([[d] * shape.tp for d in request.devices],
                                   dict(rules) if rules else shape.tp)
    if given is None:
        setup = plan_groups(model, groups, parsed, request, analysis=analysis,
                            sequence_parallel=sequence)
        made = setup.plan if request.fixes_split else _rank0_plan(setup.plan)
        return made, setup.analysis, setup.shard_plan
    merged, split = split_layers(analysis, model, shape.tp, parsed)
    if list(given.layers) != merged.layer_names:
        raise StrategyError(
            f"the plan's layers {list(given.layers)[:6]} are not the tensor-parallel "
            f"layers of this model {merged.layer_names[:6]}; re-plan the model with tp="
            f"{shape.tp}")
    specs = shard_specs(split.shard_plan)
    if dict(given.shard_specs) != specs:
        differ = sorted(set(given.shard_specs.items()) ^ set(specs.items()))
        raise StrategyError(
            f"the plan splits parameters otherwise than tp={shape.tp} with these rules "
            f"does (first differences: {differ[:4]}); pass the tensor_parallel= rules "
            "the plan was made with")
    return given, merged, split.shard_plan


def _check_layers(analysis: Analysis, plan: Plan, given: bool) -> None:
    """Refuse a plan whose layers are not this rank's model's. Without a plan file the plan
    is rank 0's (or made alike on every rank): then the ranks built different models."""
    problem = layers_problem(analysis.layer_names, plan)
    if problem is None:
        return
    if given:
        raise StrategyError(problem)
    names = analysis.layer_names
    missing = [n for n in plan.layers if n not in names]
    extra = [n for n in names if n not in plan.layers]
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise StrategyError(
        f"ranks disagree on the model: rank 0 planned layers {list(plan.layers)[:8]} but "
        f"rank {rank}'s model has {list(names)[:8]} (rank {rank} lacks {missing[:8]}, has "
        f"{extra[:8]} besides); build the same model (code, config, sizes) on every rank, "
        "e.g. from one seed and the same arguments")


def _rank_stage(graph: fx.GraphModule, model: nn.Module, shard_plan: ShardPlan | None,
                mesh: ProcessMesh, device: torch.device, origin: torch.device,
                made: Materializer | DeferredInit | None = None, sequence_parallel: bool = False
                ) -> tuple[fx.GraphModule, ShardState | None]:
    """This rank's stage graph on its device and, when the stage is split over ``tp``
    ranks, the rank's slice with collectives on the stage replica's tp group (its replicated
    region on sequence shards with ``sequence_parallel``: the pass's collectives go through
    the graph's ``_tp_comm``, this process group). A meta-built stage is materialized on
    the device by ``made`` (a split one layer by layer, each rank keeping its slice)."""
    if shard_plan is None:
        if made is not None:
            materialize_module(graph, made)
        place_graph(graph, device, origin)  # its constants, and ``origin`` in its arguments
        return route_module_randomness(graph).graph_module, None
    comm = ProcessGroupCommunicator(mesh.group("tp"))
    later = made if isinstance(made, DeferredInit) else None
    source = made.tensor if made is not None and later is None else None
    stage = route_module_randomness(shard_stage(
        graph, model, shard_plan, mesh.shard, device, source, sequence_parallel,
        derive=later.derived if later is not None else None, origin=origin)).graph_module
    setattr(stage, COMM_ATTR, comm)
    keep_non_persistent(stage, non_persistent_names(graph))
    return stage, ShardState(stage_shardings(graph, model, shard_plan), mesh.shard, comm)
