"""The one shape every graph pass has.

A pass is a function from a ``GraphModule`` to a :class:`PassResult`: the (possibly new)
module and whether it changed. Preconditions and postconditions are checked by the pass and
raise :class:`PassError` naming the pass and what was wrong (torch's
``fx/passes/infra/pass_base.py`` follows the same idea).

Analyses write their findings to ``node.meta`` under the keys listed in :data:`META_KEYS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from partitioner.errors import PassError

__all__ = ["PassResult", "PassError", "META_KEYS", "require_meta", "graph_modules",
           "attr_value"]

#: The ``node.meta`` keys the passes write, and what each holds.
META_KEYS = {
    "layer_path": "flatten_sequential: qualified name of the layer unit owning the node",
    "val": "shape_prop: a fake/meta tensor (or pytree of them) with the node's output shape",
    "cost": "annotate_cost: a NodeCost (forward/backward FLOPs, parameter and activation bytes)",
    "layer": "group_layers: index of the contiguous layer group the node belongs to",
}


@dataclass(frozen=True)
class PassResult:
    """What a pass returns."""

    graph_module: fx.GraphModule
    modified: bool


def require_meta(gm: fx.GraphModule, key: str, pass_name: str) -> None:
    """Raise unless every call node of ``gm`` carries ``node.meta[key]``."""
    missing = [n.name for n in gm.graph.nodes
               if n.op.startswith("call_") and key not in n.meta]
    if missing:
        raise PassError(f"{pass_name} needs node.meta[{key!r}] ({META_KEYS.get(key, key)}); "
                        f"missing on {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and every graph it holds: the body of a higher-order op (a ``torch.no_grad()``
    block is ``wrap_with_set_grad_enabled`` calling a ``submod_N`` graph, an autocast block
    ``wrap_with_autocast``) is a submodule with a graph of its own, which a pass rewriting
    devices, dtypes or constants must rewrite too."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield module


def attr_value(gm: fx.GraphModule, target: str) -> Any:
    """What a ``get_attr`` node of ``target`` (a dotted path) reads from ``gm``."""
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
