"""Flatten nested containers so that their children become layers.

torchgpipe (and the GPipe article among our seeds) asks users to flatten nested
``nn.Sequential`` by hand: ``Sequential(Sequential(a, b), c)`` becomes
``Sequential(0_0=a, 0_1=b, 1=c)``. :func:`flatten_sequential` does exactly that, usable on its
own. The graph pass :func:`assign_layer_paths` does the same on a captured graph without
rebuilding the model: it labels every node with the *layer unit* that owns it, looking through
containers (``Sequential``, ``ModuleList``, ``ModuleDict``) and through modules whose job is
to hold repeated blocks (GPT-2's ``transformer`` holds ``h``, a list of blocks), so that each
block, not the whole body, becomes a unit a stage boundary may fall between.

Example:
    >>> from torch import nn
    >>> flat = flatten_sequential(nn.Sequential(nn.Sequential(nn.ReLU(), nn.Tanh()), nn.ReLU()))
    >>> list(dict(flat.named_children()))
    ['0_0', '0_1', '1']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import torch.fx as fx
from torch import nn

from partitioner.passes.base import PassResult

__all__ = ["flatten_sequential", "assign_layer_paths", "expanded_modules", "display_name"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def flatten_sequential(module: nn.Sequential) -> nn.Sequential:
    """Flatten nested ``nn.Sequential`` children, joining names with ``_``.

    Args:
        module: a sequential model, possibly holding sequentials.

    Returns:
        A new ``nn.Sequential`` sharing the leaf children (no copies).

    Raises:
        TypeError: if ``module`` is not an ``nn.Sequential``.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"flatten_sequential takes an nn.Sequential, got {type(module).__name__}; "
                        "wrap the layers in nn.Sequential or use partition(), which flattens "
                        "any model's containers itself")
    return nn.Sequential(OrderedDict(_flatten(module)))


def _flatten(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        if isinstance(child, nn.Sequential):
            for sub_name, sub_child in _flatten(child):
                yield f"{name}_{sub_name}", sub_child
        else:
            yield name, child


def display_name(path: str) -> str:
    """The seeds' flattened spelling of a qualified module name: ``"0.1"`` -> ``"0_1"``."""
    return path.replace(".", "_")


def expanded_modules(root: nn.Module) -> set[str]:
    """Qualified names of the modules looked *through* (their children become layers).

    The root is always expanded; so is every container, and every module holding, at any
    depth, a container of two or more composite children of one class (repeated blocks).
    """
    expanded = {""}
    for name, module in root.named_modules():
        if name and (isinstance(module, _CONTAINERS) or _holds_repeats(module)):
            expanded.add(name)
    return expanded


def _holds_repeats(module: nn.Module) -> bool:
    """Whether a container inside ``module`` holds two or more composite blocks of one class.

    Only blocks with children of their own count: an MLP's ``Sequential(Linear, GELU,
    Linear)`` repeats ``Linear`` but is a block's internals, not a stack of blocks.
    """
    for sub in module.modules():
        if isinstance(sub, _CONTAINERS):
            kinds = [type(c) for c in sub.children() if next(c.children(), None) is not None]
            if len(kinds) >= 2 and len(set(kinds)) < len(kinds):
                return True
    return False


def _owner(paths: list[str], expanded: set[str]) -> str:
    """The outermost enclosing module that is not looked through ("" if none)."""
    for path in paths:
        if path not in expanded:
            return path
    return ""


def assign_layer_paths(gm: fx.GraphModule, root: nn.Module,
                       module_paths: dict[fx.Node, list[str]]) -> PassResult:
    """Write ``node.meta["layer_path"]`` for every call node.

    Args:
        gm: the captured graph.
        root: the user's model (its module tree decides what is looked through).
        module_paths: per node, the qualified names of its enclosing modules, outermost first
            (from ``nn_module_stack``); for ``call_module`` nodes the target is appended.

    Returns:
        ``PassResult(gm, modified=False)``: only metadata is written. Nodes owned by no layer
        (ops in an expanded module's own ``forward``) get ``""``; grouping attaches them.

    Paths naming no module of ``root`` are ignored.
    """
    expanded = expanded_modules(root)
    known = dict(root.named_modules())
    for node in gm.graph.nodes:
        if not node.op.startswith("call_"):
            continue
        paths = list(module_paths.get(node, []))
        if node.op == "call_module" and (not paths or paths[-1] != node.target):
            paths.append(str(node.target))
        # torch.export tags some helper nodes with synthetic stack entries; they name no
        # module of the model and say nothing about ownership.
        node.meta["layer_path"] = _owner([p for p in paths if p in known], expanded)
    return PassResult(gm, modified=False)
