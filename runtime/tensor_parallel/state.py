"""The state dict of a tensor-parallel model: the original model's keys, whole tensors.

Both tensor-parallel runtimes, the one-process :class:`~partitioner.runtime.tensor_parallel.module.
TensorParallelModule` (every rank a thread) and the one-rank-per-process
:class:`~partitioner.runtime.tensor_parallel.multiprocess.DistributedTensorParallel`, hold rank
graphs whose parameters are slices, under names of their own. :class:`TensorParallelState`,
their common base (itself a :class:`~partitioner.runtime.wrapper.ModelWrapper`), makes their
``state_dict()`` the original model's: it replaces the rank entries by the original keys with
whole tensors (``full_tensor``, which each runtime gathers its own way) and, on
``load_state_dict``, splits each whole tensor into the entries of the ranks held here. It
also keeps the original entries no graph uses, so the state dict stays complete, and tells
``clip_grad_norm_`` which gradients count: every slice of a split parameter, one copy of a
replicated one.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from partitioner.runtime.tensor_parallel.sharding import Sharding
    >>> class Halves(TensorParallelState):  # both ranks of one Linear's weight, in rows
    ...     def __init__(self) -> None:
    ...         super().__init__({"weight": Sharding("colwise", 0, 2)}, {"weight": "w"})
    ...         self.ranks = nn.ModuleList(nn.Linear(2, 1, bias=False) for _ in range(2))
    ...         self._keep_unused({})
    ...     def _rank_tensors(self, key):
    ...         return [(r, m.weight) for r, m in enumerate(self.ranks)]
    ...     def full_tensor(self, key, grad=False):
    ...         return torch.cat([t.detach() for _, t in self._rank_tensors(key)])
    >>> model = Halves()
    >>> model.load_state_dict({"weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]])})
    <All keys matched successfully>
    >>> model.ranks[1].weight.tolist()
    [[3.0, 4.0]]
    >>> list(model.state_dict())
    ['weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from partitioner.runtime.tensor_parallel.sharding import Sharding, shard_tensor
from partitioner.runtime.wrapper import ModelWrapper, NormCombiner, local_norms

__all__ = ["TensorParallelState"]


class TensorParallelState(ModelWrapper):
    """Base of a tensor-parallel model whose state dict has the original model's keys.

    A subclass says which tensors it holds for an original key (:meth:`_rank_tensors`) and
    how it makes one whole (:meth:`full_tensor`); the state-dict mapping does the rest. It
    calls :meth:`_keep_unused` once its rank graphs' container is registered, so the unused
    entries come after the graphs' in ``parameters()``.

    Args:
        shardings: by original state-dict key; keys not named are replicated.
        sources: by original state-dict key, where the rank graphs hold it (read by the
            subclass; here only its keys, in order, matter).
        plan: what was decided (kept as ``.plan``).
        training: the model's train/eval mode when it was partitioned.
        combine_norms: how this process's partial gradient norm combines with the other
            ranks' (one process holding every rank: as it is).
    """

    def __init__(self, shardings: Mapping[str, Sharding], sources: Mapping[str, Any], *,
                 plan: Any = None, training: bool = True,
                 combine_norms: NormCombiner = local_norms) -> None:
        super().__init__(plan, training, combine_norms=combine_norms)
        self.shardings = dict(shardings)
        self._sources = dict(sources)
        self._unused_keys: dict[str, str] = {}

    def original_keys(self) -> list[str]:
        """The original model's state-dict keys, in its order."""
        return list(self._sources) + [k for k in self._unused_keys if k not in self._sources]

    def full_tensor(self, key: str, grad: bool = False) -> torch.Tensor | None:
        """The original entry ``key`` (or, with ``grad``, its gradient), whole."""
        raise NotImplementedError(f"{type(self).__name__} must define full_tensor")

    def _rank_tensors(self, key: str) -> list[tuple[int, torch.Tensor]]:
        """The ``(rank, tensor)`` pairs held here for the original entry ``key``."""
        raise NotImplementedError(f"{type(self).__name__} must define _rank_tensors")

    def _norm_grads(self) -> list[torch.Tensor]:
        """Each gradient of the unsplit model once: every slice of a split parameter, one
        copy of a replicated one (rank 0's)."""
        seen: set[int] = set()
        counted: list[torch.Tensor] = []
        for key in self.original_keys():
            split = self._split_sharding(key) is not None
            for rank, tensor in self._rank_tensors(key):
                if id(tensor) in seen or tensor.grad is None or not (split or rank == 0):
                    continue
                seen.add(id(tensor))
                counted.append(tensor.grad.detach())
        return counted

    def _keep_unused(self, unused: Mapping[str, torch.Tensor]) -> None:
        """Hold a copy of each original entry no graph uses, in ``self.unused``."""
        self.unused = nn.Module()
        for k, (key, tensor) in enumerate(unused.items()):
            attr = f"t{k}"
            if isinstance(tensor, nn.Parameter):
                self.unused.register_parameter(attr, nn.Parameter(tensor.detach().clone(),
                                                                  tensor.requires_grad))
            else:
                self.unused.register_buffer(attr, tensor.detach().clone())
            self._unused_keys[key] = attr

    def _unused_tensor(self, key: str) -> torch.Tensor | None:
        """The kept copy of the original entry ``key``; ``None`` if a graph uses it."""
        attr = self._unused_keys.get(key)
        return None if attr is None else getattr(self.unused, attr)

    def _split_sharding(self, key: str) -> Sharding | None:
        """How the ranks split the original entry ``key``; ``None`` when each holds it whole
        (replicated, ``tp == 1``, or unused)."""
        sharding = self.shardings.get(key)
        if sharding is None or not sharding.is_split or key in self._unused_keys:
            return None
        return sharding

    def _state_to_original(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Replace the ranks' entries by the original keys with whole tensors."""
        inner = tuple(f"{prefix}{name}." for name, _ in self.named_children())
        for key in [k for k in state_dict if k.startswith(inner)]:
            del state_dict[key]
        for key in self.original_keys():
            state_dict[prefix + key] = self.full_tensor(key)

    def _state_from_original(self, state_dict: dict[str, Any], prefix: str,
                             missing_keys: list[str]) -> None:
        """Turn whole tensors under the original keys into the entries of the ranks held
        here.

        Entries of a missing key, and entries of no original key, keep their current values.
        """
        held = {key: self._rank_tensors(key) for key in self.original_keys()}  # builds graphs
        entries = _entries(self, prefix)
        names: dict[int, list[str]] = {}
        for name, tensor in entries:
            names.setdefault(id(tensor), []).append(name)
        for key, tensors in held.items():
            if prefix + key not in state_dict:
                missing_keys.append(prefix + key)
                continue
            value = state_dict.pop(prefix + key)
            sharding = self._split_sharding(key)
            for rank, tensor in tensors:
                piece = value if sharding is None else shard_tensor(value, sharding, rank)
                for name in names.get(id(tensor), []):
                    state_dict[name] = piece
        for name, tensor in entries:
            state_dict.setdefault(name, tensor.detach())


def _entries(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under ``module`` by state-dict name, shared ones under
    each of their names (train- and eval-mode graphs share their tensors)."""
    base = prefix.removesuffix(".")
    return [*module.named_parameters(base, remove_duplicate=False),
            *module.named_buffers(base, remove_duplicate=False)]
