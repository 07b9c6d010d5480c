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

This front only validates, plans and hands off: it starts torch.distributed
(``partitioner.runtime.distributed.mesh``) and the failure watchdog
(``partitioner.runtime.distributed.failure``), makes the plan from one
:class:`~partitioner.request.PlanRequest` (every rank adopts rank 0's costed plan), checks all
ranks agree on it, cuts the stage graphs (a tensor-parallel rank's slice of its stage when
``tp > 1``) and hands them to the runtime, which builds the rank
(``partitioner.runtime.distributed.model.assemble``: links, data-parallel reducer, tied
weights, boundary prediction, pipeline). Design: ``docs/design/004-distributed.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
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
    choose_plan,
    describe_cluster,
    local_batch,
    tuned_choice,
)
from partitioner.errors import ScheduleError, StageCountError, StrategyError, TuneError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads as fuse_linear_grads
from partitioner.passes.non_persistent import keep_non_persistent, non_persistent_names
from partitioner.passes.private_rng import route_module_randomness
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.passes.unbake_meta import unbake_meta
from partitioner.planning.given_mesh import mesh_degrees
from partitioner.planning.planner import plan_request, record
from partitioner.planning.tp_rules import ShardPlan
from partitioner.planning.tune import tune_count
from partitioner.planning.world import Degrees
from partitioner.plans.plan import Mesh as PlanMesh
from partitioner.plans.plan import Plan
from partitioner.plans.plan_precision import distributed_precision
from partitioner.request import PlanRequest
from partitioner.runtime.device import batches_sends
from partitioner.runtime.distributed.agreement import check_same_settings
from partitioner.runtime.distributed.boundaries import BoundaryPredictor
from partitioner.runtime.distributed.data_parallel import DEFAULT_BUCKET_BYTES
from partitioner.runtime.distributed.failure import (
    FailurePolicy,
    check_same_plan,
    start_watchdog,
)
from partitioner.runtime.distributed.mesh import Mesh, MeshShape, init_distributed
from partitioner.runtime.distributed.model import (
    DistributedModel,
    RunSettings,
    assemble,
    find_ties,
    model_device,
    sharding_problem,
)
from partitioner.runtime.materialize import (
    InitFn,
    MaterializerFactory,
    materialize_module,
    materializer_for,
)
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
        mesh: PlanMesh | None = None, init_fn: InitFn | None = None,
        tune: bool | int = False) -> DistributedModel:
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
        schedule: any registered schedule, ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (with
            ``virtual_stages >= 2``) or ``"zero_bubble"`` (default: the plan's, else 1f1b).
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
            product per micro-batch instead of a new tensor plus a sum
            (``partitioner.runtime.fused_linear``; Linear modules with hooks, and weights with
            tensor
            hooks, are left to autograd).
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
        virtual_stages: model chunks per pipeline rank ``v`` (``"interleaved"``): the model
            is cut into ``pp * v`` stages, rank ``j`` runs stages ``j, j + pp, ...``
            (default: the plan's, else 1).
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
        tune: with ``strategy="auto"``: ``True`` builds the 4 best-ranked candidates of
            rank 0's search (``n``: that many) on every rank, times a few training steps
            of each (the slowest rank's median), restores the model's tensors and runs the
            measured fastest; ``plan.candidates`` and ``plan.explain()`` show the predicted
            and measured step times (``partitioner.planning.tune``).

    Returns:
        This rank's :class:`DistributedModel`.

    Raises:
        PartitionError: a subclass naming the bad value and a fix; ``PlanMismatchError``
            (on every rank) when ranks built different plans.

    Example:
        >>> dpm = partition_distributed(model, example_inputs=(x,), pp=2, dp=2, chunks=8,
        ...                             schedule="1f1b", checkpoint="never")  # doctest: +SKIP
    """
    count = tune_count(tune)
    if count and strategy != "auto":
        raise TuneError(f"tune={tune!r} with strategy={strategy!r}: tuning times the "
                        "candidates of strategy='auto'; pass strategy='auto' or drop tune=")
    if optimizer_sharding is not None:
        check_sharding(optimizer_sharding, None)
    pp, dp, tp = mesh_degrees(mesh, pp=pp, dp=dp, tp=tp)
    given = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
    precision = distributed_precision(model, given, precision)
    materializer = materializer_for(model, init_fn, seed)
    auto = _auto_options(strategy, given, pp, dp, tp, tensor_parallel, chunks, schedule,
                         checkpoint, balance, split_points, memory_limit, cluster,
                         memory_reserve)
    if auto is None:
        pp, dp, tp = _mesh_sizes(given, pp, dp, tp)
        if tensor_parallel is not None and tp == 1:
            raise StrategyError("tensor_parallel= rules split layers over the tp shards of a "
                                "stage, but tp=1; pass tp=2 (or more) with them")
    info = init_distributed(backend)
    watchdog = start_watchdog(failure)
    # Before anything collective: ranks asked for other meshes would wait in each other's groups.
    check_same_settings(dict(
        pp=pp, dp=dp, tp=tp, tensor_parallel=tensor_parallel, chunks=chunks, schedule=schedule,
        checkpoint=checkpoint, balance=balance, split_points=split_points,
        plan=given.to_dict() if given is not None else None, memory_limit=memory_limit,
        loss_reduction=loss_reduction, bucket_mb=bucket_mb, seed=seed,
        fuse_weight_grads=fuse_weight_grads, strategy=strategy,
        cluster=describe_cluster(cluster), memory_reserve=memory_reserve,
        virtual_stages=virtual_stages, optimizer_sharding=optimizer_sharding,
        precision=precision, tune=count))
    chosen: Plan | None = None
    if auto is not None:
        auto = replace(auto, precision=precision, optimizer_sharding=optimizer_sharding)
        auto.degrees.check(info.world_size)
        chosen = choose_plan(model, example_inputs, example_kwargs, auto, info.device)
        if count:
            chosen = tuned_choice(model, chosen, count, lambda fixed: partition_distributed(
                model, **fixed, tensor_parallel=tensor_parallel if fixed["tp"] > 1 else None,
                loss_reduction=loss_reduction, bucket_mb=bucket_mb, seed=seed,
                failure=failure, fuse_weight_grads=fuse_weight_grads, backend=backend,
                precision=precision, init_fn=init_fn), example_inputs, example_kwargs)
        assert chosen.mesh is not None, "the search records the mesh it chose"
        pp, dp, tp = chosen.mesh.pp, chosen.mesh.dp, chosen.mesh.tp
        chunks, schedule, checkpoint = chosen.chunks, chosen.schedule, chosen.checkpoint
        virtual_stages = chosen.virtual_stages
        optimizer_sharding = chosen.optimizer_sharding
        example_inputs, example_kwargs = local_batch(example_inputs, example_kwargs, dp)
        # A tensor-parallel mesh plans its own split (layers merged around the splits).
        given = chosen if tp == 1 else None
    assert tp is not None
    shape = MeshShape.infer(info.world_size, pp=pp, dp=dp, tp=tp)
    optimizer_sharding = bool(optimizer_sharding)
    check_sharding(optimizer_sharding, shape.dp)
    chunks, schedule, checkpoint = _run_settings(model, given, chunks, schedule, checkpoint,
                                                 balance, split_points)
    virtual = _virtual_stages(given, virtual_stages, schedule, shape, chunks, balance)
    if given is not None and shape.tp > 1:
        balance = given.balance  # planned again to check its layers and shard specs
    request = PlanRequest.make([info.device.type] * (shape.pp * virtual), "pipeline",
                               example_inputs=example_inputs, example_kwargs=example_kwargs,
                               chunks=chunks, checkpoint=checkpoint, balance=balance,
                               split_points=split_points, memory_limit=memory_limit,
                               precision=precision)
    shard_plan: ShardPlan | None = None
    if shape.tp > 1:
        made, analysis, shard_plan = _agree_on_split_plan(model, given, request, shape,
                                                          tensor_parallel)
    else:
        try:
            made, analysis = _agree_on_plan(model, given, request)
        except StageCountError as error:
            if virtual == 1:
                raise
            raise StrategyError(
                f"pp={shape.pp} x virtual_stages={virtual} needs {shape.pp * virtual} "
                f"stages, but the model cannot be cut so ({error}); pass a smaller "
                "virtual_stages or pp") from error
    if given is not None:
        made = replace(made, chunks=chunks, checkpoint=checkpoint)
    made = _on_mesh(replace(made, schedule=schedule, precision=precision), shape, virtual)
    if chosen is not None and made is not chosen:  # keep the search's record for explain()
        made = replace(made, candidates=chosen.candidates, notes=(*chosen.notes, *made.notes))
    _check_layers(analysis, made, given is not None)
    home = model_device(model)
    here = tuple(replace(s, device=str(home)) for s in made.stages)  # as devices must say
    # Cut as a flat pipeline of P v stages: virtual stage k is graph k.
    graphs = build_stage_graphs(analysis, replace(
        made, devices=(str(home),) * len(here), stages=here, virtual_stages=1,
        mesh=PlanMesh(shape.dp, len(here), shape.tp)))
    settings = RunSettings(made.schedule, made.chunks, made.checkpoint, loss_reduction,
                           int(bucket_mb * 2**20), seed, made.to_dict(), virtual,
                           optimizer_sharding, precision)
    ranks = Mesh(shape)
    check_same_plan(*_digest(made, graphs, shape, settings))
    ties = find_ties(graphs)  # before a meta model's stage gets new, real tensors
    if virtual > 1:
        stages = {k: _rank_stage(graphs[k], model, None, ranks, info.device, materializer)[0]
                  for k in range(ranks.stage, len(graphs), shape.pp)}
    if home.type == "meta":  # the capture ran on meta; the stages run here
        for graph in graphs:
            unbake_meta(graph, info.device)
        shards = None
    else:
        stage, shards = _rank_stage(graphs[ranks.stage], model, shard_plan, ranks, info.device,
                                    materializer)
        stages = {ranks.stage: stage}
    if fuse_weight_grads:
        for graph in stages.values():
            fuse_linear_grads(graph)
    captured = analysis.captured
    return assemble(model, made, graphs, stages if virtual > 1 else stages[ranks.stage],
                    ranks, info.device, settings,
                    bind=captured.placeholder_values, restructure=captured.restructure,
                    watchdog=watchdog, shards=shards, batched=batches_sends(info.backend),
                    ties=ties)


def check_sharding(optimizer_sharding: object, dp: int | None) -> None:
    """Raises a :class:`StrategyError` unless ``optimizer_sharding`` is a bool that fits
    ``dp`` replicas (``None``: not known yet)."""
    if not isinstance(optimizer_sharding, bool):
        raise StrategyError(f"optimizer_sharding={optimizer_sharding!r}; pass True (shard the "
                            "optimizer state over the data-parallel replicas) or False")
    if optimizer_sharding and dp is not None and dp < 2:
        raise StrategyError(sharding_problem(dp))


def _auto_options(strategy: str | None, given: Plan | None, pp: int | None, dp: int | None,
                  tp: int | None, rules: Mapping[str, str] | None, chunks: int | None,
                  schedule: str | None, checkpoint: str | None,
                  balance: Sequence[int] | None, split_points: Sequence[str] | None,
                  memory_limit: float | None, cluster: Cluster | str | None,
                  memory_reserve: float | None) -> AutoOptions | None:
    """The search's options when ``strategy="auto"`` (``None`` otherwise), after refusing
    options that fix what the search chooses, or that only the search reads."""
    if strategy not in (None, "auto", "pipeline"):
        raise StrategyError(f"strategy={strategy!r} is unknown; pass 'auto' (search the mesh, "
                            "schedule and micro-batches) or 'pipeline' (the sizes as given)")
    if strategy != "auto":
        if cluster is not None or memory_reserve is not None:
            raise StrategyError("cluster= and memory_reserve= shape the search of "
                                "strategy='auto'; pass strategy='auto' or drop them")
        return None
    fixed = [name for name, value in (("plan", given), ("balance", balance),
                                      ("split_points", split_points)) if value is not None]
    if fixed:
        raise StrategyError(f"strategy='auto' chooses the split, but {fixed[0]}= fixes it; "
                            f"drop {fixed[0]}= or strategy='auto'")
    if rules is not None and (tp is None or tp == 1):
        raise StrategyError("tensor_parallel= rules split layers over the tp shards of a "
                            f"stage, but tp={tp}; pass tp=2 (or more) with them")
    memory = float(memory_limit) if memory_limit is not None else None
    return AutoOptions(Degrees(pp, dp, tp), cluster, chunks, schedule, checkpoint, memory,
                       memory_reserve, rules)


def _mesh_sizes(given: Plan | None, pp: int | None, dp: int | None, tp: int | None
                ) -> tuple[int | None, int | None, int]:
    """The call's mesh sizes, completed from a given plan: it fixes the stages, and a
    replica count it names (> 1) is kept unless overridden."""
    if given is not None:
        pp = len(given.stages) // given.virtual_stages if pp is None else pp
        if dp is None and given.mesh is not None and given.mesh.dp > 1:
            dp = given.mesh.dp
        if tp is None and given.mesh is not None:
            tp = given.mesh.tp
    tp = 1 if tp is None else tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise StrategyError(f"tp={tp!r}; pass a whole number of tensor-parallel shards >= 1")
    return pp, dp, tp


def _run_settings(model: nn.Module, given: Plan | None, chunks: int | None,
                  schedule: str | None, checkpoint: str | None,
                  balance: Sequence[int] | None, split_points: Sequence[str] | None
                  ) -> tuple[int, str, str]:
    """Chunks, schedule and checkpoint mode (the call's, else the given plan's, else the
    defaults), after checking a given plan fits the model and is not overridden."""
    if given is not None:
        if balance is not None or split_points is not None:
            raise StrategyError("plan= fixes the split; drop balance= and split_points=")
        _check_fingerprint(model, given)
    return (chunks or (given.chunks if given else 1),
            schedule or (given.schedule if given else "1f1b"),
            checkpoint or (given.checkpoint if given else "never"))


def _virtual_stages(given: Plan | None, virtual: int | None, schedule: str, shape: MeshShape,
                    chunks: int, balance: Sequence[int] | None) -> int:
    """Virtual stages per rank (the call's, else the given plan's, else 1), checked against
    the schedule, the mesh and ``balance``.

    Raises:
        StrategyError: If ``virtual`` is not a positive int, or ``balance`` does not list
            ``pp * virtual`` stages.
        ScheduleError: If the schedule does not suit ``pp``, ``chunks`` and ``virtual``.
    """
    v = virtual if virtual is not None else (given.virtual_stages if given else 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise StrategyError(f"virtual_stages={v!r}; pass the model chunks per pipeline rank, "
                            "an int >= 1 (2 or more for schedule='interleaved')")
    problems = schedule_kind(schedule).problems(shape.pp, chunks, v)
    if problems:
        raise ScheduleError("; ".join(problems))
    if balance is not None and len(balance) != shape.pp * v:
        raise StrategyError(f"balance has {len(balance)} entries but pp={shape.pp} x "
                            f"virtual_stages={v} needs {shape.pp * v} (layers per virtual "
                            f"stage, stage k on rank k % {shape.pp}); pass {shape.pp * v}")
    return v


def _on_mesh(made: Plan, shape: MeshShape, virtual: int) -> Plan:
    """``made`` (``P v`` stages in order) on the mesh: ``P`` devices, virtual stage ``k``
    on ``devices[k % P]``.

    Raises:
        StrategyError: If the plan does not have ``P v`` stages (too few layers, say).
    """
    p = shape.pp
    if virtual == 1 and made.virtual_stages == 1:
        return replace(made, mesh=PlanMesh(shape.dp, p, shape.tp))
    if len(made.stages) != p * virtual:
        raise StrategyError(f"the plan has {len(made.stages)} stages but pp={p} x "
                            f"virtual_stages={virtual} needs {p * virtual}; the model may "
                            f"have too few layers: pass a smaller virtual_stages or pp")
    devices = tuple(made.devices[k % len(made.devices)] for k in range(p))
    stages = tuple(replace(s, device=devices[s.index % p]) for s in made.stages)
    return replace(made, devices=devices, stages=stages, virtual_stages=virtual,
                   mesh=PlanMesh(shape.dp, p, shape.tp))


def _agree_on_plan(model: nn.Module, given: Plan | None, request: PlanRequest
                   ) -> tuple[Plan, Analysis]:
    """The plan every rank runs (a given plan as it is), and this rank's capture of the model.

    A given plan, ``balance=`` or ``split_points=`` is deterministic. The costed planner
    measures this machine, so near-equal splits could come out differently on two ranks:
    every rank plans, then all adopt rank 0's plan (the hash check that follows still
    compares the graphs and parameters every rank built).
    """
    analysis = analyze(model, request.example_inputs, request.kwargs,
                       need_costs=given is None and not request.fixes_split)
    if given is not None:
        return given, analysis
    made = record(plan_request(analysis, request), model, analysis, request, request.strategy)
    return (made if request.fixes_split else _rank0_plan(made)), analysis


def _rank0_plan(made: Plan) -> Plan:
    """Rank 0's costed plan, on every rank (costs measured per machine may differ)."""
    box: list[Any] = [made.to_dict()]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def _agree_on_split_plan(model: nn.Module, given: Plan | None, request: PlanRequest,
                         shape: MeshShape, rules: Mapping[str, str] | None
                         ) -> tuple[Plan, Analysis, ShardPlan]:
    """The plan every rank runs when stages are split over ``tp`` ranks, with the capture
    (layers merged so that no stage boundary cuts a column/row pair) and the shard plan.

    The tensor-parallel pass decides the splits from the model alone, so every rank finds
    the same; the stage split follows :func:`_agree_on_plan`'s rules. A given plan must
    name the same layers and shard specs as the model and rules give here (and is returned
    as it is).
    """
    groups, parsed = device_groups([[d] * shape.tp for d in request.devices],
                                   dict(rules) if rules else shape.tp)
    setup = plan_groups(model, groups, parsed, request)
    made = setup.plan
    if given is not None:
        if list(given.layers) != list(made.layers):
            raise StrategyError(
                f"the plan's layers {list(given.layers)[:6]} are not the tensor-parallel "
                f"layers of this model {list(made.layers)[:6]}; re-plan the model with tp="
                f"{shape.tp}")
        if dict(given.shard_specs) != dict(made.shard_specs):
            differ = sorted(set(given.shard_specs.items()) ^ set(made.shard_specs.items()))
            raise StrategyError(
                f"the plan splits parameters otherwise than tp={shape.tp} with these rules "
                f"does (first differences: {differ[:4]}); pass the tensor_parallel= rules "
                "the plan was made with")
        made = given
    elif not request.fixes_split:
        made = _rank0_plan(made)
    return made, setup.analysis, setup.shard_plan


def _check_fingerprint(model: nn.Module, plan: Plan) -> None:
    if plan.fingerprint is None:
        return
    from partitioner.plans.fingerprint import differences, fingerprint

    found = differences(plan.fingerprint, fingerprint(model))
    if found:
        raise StrategyError("the plan was made for another model:\n"
                            + "\n".join(f"  - {line}" for line in found[:10])
                            + "\nre-plan this model, or run the plan on the model it was "
                              "made for")


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
                mesh: Mesh, device: torch.device,
                materializer: MaterializerFactory | None = None
                ) -> tuple[fx.GraphModule, ShardState | None]:
    """This rank's stage graph on its device and, when the stage is split over ``tp``
    ranks, the rank's slice with collectives on the stage replica's tp group. A meta-built
    stage is materialized on the device (a split one layer by layer, each rank keeping
    its slice)."""
    made = materializer(device) if materializer is not None else None
    if shard_plan is None:
        if made is not None:
            materialize_module(graph, made)
        return route_module_randomness(graph.to(device)).graph_module, None
    comm = ProcessGroupCommunicator(mesh.group("tp"))
    source = made.tensor if made is not None else None
    stage = route_module_randomness(
        shard_stage(graph, model, shard_plan, mesh.shard, device, source)).graph_module
    setattr(stage, COMM_ATTR, comm)
    keep_non_persistent(stage, non_persistent_names(graph))
    return stage, ShardState(stage_shardings(graph, model, shard_plan), mesh.shard, comm)


def _digest(plan: Plan, graphs: Sequence[fx.GraphModule], shape: MeshShape,
            settings: RunSettings) -> tuple[str, str]:
    """What every rank must agree on: the split, the settings, each stage's code and tensors."""
    body = {
        "layers": [list(s.layers) for s in plan.stages], "chunks": plan.chunks,
        "checkpoint": plan.checkpoint, "schedule": plan.schedule,
        "virtual_stages": settings.virtual,
        "mesh": [shape.pp, shape.dp, shape.tp], "loss_reduction": settings.loss_reduction,
        "shard_specs": sorted((k, repr(v)) for k, v in plan.shard_specs.items()),
        "bucket_bytes": settings.bucket_bytes, "seed": settings.seed,
        "stages": [{"code": gm.code,
                    "tensors": [(n, list(t.shape), str(t.dtype)) for n, t in
                                [*gm.named_parameters(), *gm.named_buffers()]]}
                   for gm in graphs]}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    summary = (f"balance {plan.balance}, chunks {plan.chunks}, {plan.schedule}, checkpoint "
               f"{plan.checkpoint}, pp={shape.pp} dp={shape.dp}, graphs {digest[:8]}")
    return digest, summary
