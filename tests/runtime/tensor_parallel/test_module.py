"""Tests of runtime/tensor_parallel/module.py: the one-process TensorParallelModule."""

from __future__ import annotations

import pytest
import torch
from tp_models import batch_for, gpt2, mlp_pair

from partitioner import partition
from partitioner.errors import ClosedError


def test_a_model_in_eval_mode_gives_a_module_in_eval_mode() -> None:
    """Regression (issue #12): every wrapper starts in the model's mode, so a model in eval
    mode runs without dropout (torch.export baked dropout into the training-mode graphs)."""
    model = gpt2(dropout=0.1).eval()
    x = batch_for(model)
    tm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    try:
        assert tm.training is False
        with torch.no_grad():
            torch.testing.assert_close(tm(x).logits, model(x).logits)
    finally:
        tm.close()


def test_close_twice_and_running_after_close_refused() -> None:
    model = mlp_pair()
    x = batch_for(model)
    with partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,)) as tm:
        torch.testing.assert_close(tm(x), model(x))
    tm.close()
    with pytest.raises(ClosedError, match="TensorParallelModule was closed"):
        tm(x)
    assert sorted(tm.state_dict()) == sorted(model.state_dict())
