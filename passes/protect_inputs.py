"""Give a stage its own copy of an input that it modifies in place.

A stage receives its inputs as autograd leaves (that is where its backward stops), and
autograd forbids in-place changes of a leaf that requires grad; in one process the input may
also share memory with the sending stage's saved tensors. So when a stage's first use of an
input is in place (``nn.ReLU(inplace=True)`` right after a boundary, ``x.add_(...)``), this
pass inserts ``clone`` after the placeholder: the clone is differentiable, so gradients still
reach the leaf. Inputs used only out of place are left alone (no copy).

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU(inplace=True))
    >>> protect_inputs(gm).modified
    True
"""

from __future__ import annotations

import torch.fx as fx

from partitioner.passes.base import PassError, PassResult

__all__ = ["protect_inputs", "mutates_first_argument"]


def mutates_first_argument(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return bool(schema.arguments) and schema.arguments[0].is_write
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    return False


def protect_inputs(gm: fx.GraphModule) -> PassResult:
    """Insert a ``clone`` after every placeholder that some node modifies in place.

    Raises:
        PassError: if a protected placeholder is still mutated directly (postcondition).
    """
    modified = False
    for node in list(gm.graph.find_nodes(op="placeholder")):
        users = list(node.users)
        if not any(mutates_first_argument(gm, u) and u.args and u.args[0] is node for u in users):
            continue
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_method("clone", (node,))
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, c=copy: user is not c)
        modified = True
    if modified:
        gm.graph.lint()
        gm.recompile()
    for node in gm.graph.find_nodes(op="placeholder"):
        if any(mutates_first_argument(gm, u) and u.args and u.args[0] is node for u in node.users):
            raise PassError(f"protect_inputs: placeholder {node.name} is still mutated in place")
    return PassResult(gm, modified)

