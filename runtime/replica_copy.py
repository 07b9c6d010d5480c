"""What one data-parallel replica is, and how the replicas' tensors stay one model.

:class:`GraphReplica` is the plainest replica: the captured model's graph, called whole on
one device (a plan with one pipeline stage, no tensor parallelism, one micro-batch). The
replicas of a :class:`~partitioner.runtime.replicas.ReplicatedModule` may also be pipelines
(``PartitionedModule``) or tensor-parallel modules; this module does not care which.

:class:`ReplicaTensors` pairs every parameter and buffer of replica 0 (the master, whose
tensors the user's optimizer and ``state_dict`` see) with the same-named tensor of every
other replica, and does the two things that keep the copies one model:

- :meth:`ReplicaTensors.refresh`, before each forward: a master tensor that changed since the
  copies last took it (an optimizer step, ``load_state_dict``, batch norm statistics, a
  ``.to()``) is copied to every replica. "Changed" is read from the tensor's version counter
  (bumped by every in-place write, also under ``torch.no_grad``) and its storage, dtype and
  shape (a ``.to()`` or ``.data =`` swaps them). Writes through ``tensor.data`` bypass the
  version counter: after such writes call ``refresh(force=True)``
  (``ReplicatedModule.sync_replicas()``).
- :meth:`ReplicaTensors.sum_grads`, after each backward: every copy's gradient is added into
  the master's ``.grad`` and cleared, so the master holds the gradient of the whole batch.

Example:
    >>> import copy, torch
    >>> master = torch.nn.Linear(2, 2)
    >>> other = copy.deepcopy(master)
    >>> tensors = ReplicaTensors(master, [other])
    >>> with torch.no_grad():
    ...     master.weight.add_(1.0)
    >>> tensors.refresh()
    2
    >>> torch.equal(other.weight, master.weight)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from partitioner.runtime.wrapper import ModelWrapper

__all__ = ["GraphReplica", "ReplicaTensors"]

#: What marks a tensor's contents as changed: version counter, storage, dtype, shape, device.
_Stamp = tuple[int, int, torch.dtype, torch.Size, torch.device]


def _stamp(tensor: torch.Tensor) -> _Stamp:
    return (tensor._version, tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.device)


class GraphReplica(ModelWrapper):
    """One replica as one captured graph on one device.

    Its state-dict keys are the model's (``module`` holds the model, or a copy of it whose
    submodules the graphs share), so it can be the master of a
    :class:`~partitioner.runtime.replicas.ReplicatedModule`.

    Args:
        module: the model (replica 0) or this replica's copy of it.
        graph_factory: given the training flag, the graph to run (built once per mode by
            the caller; its tensors are ``module``'s).
        bind: maps a call's ``(args, kwargs)`` to the graph's placeholder values.
        restructure: maps the graph's output to what the model returns.
    """

    inner = "module"

    def __init__(self, module: nn.Module, graph_factory: Callable[[bool], fx.GraphModule],
                 bind: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]],
                 restructure: Callable[[Any], Any]) -> None:
        super().__init__(plan=None, training=module.training)
        self.module = module
        self._graph_factory = graph_factory
        self._bind = bind
        self._restructure = restructure

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_open("run the replica")
        graph = self._graph_factory(self.training)
        return self._restructure(graph(*self._bind(args, kwargs)))


class ReplicaTensors:
    """The master's parameters and buffers paired with every other replica's, by name.

    Args:
        master: replica 0.
        copies: replicas 1.., built like ``master`` (same parameter and buffer names).
    """

    def __init__(self, master: nn.Module, copies: Sequence[nn.Module]) -> None:
        self.master = master
        self.copies = list(copies)
        self._stamps: dict[str, _Stamp] = {}

    def _pairs(self, kind: str) -> list[tuple[str, torch.Tensor, list[torch.Tensor]]]:
        """``(name, master tensor, the copies' tensors)`` for parameters or buffers.

        Read on every call: a replica built lazily for the other train/eval mode may add
        tensors (torch.export graphs own their constants).
        """
        def named(module: nn.Module) -> dict[str, torch.Tensor]:
            items = (module.named_parameters() if kind == "parameters"
                     else module.named_buffers())
            return dict(items)

        master = named(self.master)
        copies = [named(c) for c in self.copies]
        pairs = []
        for name, tensor in master.items():
            missing = [r + 1 for r, c in enumerate(copies) if name not in c]
            if missing:
                raise RuntimeError(f"replica(s) {missing} have no {kind[:-1]} {name!r} that "
                                   "replica 0 has; the replicas were not built alike (a bug "
                                   "of the partitioner: please report it)")
            pairs.append((name, tensor, [c[name] for c in copies]))
        return pairs

    def refresh(self, force: bool = False) -> int:
        """Copy every master tensor that changed since the last refresh to the replicas.

        Args:
            force: copy every tensor, changed or not (after writes through ``.data``).

        Returns:
            How many master tensors were copied.
        """
        copied = 0
        with torch.no_grad():
            for kind in ("parameters", "buffers"):
                for name, tensor, others in self._pairs(kind):
                    key = f"{kind}:{name}"
                    stamp = _stamp(tensor)
                    if not force and self._stamps.get(key) == stamp:
                        continue
                    for other in others:
                        _assign(other, tensor)
                    self._stamps[key] = stamp
                    copied += 1
        return copied

    def sum_grads(self) -> None:
        """Add every copy's parameter gradient into the master's ``.grad``, then clear it.

        The replicas are added in order (replica 1, then 2, ...), so the sum is the same
        from run to run.
        """
        with torch.no_grad():
            for _, tensor, others in self._pairs("parameters"):
                for other in others:
                    if other.grad is None:
                        continue
                    grad = other.grad.to(tensor.device)
                    if tensor.grad is None:
                        tensor.grad = grad  # the copy's own tensor: it lets go of it below
                    else:
                        tensor.grad.add_(grad)
                    other.grad = None


def _assign(target: torch.Tensor, source: torch.Tensor) -> None:
    """Make ``target`` hold ``source``'s values, taking its dtype and shape if they differ
    (a master converted with ``.double()``), on ``target``'s device."""
    if target.dtype == source.dtype and target.shape == source.shape:
        target.copy_(source)
    else:
        target.data = source.detach().to(target.device, copy=True)
