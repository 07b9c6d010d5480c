"""From costs to a :class:`~partitioner.plan.Plan`: the pipeline planner and ``"auto"``.

``partition()`` hands over the model's :class:`~partitioner.cost.Workload`, its layer names
and the devices as a :class:`~partitioner.devices.Cluster`; this module asks
``partitioner.predict`` (one configuration: ``strategy="pipeline"``, ``balance=``,
``split_points=``) or ``partitioner.auto`` (the search) and writes the answer as a plan: one
stage per pipeline device with its layers, the predicted times and memory, the mesh, and the
candidates with their costs (``Plan.candidates``, read by ``Plan.explain()`` and
``partitioner.simulate``).

Example:
    >>> from partitioner.devices import Cluster
    >>> from partitioner.transformer_model import GPTShape, gpt_workload
    >>> w = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=64)
    >>> names = [layer.name for layer in w.layers]
    >>> plan = auto_plan(w, names, Cluster.preset("A100-80GB"))
    >>> plan.strategy, plan.mesh.dp * plan.mesh.tp * plan.mesh.pp
    ('hybrid', 8)
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.auto import records, search
from partitioner.cost import Workload
from partitioner.devices import Cluster
from partitioner.errors import MemoryLimitError
from partitioner.plan import Mesh, Plan, Stage
from partitioner.predict import Config, Prediction, predict, replayed
from partitioner.records import to_record
from partitioner.simulate import refine

__all__ = ["pipeline_plan", "auto_plan", "plan_from"]


def _labels(cluster: Cluster, config: Config) -> tuple[str, ...]:
    if cluster.is_local and config.dp == config.tp == 1:
        return tuple(cluster.local[:config.pp])
    stride = config.dp * config.tp  # rank = (stage * dp + replica) * tp + shard
    return tuple(f"{cluster.spec(j * stride).name}#{j * stride}" for j in range(config.pp))


def plan_from(prediction: Prediction, names: Sequence[str], cluster: Cluster, *,
              strategy: str, capture: str = "fx", candidates: tuple[dict, ...] = (),
              notes: tuple[str, ...] = ()) -> Plan:
    """The plan of one prediction: a stage per pipeline device, its chunks' layers in order.

    Args:
        prediction: the chosen configuration's prediction.
        names: the layers' names.
        cluster: the devices it was made for.
        strategy: recorded as ``Plan.strategy``.
        capture: how the model was captured.
        candidates: the records for ``Plan.candidates`` (default: this prediction's).
        notes: remarks for ``Plan.notes``.
    """
    c = prediction.config
    share = replayed(c.checkpoint, c.chunks) / c.chunks
    labels = _labels(cluster, c)
    stages = []
    for j in range(c.pp):
        mine = prediction.stages[j::c.pp]
        layers = tuple(name for s in mine for name in names[s.first:s.last])
        time = sum(s.forward + s.backward + share * s.replay for s in mine)
        stages.append(Stage(j, labels[j], layers, time, int(prediction.memory[j].total),
                            int(sum(s.param_bytes for s in mine))))
    own = candidates or (dict(to_record(prediction, cluster), rank=1, chosen=True),)
    return Plan(strategy, labels, tuple(stages), c.chunks, c.checkpoint, c.schedule, capture,
                prediction.step_time, prediction.bubble, notes, Mesh(c.dp, c.pp, c.tp),
                candidates=own)


def pipeline_plan(workload: Workload, names: Sequence[str], cluster: Cluster, *,
                  strategy: str = "pipeline", chunks: int = 1, checkpoint: str = "except_last",
                  boundaries: Sequence[int] | None = None, capacity: float | None = None,
                  optimizer: str = "adam", capture: str = "fx") -> Plan:
    """A GPipe plan over every device: the optimal split, or ``boundaries`` as given.

    Raises:
        MemoryLimitError: no split fits (only when the split is the planner's to choose).
    """
    config = Config(1, 1, cluster.size, chunks, "gpipe", 1, checkpoint, optimizer)
    prediction = predict(workload, cluster, config, boundaries, capacity)
    if prediction.reason:
        raise MemoryLimitError(prediction.reason)
    if cluster.is_local and cluster.spec(0).shared_speedup:
        prediction = refine(prediction, cluster)
    return plan_from(prediction, names, cluster, strategy=strategy, capture=capture,
                     notes=workload.notes)


def auto_plan(workload: Workload, names: Sequence[str], cluster: Cluster, *,
              chunks: int | None = None, checkpoint: str | None = None,
              capacity: float | None = None, optimizer: str = "adam",
              budget: float | None = 5.0, capture: str = "fx") -> Plan:
    """The fastest fitting configuration :func:`partitioner.auto.search` finds, as a plan.

    On this machine's devices only configurations the runtime can execute are chosen.
    ``Plan.strategy`` says what was chosen: ``"pipeline"`` (``dp = tp = 1``) or ``"hybrid"``.
    """
    result = search(workload, cluster, chunks=chunks, checkpoint=checkpoint,
                    optimizer=optimizer, budget=budget, capacity=capacity)
    made = records(result, cluster)
    from partitioner.auto import explain
    why = explain(made).splitlines()[-1]
    notes = (*workload.notes, why)
    c = result.best.config
    kind = "pipeline" if c.dp == c.tp == 1 else "hybrid"
    return plan_from(result.best, names, cluster, strategy=kind, capture=capture,
                     candidates=made, notes=notes)
