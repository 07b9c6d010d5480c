"""Non-persistent buffers stay non-persistent in the graphs cut from a model.

``torch.fx`` registers every tensor a graph reads (``get_attr``) that is not a parameter as
a *persistent* buffer of the graph module. A model's non-persistent buffers (a rotary
embedding's ``inv_freq``, a causal mask) are by definition absent from its state dict:
computed by the module, never saved. In a graph module they would become state-dict
entries, so a stage's ``state_dict()`` would hold, and loading a checkpoint would demand,
keys the model's own file never has. :func:`keep_non_persistent` marks them again by their
qualified name (a graph names its tensors as the model does).

Example:
    >>> import torch
    >>> class Rotary(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("inv_freq", torch.ones(2), persistent=False)
    ...     def forward(self, x):
    ...         return x * self.inv_freq
    >>> model = Rotary()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> list(gm.state_dict())
    ['inv_freq']
    >>> keep_non_persistent(gm, non_persistent_names(model))
    >>> list(gm.state_dict())
    []
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

__all__ = ["non_persistent_names", "keep_non_persistent"]


def non_persistent_names(module: nn.Module) -> frozenset[str]:
    """The qualified names of ``module``'s non-persistent buffers (every alias)."""
    return frozenset(f"{prefix}.{local}" if prefix else local
                     for prefix, sub in module.named_modules(remove_duplicate=False)
                     for local in sub._non_persistent_buffers_set)


def keep_non_persistent(target: nn.Module, names: Collection[str]) -> None:
    """Mark ``target``'s buffers named in ``names`` non-persistent (in place)."""
    wanted = set(names)
    for prefix, sub in target.named_modules(remove_duplicate=False):
        for local in sub._buffers:
            if (f"{prefix}.{local}" if prefix else local) in wanted:
                sub._non_persistent_buffers_set.add(local)
