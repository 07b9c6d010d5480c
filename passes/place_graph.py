"""Put a stage graph and everything it holds on its device.

``GraphModule.to(device)`` moves registered parameters and buffers only. A captured graph
holds more: tensor constants ``torch.fx`` and ``torch.export`` keep as plain attributes
(``_tensor_constant0``, a lifted ``c_...``: positions computed once at capture, masks) and,
from ``torch.export``, the device of every tensor ``forward`` created, as a constant in the
node's arguments (``arange(n, device=cpu)`` for ``arange(n, device=x.device)``). A model
captured on the CPU whose stage runs on a GPU then mixes devices in its first op ("Expected
all tensors to be on the same device"). :func:`place_graph` moves the constants too and,
when the graph was captured on another device, turns that device in every argument into
the stage's: the meta device of a meta-built model (``unbake_meta``), or the CPU a model
was captured on (a ``.to("cpu")`` the model wrote is then indistinguishable from a baked
device and follows the stage too).

Example:
    >>> import torch
    >>> class Positions(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x + torch.tensor([0.0, 1.0, 2.0]) + torch.arange(3, device=x.device)
    >>> gm = torch.export.export(Positions(), (torch.ones(2, 3),), strict=False).module()
    >>> [name for name, value in vars(gm).items() if isinstance(value, torch.Tensor)]
    ['lifted_tensor_0']
    >>> any("cpu" in str(n.kwargs) for n in gm.graph.nodes)
    True
    >>> place_graph(gm, torch.device("meta"), captured_on=torch.device("cpu")).modified
    True
    >>> gm.lifted_tensor_0.device, any("cpu" in str(n.kwargs) for n in gm.graph.nodes)
    (device(type='meta'), False)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from partitioner.passes.base import PassResult, graph_modules
from partitioner.passes.unbake_meta import replace_device

__all__ = ["place_graph"]


def place_graph(gm: fx.GraphModule, device: torch.device | str,
                captured_on: torch.device | None = None) -> PassResult:
    """``gm``'s parameters, buffers and tensor constants on ``device`` (in place); with
    ``captured_on`` (where the graph was captured: ``runtime.device.model_device`` of the
    model before any stage moved), that device in every node's arguments becomes
    ``device``.

    Returns:
        A :class:`PassResult`; ``modified`` says whether a constant moved or a node changed.
    """
    device = torch.device(device)
    modified = False
    if captured_on is not None and captured_on != device:
        modified = replace_device(gm, captured_on, device).modified
    gm.to(device)
    for graph in graph_modules(gm):  # a no_grad block's body may hold constants too
        modified = _move_constants(graph, device) or modified
    return PassResult(gm, modified)


def _move_constants(gm: fx.GraphModule, device: torch.device) -> bool:
    """Move the unregistered tensors ``gm``'s ``get_attr`` nodes read onto ``device``."""
    modified = False
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = str(node.target).rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:  # an attribute of a non-module: not a tensor this can move
            continue
        value = getattr(owner, name, None)
        registered = name in owner._parameters or name in owner._buffers
        if isinstance(value, torch.Tensor) and not registered and value.device != device:
            setattr(owner, name, value.to(device))
            modified = True
    return modified
