"""Find the gradient hooks a ``forward`` registers on its tensors, which no capture keeps.

``h.register_hook(lambda g: g * 0.5)`` inside ``forward`` (gradient scaling, clipping, a
reversal) changes the gradients of everything before ``h``. Symbolic tracing records the
call as a node whose result nobody uses (the dead-code pass then drops it) and
``torch.export`` registers it on a tensor of the trace that is gone afterwards: either
way the partitioned model computed other gradients than the model (0.034 apart on a small
MLP), silently. The capture (``partitioner.capture``) refuses such a model instead: while it
runs, :func:`hooks_registered` lists the ``register_hook`` calls ``torch.export`` makes, and
:func:`hook_nodes` the ones symbolic tracing recorded.

Example:
    >>> import torch
    >>> with hooks_registered() as calls:
    ...     _ = torch.ones(2, requires_grad=True).register_hook(lambda g: g)
    >>> calls
    ['register_hook']
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx

__all__ = ["hooks_registered", "hook_nodes", "hooks_problem", "HOOK_METHODS"]

HOOK_METHODS = ("register_hook", "register_post_accumulate_grad_hook")
"""The ``Tensor`` methods registering a hook on a tensor's gradient."""


@contextmanager
def hooks_registered() -> Iterator[list[str]]:
    """While the block runs, each :data:`HOOK_METHODS` call on a tensor made by this thread
    (the capture's; other threads' hooks are theirs) is listed by the method's name, and
    still made."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in HOOK_METHODS}
    thread = threading.get_ident()

    def recording(name: str) -> Any:
        def register(tensor: torch.Tensor, hook: Any) -> Any:
            if threading.get_ident() == thread:
                calls.append(name)
            return saved[name](tensor, hook)
        return register
    try:
        for name in HOOK_METHODS:
            setattr(torch.Tensor, name, recording(name))
        yield calls
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def hook_nodes(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` (symbolically traced) that register a gradient hook."""
    return [n.name for n in gm.graph.nodes
            if n.op == "call_method" and n.target in HOOK_METHODS]


def hooks_problem(model: str, hooks: list[str]) -> str:
    """The refusal of ``model`` whose forward registered ``hooks`` (names or nodes)."""
    return (f"{model}'s forward (or a module it calls) registers a gradient hook on a tensor "
            f"({hooks[0]}), which a "
            "captured graph cannot keep: the partitioned model would compute other gradients; "
            "register it on a module instead (module.register_full_backward_hook: a hooked "
            "module runs whole) or write the gradient change as a torch.autograd.Function")
