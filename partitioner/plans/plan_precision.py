"""``precision=`` and plans: which precision a plan given as ``plan=`` runs in.

A saved plan records its precision (``Plan.precision``) and runs in it; a ``precision=``
that disagrees is refused, as any other setting that contradicts the plan file. A
hand-written spec says nothing of precision: the call's ``precision=`` is recorded in the
plan compiled from it.

Example:
    >>> from partitioner.plans.plan import Plan, Stage
    >>> plan = Plan("pipeline", ("cpu",), (Stage(0, "cpu", ("fc",)),), precision="bf16")
    >>> planned_precision(plan, None).precision
    'bf16'
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from partitioner.errors import PlanMismatchError, PrecisionError
from partitioner.plans.plan import Plan
from partitioner.runtime.precision import check_precision

__all__ = ["planned_precision", "check_master_weights", "distributed_precision"]


def planned_precision(plan: Plan, precision: str | None) -> Plan:
    """``plan`` in the precision the call asks for (``None``: as the plan says).

    Raises:
        PrecisionError: an unknown precision.
        PlanMismatchError: a saved plan made for another precision.
    """
    if precision is None or precision == plan.precision:
        return plan
    check_precision(precision, scaled=False)
    if plan.planner is not None and plan.planner.spec is not None:
        return replace(plan, precision=precision)  # compiled from a spec just now
    raise PlanMismatchError(f"precision={precision!r} but the plan says {plan.precision!r}; "
                            "drop precision= to run the plan as saved, or edit its "
                            "\"precision\" field (or re-plan) to change it")


def check_master_weights(model: nn.Module, precision: str) -> None:
    """Refuse mixed precision on a model whose floating-point parameters are not fp32.

    Autocast keeps the parameters as the master weights: in bf16 they would round every
    optimizer update (a silent loss of accuracy).

    Raises:
        PrecisionError: naming the first such parameter and the fix.
    """
    if precision == "fp32":
        return
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise PrecisionError(
                f"precision={precision!r} keeps the parameters as fp32 master weights, but "
                f"{name} is {str(p.dtype).removeprefix('torch.')}; build the model in "
                "float32 (model.float()) or omit precision")


def distributed_precision(model: nn.Module, given: Plan | None, precision: str | None) -> str:
    """The precision ``partition_distributed`` runs: the call's, else the given plan's,
    else fp32 (checked against the plan and the model).

    Raises:
        PrecisionError: an unknown precision, fp16 (its loss scaling does not run across
            processes yet), or a model whose parameters are not fp32.
        PlanMismatchError: a given plan made for another precision.
    """
    chosen = planned_precision(given, precision).precision if given is not None \
        else check_precision("fp32" if precision is None else precision, scaled=False)
    if chosen == "fp16":
        raise PrecisionError("precision='fp16' needs loss scaling, which partition_distributed "
                             "does not run yet (every rank would have to agree on skipping "
                             "a step); pass precision='bf16', which needs none, or run fp16 "
                             "in one process with partition(..., precision='fp16', "
                             "loss_scale='dynamic')")
    check_master_weights(model, chosen)
    return chosen
