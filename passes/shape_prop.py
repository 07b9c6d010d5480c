"""Shape propagation on fake or meta tensors: shapes without compute.

Runs the graph under ``FakeTensorMode`` (or directly on ``meta`` tensors when the model lives
on the meta device), so a GPT-2-xl-sized model is analysed without allocating its weights and
without running a single real kernel. Each node gets ``node.meta["val"]``: a fake tensor, or a
pytree of them, with the node's output shape and dtype.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 5))
    >>> _ = propagate_shapes(gm, (torch.randn(2, 3),))
    >>> [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "call_function"]
    [(2, 5)]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.passes.base import PassError, PassResult

__all__ = ["propagate_shapes", "fake_mode_for", "tensor_bytes"]


def _on_meta(gm: fx.GraphModule) -> bool:
    tensors = list(gm.parameters()) + list(gm.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


@contextmanager
def fake_mode_for(gm: fx.GraphModule) -> Iterator[FakeTensorMode | None]:
    """The mode shape analysis runs in: none for meta models, else a permissive fake mode."""
    if _on_meta(gm):
        yield None
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        yield mode


class _ShapeInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode | None) -> None:
        super().__init__(gm)
        self.mode = mode

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        # The model's own tensor must never reach a kernel (in-place ops would write it).
        return _to_analysis(super().get_attr(target, args, kwargs), self.mode)

    def run_node(self, n: fx.Node) -> Any:
        try:
            _check_operand_dtypes(self.module, n, self.fetch_args_kwargs_from_env(n)[0])
            result = super().run_node(n)
        except Exception as error:
            raise PassError(f"shape propagation failed at node {n.name} ({n.format_node()}): "
                            f"{type(error).__name__}: {error}{_value_shape_hint(error)}"
                            ) from error
        n.meta["val"] = pytree.tree_map(_without_graph, result)
        return result


def _without_graph(value: Any) -> Any:
    """A value as a node's ``meta["val"]`` keeps it: detached. A fake tensor computed from
    the model's real parameters carries an autograd graph whose leaves are those
    parameters: kept in the graph's metadata it would keep every parameter the example's
    forward touched alive, after a pass (FSDP) has replaced them. (Not a leaf that requires
    grad either: the cost pass runs each op again on these values, in-place ones included.)"""
    if not isinstance(value, torch.Tensor) or value.grad_fn is None:
        return value
    return value.detach()


def _value_shape_hint(error: Exception) -> str:
    """A fix for an operation whose output size depends on its input values, else ``""``."""
    if type(error).__name__ not in ("DynamicOutputShapeException",
                                    "DataDependentOutputException"):
        return ""
    return ("; its output's size depends on the values of its inputs (bincount, nonzero, "
            "unique, boolean-mask indexing), which one captured graph cannot hold: compute a "
            "fixed-size result instead (bincount(x, minlength=n) -> one_hot(x, n).sum(0); "
            "x[mask] -> torch.where(mask, x, 0)) or do it outside forward")


_PRODUCTS = {F.linear, torch.matmul, torch.mm, torch.bmm, F.conv1d, F.conv2d, F.conv3d,
             torch.ops.aten.linear.default, torch.ops.aten.addmm.default,
             torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.matmul.default, torch.ops.aten.conv1d.default,
             torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
             torch.ops.aten.convolution.default}


def _check_operand_dtypes(root: torch.nn.Module, n: fx.Node, args: tuple[Any, ...]) -> None:
    """Refuse a matrix product of an integer tensor with a floating one, as the real kernel
    does ("mat1 and mat2 must have the same dtype"): the fake and meta kernels let it pass."""
    operands = [a for a in args if isinstance(a, torch.Tensor)]
    if n.op == "call_module":
        module = root.get_submodule(str(n.target))
        if not isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            return
        operands += [p for p in module.parameters(recurse=False)]
    elif n.op != "call_function" or n.target not in _PRODUCTS:
        return
    floating = [t.dtype for t in operands if t.is_floating_point() or t.is_complex()]
    other = [t.dtype for t in operands if not (t.is_floating_point() or t.is_complex())]
    if floating and other:
        raise TypeError(f"a matrix product of {other[0]} and {floating[0]} tensors")


def _to_analysis(value: Any, mode: FakeTensorMode | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if mode is None:
        return value.to("meta")
    return mode.from_tensor(value)


@contextmanager
def _eval_mode(gm: fx.GraphModule) -> Iterator[None]:
    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def propagate_shapes(gm: fx.GraphModule, inputs: list[Any] | tuple[Any, ...]) -> PassResult:
    """Write ``node.meta["val"]`` on every node of ``gm``.

    Args:
        gm: the graph; its parameters may be real or on the meta device.
        inputs: one value per placeholder (pytrees allowed); real tensors are converted.

    Returns:
        ``PassResult(gm, modified=False)``.

    Raises:
        PassError: naming the node whose shape could not be computed.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(placeholders):
        raise PassError(f"propagate_shapes: {len(inputs)} inputs for {len(placeholders)} "
                        "placeholders")
    # eval mode keeps batch norm from updating the real running statistics; shapes agree.
    with fake_mode_for(gm) as mode, _eval_mode(gm):
        fake_inputs = pytree.tree_map(lambda v: _to_analysis(v, mode), list(inputs))
        with torch.no_grad() if mode is None else nullcontext():
            _ShapeInterpreter(gm, mode).run(*fake_inputs)
    for node, value in zip(placeholders, fake_inputs):
        node.meta["val"] = value
    return PassResult(gm, modified=False)


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a pytree (shapes only; works on fake and meta tensors)."""
    total = 0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total
