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

The wrapper only decides and hands off: it starts torch.distributed
(``partitioner.runtime.distributed.mesh``) and
the failure watchdog (``partitioner.runtime.distributed.failure``), makes the plan
(``partitioner.api``), checks all
ranks agree on it, splits the graph, predicts the shapes crossing each boundary by
fake-tensor propagation, and builds the rank's runtime
(``partitioner.runtime.distributed.pipeline``,
``partitioner.runtime.distributed.p2p``, ``partitioner.runtime.distributed.data_parallel``).
Design: ``docs/design/004-distributed.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.analysis import Analysis, analyze, build_stage_graphs
from partitioner.api import make_plan
from partitioner.errors import StrategyError
from partitioner.passes.fuse_weight_grads import fuse_weight_grads as fuse_linear_grads
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.planning.tp_rules import ShardPlan
from partitioner.plans.plan import Mesh as PlanMesh
from partitioner.plans.plan import Plan
from partitioner.runtime.distributed.agreement import check_same_settings
from partitioner.runtime.distributed.checkpoint_io import load_checkpoint, save_checkpoint
from partitioner.runtime.distributed.data_parallel import (
    DEFAULT_BUCKET_BYTES,
    GradReducer,
    TiedGradients,
)
from partitioner.runtime.distributed.failure import (
    FailurePolicy,
    Watchdog,
    check_same_plan,
    start_watchdog,
)
from partitioner.runtime.distributed.mesh import Coords, Mesh, MeshShape, init_distributed
from partitioner.runtime.distributed.p2p import Boundary, BoundaryMismatchError, PipeLinks
from partitioner.runtime.distributed.pipeline import DistributedPipeline, StageInterface
from partitioner.runtime.stage import StageRunner
from partitioner.runtime.tensor_parallel.collectives import ProcessGroupCommunicator
from partitioner.runtime.tensor_parallel.shard_state import ShardState
from partitioner.tensor_parallel import plan_tensor_parallel, shard_stage, stage_shardings

