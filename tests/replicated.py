"""Build data-parallel replicas in one process from a model and one batch (what the planner
will do once it chooses ``dp`` in one process): plan the replica as ``pp`` stages, then give
the plan ``dp`` replicas over ``dp x pp`` "cpu" devices."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from partitioner.analysis import analyze
from partitioner.build import build_replicas
from partitioner.planning.planner import plan_request
from partitioner.plans.plan import Mesh
from partitioner.request import PlanRequest
from partitioner.runtime.replicas import ReplicatedModule

__all__ = ["replicated", "same"]


def replicated(model: nn.Module, inputs: tuple[Any, ...], dp: int, pp: int = 1, *,
               kwargs: dict[str, Any] | None = None, **options: Any) -> ReplicatedModule:
    """``model`` as ``dp`` replicas of ``pp`` stages on "cpu" devices (``options``: chunks,
    checkpoint, balance, ... as :func:`partitioner.partition` takes them)."""
    request = PlanRequest.make(["cpu"] * pp, "pipeline", example_inputs=inputs,
                               example_kwargs=kwargs, local=True, **options)
    analysis = analyze(model, request.example_inputs, request.kwargs,
                       need_costs=not request.fixes_split)
    plan = dataclasses.replace(plan_request(analysis, request), mesh=Mesh(dp, pp, 1))
    request = dataclasses.replace(request, devices=request.devices * dp)
    return build_replicas(model, analysis, plan, request)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to float64 rounding."""
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
