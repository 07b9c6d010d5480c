"""Tests of runtime/tensor_parallel/module.py: the one-process TensorParallelModule."""

from __future__ import annotations

import threading

import pytest
import torch
from tp_models import batch_for, gpt2, mlp_pair

from partitioner import partition
from partitioner.errors import ClosedError, TensorParallelError


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


def _pair() -> tuple[torch.nn.Module, torch.Tensor, torch.nn.Module]:
    torch.manual_seed(0)
    model = mlp_pair()
    x = torch.randn(8, 16)
    return model, x, partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,),
                               chunks=2)


def test_weights_loaded_into_the_original_model_afterwards_are_refused_not_ignored() -> None:
    """Issue #19: the module kept computing with the weights of partition time."""
    model, x, tm = _pair()
    with tm:
        zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(zeros)
        with pytest.raises(TensorParallelError, match=r"original model's 0\.weight, 0\.bias.*"
                                                      r"changed after partitioning"):
            tm(x)
        with pytest.raises(TensorParallelError, match="changed after partitioning"):
            tm.step(x, torch.zeros(8, 16), torch.nn.functional.mse_loss)
        tm.load_state_dict(zeros)  # the documented way is not affected
        assert bool((tm.state_dict()["0.weight"] == 0).all())


def test_an_optimizer_over_the_original_parameters_is_refused_not_a_no_op() -> None:
    """Issue #19: its parameters got no gradients and step() silently did nothing."""
    model, x, tm = _pair()
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    right = torch.optim.SGD(tm.parameters(), lr=0.1)
    with tm:
        tm.step(x, torch.zeros(8, 16), torch.nn.functional.mse_loss)
        with pytest.raises(TensorParallelError, match="build it over the wrapper's parameters"):
            wrong.step()
        before = tm.state_dict()["0.weight"].clone()
        right.step()
        assert not torch.equal(tm.state_dict()["0.weight"], before)
    wrong.step()  # closed: the model is the user's again


def test_two_threads_calling_at_once_each_get_their_own_output() -> None:
    """Issue #19: the ranks' all-reduces of two calls mixed (wrong outputs, or a hang)."""
    model, _, tm = _pair()
    inputs = [torch.randn(8, 16) for _ in range(2)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    problems: list[str] = []

    def call(k: int) -> None:
        try:
            for _ in range(30):
                torch.testing.assert_close(tm(inputs[k]).detach(), expected[k])
        except Exception as error:  # reported below, with the thread's index
            problems.append(f"thread {k}: {type(error).__name__}: {error}")

    with tm:
        threads = [threading.Thread(target=call, args=(k,), daemon=True) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "a call hung"
    assert not problems, problems[0]
