"""A rank's virtual stages as one module with the original model's names.

With ``v`` virtual stages per rank (interleaved schedules), a rank holds several stage graphs
(``j, j + P, ...``). Each graph names its parameters and buffers as the original model does
(``blocks.2.mlp.fc1.weight``), so :func:`merge_stages` puts the same tensors (not copies)
into one module tree under those names: ``parameters()``, ``state_dict()``, checkpoints and
the optimizer then see every virtual stage of the rank at once, and what trains is still
the stage graphs' own tensors. A weight two of the rank's stages share appears once.

Example:
    >>> import torch
    >>> from torch import fx, nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    >>> group = merge_stages({0: fx.symbolic_trace(model)})
    >>> sorted(group.state_dict())
    ['0.bias', '0.weight', '2.bias', '2.weight']
    >>> group.get_parameter("0.weight") is model[0].weight
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["merge_stages"]


def merge_stages(stages: Mapping[int, nn.Module]) -> nn.Module:
    """One module holding every parameter and buffer of ``stages`` under its own name.

    Raises:
        ValueError: If two stages hold different tensors under one name (the stage graphs
            were not cut from one model).
    """
    root = nn.Module()
    for stage in stages.values():
        for name, param in stage.named_parameters(remove_duplicate=False):
            _place(root, name, param, persistent=True, is_param=True)
        for name, buffer in stage.named_buffers(remove_duplicate=False):
            owner_name, _, leaf = name.rpartition(".")
            owner = stage.get_submodule(owner_name)
            persistent = leaf not in getattr(owner, "_non_persistent_buffers_set", set())
            _place(root, name, buffer, persistent=persistent, is_param=False)
    return root


def _place(root: nn.Module, name: str, tensor: torch.Tensor, *, persistent: bool,
           is_param: bool) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    present = module._parameters.get(leaf) if is_param else module._buffers.get(leaf)
    if present is not None:
        if present is not tensor:
            raise ValueError(f"two virtual stages hold different tensors named {name!r}; "
                             "cut every stage graph from the same model")
        return
    if is_param:
        assert isinstance(tensor, nn.Parameter)
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)
