"""Tests of partitioner/cost/transformer_model.py: GPT costs from the model's shape."""

from __future__ import annotations

import doctest

import pytest

import partitioner.cost.transformer_model
from partitioner.cost.cost import CostModelError
from partitioner.cost.transformer_model import GPTShape, gpt_workload, megatron_boundaries


def test_shape_validation() -> None:
    with pytest.raises(CostModelError, match="heads=5 does not divide hidden=64"):
        GPTShape(2, 64, 5, 16, 100)
    with pytest.raises(CostModelError, match="layers=0"):
        GPTShape(0, 64, 4, 16, 100)


def test_block_costs_are_the_papers() -> None:
    s, h, a = 512, 1024, 16
    block = gpt_workload(GPTShape(4, h, a, s, 1000), batch=8).layers[1]
    assert block.forward_flops == 24 * s * h * h + 4 * s * s * h
    assert block.param_bytes == 2 * (12 * h * h + 13 * h)
    assert block.activation_bytes == s * h * (34 + 5 * a * s / h)  # Korthikanti et al.
    assert block.activations_on(8) == s * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert block.tp_all_reduces == 2 and block.splittable


def test_workload_layout() -> None:
    w = gpt_workload(GPTShape(3, 64, 4, 16, 100), batch=4)
    assert [layer.name for layer in w.layers] == ["embedding", "block.0", "block.1",
                                                  "block.2", "head"]
    assert w.boundaries == (0.0, 2048.0, 2048.0, 2048.0, 2048.0, 0.0)
    assert w.dtype == "bf16" and w.mixed_precision and w.batch == 4
    assert len({layer.signature for layer in w.layers}) == 3


def test_megatron_split_is_equal_layers_per_stage() -> None:
    shape = GPTShape(8, 64, 4, 16, 100)
    assert megatron_boundaries(shape, 4) == (0, 3, 5, 7, 10)
    with pytest.raises(CostModelError, match="8 layers do not split evenly into 3"):
        megatron_boundaries(shape, 3)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.transformer_model).failed == 0
