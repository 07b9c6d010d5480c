"""Plan and spec files: refused with the path named before anything large or deep is parsed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from torch import nn

from partitioner import Plan
from partitioner.apply import load_plan
from partitioner.errors import PartitionError, PlanFormatError, SpecError
from partitioner.plans.documents import MAX_DOCUMENT_BYTES, check_document
from partitioner.plans.spec import Spec, read_document

PLAN = {"format": "partitioner.plan", "version": 1, "strategy": "x", "devices": ["cpu"],
        "stages": [{"index": 0, "device": "cpu", "layers": ["a"]}]}


def _deep_plan(depth: int) -> str:
    text = json.dumps({**PLAN, "candidates": ["@"]})
    return text.replace('"@"', '{"a": ' + "[" * depth + "1" + "]" * depth + "}")


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_plan_json_is_a_plan_format_error(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "deep.json"
    path.write_text(_deep_plan(depth))
    with pytest.raises(PlanFormatError, match="plan file '.*deep.json' nests deeper than 64"):
        Plan.load(path)
    with pytest.raises(SpecError, match="nests deeper than 64 levels"):
        load_plan(path)


def test_deeply_nested_yaml_is_a_spec_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("stages: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(SpecError, match="spec '.*deep.yaml' nests deeper than 64 levels"):
        Spec.load(path)


def test_files_over_the_size_limit_are_refused_before_parsing(tmp_path: Path) -> None:
    for name in ("huge.json", "huge.yaml"):
        path = tmp_path / name
        with path.open("wb") as file:
            file.truncate(MAX_DOCUMENT_BYTES + 5 * 2**20)  # sparse: no time to write it
        with pytest.raises(SpecError) as caught:
            load_plan(path)
        message = str(caught.value)
        assert name in message and "21.0 MiB" in message and "16 MiB limit" in message
        assert "check that this is the file you meant" in message
    with pytest.raises(PlanFormatError, match="huge.json' is 21.0 MiB, over the 16 MiB"):
        Plan.load(tmp_path / "huge.json")


def test_a_file_at_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "padded.json"
    text = json.dumps(PLAN)
    path.write_text(text + " " * (MAX_DOCUMENT_BYTES - len(text)))
    assert Plan.load(path).layers == ("a",)


def test_a_missing_path_or_a_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "plan.json"
    with pytest.raises(PlanFormatError, match="cannot read plan file '.*plan.json': it does "
                                              "not exist"):
        Plan.load(missing)
    with pytest.raises(SpecError, match="cannot read plan or spec file '.*plan.json': it does "
                                        "not exist .*check the path"):
        load_plan(missing)
    with pytest.raises(PlanFormatError, match=f"'{tmp_path}': it is a directory"):
        Plan.load(tmp_path)
    with pytest.raises(SpecError, match=f"'{tmp_path}': it is a directory"):
        Spec.load(tmp_path)


def test_bytes_that_are_not_text_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_bytes(pickle.dumps(nn.Linear(2, 2)))
    with pytest.raises(SpecError, match="model.yaml' is not UTF-8 text \\(byte 0x80 at "
                                         "offset 0\\)"):
        load_plan(path)
    with pytest.raises(PlanFormatError, match="is not UTF-8 text"):
        Plan.load(path)


@pytest.mark.parametrize(("text", "what"), [("- a\n- b\n", "is a list"), ("", "is empty"),
                                            ("just words\n", "is a str")])
def test_yaml_that_is_not_a_mapping_names_the_path(tmp_path: Path, text: str, what: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"spec.yaml' {what}, not a mapping"):
        read_document(path)
    with pytest.raises(SpecError, match=f"spec.yaml' {what}, not a mapping"):
        load_plan(path)


def test_json_that_is_not_a_mapping_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("[1, 2]")
    with pytest.raises(SpecError, match="plan.json' is a list, not a mapping"):
        load_plan(path)
    with pytest.raises(PlanFormatError, match="plan.json': a plan is a JSON object, got list"):
        Plan.load(path)


def test_nan_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAN, "predicted_step_time": float("nan")}))
    with pytest.raises(PlanFormatError, match="not valid JSON: NaN is not a JSON number"):
        Plan.load(path)


def test_yaml_aliases_that_expand_too_far_or_loop_are_refused(tmp_path: Path) -> None:
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n"
    for previous, name in zip("abcdefgh", "bcdefghi"):
        laughs += f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]\n"
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs)
    with pytest.raises(SpecError, match="laughs.yaml' expands to more than 4,194,304 values"):
        load_plan(path)
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [1, *a]\n")
    with pytest.raises(SpecError, match="loop.yaml' refers to itself"):
        load_plan(loop)


def test_a_key_written_twice_is_refused_naming_it(tmp_path: Path) -> None:
    """Issue #19: a spec with ``stages:`` twice silently kept the second."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("stages:\n  - [fc1]\nchunks: 2\nstages:\n  - [fc2]\n")
    with pytest.raises(SpecError, match=r"spec.yaml' writes key 'stages' twice in one "
                                        r"mapping \(lines 1 and 4\)"):
        Spec.load(spec)
    spec_json = tmp_path / "spec.json"
    spec_json.write_text('{"chunks": 2, "chunks": 4}')
    with pytest.raises(SpecError, match="spec.json' writes key 'chunks' twice"):
        Spec.load(spec_json)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN)[:-1] + ', "strategy": "y"}')
    with pytest.raises(PlanFormatError, match="writes key 'strategy' twice"):
        Plan.load(plan)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("base: &b {chunks: 2, x: 1}\nother:\n  <<: *b\n  chunks: 4\n")
    assert read_document(path)["other"] == {"chunks": 4, "x": 1}


def test_aliases_do_not_hide_depth() -> None:
    inner: list[object] = [1]
    for _ in range(40):
        inner = [inner]
    outer: list[object] = [inner]
    for _ in range(40):
        outer = [outer]
    # ``inner`` is seen first near the top, then again 40 levels down: 82 levels in all.
    with pytest.raises(SpecError, match="nests deeper than 64"):
        check_document({"a": inner, "b": outer}, "spec", SpecError)
    check_document({"a": inner, "b": [inner, inner]}, "spec", SpecError)


def test_errors_are_partition_errors_and_value_errors(tmp_path: Path) -> None:
    with pytest.raises(PartitionError) as caught:
        load_plan(tmp_path / "missing.yaml")
    assert isinstance(caught.value, ValueError)
