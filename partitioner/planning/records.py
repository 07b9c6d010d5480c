"""Predictions as plain JSON data, and back: what a plan keeps of how it was chosen.

``Plan.candidates`` holds one record per ranked candidate: its configuration, predicted
step time, bubble and memory; the chosen candidate's record also holds its stage costs and
the cluster, which is all :func:`partitioner.planning.simulate.simulate` needs to replay a saved
plan.
Records are made of lists, dicts, strings and numbers only, so they survive a JSON round trip
unchanged (and compare equal after it).

Example:
    >>> from partitioner.cost.devices import Cluster
    >>> from partitioner.planning.predict import Config, predict
    >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
    >>> cluster = Cluster.preset("A100-80GB")
    >>> p = predict(gpt_workload(GPTShape(4, 256, 4, 128, 1000), 16), cluster, Config(dp=8))
    >>> again, same = from_record(to_record(p, cluster))
    >>> again.step_time == p.step_time and same == cluster
    True
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from partitioner.cost.devices import Cluster, DeviceSpec, LinkSpec
from partitioner.cost.memory import MemoryBreakdown
from partitioner.planning.predict import Config, ConfigError, Prediction, StageProfile

__all__ = ["to_record", "from_record", "built_first", "DETAIL_KEYS"]

DETAIL_KEYS = ("stages", "memory", "dp_times", "optimizer_times", "breakdown", "cluster")
"""What a detailed record adds (:func:`to_record` with ``detail``): only the chosen
candidate's record of a plan holds them."""


def built_first(records: Sequence[dict[str, Any]], index: int, own: dict[str, Any],
                keep: Sequence[str]) -> tuple[dict[str, Any], ...]:
    """``records`` as a plan keeps them once the plan that runs was built for
    ``records[index]``: that one first, holding ``own`` (the built plan's record: its
    prediction, stage costs and cluster) with the keys ``keep`` of ``records[index]``, and
    ``ranked_step_time``, the step time the candidate was ranked by, where the plan built
    predicts another; the search's summary stays on the first record and the others keep no
    stage costs.

    A plan's first candidate is the one its step is simulated from, explained and drawn
    (``Plan.candidates``): it must be the plan that runs.

    Example:
        >>> ranked = [{"label": "a", "step_time": 0.1, "stages": [1], "search": {"n": 2}},
        ...           {"label": "b", "step_time": 0.2, "rank": 2}]
        >>> own = {"label": "b", "step_time": 0.3, "stages": [2], "rank": 1}
        >>> [(r["label"], r.get("rank"), r.get("ranked_step_time"), r.get("stages"),
        ...   r.get("search"))
        ...  for r in built_first(ranked, 1, own, ("rank",))]
        [('b', 2, 0.2, [2], {'n': 2}), ('a', None, None, None, None)]
    """
    first = {k: v for k, v in own.items() if k != "search"}
    first.update({k: v for k, v in records[index].items() if k in keep})
    if records[index].get("step_time") != own.get("step_time"):
        first["ranked_step_time"] = records[index].get("step_time")
    if "search" in records[0]:
        first["search"] = records[0]["search"]
    others = ({k: v for k, v in r.items() if k not in DETAIL_KEYS and k != "search"}
              for i, r in enumerate(records) if i != index)
    return (first, *others)


def to_record(prediction: Prediction, cluster: Cluster | None = None, *,
              detail: bool = True) -> dict[str, Any]:
    """A JSON-ready summary of a prediction (with stage costs and the cluster if ``detail``).

    :func:`from_record` reads the detailed form back, which is what lets
    ``partitioner.planning.simulate`` replay a saved plan.
    """
    c = prediction.config
    record: dict[str, Any] = {
        "config": asdict(c), "label": c.label(), "step_time": prediction.step_time,
        "pipeline_time": prediction.pipeline_time, "bubble": prediction.bubble,
        "peak_memory": prediction.peak_memory, "capacity": prediction.capacity,
        "fits": prediction.fits, "reason": prediction.reason,
        "samples_per_second": prediction.samples_per_second,
        "dp_time": prediction.dp_time, "optimizer_time": prediction.optimizer_time,
        "boundaries": list(prediction.boundaries)}
    if detail:
        detailed = dict(stages=[asdict(s) for s in prediction.stages],
                        memory=[asdict(m) for m in prediction.memory],
                        dp_times=list(prediction.dp_times),
                        optimizer_times=list(prediction.optimizer_times),
                        breakdown=dict(prediction.breakdown),
                        cluster=_cluster_dict(cluster) if cluster is not None else None)
        record.update({k: detailed[k] for k in DETAIL_KEYS if detailed[k] is not None})
    return json.loads(json.dumps(record))  # lists, not tuples: equal after a JSON round trip


def from_record(record: dict[str, Any]) -> tuple[Prediction, Cluster | None]:
    """The prediction (and cluster, if recorded) of a detailed :func:`to_record` dict.

    Raises:
        ConfigError: the record lacks the stage costs.
    """
    if "stages" not in record:
        raise ConfigError("this candidate record has no stage costs (only the chosen "
                          "candidate of a plan keeps them)")
    stages = tuple(StageProfile(**{**s, "sharing": tuple(s.get("sharing", ()))})
                   for s in record["stages"])
    prediction = Prediction(
        Config(**record["config"]), stages,
        record["step_time"], record["pipeline_time"], record["bubble"],
        tuple(MemoryBreakdown(**m) for m in record["memory"]), record["capacity"],
        tuple(record["dp_times"]), tuple(record["optimizer_times"]),
        record["samples_per_second"], record["reason"], dict(record.get("breakdown", {})))
    cluster = _cluster_from(record["cluster"]) if "cluster" in record else None
    return prediction, cluster


def _cluster_dict(cluster: Cluster) -> dict[str, Any]:
    return {"device": asdict(cluster.device), "nodes": cluster.nodes,
            "devices_per_node": cluster.devices_per_node,
            "intra_node": asdict(cluster.intra_node),
            "inter_node": asdict(cluster.inter_node) if cluster.inter_node else None,
            "nics_per_node": cluster.nics_per_node, "local": list(cluster.local),
            "processes": cluster.processes}


def _cluster_from(data: dict[str, Any]) -> Cluster:
    device = DeviceSpec(**{**data["device"], "peak_flops": data["device"]["peak_flops"],
                           "shared_speedup": tuple(data["device"]["shared_speedup"])})
    inter = _link_from(data["inter_node"]) if data["inter_node"] else None
    return Cluster(device, data["nodes"], data["devices_per_node"],
                   _link_from(data["intra_node"]), inter, data["nics_per_node"],
                   tuple(data["local"]), processes=bool(data.get("processes", False)))


def _link_from(data: dict[str, Any]) -> LinkSpec:
    rings = tuple((int(n), float(a), float(b)) for n, a, b in data.get("rings", ()))
    staggered = tuple((float(a), float(t)) for a, t in data.get("staggered_all_reduce", ()))
    computing = tuple((int(n), float(a), float(t))
                      for n, a, t in data.get("computing_all_reduce", ()))
    return LinkSpec(**{**data, "rings": rings, "staggered_all_reduce": staggered,
                       "computing_all_reduce": computing})
