"""A declarative model-partitioning compiler for PyTorch.

``partition(model, devices=[...])`` captures a model as a ``torch.fx`` graph, plans how to
split it over devices, and returns an ``nn.Module`` that runs the plan.

One installed namespace: ``partitioner`` (the front: api, request, analysis, build, apply,
capture, errors, cli), ``partitioner.cost``, ``partitioner.planning``, ``partitioner.plans``,
``partitioner.viz``, and ``partitioner.passes`` / ``partitioner.runtime`` (the source tree's
``passes/`` and ``runtime/`` folders). ``docs/design/006-layout.md`` says what lives where.

The public names are imported on first use: importing ``partitioner.errors`` (as every
runtime module does) or parsing the command line (``partitioner --help``) must not import
torch and the whole planner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partitioner.api import make_plan, partition
    from partitioner.apply import load_plan
    from partitioner.capture import TraceError
    from partitioner.cost.devices import Cluster, DeviceSpec
    from partitioner.distributed import DistributedModel, partition_distributed
    from partitioner.errors import PartitionError
    from partitioner.passes.flatten_sequential import flatten_sequential
    from partitioner.planning.options import Options, Precision, Schedule, Sharding
    from partitioner.planning.simulate import simulate
    from partitioner.plans.plan import Mesh, Plan, Stage
    from partitioner.plans.spec import Spec
    from partitioner.runtime.distributed.sharded_checkpoint import checkpoint_to_state_dict
    from partitioner.tensor_parallel import parallelize
    from partitioner.viz import visualize

__all__ = ["partition", "make_plan", "Plan", "Stage", "PartitionError", "TraceError",
           "flatten_sequential", "visualize", "load_plan", "Spec", "partition_distributed",
           "DistributedModel", "parallelize", "simulate", "Cluster", "DeviceSpec", "Mesh",
           "Options", "Schedule", "Precision", "Sharding", "checkpoint_to_state_dict"]

_WHERE = {
    "partition": "partitioner.api",
    "make_plan": "partitioner.api",
    "Plan": "partitioner.plans.plan",
    "Stage": "partitioner.plans.plan",
    "PartitionError": "partitioner.errors",
    "TraceError": "partitioner.errors",
    "flatten_sequential": "partitioner.passes.flatten_sequential",
    "visualize": "partitioner.viz",
    "load_plan": "partitioner.apply",
    "Spec": "partitioner.plans.spec",
    "partition_distributed": "partitioner.distributed",
    "DistributedModel": "partitioner.distributed",
    "parallelize": "partitioner.tensor_parallel",
    "simulate": "partitioner.planning.simulate",
    "Cluster": "partitioner.cost.devices",
    "DeviceSpec": "partitioner.cost.devices",
    "Mesh": "partitioner.plans.plan",
    "Options": "partitioner.planning.options",
    "Schedule": "partitioner.planning.options",
    "Precision": "partitioner.planning.options",
    "Sharding": "partitioner.planning.options",
    "checkpoint_to_state_dict": "partitioner.runtime.distributed.sharded_checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
