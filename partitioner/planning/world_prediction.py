"""The step of a plan whose sizes the caller gave, predicted as the world's ranks run it.

``partition_distributed(model, x, pp=4)`` (or ``dp=``, ``tp=``) cuts the model as a
one-process pipeline would (``PlanRequest`` over ``pp`` devices of the ranks' type),
then runs it on processes: each replica all-reduces its gradients over the link, every rank
steps its own optimizer and all-reduces the loss, and a rank that waited for a message
starts cold (``partitioner.planning.simulate``). :func:`predicted_as_run` costs that plan's
own split and sizes on the world's cluster (``Cluster.processes``), so the plan's header,
``explain()``, ``simulate`` and the step it records agree with what the ranks do, as
``strategy="auto"``'s plans do; before, such a plan recorded the one-process pipeline of
one replica (``dp=1`` in its header whatever ``dp`` ran). A split fixed by ``balance=`` or
``split_points=`` is not costed at all (the capture skips the costs), so such plans carry
no prediction, as before.

Example:
    >>> import torch
    >>> from partitioner import make_plan
    >>> from partitioner.analysis import analyze
    >>> from partitioner.planning.world import REFERENCE_LOOPBACK, world_cluster
    >>> from partitioner.cost.devices import REFERENCE_CPU
    >>> from partitioner.runtime.mesh import Mesh
    >>> from dataclasses import replace
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    >>> x = torch.randn(16, 64)
    >>> plan = make_plan(model, ["cpu", "cpu"], example_inputs=(x,), chunks=2,
    ...                  schedule="1f1b", checkpoint="never")
    >>> plan = replace(plan, mesh=Mesh(dp=2, pp=2, tp=1))
    >>> world = world_cluster(["h"] * 4, "cpu", cpu=REFERENCE_CPU, link=REFERENCE_LOOPBACK)
    >>> ran = predicted_as_run(plan, analyze(model, (x,)).workload, world)
    >>> ran.candidates[0]["label"], ran.candidates[0]["cluster"]["processes"]
    ('dp=2 tp=1 pp=2 m=2 1f1b ckpt=never', True)
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

from partitioner.cost.cost import Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.precision_cost import precision_workload
from partitioner.errors import PartitionError
from partitioner.planning.predict import Config, predict, replayed
from partitioner.planning.records import to_record
from partitioner.planning.simulate import predict_step
from partitioner.planning.world import assume_split
from partitioner.plans.plan import Plan

__all__ = ["predicted_as_run", "not_predicted"]


def predicted_as_run(plan: Plan, workload: Workload, cluster: Cluster, *,
                     precision: str = "fp32") -> Plan:
    """``plan`` with its step, bubble, stage times and candidate record predicted for its
    mesh on ``cluster`` (the world's ranks), its own split kept.

    Args:
        plan: the plan the ranks run (its ``mesh``, micro-batches, schedule, virtual stages,
            checkpoint mode and optimizer sharding are costed as given).
        workload: the model's costs from one replica's example batch (``dp`` replicas make
            a step of ``dp`` times it), over the plan's layers.
        cluster: the world's devices and link.
        precision: the run's ``precision=``.

    Returns:
        The plan with the new figures; where its sizes cannot be costed (a configuration
        the cost model refuses), the plan without a predicted step and a note saying why,
        rather than a number for another run.
    """
    mesh = plan.mesh
    dp, tp, pp = (mesh.dp, mesh.tp, mesh.pp) if mesh is not None else (1, 1, len(plan.devices))
    counts = [len(s.layers) for s in plan.stages]
    if sum(counts) != len(workload.layers):  # costing another split would be another run
        return not_predicted(plan, f"the plan's {sum(counts)} layers are not the capture's "
                                   f"{len(workload.layers)}")
    boundaries = (0, *accumulate(counts))
    work = precision_workload(replace(workload, batch=workload.batch * dp, splits=None),
                              precision)
    if tp > 1 and work.max_tp == 1:
        work = assume_split(work)
    try:
        config = Config(dp=dp, tp=tp, pp=pp, chunks=plan.chunks, schedule=plan.schedule,
                        virtual=plan.virtual_stages, checkpoint=plan.checkpoint,
                        optimizer_sharding=plan.optimizer_sharding and dp > 1)
        prediction = predict_step(predict(work, cluster, config, boundaries), cluster)
    except PartitionError as error:
        return not_predicted(plan, str(error).splitlines()[0])
    share = replayed(config.checkpoint, config.chunks) / config.chunks
    stages = tuple(replace(s, predicted_time=p.forward + p.backward + share * p.replay)
                   for s, p in zip(plan.stages, prediction.stages))
    record = dict(to_record(prediction, cluster), rank=1, chosen=True)
    kept = tuple(n for n in plan.notes if not n.startswith("chosen:"))
    note = (f"predicted as {cluster.size} ranks run it ({cluster.intra_node.name}): "
            f"{config.label()}, {prediction.step_time * 1e3:.3g} ms a step")
    return replace(plan, stages=stages, predicted_step_time=prediction.step_time,
                   predicted_bubble=prediction.bubble, candidates=(record,),
                   notes=(*kept, note))


def not_predicted(plan: Plan, why: str) -> Plan:
    """``plan`` without a predicted step (nor the candidates it came from), with a note
    saying ``why``: what a plan of given sizes records where its ranks' step cannot be
    costed, rather than a figure for another run."""
    return replace(plan, predicted_step_time=None, predicted_bubble=None, candidates=(),
                   notes=(*plan.notes, f"step not predicted for these ranks: {why}"))
