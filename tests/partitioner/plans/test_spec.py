from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import ResidualCNN, gpt2, mlp

from partitioner import Spec, load_plan, make_plan, partition
from partitioner.plans.plan import Plan, ShardSpec
from partitioner.plans.spec import SpecError, layer_matches, summarize_names

X = torch.randn(6, 3, 8, 8)


def test_globs_name_stages_and_the_compiler_fills_the_rest() -> None:
    spec = {"stages": [{"layers": "layer1"}, {"layers": "layer2.*"}], "chunks": 3,
            "checkpoint": "never"}
    model = ResidualCNN()
    pm = partition(model, ["cpu", "cpu"], example_inputs=(X,), plan=spec)
    plan = pm.plan
    assert plan.stages[0].layers == ("stem.0", "stem.1", "layer1.0", "layer1.1")
    assert plan.stages[1].layers == ("layer2.0", "layer2.1", "head")
    assert plan.strategy == "spec" and plan.chunks == 3 and plan.checkpoint == "never"
    assert plan.planner is not None and plan.planner.spec == spec
    assert any("stem.0, stem.1" in note for note in plan.notes)
    assert plan.fingerprint is not None and plan.stages[0].predicted_time is not None
    torch.testing.assert_close(pm(X), model(X))
    pm.close()


