"""A declarative model-partitioning compiler for PyTorch.

``partition(model, devices=[...])`` captures a model as a ``torch.fx`` graph, plans how to
split it over devices, and returns an ``nn.Module`` that runs the plan.

The public names are imported lazily, so that ``runtime`` (which raises this package's
errors) can import ``partitioner.errors`` without pulling in the planner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partitioner.api import make_plan, partition
    from partitioner.capture import TraceError
    from partitioner.errors import PartitionError
    from partitioner.plan import Plan, Stage
    from passes.flatten_sequential import flatten_sequential

__all__ = ["partition", "make_plan", "Plan", "Stage", "PartitionError", "TraceError",
           "flatten_sequential"]

_WHERE = {
    "partition": "partitioner.api",
    "make_plan": "partitioner.api",
    "Plan": "partitioner.plan",
    "Stage": "partitioner.plan",
    "PartitionError": "partitioner.errors",
    "TraceError": "partitioner.errors",
    "flatten_sequential": "passes.flatten_sequential",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
