"""Save and load a partitioned run as one consolidated checkpoint.

Each stage's module names its parameters as the original model does, so the state of the
whole model is the union of the stages' states. Rank 0 gathers the stages' states (from
replica 0, shard 0; the other replicas hold the same values) and writes one file::

    {"format": "partitioner.checkpoint", "version": 1,
     "model": {key: tensor},                       # the unpartitioned model's state dict
     "optimizer": {"state": {key: {...}}, "param_groups": [{..., "params": [key, ...]}]},
     "extra": {...}}                               # e.g. the step counter, the plan

``torch.load(path, weights_only=True)["model"]`` loads into the unpartitioned model; the
optimizer state is keyed by parameter name, so it loads into any partitioned run of the
model (same plan or not), each rank taking its own parameters' entries, and training resumes
exactly.

The file is written atomically: to a temporary file in the same directory, flushed and
fsynced, then renamed over the target with ``os.replace``. A crash leaves the previous file
intact, never a half-written one. The temporary is removed on any failure the writer lives
through (an exception, or the failure watchdog stopping the process); one left by a writer
that was killed is named after its host and process id, and the next save to the same path
removes it once that process is gone. A peer waiting for rank 0 to write the file, whose
wait fails because rank 0 died, raises a ``CommunicationError`` naming rank 0.

Example:
    >>> import tempfile, torch, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    >>> atomic_save({"w": torch.ones(2)}, path)
    >>> torch.load(path, weights_only=True)["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import CheckpointError, CheckpointWriteError
from partitioner.runtime.distributed.comm_failure import communicating
from partitioner.runtime.distributed.failure import undo_on_abort
from partitioner.runtime.distributed.weights_file import read_weights
from partitioner.runtime.distributed.weights_folder import read_folder
from partitioner.runtime.distributed.zero import ShardedOptimizer
from partitioner.runtime.tensor_parallel.shard_state import ShardState

__all__ = ["CheckpointError", "CheckpointWriteError", "atomic_save", "remove_stale_temporaries",
           "named_optimizer_state", "load_named_optimizer_state", "merge_optimizer_states",
           "save_checkpoint", "load_checkpoint", "read_checkpoint", "read_any",
           "refuse_unexpected", "FORMAT", "VERSION"]

FORMAT = "partitioner.checkpoint"
VERSION = 1
_RANK0_HINT = ("rank 0, which writes the checkpoint, or another rank most likely died (the "
               "first rank that failed is named in the logs); a file already at that path "
               "keeps its previous contents: resume from it")


def _writer_tag() -> str:
    return f"w{os.getpid()}@{socket.gethostname()}"


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries of ``path`` whose writer, on this host, no longer runs.

    A writer killed while saving (a signal, the out-of-memory killer) cannot remove its
    temporary file; its name says which process wrote it. Temporaries of live processes
    and of other hosts are left alone.

    Returns:
        The files removed.
    """
    target = Path(path)
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.w(\d+)@(.+)\.[^.]+\.tmp$")
    removed = []
    host = socket.gethostname()
    for candidate in target.parent.glob(f".{target.name}.w*.tmp"):
        match = pattern.match(candidate.name)
        if match is None or match.group(2) != host:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not _alive(pid):
            _unlink(candidate)
            removed.append(candidate)
    return removed


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` so that ``path`` is either the old file or the new one.

    Raises:
        CheckpointWriteError: if writing fails (disk full, no permission); the temporary
            file is removed and ``path`` keeps its previous contents.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.{_writer_tag()}.", suffix=".tmp",
                                    dir=target.parent)
    except OSError as error:
        raise CheckpointWriteError(f"cannot write a checkpoint in {target.parent}: {error}; "
                                   "save to a directory this process may write") from error
    try:
        with undo_on_abort(lambda: _unlink(temp)):
            with os.fdopen(fd, "wb") as handle:
                torch.save(obj, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, target)
    except BaseException as error:
        _unlink(temp)
        if isinstance(error, OSError):
            raise CheckpointWriteError(
                f"writing the checkpoint {target} failed: {type(error).__name__}: {error}; "
                f"{target} keeps its previous contents; free disk space (or fix the "
                "directory's permissions) and save again") from error
        raise
    try:
        directory = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory)
    except OSError:
        pass
    finally:
        os.close(directory)


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    by_id = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    names, stray = [], 0
    for p in _ordered_params(optimizer):
        if id(p) not in by_id:
            stray += 1
        names.append(by_id.get(id(p), ""))
    if stray:
        raise CheckpointError(f"the optimizer holds {stray} parameters that are not this "
                              "rank's stage's; build it over the partitioned model's "
                              "parameters(), e.g. torch.optim.Adam(dpm.parameters())")
    return names


def named_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module
                          ) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named as in ``module`` instead of numbered."""
    names = _names(module, optimizer)
    local = optimizer.state_dict()
    state = {names[index]: _to_cpu(value) for index, value in local["state"].items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [names[index] for index in group["params"]]}
              for group in local["param_groups"]]
    return {"state": state, "param_groups": groups}


def merge_optimizer_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One named optimizer state from the stages' (group ``g`` of each stage merged)."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in parts:
        merged["state"].update(part["state"])
        for g, group in enumerate(part["param_groups"]):
            if g == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            merged["param_groups"][g]["params"] += group["params"]
    return merged


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module,
                               named: dict[str, Any]) -> None:
    """Load a named optimizer state into ``optimizer`` over ``module``'s parameters.

    Raises:
        CheckpointError: if the optimizer has more parameter groups than the checkpoint.
    """
    names = _names(module, optimizer)
    local = optimizer.state_dict()
    if len(local["param_groups"]) > len(named["param_groups"]):
        raise CheckpointError(f"the optimizer has {len(local['param_groups'])} parameter "
                              f"groups but the checkpoint {len(named['param_groups'])}; "
                              "build the optimizer with the groups it was saved with")
    groups = [{**{k: v for k, v in named["param_groups"][g].items() if k != "params"},
               "params": group["params"]} for g, group in enumerate(local["param_groups"])]
    state = {index: named["state"][names[index]]
             for group in local["param_groups"] for index in group["params"]
             if names[index] in named["state"]}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def save_checkpoint(path: str | os.PathLike[str], stage: nn.Module, *, contributes: bool,
                    group: Any, base_state: dict[str, Any],
                    optimizer: torch.optim.Optimizer | ShardedOptimizer | None = None,
                    extra: dict[str, Any] | None = None,
                    aliases: Sequence[Sequence[str]] = (), shards: ShardState | None = None
                    ) -> None:
    """Gather every stage's state on rank 0 and write one checkpoint (collective, all ranks).

    Args:
        path: the file to write (rank 0 writes it).
        stage: this rank's stage module; its state-dict keys are the model's.
        contributes: whether this rank sends its stage (one rank per stage: replica 0,
            shard 0); those ranks must form ``group``, which contains rank 0.
        group: the process group of the contributing ranks (ignored on the others).
        base_state: rank 0's full model state; keys no stage holds keep these values
            (``None`` values, a meta-built model's tensors, are dropped unless a stage holds
            them).
        optimizer: this rank's optimizer, if its state is saved too (a sharded one gathers
            its replicas' slices: then every rank must call this).
        extra: more picklable values to store (the same on every rank).
        aliases: groups of keys naming one tensor in the model (tied weights); a stage may
            name it by any of them, and every key of the group gets the stage's value.
        shards: when ``stage`` is one tensor-parallel rank's slice, which entries are split;
            every rank of the group then gathers the whole tensors (also of the optimizer
            state) before its shard 0 contributes them.
    """
    model_state: dict[str, Any] = stage.state_dict()
    optim_state = _named_state(optimizer, stage) if optimizer is not None else None
    if shards is not None:
        model_state = shards.gather(model_state)
        if optim_state is not None:
            params = dict(stage.named_parameters(remove_duplicate=False))
            optim_state = shards.gather_optimizer(optim_state, params)
    if contributes:
        part = {"model": {k: _to_cpu(v) for k, v in model_state.items()},
                "optimizer": _to_cpu(optim_state)}
        rank = dist.get_rank()
        gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
        with communicating(f"saving {path}: gathering the stages' states on rank 0",
                           _RANK0_HINT):
            dist.gather_object(part, gathered, dst=0, group=group)
        if rank == 0:
            assert gathered is not None
            model = {k: _to_cpu(v) for k, v in base_state.items()}
            provided: set[str] = set()
            for piece in gathered:
                model.update({k: v for k, v in piece["model"].items() if k in model})
                provided.update(piece["model"])
            for keys in aliases:
                source = next((k for k in keys if k in provided), None)
                if source is not None:
                    model.update({key: model[source] for key in keys})
            # A meta-built model's base holds None where no stage provided a value.
            model = {k: v for k, v in model.items() if v is not None}
            optim = (merge_optimizer_states([p["optimizer"] for p in gathered])
                     if optimizer is not None else None)
            atomic_save({"format": FORMAT, "version": VERSION, "model": model,
                         "optimizer": optim, "extra": dict(extra or {})}, path)
    with communicating(f"saving {path}: waiting for rank 0 to write the file", _RANK0_HINT):
        dist.barrier()


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint file written by :func:`save_checkpoint`."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as error:
        raise CheckpointError(f"no checkpoint at {path}; pass the path save() wrote") from error
    except Exception as error:  # a folder, a truncated file, not a torch.save file
        raise CheckpointError(f"cannot read {path} as a checkpoint ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); pass "
                              "the file save() wrote") from error
    return _checked(data, path)


def _checked(data: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a partitioner checkpoint (format "
                              f"{data.get('format') if isinstance(data, dict) else None!r}); "
                              "a plain state dict loads with load_state_dict instead")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {data.get('version')!r}; this "
                              f"partitioner reads version {VERSION}")
    return data


def read_any(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint, or a whole-model state dict (``torch.save`` or safetensors) as one
    without optimizer state, its tensors read only when used; a folder is read as
    transformers' safetensors shards with their index (``weights_folder``)."""
    data = read_folder(path) if Path(path).is_dir() else read_weights(path)
    if isinstance(data, dict) and "format" in data:
        return _checked(data, path)
    if isinstance(data, Mapping) and all(isinstance(v, torch.Tensor) for v in data.values()):
        return {"model": data, "optimizer": None, "extra": {}}
    raise CheckpointError(f"{path} holds a {type(data).__name__}, neither a partitioner "
                          "checkpoint nor a state dict of tensors; pass a file written by "
                          "save() or torch.save(model.state_dict(), path)")


def load_checkpoint(path: str | os.PathLike[str], stage: nn.Module, *,
                    optimizer: torch.optim.Optimizer | ShardedOptimizer | None = None,
                    shards: ShardState | None = None,
                    model_keys: Collection[str] | None = None,
                    strict: bool = True) -> dict[str, Any]:
    """Load this rank's part of a checkpoint into ``stage`` (and ``optimizer``).

    Every rank reads the file (a filesystem all ranks see), only the tensors of its stage
    (``weights_file``): a checkpoint :func:`save_checkpoint` wrote, or the whole model's
    state dict saved with ``torch.save`` or as a ``.safetensors`` file. With ``shards``
    (``stage`` is one tensor-parallel rank's slice) each rank keeps its slice of every split
    entry, cutting one whole tensor at a time.

    A file holding keys the whole model lacks (``model_keys``) is another model's, whose
    weights would be loaded only in part; with ``strict`` (the default, as
    ``nn.Module.load_state_dict``) it is refused, naming them.

    Args:
        path: the file.
        stage: this rank's stage; its state-dict keys are the model's.
        optimizer: the optimizer to restore too.
        shards: how a tensor-parallel rank cuts its slices.
        model_keys: every state-dict key of the whole model (``None``: not checked).
        strict: refuse a file with keys outside ``model_keys`` (``False``: ignore them).

    Returns:
        The checkpoint's ``extra`` values.

    Raises:
        CheckpointError: a malformed file, a key of this stage missing from it, with
            ``strict`` a key the model lacks, or an optimizer given for a checkpoint saved
            without one.
    """
    data = read_any(path)
    if strict and model_keys is not None:
        refuse_unexpected(path, data["model"], model_keys)
    own = stage.state_dict()
    missing = [k for k in own if k not in data["model"]]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} keys of this stage: "
                              f"{', '.join(missing[:8])}; it was saved from another model: "
                              "pass a file of this model's whole state dict")
    source = data["model"]  # a safetensors file reads a tensor on lookup: one at a time
    with torch.no_grad():
        for key, value in own.items():
            part = shards.split({key: source[key]})[key] if shards is not None else source[key]
            if tuple(part.shape) != tuple(value.shape):
                raise CheckpointError(f"{path} holds {key} of shape {tuple(part.shape)} but "
                                      f"this stage's is {tuple(value.shape)}; pass a file of "
                                      "this model's state dict")
            value.copy_(part)
    if optimizer is not None:
        if data.get("optimizer") is None:
            raise CheckpointError(f"{path} holds no optimizer state; save it with "
                                  "optimizer=, or load without one")
        named = data["optimizer"]
        if shards is not None:
            named = shards.split_optimizer(named, {k: source[k] for k in own})
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.load_named_state(named, _aliases(stage))
        else:
            load_named_optimizer_state(optimizer, stage, named)
    return dict(data.get("extra") or {})


def refuse_unexpected(path: str | os.PathLike[str], saved: Mapping[str, Any],
                      model_keys: Collection[str]) -> None:
    """Raise a :class:`CheckpointError` naming the keys of ``saved`` the model lacks."""
    known = set(model_keys)
    unexpected = [k for k in saved if k not in known]
    if unexpected:
        raise CheckpointError(f"{path} holds {len(unexpected)} keys this model lacks: "
                              f"{', '.join(unexpected[:8])}; it was saved from another model: "
                              "pass a file of this model's state dict, or load(..., "
                              "strict=False) to ignore them")


def _named_state(optimizer: torch.optim.Optimizer | ShardedOptimizer, stage: nn.Module
                 ) -> dict[str, Any]:
    """The optimizer's whole state by parameter name (a sharded one gathers its replicas')."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.named_state()
    return named_optimizer_state(optimizer, stage)


def _aliases(stage: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter of ``stage``, by each of its names (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {name: group for group in names.values() for name in group}
