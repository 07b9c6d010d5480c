"""Tests of partitioner/planning/records.py: predictions as JSON data and back."""

from __future__ import annotations

import doctest
import json

import pytest

import partitioner.planning.records
from partitioner.cost.devices import REFERENCE_CPU, Cluster, LinkSpec
from partitioner.cost.transformer_model import GPTShape, gpt_workload
from partitioner.planning.predict import Config, ConfigError, predict
from partitioner.planning.records import from_record, to_record
from partitioner.planning.world import world_cluster

CLUSTER = Cluster.preset("A100-80GB", nodes=2)
WORKLOAD = gpt_workload(GPTShape(16, 2048, 16, 1024, 50304), batch=64)


def test_records_round_trip_through_json() -> None:
    prediction = predict(WORKLOAD, CLUSTER, Config(dp=2, tp=2, pp=4, chunks=8))
    record = to_record(prediction, CLUSTER)
    again, cluster = from_record(json.loads(json.dumps(record)))
    assert again.stages == prediction.stages and again.step_time == prediction.step_time
    assert cluster == CLUSTER
    with pytest.raises(ConfigError, match="no stage costs"):
        from_record(to_record(prediction, detail=False))


def test_a_measured_world_link_round_trips_with_its_timed_rings() -> None:
    link = LinkSpec("gloo (measured)", 3e9, 4e-5, busy_latency=9e-5, wake=1e-4,
                    rings=((2, 1.3e-4, 1.2e9), (4, 7e-4, 2e9)), scalar_all_reduce=5e-4,
                    staggered_all_reduce=((5e-4, 1.5e-3), (5e-3, 5.6e-3)))
    world = world_cluster(["h"] * 4, "cpu", cpu=REFERENCE_CPU, link=link)
    prediction = predict(WORKLOAD, world, Config(dp=2, pp=2, chunks=2))
    _, cluster = from_record(json.loads(json.dumps(to_record(prediction, world))))
    assert cluster == world and cluster.intra_node.rings == link.rings
    assert cluster.processes


def test_records_are_json_already() -> None:
    record = to_record(predict(WORKLOAD, CLUSTER, Config(dp=16)), CLUSTER)
    assert json.loads(json.dumps(record)) == record
    assert record["label"] == "dp=16 tp=1 pp=1 m=1 gpipe ckpt=never"


def test_doctests() -> None:
    assert doctest.testmod(partitioner.planning.records).failed == 0