__all__ = ["partition_distributed", "DistributedModel", "BoundaryPredictor", "find_ties"]


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
        backend: str | None = None) -> DistributedModel:
    """Partition ``model`` over the ranks of this torch.distributed run; keep this rank's stage.

    Call it on every rank with the same arguments (collective). Starts torch.distributed
    from torchrun's environment when it is not started yet.

    Args:
        model: the whole model, built identically on every rank (same seed or weights).
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
        schedule: ``"1f1b"`` or ``"gpipe"`` (default: the plan's, else 1f1b).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"`` (default: the plan's, else
            never: 1F1B already bounds the activations a stage holds).
        balance: layers per stage (torchgpipe's ``balance``).
        split_points: module names at which a new stage begins.
        plan: a :class:`Plan` or plan file to run as written (its split, chunks, mesh).
        memory_limit: bytes per stage for the planner.
        loss_reduction: how ``loss_fn`` reduces a micro-batch, ``"mean"`` or ``"sum"``.
        bucket_mb: data-parallel all-reduce bucket size, in MiB.
        seed: base seed of the stages' dropout generators.
        failure: the watchdog's timings (see
        ``partitioner.runtime.distributed.failure.FailurePolicy``).
        fuse_weight_grads: add Linear layers' weight gradients into ``.grad`` in place, one
            product per micro-batch instead of a new tensor plus a sum
            (``partitioner.runtime.fused_linear``; Linear modules with hooks, and weights with
            tensor
            hooks, are left to autograd).
        backend: ``"gloo"`` or ``"nccl"`` if torch.distributed must be started.

    Returns:
        This rank's :class:`DistributedModel`.

    Raises:
        PartitionError: a subclass naming the bad value and a fix; ``PlanMismatchError``
            (on every rank) when ranks built different plans.

    Example:
        >>> dpm = partition_distributed(model, example_inputs=(x,), pp=2, dp=2, chunks=8,
        ...                             schedule="1f1b", checkpoint="never")  # doctest: +SKIP
    """
    given = Plan.load(plan) if isinstance(plan, (str, Path)) else plan
    if given is not None:
        # A plan fixes the stages; a replica count it names (> 1) is kept unless overridden.
        pp = len(given.stages) if pp is None else pp
        if dp is None and given.mesh is not None and given.mesh.dp > 1:
            dp = given.mesh.dp
        if tp is None and given.mesh is not None:
            tp = given.mesh.tp
    tp = 1 if tp is None else tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise StrategyError(f"tp={tp!r}; pass a whole number of tensor-parallel shards >= 1")
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
        fuse_weight_grads=fuse_weight_grads))
    shape = MeshShape.infer(info.world_size, pp=pp, dp=dp, tp=tp)
    settings = {"chunks": chunks, "schedule": schedule, "checkpoint": checkpoint}
    shard_plan: ShardPlan | None = None
    if shape.tp > 1:
        made, analysis, shard_plan = _agree_on_split_plan(
            model, given, shape, info.device.type, settings, example_inputs, example_kwargs,
            balance, split_points, memory_limit, tensor_parallel)
    else:
        made = _agree_on_plan(model, given, shape, info.device.type, settings,
                              example_inputs, example_kwargs, balance, split_points,
                              memory_limit)
        analysis = analyze(model, example_inputs, example_kwargs, need_costs=False)
    names = [layer.name for layer in analysis.layers]
    if names != list(made.layers):
        missing = [n for n in made.layers if n not in names]
        extra = [n for n in names if n not in made.layers]
        raise StrategyError(f"the plan's layers are not this model's: missing here "
                            f"{missing[:8]}, not in the plan {extra[:8]}; re-plan the model")
    home = _model_device(model)
    graphs = build_stage_graphs(analysis, replace(made, devices=(str(home),) * len(made.stages)))
    mesh = Mesh(shape)
    bucket_bytes = int(bucket_mb * 2**20)
    digest, summary = _digest(made, graphs, shape, loss_reduction, bucket_bytes, seed)
    check_same_plan(digest, summary)
    j = mesh.stage
    shards: ShardState | None = None
    if shard_plan is not None:
        # This rank's slice of its stage; collectives on the stage replica's tp group.
        comm = ProcessGroupCommunicator(mesh.group("tp"))
        stage = shard_stage(graphs[j], model, shard_plan, mesh.shard, info.device)
        setattr(stage, COMM_ATTR, comm)
        shards = ShardState(stage_shardings(graphs[j], model, shard_plan), mesh.shard, comm)
    else:
        stage = graphs[j].to(info.device)
    if fuse_weight_grads:
        fuse_linear_grads(stage)
    devices = [info.device if k == j else home for k in range(len(graphs))]
    links = PipeLinks(mesh.group("pp"), mesh.neighbour("pp", -1), mesh.neighbour("pp", 1),
                      info.device, batched=info.backend == "nccl")
    # The 1/dp of the replica average rides on the loss weights: the all-reduce just sums.
    reducer = (GradReducer(list(stage.parameters()), mesh.group("dp"), bucket_bytes,
                           predivided=True) if shape.dp > 1 else None)
    ties = find_ties(graphs)
    tied = _tie_groups(ties, mesh, stage)
    # A weight tied across stages is counted by its first stage only in gradient norms.
    not_first = frozenset(name for tie in ties for k, name in tie[1:] if k == j)
    pipeline = DistributedPipeline(
        StageRunner(j, stage, info.device, shard=mesh.shard if shards is not None else None),
        n_stages=shape.pp, links=links,
        interfaces=BoundaryPredictor(graphs, j, devices), schedule=made.schedule,
        chunks=made.chunks, checkpoint=made.checkpoint,
        restructure=analysis.captured.restructure, reducer=reducer, tied=tied, dp_size=shape.dp,
        loss_rank=j == shape.pp - 1 and mesh.shard == 0, loss_reduction=loss_reduction,
        grad_scale=1.0 / shape.dp)
    return DistributedModel(model, made, mesh, pipeline, stage,
                            bind=analysis.captured.placeholder_values, seed=seed,
                            watchdog=watchdog, shards=shards, norm_skip=not_first)


