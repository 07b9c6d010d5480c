"""The loader checks every field as the shipped schema does, and what the schema cannot say."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from partitioner import Plan
from partitioner.errors import PartitionError
from partitioner.plans.plan import PlanFormatError, Stage

jsonschema = pytest.importorskip("jsonschema")  # a test extra (absent on the GPU machine)

BASE: dict[str, Any] = {"format": "partitioner.plan", "version": 1, "strategy": "pipeline",
                        "devices": ["cpu", "cpu"],
                        "stages": [{"index": 0, "device": "cpu", "layers": ["a"]},
                                   {"index": 1, "device": "cpu", "layers": ["b"]}]}
TENSOR = {"kind": "tensor", "dtype": "float32", "shape": [4, 8], "batch_dim": 0}
STAGE = {"index": 0, "device": "cpu", "layers": ["a"]}

# (what is wrong, the key it is at, the document's changes): each must be refused by both.
BAD: list[tuple[str, str, dict[str, Any]]] = [
    ("capture pickle", "capture: 'pickle'", {"capture": "pickle"}),
    ("strategy a number", "strategy: 123", {"strategy": 123}),
    ("notes a string", "notes: 'a string'", {"notes": "a string"}),
    ("notes of numbers", "notes: [1]", {"notes": [1]}),
    ("devices empty", "devices: []", {"devices": []}),
    ("devices a string", "devices: 'cpu'", {"devices": "cpu"}),
    ("stages empty", "stages: []", {"stages": []}),
    ("chunks zero", "chunks: 0", {"chunks": 0}),
    ("chunks a string", "chunks: '2'", {"chunks": "2"}),
    ("chunks a bool", "chunks: True", {"chunks": True}),
    ("chunks a fraction", "chunks: 2.5", {"chunks": 2.5}),
    ("checkpoint unknown", "checkpoint: 'sometimes'", {"checkpoint": "sometimes"}),
    ("schedule a number", "schedule: 1", {"schedule": 1}),
    ("bubble above one", "predicted_bubble: 1.5", {"predicted_bubble": 1.5}),
    ("negative step time", "predicted_step_time: -1", {"predicted_step_time": -1}),
    ("unknown key", "chunk: unknown key; did you mean 'chunks'?", {"chunk": 2}),
    ("candidates of strings", "candidates[0]: 'x'", {"candidates": ["x"]}),
    ("stage with an unknown key", "stages[0].layer: unknown key",
     {"stages": [{**STAGE, "layer": ["a"]}]}),
    ("stage index negative", "stages[0].index: -1", {"stages": [{**STAGE, "index": -1}]}),
    ("stage layers a string", "stages[0].layers: 'a'", {"stages": [{**STAGE, "layers": "a"}]}),
    ("stage layers empty", "stages[0].layers: []", {"stages": [{**STAGE, "layers": []}]}),
    ("stage without device", "stages[0].device: missing",
     {"stages": [{"index": 0, "layers": ["a"]}]}),
    ("stage memory a fraction", "stages[0].predicted_memory: 1.5",
     {"stages": [{**STAGE, "predicted_memory": 1.5}]}),
    ("mesh zero", "mesh.dp: 0", {"mesh": {"dp": 0}}),
    ("mesh unknown axis", "mesh.xp: unknown key", {"mesh": {"xp": 1}}),
    ("mesh a list", "mesh: [1, 2, 1]", {"mesh": [1, 2, 1]}),
    ("shard kind unknown", "shard_specs['a.w'].kind: 'diag'",
     {"shard_specs": {"a.w": {"dim": 0, "kind": "diag"}}}),
    ("shard without dim", "shard_specs['a.w'].dim: missing",
     {"shard_specs": {"a.w": {"kind": "colwise"}}}),
    ("planner balance zero", "planner.balance[0]: 0", {"planner": {"balance": [0]}}),
    ("planner memory zero", "planner.memory_limit[0]: 0", {"planner": {"memory_limit": [0]}}),
    ("planner inputs a string", "planner.example_inputs: 'float32[2]'",
     {"planner": {"example_inputs": "float32[2]"}}),
    ("planner spec a string", "planner.spec: 'x'", {"planner": {"spec": "x"}}),
    ("planner unknown key", "planner.bogus: unknown key", {"planner": {"bogus": 1}}),
    ("signature shape negative", "planner.signature.args[0].shape: [-1]",
     {"planner": {"signature": {"args": [{**TENSOR, "shape": [-1], "batch_dim": None}]}}}),
    ("signature unknown kind", "planner.signature.args[0].kind: 'blob'",
     {"planner": {"signature": {"args": [{"kind": "blob"}]}}}),
    ("signature value a list", "planner.signature.args[0].value: [1]",
     {"planner": {"signature": {"args": [{"kind": "value", "value": [1]}]}}}),
    ("signature extra key", "planner.signature.args[0].extra: unknown key",
     {"planner": {"signature": {"args": [{**TENSOR, "extra": 1}]}}}),
    ("signature tensor without dtype", "planner.signature.kwargs['m'].dtype: None",
     {"planner": {"signature": {"kwargs": {"m": {"kind": "tensor", "shape": [2]}}}}}),
    ("signature dict of a list", "planner.signature.kwargs['d'].items: []",
     {"planner": {"signature": {"kwargs": {"d": {"kind": "dict", "items": []}}}}}),
    ("signature nested bad", "planner.signature.args[0].items[1].type: 3",
     {"planner": {"signature": {"args": [{"kind": "tuple",
                                          "items": [TENSOR, {"kind": "type", "type": 3}]}]}}}),
    ("fingerprint digest", "fingerprint.digest: 'md5:x'",
     {"fingerprint": {"digest": "md5:x", "modules": [], "parameters": {}}}),
    ("fingerprint without parameters", "fingerprint.parameters: missing",
     {"fingerprint": {"digest": "sha256:" + "0" * 64, "modules": []}}),
    ("fingerprint shape a string", "fingerprint.parameters['w'].shape: 'x'",
     {"fingerprint": {"digest": "sha256:" + "0" * 64, "modules": [],
                      "parameters": {"w": {"shape": "x", "dtype": "float32"}}}}),
]


def _schema() -> dict[str, Any]:
    text = resources.files("partitioner.plans").joinpath("plan_schema.json").read_text()
    return json.loads(text)


def _document(changes: dict[str, Any]) -> dict[str, Any]:
    document = {**BASE, **changes}
    if "stages" in changes and isinstance(changes["stages"], list) and changes["stages"]:
        document["devices"] = ["cpu"] * len(changes["stages"])
    return json.loads(json.dumps(document))


@pytest.mark.parametrize(("case", "key", "changes"), BAD, ids=[case for case, _, _ in BAD])
def test_schema_and_loader_refuse_the_same_bad_documents(case: str, key: str,
                                                         changes: dict[str, Any]) -> None:
    document = _document(changes)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, _schema())
    with pytest.raises(PlanFormatError) as caught:
        Plan.from_dict(document)
    assert key in str(caught.value), case
    assert isinstance(caught.value, ValueError)


def test_schema_and_loader_accept_the_same_good_documents() -> None:
    signature = {"args": [TENSOR, {"kind": "value", "value": None},
                          {"kind": "list", "items": [{"kind": "type", "type": "Cache"}]}],
                 "kwargs": {"mask": {**TENSOR, "dtype": "bool"},
                            "opts": {"kind": "dict", "items": {"k": {"kind": "value",
                                                                     "value": 2.5}}}}}
    goods = [BASE, {**BASE, "chunks": 2.0, "mesh": {"dp": 1.0, "pp": 2}},
             {**BASE, "planner": {"strategy": "auto", "signature": signature}},
             {**BASE, "planner": None, "fingerprint": None, "mesh": None}]
    for document in goods:
        jsonschema.validate(document, _schema())
        plan = Plan.from_dict(document)
        assert Plan.from_dict(json.loads(plan.to_json())) == plan
    # JSON has one kind of number: 2.0 is the integer 2 (as JSON Schema counts it).
    assert Plan.from_dict(goods[1]).chunks == 2 and isinstance(Plan.from_dict(goods[1]).chunks,
                                                                 int)


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(PlanFormatError) as caught:
        Plan.from_dict({**BASE, "capture": "pickle", "strategy": 123, "notes": "a string"})
    lines = str(caught.value).splitlines()
    assert lines[0] == "invalid plan:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["strategy", "capture", "notes"]


def test_notes_are_never_read_back_as_characters() -> None:
    with pytest.raises(PlanFormatError, match="notes: 'abc'; give a list of strings"):
        Plan.from_dict({**BASE, "notes": "abc"})


def test_a_stage_device_that_disagrees_with_devices_is_refused() -> None:
    document = json.loads(json.dumps(BASE))
    document["stages"][1]["device"] = "cuda:1"
    jsonschema.validate(document, _schema())  # the schema cannot tell
    with pytest.raises(PlanFormatError) as caught:
        Plan.from_dict(document)
    message = str(caught.value)
    assert "stages[1].device is 'cuda:1' but devices[1] is 'cpu'" in message
    assert "make them the same" in message
    with pytest.raises(PlanFormatError, match="stages\\[0\\].device is 'cpu:1'"):
        Plan("x", ("cpu",), (Stage(0, "cpu:1", ("a",)),))


def test_a_plan_dict_with_tuples_reads_back() -> None:
    """``partition_distributed`` broadcasts ``to_dict()`` without JSON: tuples stay tuples."""
    plan = Plan.from_dict(BASE)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_format_and_version_are_checked_first() -> None:
    with pytest.raises(PlanFormatError, match="format is 'other'"):
        Plan.from_dict({**BASE, "format": "other", "strategy": 1})
    with pytest.raises(PlanFormatError, match="plan file version 2"):
        Plan.from_dict({**BASE, "version": 2})
    with pytest.raises(PartitionError, match="a plan is a JSON object, got list"):
        Plan.from_dict([BASE])  # type: ignore[arg-type]


def test_a_deeply_nested_dict_is_refused_without_recursion_error() -> None:
    deep: Any = "x"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(PlanFormatError, match="nests deeper than 64 levels"):
        Plan.from_dict({**BASE, "candidates": [{"deep": deep}]})


def test_split_kinds_are_defined_once_and_the_schema_agrees() -> None:
    from partitioner.passes.tensor_parallel.match import SITE_KINDS
    from partitioner.planning.tp_rules import RULE_KINDS
    from partitioner.plans import plan
    from partitioner.runtime.tensor_parallel.sharding import KINDS, SPLIT_KINDS

    shard = _schema()["properties"]["shard_specs"]["additionalProperties"]
    assert tuple(shard["properties"]["kind"]["enum"]) == SPLIT_KINDS
    assert plan.SHARD_KINDS is SPLIT_KINDS
    assert set(KINDS) <= set(RULE_KINDS)
    assert {k for kinds in SITE_KINDS.values() for k in kinds} <= set(RULE_KINDS)
