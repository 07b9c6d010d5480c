"""Capture a model built on the meta device as if its tensors were on a real device.

Model code branches on devices: transformers' mixture-of-experts layers count tokens per
expert with ``histc`` on float inputs ``if device.type in ("cpu", "mps")`` and on int32
otherwise (which the CPU kernel refuses). Exported on the meta device, such a model takes
the branch of no device it will run on. :func:`fake_device` swaps the model's meta tensors
for fake tensors (no memory) on the device the example inputs are on, and makes the
inputs fake in the same mode, so ``torch.export`` sees that device; afterwards
:func:`restore_meta` points the captured graph back at the model's own meta tensors and
turns the device constants it baked into the meta device (``passes/unbake_meta.bake_meta``),
which each stage later trades for its own (``unbake_meta``).

Example:
    >>> import torch
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(2, 2)
    >>> with fake_device(model, (torch.ones(1, 2),), {}) as (args, kwargs, device):
    ...     str(model.weight.device), str(args[0].device), str(device)
    ('cpu', 'cpu', 'cpu')
    >>> model.weight.is_meta
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from partitioner.passes.base import graph_modules
from partitioner.passes.unbake_meta import bake_meta

__all__ = ["fake_device", "restore_meta"]

Inputs = tuple[tuple[Any, ...], dict[str, Any], torch.device | None]


@contextlib.contextmanager
def fake_device(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> Iterator[Inputs]:
    """Inside: ``model``'s meta tensors are fake tensors on the inputs' device, and the
    inputs fake in the same mode; yields ``(args, kwargs, device)``. A model with no meta
    tensor is left alone (``device`` is then ``None``). The tensors are put back on exit."""
    slots = [(store, name, tensor) for store in _stores(model)
             for name, tensor in list(store.items())
             if tensor is not None and tensor.is_meta]
    if not slots:
        yield args, kwargs, None
        return
    device = _inputs_device((args, kwargs))
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    try:
        for store, name, tensor in slots:
            with mode:
                fake = torch.empty_like(tensor, device=device)
            store[name] = (nn.Parameter(fake, tensor.requires_grad)
                           if isinstance(tensor, nn.Parameter) else fake)

        def to_fake(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if value.is_meta:
                with mode:
                    return torch.empty_like(value, device=device)
            return mode.from_tensor(value.to(device))

        faked = pytree.tree_map(to_fake, (args, kwargs))
        yield faked[0], faked[1], device
    finally:
        for store, name, tensor in slots:
            store[name] = tensor


def restore_meta(gm: fx.GraphModule, model: nn.Module, device: torch.device) -> None:
    """Point ``gm``'s tensors (captured as fakes by :func:`fake_device`) back at
    ``model``'s meta tensors of the same names, any other fake (a constant ``forward``
    made) at an empty meta tensor, and its ``device`` constants at the meta device."""
    own = {**dict(model.named_parameters(remove_duplicate=False)),
           **dict(model.named_buffers(remove_duplicate=False))}
    for prefix, module in gm.named_modules(remove_duplicate=False):
        for store in _stores(module, recurse=False):
            for name, tensor in list(store.items()):
                key = f"{prefix}.{name}" if prefix else name
                if key in own:
                    store[name] = own[key]
                elif tensor is not None and tensor.device.type != "meta":
                    store[name] = torch.empty_like(tensor, device="meta")
    for graph in graph_modules(gm):  # a no_grad block's graph may hold constants too
        for name, value in list(vars(graph).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                    and value.device.type != "meta" and name not in graph._buffers:
                setattr(graph, name, torch.empty_like(value, device="meta"))
    bake_meta(gm, device)


def _stores(root: nn.Module, *, recurse: bool = True) -> list[dict[str, Any]]:
    """The parameter and buffer dictionaries of ``root`` (and its modules)."""
    modules = root.modules() if recurse else [root]
    return [store for module in modules for store in (module._parameters, module._buffers)]


def _inputs_device(tree: Any) -> torch.device:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
            return leaf.device
    return torch.device("cpu")