def _agree_on_plan(model: nn.Module, given: Plan | None, shape: MeshShape, kind: str,
                   settings: dict[str, Any], example_inputs: tuple[Any, ...] | None,
                   example_kwargs: dict[str, Any] | None, balance: Sequence[int] | None,
                   split_points: Sequence[str] | None, memory_limit: float | None) -> Plan:
    """The plan every rank runs.

    A given plan, ``balance=`` or ``split_points=`` is deterministic. The costed planner
    measures this machine, so near-equal splits could come out differently on two ranks:
    every rank plans, then all adopt rank 0's plan (the hash check that follows still
    compares the graphs and parameters every rank built).
    """
    chunks, schedule, checkpoint = _run_settings(model, given, settings, balance, split_points)
    mesh = PlanMesh(shape.dp, shape.pp, shape.tp)
    if given is not None:
        return replace(given, chunks=chunks, schedule=schedule, checkpoint=checkpoint,
                       mesh=mesh)
    made = make_plan(model, [kind] * shape.pp, "pipeline", example_inputs=example_inputs,
                     example_kwargs=example_kwargs, chunks=chunks, checkpoint=checkpoint,
                     balance=balance, split_points=split_points, memory_limit=memory_limit)
    if balance is None and split_points is None:
        made = _rank0_plan(made)
    return replace(made, schedule=schedule, mesh=mesh)


def _run_settings(model: nn.Module, given: Plan | None, settings: dict[str, Any],
                  balance: Sequence[int] | None, split_points: Sequence[str] | None
                  ) -> tuple[int, str, str]:
    """Chunks, schedule and checkpoint mode (the call's, else the given plan's, else the
    defaults), after checking a given plan fits the model and is not overridden."""
    if given is not None:
        if balance is not None or split_points is not None:
            raise StrategyError("plan= fixes the split; drop balance= and split_points=")
        _check_fingerprint(model, given)
    return (settings["chunks"] or (given.chunks if given else 1),
            settings["schedule"] or (given.schedule if given else "1f1b"),
            settings["checkpoint"] or (given.checkpoint if given else "never"))


def _rank0_plan(made: Plan) -> Plan:
    """Rank 0's costed plan, on every rank (costs measured per machine may differ)."""
    box: list[Any] = [made.to_dict()]
    dist.broadcast_object_list(box, src=0)
    return Plan.from_dict(box[0])


def _agree_on_split_plan(model: nn.Module, given: Plan | None, shape: MeshShape, kind: str,
                         settings: dict[str, Any], example_inputs: tuple[Any, ...] | None,
                         example_kwargs: dict[str, Any] | None,
                         balance: Sequence[int] | None, split_points: Sequence[str] | None,
                         memory_limit: float | None, rules: Mapping[str, str] | None
                         ) -> tuple[Plan, Analysis, ShardPlan]:
    """The plan every rank runs when stages are split over ``tp`` ranks, with the capture
    (layers merged so that no stage boundary cuts a column/row pair) and the shard plan.

    The tensor-parallel pass decides the splits from the model alone, so every rank finds
    the same; the stage split follows :func:`_agree_on_plan`'s rules. A given plan must
    name the same layers and shard specs as the model and rules give here.
    """
    chunks, schedule, checkpoint = _run_settings(model, given, settings, balance, split_points)
    if given is not None:
        balance = given.balance
    groups = [[kind] * shape.tp for _ in range(shape.pp)]
    setup = plan_tensor_parallel(model, groups, dict(rules) if rules else shape.tp,
                                 strategy="pipeline", example_inputs=example_inputs,
                                 example_kwargs=example_kwargs, chunks=chunks,
                                 checkpoint=checkpoint, balance=balance,
                                 split_points=split_points, memory_limit=memory_limit)
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
        made = replace(given, chunks=chunks, checkpoint=checkpoint)
    elif balance is None and split_points is None:
        made = _rank0_plan(made)
    mesh = PlanMesh(shape.dp, shape.pp, shape.tp)
    return replace(made, schedule=schedule, mesh=mesh), setup.analysis, setup.shard_plan


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


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def find_ties(graphs: Sequence[fx.GraphModule]) -> list[tuple[tuple[int, str], ...]]:
    """Parameters used by more than one stage: per shared tensor, ``(stage, name)`` pairs.

    Example:
        >>> a = torch.nn.Linear(2, 2)
        >>> find_ties([fx.symbolic_trace(a), fx.symbolic_trace(a)])
        [((0, 'weight'), (1, 'weight')), ((0, 'bias'), (1, 'bias'))]
    """
    users: dict[int, list[tuple[int, str]]] = {}
    for j, gm in enumerate(graphs):
        for name, param in gm.named_parameters():
            if all(stage != j for stage, _ in users.get(id(param), [])):
                users.setdefault(id(param), []).append((j, name))
    return [tuple(u) for u in users.values() if len(u) > 1]


