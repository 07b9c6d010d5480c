"""What one data-parallel replica is, and how the replicas' tensors stay one model.

:class:`GraphReplica` is the plainest replica: the captured model's graph, called whole on
one device (a plan with one pipeline stage, no tensor parallelism, one micro-batch). The
replicas of a :class:`~partitioner.runtime.replicas.ReplicatedModule` may also be pipelines
(``PartitionedModule``) or tensor-parallel modules; this module does not care which.

:class:`ReplicaTensors` pairs every parameter and buffer of replica 0 (the master, whose
tensors the user's optimizer and ``state_dict`` see) with the same-named tensor of every
other replica, and does the two things that keep the copies one model:

- :meth:`ReplicaTensors.refresh`, before each call: every replica tensor whose values differ
  from the master's is overwritten with them (an optimizer step, ``load_state_dict``, batch
  norm statistics, a ``.to()``). The values are compared, not tracked: version counters miss
  fused optimizers (``torch.optim.AdamW(fused=True)``) and batch norm's running statistics,
  which write without bumping them, so tracking them would leave replicas silently stale.
  Equal tensors are left alone, so a replica's activations saved by an earlier forward stay
  valid for its backward (two forwards, then one backward of both).
- :meth:`ReplicaTensors.sum_grads`, after each backward: every copy's gradient is added into
  the master's ``.grad`` and cleared, so the master holds the gradient of the whole batch.

Example:
    >>> import copy, torch
    >>> master = torch.nn.Linear(2, 2)
    >>> other = copy.deepcopy(master)
    >>> tensors = ReplicaTensors(master, [other])
    >>> with torch.no_grad():
    ...     _ = master.weight.add_(1.0)
    >>> tensors.refresh()
    1
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

    def refresh(self) -> int:
        """Give every replica the master's values where its own differ.

        Returns:
            How many replica tensors were overwritten.
        """
        copied = 0
        with torch.no_grad():
            for kind in ("parameters", "buffers"):
                for _, tensor, others in self._pairs(kind):
                    for other in others:
                        copied += _assign(other, tensor)
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


def _assign(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Make ``target`` hold ``source``'s values, on ``target``'s device, taking its dtype and
    shape if they differ (a master converted with ``.double()``); ``False`` if it did."""
    if target.dtype != source.dtype or target.shape != source.shape:
        target.data = source.detach().to(target.device, copy=True)
        return True
    if target.device.type != "cpu" or source.device.type != "cpu":
        # On an accelerator comparing first costs more than copying: ``torch.equal`` waits
        # for the device (one host sync per tensor, hundreds a step), a copy is queued.
        target.copy_(source.detach(), non_blocking=target.device.type != "cpu")
        return True
    value = source.detach().to(target.device)
    if torch.equal(target, value):
        return False
    target.copy_(value)
    return True
