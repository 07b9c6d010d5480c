"""Find the layers tensor parallelism can split: Linear-like products and Embeddings.

A *site* is one graph node that multiplies by, or looks up in, a parameter matrix, in any of
the spellings a captured graph has:

==========================  ===================================  ==========================
what                        graph spelling                       weight layout
==========================  ===================================  ==========================
``nn.Linear``               ``call_module``, ``F.linear``,       ``(out, in)``
                            ``aten.linear``
transformers' ``Conv1D``    ``call_module``, ``aten.addmm``      ``(in, out)``
``x @ W``                   ``torch.matmul``, ``aten.mm`` ...    ``(in, out)``
``nn.Embedding``            ``call_module``, ``F.embedding``,    ``(num, dim)``
                            ``aten.embedding``
``nn.MultiheadAttention``   ``call_module`` (both captures keep  fused ``in_proj_weight``
                            it whole: ``passes.fold_attention``)  ``(3E, E)``, ``out_proj``
==========================  ===================================  ==========================

An attention site splits by heads (``partitioner.runtime.tensor_parallel.attention``); the
projections of an attention that a capture inlined are not sites (they stay whole).

Each site is named for the rules (``tensor_parallel={"h.*.mlp.c_fc": "colwise"}``) by the
module that owns its weight and ran it (``transformer.wte`` even when the weight is tied to
``lm_head``), or by the weight's own name when it is a bare parameter.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> [(s.name, s.op, s.layout) for s in find_sites(torch.fx.symbolic_trace(model), model)]
    [('0', 'linear', 'out_in'), ('2', 'linear', 'out_in')]
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["Site", "find_sites", "is_conv1d", "attr_tensor"]

aten = torch.ops.aten

_LINEAR_FUNCTIONS = {F.linear, torch._C._nn.linear, aten.linear.default}
_MATMUL_FUNCTIONS = {torch.matmul, operator.matmul, torch.mm, aten.mm.default,
                     aten.matmul.default}
_ADDMM_FUNCTIONS = {torch.addmm, aten.addmm.default}
_EMBEDDING_FUNCTIONS = {F.embedding, aten.embedding.default}


@dataclass(frozen=True)
class Site:
    """One splittable layer call.

    Attributes:
        node: the graph node's name.
        op: ``"linear"`` or ``"embedding"``.
        name: the module name rules match (see the module docstring).
        weight: attribute path of the weight in the graph module.
        bias: attribute path of the bias, if any.
        layout: ``"out_in"`` (``nn.Linear``), ``"in_out"`` (``Conv1D``, ``x @ W``) or
            ``"table"`` (embeddings).
        shape: the weight's shape.
        heads: an attention's number of heads (``0`` for other sites).
        parts: an attention's tensors split by heads, as ``(path, kind, dim, blocks)``.
    """

    node: str
    op: str
    name: str
    weight: str
    bias: str | None
    layout: str
    shape: tuple[int, ...]
    heads: int = 0
    parts: tuple[tuple[str, str, int, tuple[int, ...] | None], ...] = ()

    @property
    def out_dim(self) -> int:
        """The weight dimension of output features (columns of ``y = x W^T``)."""
        return 0 if self.layout == "out_in" else 1

    @property
    def in_dim(self) -> int:
        """The weight dimension of input features."""
        return 1 if self.layout == "out_in" else 0


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers-style ``Conv1D`` (weight ``(in, out)``, ``nf``)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and isinstance(weight, torch.Tensor) and weight.dim() == 2)


def attr_tensor(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target names in ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def find_sites(gm: fx.GraphModule, root: nn.Module | None = None) -> list[Site]:
    """Every Linear-like and Embedding call of ``gm`` whose weight is a 2-D parameter.

    Args:
        gm: the graph.
        root: the user's model, to name call-function sites by the module that ran them;
            without it they are named by their weight's owner.

    Returns:
        The sites in graph order.
    """
    modules = dict(root.named_modules()) if root is not None else {}
    sites = []
    for node in gm.graph.nodes:
        site = _site(gm, node, modules)
        if site is not None:
            sites.append(site)
    return sites


def _site(gm: fx.GraphModule, node: fx.Node, modules: dict[str, nn.Module]) -> Site | None:
    if node.op == "call_module":
        return _module_site(gm, node)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _LINEAR_FUNCTIONS:
        weight, bias = _arg(node, 1, "weight"), _arg(node, 2, "bias")
        return _make(gm, node, modules, "linear", weight, bias, "out_in", inputs=(0,))
    if target in _ADDMM_FUNCTIONS:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        return _make(gm, node, modules, "linear", node.args[2], node.args[0], "in_out",
                     inputs=(1,))
    if target in _MATMUL_FUNCTIONS and len(node.args) == 2:
        return _make(gm, node, modules, "linear", node.args[1], None, "in_out", inputs=(0,))
    if target in _EMBEDDING_FUNCTIONS:
        weight = node.args[0] if target is aten.embedding.default else _arg(node, 1, "weight")
        return _make(gm, node, modules, "embedding", weight, None, "table", inputs=())
    return None


def _arg(node: fx.Node, index: int, name: str) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name)


def _module_site(gm: fx.GraphModule, node: fx.Node) -> Site | None:
    target = str(node.target)
    module: Any = gm.get_submodule(target)
    bias = f"{target}.bias" if getattr(module, "bias", None) is not None else None
    if type(module) is nn.Linear:
        return Site(node.name, "linear", target, f"{target}.weight", bias, "out_in",
                    tuple(module.weight.shape))
    if is_conv1d(module):
        return Site(node.name, "linear", target, f"{target}.weight", bias, "in_out",
                    tuple(module.weight.shape))
    if type(module) is nn.Embedding and module.max_norm is None:
        return Site(node.name, "embedding", target, f"{target}.weight", None, "table",
                    tuple(module.weight.shape))
    if type(module) is nn.MultiheadAttention:
        return _attention_site(node.name, target, module)
    return None


def _attention_site(node: str, target: str, module: nn.MultiheadAttention) -> Site:
    """An ``nn.MultiheadAttention`` call split by heads: q, k, v rows of each head's share
    (the fused weight as three blocks), ``bias_k``/``bias_v`` entries, ``out_proj`` columns."""
    embed = module.embed_dim
    fused = module.in_proj_weight is not None
    weight = f"{target}.in_proj_weight" if fused else f"{target}.q_proj_weight"
    blocks = (embed, embed, embed)
    parts: list[tuple[str, str, int, tuple[int, ...] | None]] = (
        [(weight, "colwise", 0, blocks)] if fused else
        [(f"{target}.{p}_proj_weight", "colwise", 0, None) for p in "qkv"])
    bias = f"{target}.in_proj_bias" if module.in_proj_bias is not None else None
    if bias is not None:
        parts.append((bias, "colwise", 0, blocks))
    if module.bias_k is not None and module.bias_v is not None:
        parts += [(f"{target}.bias_{p}", "colwise", 2, None) for p in "kv"]
    parts.append((f"{target}.out_proj.weight", "rowwise", 1, None))
    shape = tuple(getattr(module, weight.rpartition(".")[2]).shape)
    return Site(node, "attention", target, weight, bias, "heads", shape, module.num_heads,
                tuple(parts))


def _make(gm: fx.GraphModule, node: fx.Node, modules: dict[str, nn.Module], op: str,
          weight: Any, bias: Any, layout: str, inputs: tuple[int, ...]) -> Site | None:
    if not _is_param(gm, weight) or attr_tensor(gm, weight.target).dim() != 2:
        return None
    if bias is not None and not _is_param(gm, bias):
        return None
    if any(_is_param(gm, node.args[k]) for k in inputs if k < len(node.args)):
        return None  # a product of two parameters is not a layer call
    if op == "embedding" and not _plain_embedding(node):
        return None
    tensor = attr_tensor(gm, weight.target)
    name = _name(node, tensor, weight.target, modules)
    if isinstance(modules.get(name), nn.MultiheadAttention):
        return None  # an inlined attention's in-projection: its heads cannot be followed
    return Site(node.name, op, name, str(weight.target),
                str(bias.target) if bias is not None else None, layout, tuple(tensor.shape))


def _is_param(gm: fx.GraphModule, value: Any) -> bool:
    return (isinstance(value, fx.Node) and value.op == "get_attr"
            and isinstance(attr_tensor(gm, str(value.target)), torch.Tensor))


def _plain_embedding(node: fx.Node) -> bool:
    """Embeddings with ``max_norm`` rewrite rows in place; they are kept whole."""
    if node.target is aten.embedding.default:
        return True
    return _arg(node, 3, "max_norm") is None


def _name(node: fx.Node, tensor: torch.Tensor, target: str,
          modules: dict[str, nn.Module]) -> str:
    """The innermost module that ran ``node`` and owns ``tensor``, else the weight's owner."""
    stack = node.meta.get("nn_module_stack") or {}
    for entry in reversed(list(stack.values())):
        path = entry[0] if isinstance(entry, tuple) else None
        module = modules.get(path) if path else None
        if module is not None and any(p is tensor for p in module.parameters(recurse=False)):
            return str(path)
    owner, _, leaf = target.rpartition(".")
    if owner and leaf == "weight":
        return owner
    return target