def _tie_groups(ties: list[tuple[tuple[int, str], ...]], mesh: Mesh,
                stage: fx.GraphModule) -> TiedGradients | None:
    """One process group per tie and replica (collective); this rank's parameters in them."""
    mine = []
    for tie in ties:
        for replica in range(mesh.shape.dp):
            for shard in range(mesh.shape.tp):
                ranks = [mesh.shape.rank_of(Coords(j, replica, shard)) for j, _ in tie]
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    name = next(n for j, n in tie if j == mesh.stage)
                    mine.append((stage.get_parameter(name), group))
    return TiedGradients(mine) if mine else None


def _digest(plan: Plan, graphs: Sequence[fx.GraphModule], shape: MeshShape, reduction: str,
            bucket_bytes: int, seed: int) -> tuple[str, str]:
    """What every rank must agree on: the split, the settings, each stage's code and tensors."""
    body = {
        "layers": [list(s.layers) for s in plan.stages], "chunks": plan.chunks,
        "checkpoint": plan.checkpoint, "schedule": plan.schedule,
        "mesh": [shape.pp, shape.dp, shape.tp], "loss_reduction": reduction,
        "shard_specs": sorted((k, repr(v)) for k, v in plan.shard_specs.items()),
        "bucket_bytes": bucket_bytes, "seed": seed,
        "stages": [{"code": gm.code,
                    "tensors": [(n, list(t.shape), str(t.dtype)) for n, t in
                                [*gm.named_parameters(), *gm.named_buffers()]]}
                   for gm in graphs]}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    summary = (f"balance {plan.balance}, chunks {plan.chunks}, {plan.schedule}, checkpoint "
               f"{plan.checkpoint}, pp={shape.pp} dp={shape.dp}, graphs {digest[:8]}")
    return digest, summary


class BoundaryPredictor:
    """What crosses this stage's boundaries, predicted by running stages ``0..j`` on fake
    tensors (no compute, no data), once per distinct micro-batch signature.

    Args:
        graphs: every stage's graph (other stages only lend their structure and shapes).
        stage: this rank's stage ``j``.
        devices: where each stage's parameters live on this rank.
    """

    def __init__(self, graphs: Sequence[fx.GraphModule], stage: int,
                 devices: Sequence[torch.device]) -> None:
        self.graphs = list(graphs)
        self.stage = stage
        self.devices = list(devices)
        self._cache: dict[Any, StageInterface] = {}

    def __call__(self, micro: list[list[Any]]) -> list[StageInterface]:
        return [self.interface(values) for values in micro]

    def interface(self, values: list[Any]) -> StageInterface:
        """This stage's interface for one micro-batch of stage-0 placeholder values."""
        key = _signature(values)
        if key not in self._cache:
            self._cache[key] = self._predict(values)
        return self._cache[key]

    def _predict(self, values: list[Any]) -> StageInterface:
        j, last = self.stage, len(self.graphs) - 1
        boundaries: list[Boundary] = []
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad(), \
                _eval_mode(self.graphs[:j + 1]):
            current = pytree.tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, values)
            for k in range(min(j, last - 1) + 1):
                device = self.devices[k]
                current = pytree.tree_map(
                    lambda v, d=device: v.to(d) if isinstance(v, torch.Tensor) else v, current)
                gm = self.graphs[k]
                try:
                    out = type(gm).forward(gm, *current)
                except Exception as error:
                    raise BoundaryMismatchError(
                        f"cannot predict what stage {k} sends on ({type(error).__name__}: "
                        f"{error}); values crossing stages must have shapes that follow from "
                        "the input shapes (no data-dependent shapes at a boundary)") from error
                boundaries.append(Boundary.of(out))
                current = list(out)
        return StageInterface(boundaries[j - 1] if j > 0 else None,
                              boundaries[j] if j < last else None)