def test_yaml_spec_with_devices_per_stage_and_tensor_parallel_rules(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("""\
# two stages; the planner's costs are still computed
stages:
  - {layers: "transformer.h.0", device: cpu}
  - {layers: "transformer.h.1", device: cpu}
tensor_parallel:
  "transformer.h.*.mlp.c_fc": {kind: colwise, dim: 1}   # GPT-2's Conv1D is (in, out)
  "transformer.wte": vocab
""")
    ids = torch.randint(0, 64, (4, 16))
    plan = make_plan(gpt2(), None, example_inputs=(ids,), plan=path)
    assert plan.devices == ("cpu", "cpu")
    assert plan.stages[1].layers[0] == "transformer.h.1"
    assert plan.shard_specs["transformer.h.0.mlp.c_fc.weight"] == ShardSpec(1, "colwise")
    assert plan.shard_specs["transformer.wte.weight"] == ShardSpec(0, "vocab")
    assert "transformer.h.0.mlp.c_fc.bias" in plan.shard_specs


def test_kinds_split_weights_and_biases_by_megatron_convention() -> None:
    spec = {"tensor_parallel": {"0": "colwise", "2": "rowwise"}, "balance": [3, 4]}
    plan = make_plan(mlp(), ["cpu"] * 2, plan=spec)
    assert plan.shard_specs == {"0.weight": ShardSpec(0, "colwise"),
                                "0.bias": ShardSpec(0, "colwise"),
                                "2.weight": ShardSpec(1, "rowwise")}


def test_spec_without_split_is_planned_optimally() -> None:
    spec = {"devices": ["cpu"] * 3, "chunks": 2}
    planned = make_plan(ResidualCNN(), None, example_inputs=(X,), plan=spec)
    # A spec's checkpoint defaults to "except_last" (GPipe's), the direct call searches it.
    direct = make_plan(ResidualCNN(), ["cpu"] * 3, example_inputs=(X,), chunks=2,
                       checkpoint=planned.checkpoint)
    assert planned.balance == direct.balance and planned.strategy == direct.strategy
    # Regression: auto's choice of replicas was recorded with the spec's mesh (dp=1).
    assert planned.mesh == direct.mesh and planned.schedule == direct.schedule


def test_split_points_and_balance_in_a_spec() -> None:
    by_points = make_plan(mlp(), ["cpu"] * 2, plan={"split_points": ["4"]})
    by_balance = make_plan(mlp(), ["cpu"] * 2, plan={"balance": [4, 3]})
    assert by_points.balance == by_balance.balance == (4, 3)


def test_structural_errors_name_every_wrong_key() -> None:
    with pytest.raises(SpecError) as caught:
        Spec.from_dict({"stages": [{"layers": "a", "devcie": "cpu"}, {"layers": 3}],
                        "chunks": 0, "checkpoint": "sometimes", "schedual": "gpipe",
                        "tensor_parallel": {"a": "diagonal"}})
    message = str(caught.value)
    for expected in ("stages[0].devcie: unknown key; did you mean 'device'?",
                     "stages[1].layers: 3; give a module-name glob",
                     "chunks: 0; give a positive integer",
                     "checkpoint: 'sometimes'; use one of always, except_last, never",
                     "schedual: unknown key; did you mean 'schedule'?",
                     "tensor_parallel['a']: kind 'diagonal'; use one of colwise"):
        assert expected in message
    assert isinstance(caught.value, ValueError)


def test_a_pattern_matching_no_layer_points_at_its_key() -> None:
    spec = {"stages": [{"layers": "layer1"}, {"layers": "layer2"}, {"layers": "blocks.9*"}]}
    with pytest.raises(SpecError, match=r"stages\[2\].layers: pattern 'blocks.9\*' matches no "
                                        r"layer; layers are stem.0, stem.1, layer1.0, layer1.1, "):
        make_plan(ResidualCNN(), ["cpu"] * 3, plan=spec)


def test_stages_out_of_order_or_overlapping_are_refused() -> None:
    with pytest.raises(SpecError, match=r"stages\[1\].layers: its first layer layer1.0 does not "
                                        r"come after stages\[0\]'s first layer layer2.0"):
        make_plan(ResidualCNN(), ["cpu"] * 2,
                  plan={"stages": [{"layers": "layer2"}, {"layers": "layer1"}]})
    with pytest.raises(SpecError, match=r"stages\[0\].layers: matches head, which come after"):
        make_plan(ResidualCNN(), ["cpu"] * 2,
                  plan={"stages": [{"layers": ["stem", "head"]}, {"layers": "layer2"}]})


def test_name_problems_are_reported_together() -> None:
    spec = {"stages": [{"layers": "stem"}, {"layers": "nope"}],
            "tensor_parallel": {"layer1.*.conv9": "colwise"}}
    with pytest.raises(SpecError) as caught:
        make_plan(ResidualCNN(), ["cpu"] * 2, plan=spec)
    assert "stages[1].layers: pattern 'nope'" in str(caught.value)
    assert "tensor_parallel['layer1.*.conv9']: pattern matches no module" in str(caught.value)
    assert "layer1.0.conv1" in str(caught.value)  # names like it


def test_disagreements_between_spec_and_call_are_refused() -> None:
    with pytest.raises(SpecError, match="chunks: the spec says 2 but chunks=4"):
        make_plan(mlp(), ["cpu"] * 2, chunks=4, plan={"balance": [3, 4], "chunks": 2})
    with pytest.raises(SpecError, match="the number of stages disagrees"):
        Spec.from_dict({"balance": [3, 4], "devices": ["cpu"] * 3})
    with pytest.raises(SpecError, match="spec names no devices"):
        make_plan(mlp(), None, plan={"balance": [3, 4]})
    with pytest.raises(SpecError, match="give one way of splitting"):
        Spec.from_dict({"balance": [3, 4], "split_points": ["4"]})


def test_load_plan_tells_plans_from_specs(tmp_path: Path) -> None:
    plan = make_plan(mlp(), ["cpu"] * 2, balance=[3, 4])
    plan.save(tmp_path / "plan.json")
    (tmp_path / "spec.json").write_text(json.dumps({"balance": [3, 4]}))
    assert isinstance(load_plan(tmp_path / "plan.json"), Plan)
    assert isinstance(load_plan(tmp_path / "spec.json"), Spec)
    (tmp_path / "bad.yaml").write_text("stages: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_plan(tmp_path / "bad.yaml")


def test_yaml_loading_never_builds_python_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("chunks: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        Spec.load(path)


def test_layer_matching_and_name_summaries() -> None:
    assert layer_matches("h.[0-5]", "h.3") and not layer_matches("h.[0-5]", "h.13")
    assert layer_matches("layer1", "layer1.0") and layer_matches("0_1", "0.1")
    assert layer_matches("h.1", "h.1#2")
    assert summarize_names([f"h.{k}" for k in range(48)]) == "h.0 .. h.47"


def test_a_spec_schedule_is_one_some_runtime_executes() -> None:
    # Taken from the schedule registry: every registered schedule runs somewhere.
    for name in ("gpipe", "1f1b", "interleaved", "zero_bubble", "v_shape"):
        assert Spec.from_dict({"schedule": name}).schedule == name
    with pytest.raises(SpecError, match="schedule: 'zb'; use one of gpipe, 1f1b, "
                                        "interleaved, zero_bubble, v_shape$"):
        Spec.from_dict({"schedule": "zb"})
