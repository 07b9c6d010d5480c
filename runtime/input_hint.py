"""Why a call's inputs do not fit what a stage was captured with, as a fix to append.

A stage that raises on a call's inputs gives torch's message ("mat1 and mat2 shapes cannot
be multiplied", "'list' object has no attribute ...") about a graph node the user never
wrote. The placeholders of the first stage remember the example inputs (``meta["val"]``),
so the error can say which input differs from the example and how: another type, an
integer tensor where a floating one was planned, or another shape beyond dim 0 (the batch,
which may change between calls).

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Linear(4, 2))
    >>> next(iter(gm.graph.nodes)).meta["val"] = torch.zeros(8, 4)
    >>> print(input_hint(gm, [torch.zeros(8, 5)]).split(":")[0])
    ; input is (B, 5) float32 where the model was partitioned with (B, 4) float32
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["input_hint"]


def _describe(tensor: torch.Tensor) -> str:
    dims = ["B", *(str(d) for d in tensor.shape[1:])] if tensor.dim() else []
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''}) " \
           f"{str(tensor.dtype).removeprefix('torch.')}"


def _differs(value: torch.Tensor, example: torch.Tensor) -> bool:
    if value.dim() != example.dim():
        return True
    if value.is_floating_point() != example.is_floating_point():
        return True   # (float dtypes that differ get their own fix: the stage's dtype hint)
    return any(isinstance(want, int) and got != want
               for got, want in zip(value.shape[1:], example.shape[1:], strict=True))


def input_hint(graph_module: fx.GraphModule, inputs: list[Any]) -> str:
    """``"; <input> is ... where the model was partitioned with ...: <fix>"``, or ``""``
    when every input fits its placeholder's example (``meta["val"]``)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    problems = []
    for node, value in zip(placeholders, inputs, strict=False):
        example = node.meta.get("val")
        if not isinstance(example, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{node.target} is a {type(value).__name__} where the model was "
                            f"partitioned with a {_describe(example)} tensor")
        elif _differs(value, example):
            problems.append(f"{node.target} is {_describe(value)} where the model was "
                            f"partitioned with {_describe(example)}")
    if not problems:
        return ""
    return (f"; {'; '.join(problems)}: pass inputs like the example inputs (only dim 0, the "
            "batch, may differ) or partition again with an example of these")
