"""Checkpoints that never gather: ``torch.distributed.checkpoint`` folders of every rank's shards.

``dpm.save(folder, optimizer)`` has every rank write what it holds, in parallel, into one
``torch.distributed.checkpoint`` (DCP) folder: its stage's tensors under the original
model's keys, its optimizer state under the parameters' names. Nothing is gathered on one
rank. The replicas of a stage hold the same plain tensors, and DCP writes each once; an
FSDP stage's parameters and optimizer state are ``DTensor`` s (each replica writes its
shard); a tensor-parallel rank's slice is written as a ``DTensor`` over the stage's ``tp``
group, and with FSDP over tp slices FSDP's shard of the slice as a ``DTensor`` over the
stage's ``(tp, dp)`` mesh (:class:`TpLayout`; a fused, blocked entry such as a qkv
projection is gathered within those groups and written whole). DCP records where every
piece lies in the whole tensor, so ``dpm.load(folder, optimizer)`` reads, on each rank of
any other mesh, just the pieces its own stage (or shard) needs: a checkpoint saved at
``pp=2`` loads at ``dp=2`` or ``tp=2``.

Keys: ``model/<state-dict key>``, ``optim/<parameter>/<state key>`` (``exp_avg``,
``step``, ...), ``group/<parameter>`` (its group's hyperparameters), ``extra`` (steps, plan).
Tensors of the model that no stage holds (a buffer no graph reads) are written by rank 0.

:func:`checkpoint_to_state_dict` turns such a folder, offline and in one process, into the
unpartitioned model's state dict (``model.load_state_dict(sd, strict=True)``);
:func:`read_sharded_checkpoint` also returns the optimizer state by parameter name, the
format of the single-file checkpoints (``checkpoint_io``).

Example:
    >>> dpm.save("ckpt", optimizer)                          # doctest: +SKIP
    >>> dpm2.load("ckpt", optimizer2)         # any mesh        # doctest: +SKIP
    >>> model.load_state_dict(checkpoint_to_state_dict("ckpt"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import CheckpointError
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.fsdp import cut_like
from partitioner.runtime.tensor_parallel.shard_state import ShardState
from partitioner.runtime.tensor_parallel.sharding import shard_tensor

__all__ = ["is_sharded_checkpoint", "writes_one_file", "save_sharded", "load_sharded",
           "read_sharded_checkpoint", "checkpoint_to_state_dict", "TpLayout"]

MODEL, OPTIM, GROUP, EXTRA = "model/", "optim/", "group/", "extra"


class TpLayout:
    """How a tensor-parallel rank's slices are DTensors over its ``tp`` group.

    Args:
        shards: the stage's split entries (by state-dict key).
        mesh: a one-dimensional ``DeviceMesh`` over the stage replica's ``tp`` group, or
            with ``sharding="fsdp"`` the stage's ``(tp, dp)`` mesh: each slice is then
            FSDP's ``DTensor`` over the dp group, and its shard a piece of the whole tensor
            cut twice (``partitioner.runtime.distributed.fsdp.tp_dp_device_mesh``).
    """

    def __init__(self, shards: ShardState, mesh: Any) -> None:
        self.shards = shards
        self.mesh = mesh

    def blocked(self, key: str) -> bool:
        """Whether ``key`` is split in blocks (fused qkv): not one contiguous DTensor."""
        sharding = self.shards.shardings.get(key)
        return sharding is not None and sharding.blocks is not None

    def wrap(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's slice of ``key``, or a state shaped like it; FSDP's DTensor
        of it) as a DTensor of the whole tensor, sharing ``local``'s storage."""
        from torch.distributed.tensor import DTensor, Placement, Shard

        sharding = self.shards.shardings[key]
        assert sharding.dim is not None
        shape = list(local.shape)
        shape[sharding.dim] *= sharding.tp
        stride = torch.empty(shape, device="meta").stride()
        placements: list[Placement] = [Shard(sharding.dim)]
        if isinstance(local, DTensor):  # cut by tp, then by FSDP over the replicas
            placements += list(local.placements)
            local = local.to_local()
        return DTensor.from_local(local, self.mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def whole(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of ``key`` from this rank's slice (FSDP's shard of it gathered
        first; collective over the stage's tp, and dp, groups)."""
        return self.shards.gather({key: _full(local)})[key]

    def unwrap(self, loaded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a DTensor :meth:`wrap` made, as ``like`` holds it: a plain
        slice, or FSDP's DTensor over the replicas."""
        return _like(_local(loaded), like)

    def whole_entries(self, entries: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict's split entries of an FSDP stage as DTensors of the whole tensors
        (:meth:`wrap`: nothing gathered); a blocked one, not one DTensor, gathered whole
        (collective, in the same order on every rank)."""
        return {k: self.whole(k, v) if self.blocked(k) else self.wrap(k, v)
                for k, v in sorted(entries.items())}

    def cut_entries(self, entries: Mapping[str, torch.Tensor],
                    held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Split entries given whole (or as :meth:`whole_entries` made them) as this rank
        holds them (``held``: its stage's state dict)."""
        return {k: self.unwrap(v, held[k]) if hasattr(v, "to_local") and not self.blocked(k)
                else self.cut(k, _full(v), held[k]) for k, v in entries.items()}

    def cut(self, key: str, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor ``whole`` of ``key``, as ``like`` holds it."""
        piece = shard_tensor(whole, self.shards.shardings[key], self.shards.rank)
        return cut_like(piece, like)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as the local shard of a DTensor placed as ``like`` (if it is one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _save_planner() -> Any:
    """DCP's planner keeping our keys: nested values (hyperparameters, extra) stay whole."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(flatten_state_dict=False)


def _load_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    # Unflattened, the planner reads non-tensor values into the very dict it was given.
    return DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def writes_one_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``save(path)`` writes the one consolidated file (a ``.pt``/``.pth`` name)
    rather than a sharded checkpoint folder."""
    return Path(path).suffix in (".pt", ".pth")


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by :func:`save_sharded` (DCP's ``.metadata``)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _names(stage: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in stage.named_parameters()}


def _local_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state (``ZeroRedundancyOptimizer``'s inner one)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _stage_entries(stage: nn.Module, tp: TpLayout | None) -> dict[str, Any]:
    """This rank's model entries: DTensors where it holds a shard, whole tensors else."""
    state = stage.state_dict()
    out: dict[str, Any] = {}
    for key, value in state.items():
        if tp is not None and key in tp.shards.shardings:
            value = tp.whole(key, value) if tp.blocked(key) else tp.wrap(key, value)
        out[MODEL + key] = value
    return out


def _optimizer_entries(optimizer: Any, stage: nn.Module, tp: TpLayout | None
                       ) -> dict[str, Any]:
    names = _names(stage)
    params = dict(stage.named_parameters())
    if hasattr(optimizer, "named_state"):  # our sharded optimizer: its replicas' gathered
        return _named_entries(optimizer.named_state(), params, tp)
    local = _local_optimizer(optimizer)
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds parameters that are not this "
                                      "rank's stage's; build it over dpm.parameters() or "
                                      "with dpm.make_optimizer")
            out[GROUP + names[id(p)]] = hyper
    for p, state in local.state.items():
        name = names[id(p)]
        for key, value in state.items():
            out[f"{OPTIM}{name}/{key}"] = _tp_value(name, value, params, tp)
    return out


def _tp_value(name: str, value: Any, params: Mapping[str, torch.Tensor],
              tp: TpLayout | None) -> Any:
    """An optimizer state entry as DCP stores it: a tensor shaped like a tensor-parallel
    parameter's slice becomes the whole tensor's DTensor (or, blocked, the gathered whole)."""
    if isinstance(value, torch.Tensor) and tp is not None \
            and name in tp.shards.shardings and value.shape == params[name].shape:
        return tp.whole(name, value) if tp.blocked(name) else tp.wrap(name, value)
    return value


def _named_entries(named: Mapping[str, Any], params: Mapping[str, torch.Tensor],
                   tp: TpLayout | None) -> dict[str, Any]:
    """Entries of a whole optimizer state by parameter name (the sharded optimizer's
    ``named_state()``, the same on every replica: DCP writes each once)."""
    out: dict[str, Any] = {}
    for group in named["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.update({GROUP + name: hyper for name in group["params"]})
    for name, state in named["state"].items():
        for key, value in state.items():
            out[f"{OPTIM}{name}/{key}"] = _tp_value(name, value, params, tp)
    return out


def _optimizer_params(optimizer: Any, stage: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The stage's parameters an optimizer holds state for, by name (the sharded
    optimizer's state lies in its slices, but is saved by the parameters' names)."""
    grads = getattr(optimizer, "grads", None)
    if hasattr(optimizer, "named_state") and grads is not None:
        return [(name, p) for shard in grads.shards
                for name, p in zip(shard.names, shard.params)]
    names = _names(stage)
    return [(names[id(p)], p) for g in _local_optimizer(optimizer).param_groups
            for p in g["params"]]


def save_sharded(path: str | os.PathLike[str], stage: nn.Module, *,
                 optimizer: Any = None, tp: TpLayout | None = None,
                 extra: Mapping[str, Any] | None = None,
                 base_state: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> None:
    """Write this rank's part of the checkpoint folder ``path`` (collective: every rank).

    Args:
        path: the folder (created).
        stage: this rank's stage module (its keys are the model's).
        optimizer: this rank's optimizer (a ``torch.optim`` one over the stage, or torch's
            ``ZeroRedundancyOptimizer``), if its state is saved too.
        tp: with a stage split over ``tp`` ranks, how its slices are DTensors.
        extra: picklable values (the same on every rank).
        base_state: the whole model's state dict (called on rank 0 only): its tensors that
            no rank's stage holds are written from it.
    """
    import torch.distributed.checkpoint as dcp

    entries = _stage_entries(stage, tp)
    if optimizer is not None:
        entries.update(_optimizer_entries(optimizer, stage, tp))
    entries[EXTRA] = dict(extra or {})
    held: list[Any] = [None] * dist.get_world_size()
    with communicating(f"saving {path}: exchanging the stages' key names"):
        dist.all_gather_object(held, sorted(entries))
    if dist.get_rank() == 0 and base_state is not None:
        known = {key for keys in held for key in keys}
        for key, value in base_state().items():
            if MODEL + key not in known and isinstance(value, torch.Tensor) \
                    and not value.is_meta:
                entries[MODEL + key] = value
    Path(path).mkdir(parents=True, exist_ok=True)
    with communicating(f"saving the sharded checkpoint {path}"):
        dcp.save(entries, checkpoint_id=str(path), planner=_save_planner())


def _metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as error:
        raise CheckpointError(f"cannot read the sharded checkpoint {path} ({type(error).__name__}"
                              f": {error}); pass the folder save() wrote") from error


def _saved_key(key: str, saved: Mapping[str, Any], aliases: Mapping[str, list[str]]
               ) -> str | None:
    for candidate in [key, *aliases.get(key, [])]:
        if MODEL + candidate in saved:
            return candidate
    return None


def _model_targets(path: str | os.PathLike[str], stage: nn.Module, saved: Mapping[str, Any],
                   tp: TpLayout | None, aliases: Mapping[str, list[str]]
                   ) -> tuple[dict[str, Any], list[tuple[torch.Tensor, str, torch.Tensor]]]:
    """What to read for this stage, and the (parameter, key, whole tensor) to cut after."""
    targets: dict[str, Any] = {}
    cuts: list[tuple[torch.Tensor, str, torch.Tensor]] = []
    missing = []
    for key, value in stage.state_dict().items():
        found = _saved_key(key, saved, aliases)
        if found is None:
            missing.append(key)
            continue
        size = tuple(saved[MODEL + found].size)
        if tp is not None and key in tp.shards.shardings:
            if tp.blocked(key):
                whole = torch.empty(size, dtype=value.dtype)
                cuts.append((value, key, whole))
                targets[MODEL + found] = whole
                continue
            value = tp.wrap(key, value)
        if tuple(value.shape) != size:
            raise CheckpointError(f"{path} holds {key} of shape {size} but this model's is "
                                  f"{tuple(value.shape)}; pass a checkpoint of this model")
        targets[MODEL + found] = value
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} keys of this stage: "
                              f"{', '.join(missing[:8])}; it was saved from another model")
    return targets, cuts


def _refuse_unexpected(path: str | os.PathLike[str], saved: Mapping[str, Any],
                       model_keys: Collection[str]) -> None:
    known = set(model_keys)
    unexpected = [k[len(MODEL):] for k in saved
                  if k.startswith(MODEL) and k[len(MODEL):] not in known]
    if unexpected:
        raise CheckpointError(f"{path} holds {len(unexpected)} keys this model lacks: "
                              f"{', '.join(unexpected[:8])}; it was saved from another model: "
                              "pass a checkpoint of this model, or load(..., strict=False)")


def _optimizer_targets(optimizer: Any, stage: nn.Module, saved: Mapping[str, Any],
                       tp: TpLayout | None) -> dict[str, Any]:
    """Destinations of this rank's optimizer state (its own parameters' only): shaped like
    the parameter (an FSDP DTensor, a tp slice's DTensor, a whole tensor to cut for a blocked
    one), or as saved (a step count)."""
    targets: dict[str, Any] = {}
    for name, p in _optimizer_params(optimizer, stage):
        sliced = tp is not None and name in tp.shards.shardings and not tp.blocked(name)
        whole = tuple(tp.wrap(name, p.detach()).shape) if sliced and tp is not None \
            else tuple(p.shape)
        for full in (k for k in saved if k.startswith(f"{OPTIM}{name}/")):
            meta = saved[full]
            size = tuple(getattr(meta, "size", ()) or ())
            if not hasattr(meta, "size"):
                targets[full] = None  # a non-tensor value, read as it was saved
            elif size == whole and sliced and tp is not None:
                targets[full] = tp.wrap(name, torch.zeros_like(p))
            elif size == tuple(p.shape):  # in the saved dtype (a bf16 stage's fp32 moments)
                targets[full] = torch.zeros_like(p, dtype=meta.properties.dtype)
            else:  # a step count, or a blocked entry's whole state (cut when installed)
                targets[full] = torch.zeros(size, dtype=meta.properties.dtype)
        if GROUP + name in saved:
            targets[GROUP + name] = None
    return targets


def _install_optimizer(optimizer: Any, stage: nn.Module, loaded: Mapping[str, Any],
                       tp: TpLayout | None) -> None:
    names = _names(stage)
    params = dict(stage.named_parameters())
    named: dict[str, Any] = {}
    for name, _ in _optimizer_params(optimizer, stage):
        prefix = f"{OPTIM}{name}/"
        state = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tp is not None and name in \
                    tp.shards.shardings and not tp.blocked(name):
                state[key] = tp.unwrap(value, params[name]) if value.dim() else value
            elif isinstance(value, torch.Tensor) and value.dim() and tp is not None \
                    and tp.blocked(name) and value.shape != params[name].shape:
                state[key] = tp.cut(name, value, params[name])
        named[name] = state
    if hasattr(optimizer, "load_named_state"):  # our sharded optimizer cuts its slices
        group = next((v for k, v in loaded.items() if k.startswith(GROUP) and
                      isinstance(v, dict)), {})
        optimizer.load_named_state({"state": {k: v for k, v in named.items() if v},
                                    "param_groups": [group]})
        return
    local = _local_optimizer(optimizer)
    for name, p in _optimizer_params(optimizer, stage):
        if named[name]:
            local.state[p] = named[name]
        else:
            local.state.pop(p, None)
    for groups in {id(optimizer.param_groups): optimizer.param_groups,
                   id(local.param_groups): local.param_groups}.values():
        for group in groups:
            first = next((loaded[GROUP + names[id(p)]] for p in group["params"]
                          if isinstance(loaded.get(GROUP + names[id(p)]), dict)), None)
            if first is not None:
                group.update(first)


def load_sharded(path: str | os.PathLike[str], stage: nn.Module, *, optimizer: Any = None,
                 tp: TpLayout | None = None, model_keys: Collection[str] | None = None,
                 aliases: Mapping[str, list[str]] | None = None, strict: bool = True
                 ) -> dict[str, Any]:
    """Fill ``stage`` (and ``optimizer``) from the folder ``path`` (collective: every rank).

    Each rank reads only the pieces its stage, shard or FSDP shard covers, whatever mesh
    wrote the folder.

    Returns:
        The checkpoint's ``extra`` values.

    Raises:
        CheckpointError: not such a folder; a key of this stage missing or of another shape;
            with ``strict``, keys the model lacks; an optimizer given for a checkpoint
            saved without one.
    """
    import torch.distributed.checkpoint as dcp

    saved = _metadata(path)
    if strict and model_keys is not None:
        _refuse_unexpected(path, saved, model_keys)
    targets, cuts = _model_targets(path, stage, saved, tp, dict(aliases or {}))
    if optimizer is not None:
        if not any(k.startswith(GROUP) for k in saved):
            raise CheckpointError(f"{path} holds no optimizer state; save it with "
                                  "optimizer=, or load without one")
        targets.update(_optimizer_targets(optimizer, stage, saved, tp))
    targets[EXTRA] = None
    with torch.no_grad(), communicating(f"loading the sharded checkpoint {path}"):
        dcp.load(targets, checkpoint_id=str(path), planner=_load_planner())
        for value, key, whole in cuts:
            assert tp is not None
            _local(value).copy_(_local(tp.cut(key, whole, value)))
    if optimizer is not None:
        _install_optimizer(optimizer, stage, targets, tp)
    return dict(targets[EXTRA] or {})


def read_sharded_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole checkpoint in this process (offline; no process group needed): ``{"model":
    state dict, "optimizer": {"state": {name: {...}}, "param_groups": [...]} or None,
    "extra": {...}}``, the single-file checkpoints' layout.

    Raises:
        CheckpointError: if ``path`` is not a folder :func:`save_sharded` wrote.
    """
    import torch.distributed.checkpoint as dcp

    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint folder (no .metadata); "
                              "pass the folder dpm.save(folder) wrote")
    saved = _metadata(path)
    targets: dict[str, Any] = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        if hasattr(meta, "size") else None for key, meta in saved.items()}
    dcp.load(targets, checkpoint_id=str(path), planner=_load_planner(), no_dist=True)
    model = {k[len(MODEL):]: v for k, v in targets.items() if k.startswith(MODEL)}
    state: dict[str, dict[str, Any]] = {}
    for key, value in targets.items():
        if key.startswith(OPTIM):
            name, _, entry = key[len(OPTIM):].rpartition("/")
            state.setdefault(name, {})[entry] = value
    groups: dict[str, dict[str, Any]] = {}
    for key, hyper in targets.items():
        if key.startswith(GROUP):
            frozen = repr(sorted(hyper.items()))
            groups.setdefault(frozen, {**hyper, "params": []})["params"].append(
                key[len(GROUP):])
    optimizer = {"state": state, "param_groups": list(groups.values())} if groups else None
    return {"model": model, "optimizer": optimizer, "extra": dict(targets.get(EXTRA) or {})}


def checkpoint_to_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The unpartitioned model's state dict from a folder ``dpm.save(folder)`` wrote, in one
    process, offline: ``model.load_state_dict(checkpoint_to_state_dict(folder))``.

    Raises:
        CheckpointError: if ``path`` is not such a folder.
    """
    return dict(read_sharded_checkpoint(path)["model"])
