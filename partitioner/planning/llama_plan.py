"""Plan a transformers Llama model for a cluster beyond this machine as such runs train it.

When ``make_plan`` is given a ``LlamaForCausalLM`` (built on the meta device, typically) and
a preset cluster, the captured graph's costs are replaced by the Llama workload
(``partitioner.cost.llama_model``): fused causal attention, sequence parallelism, FSDP
and per-layer recomputation. Recomputation is a property of the workload (each layer keeps
its input and replays its forward), so the search runs with ``checkpoint="never"`` (no
whole-stage replay on top) and the modes are tried in order:

====================  ===============================================================
``checkpoint=``       Llama recomputation tried
====================  ===============================================================
``None``              none, then selective (torchtitan's per-op policy), then full,
                      the first that fits
``"never"``           none
``"selective"``       selective
any other             full (every layer replayed)
====================  ===============================================================

``compiled=False`` (``PlanRequest.compiled``) costs the element-wise steps as eager PyTorch
runs them (``LlamaRun.fused``); ``None`` or ``True`` as ``torch.compile`` fuses them.
``checkpoint="selective"`` for any other model, or on this machine, is refused: only the
Llama workload knows which of a block's operations that policy keeps.

On this machine's devices the captured costs stay (they are what the runtimes here run).

Example:
    >>> recompute_modes(None), recompute_modes("always"), recompute_modes("selective")
    (('none', 'selective', 'full'), ('full',), ('selective',))
"""

from __future__ import annotations

from collections.abc import Callable

from partitioner.analysis import Analysis
from partitioner.cost.cost import Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.llama_model import llama_variants
from partitioner.errors import MemoryLimitError, StrategyError
from partitioner.plans.plan import Plan
from partitioner.request import PlanRequest
from partitioner.runtime.checkpointing import NEVER, SELECTIVE

__all__ = ["recompute_modes", "workload_variants", "first_fitting"]


def recompute_modes(checkpoint: str | None) -> tuple[str, ...]:
    """The per-layer recomputation modes to try for ``checkpoint=`` (see the table)."""
    if checkpoint is None:
        return ("none", "selective", "full")
    if checkpoint == SELECTIVE:
        return ("selective",)
    return ("none",) if checkpoint == NEVER else ("full",)


def workload_variants(analysis: Analysis, request: PlanRequest, cluster: Cluster,
                      workload: Workload) -> list[tuple[Workload, str | None]]:
    """``(workload, checkpoint)`` pairs to plan, in order: the Llama workloads when
    ``analysis`` is a Llama model planned beyond this machine, else ``workload`` with the
    request's checkpoint mode.

    Args:
        analysis: the analysed model (``analysis.llama`` set for a Llama model).
        request: the request (its mesh's ``tp`` decides the KV projections' split).
        cluster: the cluster planned for.
        workload: the captured costs at the request's precision.

    Raises:
        StrategyError: ``checkpoint="selective"`` for a model that is not a transformers
            Llama model.
    """
    llama = analysis.llama
    if llama is None or cluster.is_local:
        _refuse_selective(request, workload)
        return [(workload, request.checkpoint)]
    shape = llama.shape
    tp = request.mesh.tp if request.mesh is not None else min(cluster.devices_per_node,
                                                              shape.kv_heads)
    found = llama_variants(llama, analysis.layer_names, workload, tp=tp,
                           recompute=recompute_modes(request.checkpoint),
                           fused=request.compiled is not False)
    if not found:
        _refuse_selective(request, workload)
        return [(workload, request.checkpoint)]
    return [(w, NEVER) for w in found]


def _refuse_selective(request: PlanRequest, workload: Workload) -> None:
    if request.checkpoint == SELECTIVE:
        raise StrategyError(f"checkpoint='selective' for {workload.name}"
                            ": torchtitan's per-op recomputation is costed for transformers "
                            "Llama models (LlamaForCausalLM and its kin) only, whose blocks' "
                            "operations the planner knows; pass checkpoint='always', "
                            "'except_last', 'never' or None")


def first_fitting(variants: list[tuple[Workload, str | None]],
                  plan_for: Callable[[Workload, str | None], Plan]) -> Plan:
    """The plan of the first variant that fits memory.

    Raises:
        MemoryLimitError: the last variant's, when none fits.
    """
    for workload, checkpoint in variants[:-1]:
        try:
            return plan_for(workload, checkpoint)
        except MemoryLimitError:
            continue
    return plan_for(*variants[-1])
