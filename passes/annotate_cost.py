"""Cost annotation: FLOPs, parameter bytes and activation bytes per node.

Forward FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` while each node is
re-run on the fake values left by shape propagation (no real compute). Backward FLOPs follow
the usual rule for matrix products and convolutions: two products of the forward's size (the
gradient of the input and of the weight), so twice the forward; ops FlopCounterMode does not
count (element-wise, normalisation) are memory-bound and costed by their bytes instead.

Each parameter is charged once, to the first node that uses it, so tied weights are not
double counted.

Running an op on fake values costs about 2 ms (most of an analysis: ``partition`` analyses a
model once per call, and ``tune=`` and the tests call it often on the same layers), so the
count of a node is kept by what determines it: the function, method or ``torch.nn`` module
(its class, configuration and tensors' shapes) and its inputs' shapes and dtypes. A node
with any other input (an object the key cannot name, a symbolic size) is run every time.

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

import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from partitioner.passes.base import PassResult, attr_value, require_meta
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


_COUNTED: dict[Hashable, int] = {}
"""FLOPs by :func:`_flop_key` (cleared when it reaches :data:`_KEEP` entries)."""
_KEEP = 4096
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format,
          torch.layout, type(None), type(...))

_OWN = ("torch", "_operator", "operator", "builtins", "math")
"""Modules whose functions' FLOPs depend on their inputs only."""


def _flop_key(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: Any) -> Hashable | None:
    """What determines ``node``'s FLOPs, or ``None`` when that cannot be named."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not type(module).__module__.startswith("torch.nn."):
            return None  # a user's leaf module may branch on attributes no key shows
        tensors = itertools.chain(module.named_parameters(), module.named_buffers())
        # Its plain attributes too (nn.MultiheadAttention's batch_first is not in its repr).
        settings = tuple((m_name, tuple(sorted(
            (k, v) for k, v in vars(m).items() if isinstance(v, _PLAIN))))
            for m_name, m in module.named_modules())
        head: Hashable = (type(module), module.extra_repr(), settings,
                          tuple(type(m) for m in module.modules()),
                          tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))
    elif node.op == "call_method" or str(getattr(node.target, "__module__", "")).startswith(
            _OWN):
        head = (node.op, node.target)
    else:
        return None  # a user's function (torch.fx.wrap) may read state no key shows
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        elif isinstance(leaf, slice):
            parts.append(("slice", leaf.start, leaf.stop, leaf.step))
        elif isinstance(leaf, _PLAIN):
            parts.append((type(leaf), leaf))
        else:
            return None
    key = (head, str(spec), tuple(parts))
    try:
        hash(key)  # a symbolic size (torch.SymInt) is not hashable
    except TypeError:
        return None
    return key


def _count_flops(gm: fx.GraphModule, node: fx.Node, counter: FlopCounterMode) -> int:
    """The FLOPs of ``node`` run once on its fake inputs (what ``counter``, active for the
    whole graph, adds), or the count kept for the same op on the same shapes."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return 0
    args = fx.map_arg(node.args, _fake)
    kwargs = fx.map_arg(node.kwargs, _fake)
    key = _flop_key(gm, node, args, kwargs)
    if key is not None and key in _COUNTED:
        return _COUNTED[key]
    flops = _run_counted(gm, node, counter, args, kwargs)
    if key is not None:
        if len(_COUNTED) >= _KEEP:
            _COUNTED.clear()
        _COUNTED[key] = flops
    return flops


def _run_counted(gm: fx.GraphModule, node: fx.Node, counter: FlopCounterMode, args: Any,
                 kwargs: Any) -> int:
    before = counter.get_total_flops()
    # Grad mode on: under no_grad a view module (nn.Flatten) returns a grad-requiring fake
    # tensor with no grad_fn, and FlopCounterMode's module hooks assert on it.
    with torch.enable_grad():
        if node.op == "call_function":
            node.target(*args, **kwargs)  # type: ignore[operator]
        elif node.op == "call_method":
            getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            gm.get_submodule(str(node.target))(*args, **kwargs)
    return int(counter.get_total_flops() - before)


def _owned_tensors(gm: fx.GraphModule, node: fx.Node, seen: set[int]) -> tuple[int, int]:
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        params, buffers = list(module.parameters()), list(module.buffers())
    elif node.op == "get_attr":
        value = attr_value(gm, str(node.target))
        if isinstance(value, torch.nn.Parameter):
            params = [value]
        elif isinstance(value, torch.Tensor):
            buffers = [value]
    return _charge(params, seen), _charge(buffers, seen)


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
        with fake_mode_for(gm), FlopCounterMode(display=False) as counter:
            for node in gm.graph.nodes:
                node.meta["cost"] = _node_cost(gm, node, seen, counter)
    finally:
        for module, training in modes.items():
            module.training = training
    return PassResult(gm, modified=False)


def _node_cost(gm: fx.GraphModule, node: fx.Node, seen: set[int],
               counter: FlopCounterMode) -> NodeCost:
    params, buffers = _owned_tensors(gm, node, seen)
    if node.op in ("placeholder", "output", "get_attr"):
        return NodeCost(param_bytes=params, buffer_bytes=buffers)
    flops = _count_flops(gm, node, counter)
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

