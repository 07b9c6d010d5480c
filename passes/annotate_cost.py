"""Cost annotation: FLOPs, parameter bytes and activation bytes per node.

Forward FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` while each node is
re-run on the fake values left by shape propagation (no real compute). Backward FLOPs follow
the usual rule for matrix products and convolutions: two products of the forward's size (the
gradient of the input and of the weight), so twice the forward; ops FlopCounterMode does not
count (element-wise, normalisation) are memory-bound and costed by their bytes instead.

Each parameter is charged once, to the first node that uses it, so tied weights are not
double counted.

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 8))
    >>> _ = propagate_shapes(gm, (torch.randn(2, 4),))
    >>> _ = annotate_cost(gm)
    >>> [n.meta["cost"].forward_flops for n in gm.graph.nodes if n.op == "call_function"]
    [128]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from partitioner.passes.base import PassResult, require_meta
from partitioner.passes.shape_prop import fake_mode_for, tensor_bytes

__all__ = ["NodeCost", "annotate_cost", "total_flops"]


@dataclass(frozen=True)
class NodeCost:
    """The cost of one graph node for one batch of the example inputs.

    Attributes:
        forward_flops: floating-point operations of the forward.
        backward_flops: floating-point operations of the backward.
        param_bytes: bytes of the parameters first used by this node.
        buffer_bytes: bytes of the buffers first used by this node.
        activation_bytes: bytes of the node's output tensors.
        input_bytes: bytes of the tensors the node reads (memory traffic).
    """

    forward_flops: int = 0
    backward_flops: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    input_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("forward_flops", "backward_flops", "param_bytes", "buffer_bytes",
                     "activation_bytes", "input_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"NodeCost.{name} is {getattr(self, name)}; costs are >= 0")


def _fake(value: Any) -> Any:
    return value.meta.get("val") if isinstance(value, fx.Node) else value


def _count_flops(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.op not in ("call_function", "call_method", "call_module"):
        return 0
    args = fx.map_arg(node.args, _fake)
    kwargs = fx.map_arg(node.kwargs, _fake)
    counter = FlopCounterMode(display=False)
    # Grad mode on: under no_grad a view module (nn.Flatten) returns a grad-requiring fake
    # tensor with no grad_fn, and FlopCounterMode's module hooks assert on it.
    with counter, torch.enable_grad():
        if node.op == "call_function":
            node.target(*args, **kwargs)  # type: ignore[operator]
        elif node.op == "call_method":
            getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            gm.get_submodule(str(node.target))(*args, **kwargs)
    return int(counter.get_total_flops())


def _owned_tensors(gm: fx.GraphModule, node: fx.Node, seen: set[int]) -> tuple[int, int]:
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        params, buffers = list(module.parameters()), list(module.buffers())
    elif node.op == "get_attr":
        value = _fetch(gm, str(node.target))
        if isinstance(value, torch.nn.Parameter):
            params = [value]
        elif isinstance(value, torch.Tensor):
            buffers = [value]
    return _charge(params, seen), _charge(buffers, seen)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _charge(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def annotate_cost(gm: fx.GraphModule) -> PassResult:
    """Write ``node.meta["cost"]`` (a :class:`NodeCost`) on every node.

    Args:
        gm: a graph after :func:`partitioner.passes.shape_prop.propagate_shapes`.

    Returns:
        ``PassResult(gm, modified=False)``.

    Raises:
        PassError: if shape propagation has not run.
    """
    require_meta(gm, "val", "annotate_cost")
    seen: set[int] = set()
    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with fake_mode_for(gm):
            for node in gm.graph.nodes:
                node.meta["cost"] = _node_cost(gm, node, seen)
    finally:
        for module, training in modes.items():
            module.training = training
    return PassResult(gm, modified=False)


def _node_cost(gm: fx.GraphModule, node: fx.Node, seen: set[int]) -> NodeCost:
    params, buffers = _owned_tensors(gm, node, seen)
    if node.op in ("placeholder", "output", "get_attr"):
        return NodeCost(param_bytes=params, buffer_bytes=buffers)
    flops = _count_flops(gm, node)
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    return NodeCost(
        forward_flops=flops,
        backward_flops=2 * flops,
        param_bytes=params,
        buffer_bytes=buffers,
        activation_bytes=tensor_bytes(node.meta.get("val")),
        input_bytes=sum(tensor_bytes(v) for v in inputs) + params,
    )


def total_flops(gm: fx.GraphModule) -> int:
    """Sum of forward FLOPs over the graph (after :func:`annotate_cost`)."""
    return sum(n.meta["cost"].forward_flops for n in gm.graph.nodes if "cost" in n.meta)

