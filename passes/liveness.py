"""Which values cross which boundary of a chain of units (layers or stages).

Nodes are numbered by the unit that computes them; a value computed in unit ``a`` and last
used in unit ``b > a`` is *live* at every boundary ``a < u <= b``, and must be handed across
each of them (a skip connection from stage 0 to stage 3 crosses boundaries 1, 2 and 3).
Placeholders count as computed in unit 0; ``get_attr`` nodes are never handed across (each
unit fetches the attribute itself); the output node counts as used in the last unit.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    >>> units = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "call_module")}
    >>> [[v.name for v in vs] for vs in live_values(gm, units, 2)]
    [['_0']]
"""

from __future__ import annotations

import torch.fx as fx

__all__ = ["live_values", "transported"]


def transported(node: fx.Node) -> bool:
    """Whether ``node``'s value is handed between units (everything but attributes/output)."""
    return node.op in ("placeholder", "call_function", "call_method", "call_module")


def live_values(gm: fx.GraphModule, unit_of: dict[fx.Node, int],
                n_units: int) -> list[list[fx.Node]]:
    """For each boundary ``u`` in ``1..n_units-1``, the values live across it, in graph order.

    Args:
        gm: the graph.
        unit_of: the unit of every call node; placeholders default to 0.
        n_units: how many units the chain has.

    Returns:
        A list of ``n_units - 1`` lists; entry ``u - 1`` holds the values crossing boundary ``u``.
    """
    def unit(node: fx.Node) -> int:
        if node.op == "output":
            return n_units - 1
        return unit_of.get(node, 0)

    live: list[list[fx.Node]] = [[] for _ in range(max(n_units - 1, 0))]
    for node in gm.graph.nodes:
        if not transported(node) or not node.users:
            continue
        born = unit(node)
        last = max(unit(user) for user in node.users)
        for u in range(born + 1, last + 1):
            live[u - 1].append(node)
    return live