def _signature(values: list[Any]) -> Any:
    leaves, spec = pytree.tree_flatten(values)
    return str(spec), tuple((tuple(v.shape), v.dtype, v.device.type)
                            if isinstance(v, torch.Tensor) else ("value", repr(v))
                            for v in leaves)


@contextmanager
def _eval_mode(graphs: Sequence[nn.Module]) -> Iterator[None]:
    # Eval mode keeps batch norm from updating real running statistics with fake values.
    modes = {m: m.training for gm in graphs for m in gm.modules()}
    for m in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


class DistributedModel(nn.Module):
    """This rank's stage of a model partitioned over processes.

    ``parameters()`` are this rank's stage's (give them to any optimizer); ``state_dict()``
    is this stage's part with the original model's keys, whole tensors even when the stage
    is split over ``tp`` ranks (then it is a collective: every rank of the stage replica's
    tp group calls it, and ``load_state_dict`` keeps each rank's slice); ``train()``/
    ``eval()`` work as usual. Calling it is not supported: a pipeline stage alone has no
    meaningful output, so training goes through :meth:`step` and evaluation through
    :meth:`evaluate`.

    Attributes:
        plan: the plan every rank runs.
        mesh: this rank's place in the (pp, dp, tp) mesh and its groups.
        pipeline: the runtime executing the stage.
        steps: training steps run so far (saved in checkpoints; seeds dropout).
    """

    _model: nn.Module

    def __init__(self, model: nn.Module, plan: Plan, mesh: Mesh, pipeline: DistributedPipeline,
                 stage: fx.GraphModule, *,
                 bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]], seed: int,
                 watchdog: Watchdog, shards: ShardState | None = None,
                 norm_skip: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.stage = stage
        self.plan = plan
        self.mesh = mesh
        self.pipeline = pipeline
        self.steps = 0
        self.__dict__["_model"] = model  # not a submodule: its other stages are not ours
        self._bind = bind
        self._seed = seed
        self._watchdog = watchdog
        self._shards = shards
        self._norm_skip = norm_skip
        self.register_state_dict_post_hook(_strip_stage_prefix)
        self.register_state_dict_post_hook(_gather_shards)
        self.register_load_state_dict_pre_hook(_split_shards)
        self.register_load_state_dict_pre_hook(_add_stage_prefix)

    @property
    def stage_index(self) -> int:
        """The pipeline stage this rank runs."""
        return self.mesh.stage

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss."""
        return self.mesh.stage == self.mesh.shape.pp - 1

    def _values(self, inputs: Any, kwargs: dict[str, Any] | None) -> list[Any]:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return self._bind(args, dict(kwargs or {}))

    def _step_seed(self) -> int:
        key = (self._seed, self.steps, self.mesh.replica, self.mesh.stage)
        return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little")

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             kwargs: dict[str, Any] | None = None) -> float:
        """One training step's forward and backward over the pipeline; returns its loss.

        Every rank of a replica passes the same batch (stage 0 reads ``inputs``, the last
        stage ``targets``; the others use their shapes). Gradients accumulate into this
        stage's ``.grad`` exactly as full-batch training would produce them (averaged over
        replicas); then call your optimizer's ``step()``.

        Args:
            inputs: the model's positional input (a tensor) or a tuple of them.
            targets: what ``loss_fn`` compares with (any pytree split like the inputs).
            loss_fn: ``loss_fn(outputs, targets) -> scalar``, run per micro-batch.
            kwargs: keyword inputs of the model.

        Returns:
            The loss of the whole batch, averaged over replicas, on every rank.
        """
        with self._watchdog.guard():
            loss = self.pipeline.step(self._values(inputs, kwargs), targets, loss_fn,
                                      seed=self._step_seed())
        self.steps += 1
        return loss

    def evaluate(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                 *, kwargs: dict[str, Any] | None = None) -> float:
        """The loss of a batch without autograd (call ``eval()`` first for eval mode)."""
        with self._watchdog.guard():
            return self.pipeline.evaluate(self._values(inputs, kwargs), targets, loss_fn,
                                          seed=self._step_seed())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a DistributedModel runs one pipeline stage; train with "
                        "dpm.step(inputs, targets, loss_fn) and evaluate with dpm.evaluate(...)")

    def save(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write one consolidated checkpoint from rank 0 (collective; all ranks call it).

        ``torch.load(path)["model"]`` loads into the unpartitioned model; :meth:`load`
        resumes a partitioned run from it.
        """
        contributes = self.mesh.replica == 0 and self.mesh.shard == 0
        base = self._model.state_dict() if self.mesh.rank == 0 else {}
        same: dict[int, list[str]] = {}
        for key, tensor in self._model.state_dict(keep_vars=True).items():
            same.setdefault(id(tensor), []).append(key)
        with self._watchdog.guard():
            save_checkpoint(path, self.stage, contributes=contributes,
                            group=self.mesh.group("pp"), base_state=base, optimizer=optimizer,
                            extra={"steps": self.steps, "plan": self.plan.to_dict()},
                            aliases=[keys for keys in same.values() if len(keys) > 1],
                            shards=self._shards)

    def load(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume from a checkpoint written by :meth:`save` (each rank reads its part)."""
        extra = load_checkpoint(path, self.stage, optimizer=optimizer, shards=self._shards)
        self.steps = int(extra.get("steps", 0))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients (collective).

        Call it on every rank after :meth:`step` and before ``optimizer.step()``. The norm
        is the unpartitioned model's: each gradient counts once although ranks hold copies
        (replicas hold the same averaged gradients; a replicated parameter of a split stage
        counts on tp rank 0, a split one by all its slices; a weight tied across stages on
        its first stage). Every rank scales its own gradients by the same factor.

        Returns:
            The total norm of the gradients (before clipping), the same on every rank.

        Raises:
            RuntimeError: with ``error_if_nonfinite``, if the norm is nan or infinite.
        """
        norm_type = float(norm_type)
        split = self._shards.shardings if self._shards is not None else {}
        grads = {name: p.grad.detach() for name, p in self.stage.named_parameters()
                 if p.grad is not None}
        counted = [g for name, g in grads.items() if name not in self._norm_skip
                   and (name in split or self.mesh.shard == 0)]
        device = self.pipeline.runner.device
        if norm_type == float("inf"):
            total = torch.stack([g.abs().max().double() for g in counted]).max().to(device) \
                if counted else torch.zeros((), dtype=torch.float64, device=device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = torch.zeros((), dtype=torch.float64, device=device)
            for g in counted:
                total += g.double().norm(norm_type).to(device) ** norm_type
            dist.all_reduce(total)  # every replica added the same sum
            total = (total / self.mesh.shape.dp) ** (1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"{float(total)}; pass error_if_nonfinite=False to scale anyway")
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads.values():
            g.mul_(factor.to(g.device, g.dtype))
        dtype = next(iter(grads.values())).dtype if grads else torch.float32
        return total.to(dtype)  # as torch's: in the gradients' dtype

    def close(self) -> None:
        """Remove the data-parallel hooks (the process group stays up)."""
        if self.pipeline.reducer is not None:
            self.pipeline.reducer.close()


def _strip_stage_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + "stage."):
            state_dict[prefix + key[len(prefix) + len("stage."):]] = state_dict.pop(key)


def _gather_shards(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   local_metadata: Any) -> None:
    _convert_shards(module, state_dict, prefix, whole=True)


def _split_shards(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  *args: Any) -> None:
    _convert_shards(module, state_dict, prefix, whole=False)


def _convert_shards(module: nn.Module, state_dict: dict[str, Any], prefix: str, *,
                    whole: bool) -> None:
    """Make the split entries of ``state_dict`` whole (a collective) or this rank's slices."""
    shards: ShardState | None = module._shards  # type: ignore[assignment]
    if shards is None:
        return
    entries = {k: state_dict[prefix + k] for k in shards.shardings if prefix + k in state_dict}
    converted = shards.gather(entries) if whole else shards.split(entries)
    for key, value in converted.items():
        state_dict[prefix + key] = value


def _add_stage_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                      *args: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + "stage."):
            state_dict[prefix + "stage." + key[len(prefix):]] = state_dict.pop(key)
