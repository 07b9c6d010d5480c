"""The measured timeline of a partitioned module of any kind, one row per device.

Each one-process runtime records what its last forward and backward did: a pipeline (and a
tensor-parallel module, whose stages are pipelined alike) every action's span
(``LocalPipeline.timeline``, seconds since its ``origin``); replicas each replica's forward
and backward (``ReplicatedModule.timeline``), and, when the replicas are pipelines, each
replica's own pipeline timeline. :func:`measured_timeline` puts them on one clock with a row
per device of the plan's mesh (``partitioner.viz.mesh``): a tensor-parallel stage's ranks
share its recorded span (the stage runs them together), so each rank's row repeats it.

Example:
    >>> measured_timeline(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    partitioner.errors.TimelineError: cannot draw the measured timeline of a object; ...
"""

from __future__ import annotations

from typing import Any

from partitioner.errors import TimelineError
from partitioner.plans.plan import Plan
from partitioner.viz.mesh import device_rows, mesh_shape
from partitioner.viz.timeline import Bar, Timeline, per_device

__all__ = ["measured_timeline"]

#: (device row, phase, micro-batch, start, end), times on time.perf_counter()'s clock.
_Span = tuple[int, str, int, float, float]


def measured_timeline(pm: Any) -> Timeline:
    """What the last forward and backward of ``pm`` did, a row per device of its plan.

    Args:
        pm: a ``PartitionedModule``, ``TensorParallelModule`` or ``ReplicatedModule``
            (of whole models, pipelines or tensor-parallel modules) that has run.

    Raises:
        TimelineError: the module has not run yet, or is not a partitioned module.
    """
    plan = getattr(pm, "plan", None)
    if not isinstance(plan, Plan) or not (hasattr(pm, "replicas") or hasattr(pm, "pipeline")):
        raise TimelineError(f"cannot draw the measured timeline of a {type(pm).__name__}; "
                            "pass a module partition() returned")
    spans = _replica_spans(pm, plan) if hasattr(pm, "replicas") else _pipeline_spans(pm, 0, plan)
    if not spans:
        raise TimelineError("the partitioned module has not run yet; call pm(x) (and "
                            "loss.backward()) before drawing its measured timeline")
    origin = min(s[3] for s in spans)
    bars = tuple(sorted((Bar(row, phase, i, start - origin, end - origin)
                         for row, phase, i, start, end in spans),
                        key=lambda b: (b.start, b.stage)))
    return per_device(Timeline(bars, "s", "measured"), plan)


def _pipeline_spans(module: Any, replica: int, plan: Plan) -> list[_Span]:
    """The actions of ``module``'s pipeline on the rows of replica ``replica``'s devices:
    virtual stage ``k`` on the pipeline position its placement names, repeated for each
    rank."""
    pp = mesh_shape(plan)[1]
    pipeline = module.pipeline()
    # Which device runs virtual stage k: the pipeline's placement when it has one.
    placement = getattr(pipeline, "placement", None)
    rows = [r for r in device_rows(plan) if r.replica == replica]
    spans = []
    for action, start, end in list(pipeline.timeline):
        phase = str(getattr(action.phase, "value", action.phase))[:1].upper()
        j = placement[action.stage] if placement is not None else action.stage % pp
        for row in rows:
            if row.stage == j:
                spans.append((row.index, phase, int(action.microbatch),
                              pipeline.origin + start, pipeline.origin + end))
    return spans


def _replica_spans(pm: Any, plan: Plan) -> list[_Span]:
    """Each replica's pipeline actions, or (a whole model per replica) its recorded
    forward and backward, on its devices' rows."""
    rows = device_rows(plan)
    spans: list[_Span] = []
    for r, replica in enumerate(pm.replicas):
        if hasattr(replica, "pipeline"):
            spans += _pipeline_spans(replica, r, plan)
            continue
        mine = [row.index for row in rows if row.replica == r]
        spans += [(row, phase, 0, start, end) for k, phase, start, end in pm.timeline
                  if k == r for row in mine]
    return spans
