"""Transparency: a partitioned model computes what the model computes, outputs and gradients."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import LongSkip, ResidualCNN, gpt2, mlp, nested_sequential
from torch import nn

from partitioner import partition

MODES = ("always", "except_last", "never")
CHUNKS = (1, 3, 4)
CASES = list(itertools.product(CHUNKS, MODES))


def _inputs(name: str) -> torch.Tensor:
    return {
        "mlp": lambda: torch.randn(12, 12),
        "nested": lambda: torch.randn(12, 10),
        "cnn": lambda: torch.randn(12, 3, 8, 8),
        "skip": lambda: torch.randn(12, 8),
        "gpt2": lambda: torch.randint(0, 64, (12, 8)),
    }[name]()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": mlp, "nested": nested_sequential, "cnn": ResidualCNN, "skip": LongSkip,
    "gpt2": gpt2,
}


def _loss(out: Any) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return (logits.float() ** 2).mean()


def _check(name: str, chunks: int, mode: str, n_devices: int) -> None:
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    x = _inputs(name)
    expected = reference(x)
    _loss(expected).backward()

    pm = partition(model, devices=["cpu"] * n_devices, example_inputs=(x,), chunks=chunks,
                   checkpoint=mode)
    assert len(pm.plan.stages) == n_devices
    out = pm(x)
    got = out.logits if hasattr(out, "logits") else out
    want = expected.logits if hasattr(expected, "logits") else expected
    torch.testing.assert_close(got, want)
    _loss(out).backward()
    grads = dict(reference.named_parameters())
    for key, param in model.named_parameters():
        assert param.grad is not None, f"{key} got no gradient"
        torch.testing.assert_close(param.grad, grads[key].grad, msg=key)


@pytest.mark.parametrize(("chunks", "mode"), CASES)
@pytest.mark.parametrize("name", ["mlp", "nested", "cnn", "skip"])
def test_outputs_and_gradients_match(name: str, chunks: int, mode: str) -> None:
    n_devices = 2 + (CHUNKS.index(chunks) + MODES.index(mode)) % 3
    _check(name, chunks, mode, n_devices)


@pytest.mark.parametrize(("chunks", "mode"), CASES)
def test_gpt2_through_export_matches(chunks: int, mode: str) -> None:
    n_devices = 2 + (CHUNKS.index(chunks) + MODES.index(mode)) % 3
    _check("gpt2", chunks, mode, n_devices)


def test_skip_connection_spans_three_stages() -> None:
    model = LongSkip()
    x = _inputs("skip")
    pm = partition(model, devices=["cpu"] * 4, example_inputs=(x,), chunks=2,
                   balance=[1, 2, 2, 1])
    assert pm.plan.stages[0].layers == ("layers.0",)
    stages = pm.pipeline().runners
    crossing = [set(r.graph_module.graph.find_nodes(op="placeholder")) for r in stages[1:]]
    assert all(any(n.name.startswith("tanh") for n in names) for names in crossing)
    torch.testing.assert_close(pm(x), model(x))


def test_eval_mode_and_no_grad_match() -> None:
    model = gpt2(dropout=0.1)
    x = _inputs("gpt2")
    pm = partition(model, devices=["cpu"] * 2, example_inputs=(x,), chunks=3)
    pm.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x).logits, model(x).logits)
