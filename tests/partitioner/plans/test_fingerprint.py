from __future__ import annotations

import torch
from models import LongSkip, mlp
from torch import nn

from partitioner.plans.fingerprint import Fingerprint, differences, fingerprint


def test_fingerprint_is_stable_and_ignores_values_and_device() -> None:
    a = fingerprint(mlp())
    torch.manual_seed(1)
    with torch.device("meta"):
        b = fingerprint(mlp())
    assert a == b
    assert a.digest.startswith("sha256:") and len(a.digest) == 7 + 64


def test_fingerprint_records_modules_shapes_and_dtypes() -> None:
    f = fingerprint(LongSkip(width=8))
    assert f.model == "LongSkip"
    assert "layers.5" in f.modules
    weight = next(e for e in f.parameters if e.name == "layers.0.weight")
    assert weight.shape == (8, 8) and weight.dtype == "float32"


def test_differences_list_shapes_dtypes_and_missing_names() -> None:
    base = fingerprint(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    wider = fingerprint(nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)))
    lines = differences(base, wider)
    assert "parameter 0.weight: shape (8, 4) in the plan, (9, 4) in the model" in lines
    shorter = fingerprint(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    lines = differences(base, shorter)
    assert "module '2' is in the plan but not in the model" in lines
    assert "parameter 2.weight is in the plan but not in the model" in lines
    half = fingerprint(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half())
    assert any("dtype float32 in the plan, float16 in the model" in line
               for line in differences(base, half))


def test_differences_are_capped() -> None:
    a = fingerprint(nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)]))
    b = fingerprint(nn.Sequential(*[nn.Linear(5, 5) for _ in range(20)]))
    lines = differences(a, b, limit=3)
    assert len(lines) == 4 and lines[-1] == "... and 37 more like these"


def test_same_model_has_no_differences() -> None:
    assert differences(fingerprint(mlp()), fingerprint(mlp())) == []


def test_fingerprint_json_round_trip_checks_the_digest() -> None:
    f = fingerprint(mlp())
    assert Fingerprint.from_dict(f.to_dict()) == f
    edited = f.to_dict()
    edited["parameters"]["0.weight"]["shape"] = [1, 1]
    try:
        Fingerprint.from_dict(edited)
    except ValueError as error:
        assert "edited by hand" in str(error)
    else:
        raise AssertionError("an edited fingerprint was accepted")
