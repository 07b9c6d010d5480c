"""One contract for every one-process wrapper ``partition`` may return (a pipeline, tensor
parallelism, tensor parallelism x pipeline, data-parallel replicas of a graph, of a pipeline
or of a tensor-parallel module), each test run over every kind: the model's train/eval mode
and its switches, its state-dict and parameter names, a state-dict round trip, an optimizer
over ``pm.parameters()`` training like one over the model's, the model's own parameters
shared or refused (never ignored), ``.plan``, ``close()``, ``step()``, calls from two
threads. (tests/runtime/test_module.py and test_local.py hold the pipeline's own versions.)

``pm.module``: the model itself for a pipeline; replica 0 for replicas (a wrapper whose
``.module`` chain ends at the model, or a tensor-parallel module); tensor-parallel modules
have none (their ranks hold slices). README "Restrictions" states the same."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn
from tp_models import batch_for, gpt2

from partitioner import make_plan, partition
from partitioner.errors import ClosedError, LossError, TensorParallelError
from partitioner.plans.plan import Mesh, Plan
from partitioner.runtime.module import PartitionedModule
from partitioner.runtime.replicas import ReplicatedModule
from partitioner.runtime.tensor_parallel.module import TensorParallelModule
from partitioner.runtime.wrapper import ModelWrapper

KINDS = ("pipeline", "tensor_parallel", "tp_pipeline", "replicas", "replicas_pipeline",
         "replicas_tp")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 8),
                         nn.Tanh(), nn.Linear(8, 4))


def _plan(kind: str, model: nn.Module, x: torch.Tensor) -> Plan:
    """A plan of ``kind`` for ``model`` (replicas: a saved plan's mesh given dp=2)."""
    if kind == "pipeline":
        return make_plan(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=2)
    if kind == "tp_pipeline":  # 2 stages, each split over 2 tensor-parallel ranks
        tpp = partition(model, ["cpu"] * 4, "pipeline", example_inputs=(x,), tensor_parallel=2,
                        chunks=2)
        tpp.close()
        return tpp.plan
    tp = partition(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), tensor_parallel=2)
    tp.close()
    if kind == "tensor_parallel":
        return tp.plan
    if kind == "replicas_tp":
        return dataclasses.replace(tp.plan, mesh=Mesh(2, 1, 2))
    if kind == "replicas_pipeline":  # each replica a pipeline of 2 stages
        two = make_plan(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=2)
        return dataclasses.replace(two, mesh=Mesh(2, 2, 1))
    single = make_plan(model, ["cpu"], "pipeline", example_inputs=(x,), chunks=1,
                       checkpoint="never")  # each replica its graph, called directly
    return dataclasses.replace(single, mesh=Mesh(2, 1, 1))


def _wrap(kind: str, model: nn.Module, x: torch.Tensor) -> ModelWrapper:
    """The wrapper of ``kind`` around ``model``, built by applying a plan of it."""
    plan = _plan(kind, model, x)
    wrapper = partition(model, None, plan=plan, example_inputs=(x,))
    expected = {"pipeline": PartitionedModule, "tensor_parallel": TensorParallelModule,
                "tp_pipeline": TensorParallelModule, "replicas": ReplicatedModule,
                "replicas_pipeline": ReplicatedModule, "replicas_tp": ReplicatedModule}[kind]
    assert isinstance(wrapper, expected)
    assert wrapper.plan == plan
    return wrapper


def _grads(wrapper: ModelWrapper, model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of every parameter of the model, by its name, whole."""
    holder = wrapper.module if isinstance(wrapper, ReplicatedModule) else wrapper
    if isinstance(holder, TensorParallelModule):
        grads = {k: holder.full_tensor(k, grad=True) for k, _ in model.named_parameters()}
        return {k: g for k, g in grads.items() if g is not None}
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("training", [True, False])
def test_starts_in_the_models_mode(kind: str, training: bool) -> None:
    model, x = _model().train(training), torch.randn(6, 8)
    with _wrap(kind, model, x) as wrapper:
        assert wrapper.training is training
        assert model.training is training
        if not training:  # no dropout: the model's outputs exactly
            with torch.no_grad():
                torch.testing.assert_close(wrapper(x), model(x))
        wrapper.train(not training)
        assert wrapper.training is not training


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_has_the_models_keys_and_round_trips(kind: str) -> None:
    model, x = _model().eval(), torch.randn(6, 8)
    with _wrap(kind, model, x) as wrapper:
        state = wrapper.state_dict()
        assert list(state) == list(model.state_dict())
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value)
        zeros = {k: torch.zeros_like(v) for k, v in state.items()}
        wrapper.load_state_dict(zeros)
        assert all(bool((v == 0).all()) for v in wrapper.state_dict().values())
        with torch.no_grad():
            assert bool((wrapper(x) == 0).all())


@pytest.mark.parametrize("kind", KINDS)
def test_close_twice_and_running_after_close_refused(kind: str) -> None:
    model, x = _model().eval(), torch.randn(6, 8)
    wrapper = _wrap(kind, model, x)
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x), model(x))
    wrapper.close()
    wrapper.close()  # idempotent
    assert wrapper.closed
    with pytest.raises(ClosedError):
        wrapper(x)
    with pytest.raises(ClosedError):
        wrapper.step(x, torch.zeros(6, 4), nn.functional.mse_loss)
    assert list(wrapper.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_step_gives_the_models_loss_and_gradients(kind: str, reduction: str) -> None:
    model, x, y = _model().eval(), torch.randn(6, 8), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        lambda out, target: nn.functional.mse_loss(out, target, reduction=reduction))
    with _wrap(kind, model, x) as wrapper:
        loss = wrapper.step(x, y, loss_fn, loss_reduction=reduction)
        got = _grads(wrapper, model)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    assert sorted(got) == sorted(k for k, _ in reference.named_parameters())
    for key, p in reference.named_parameters():
        torch.testing.assert_close(got[key], p.grad, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor_parallel", "replicas"])
def test_an_exported_model_in_eval_mode_runs_without_dropout(kind: str) -> None:
    """The pipeline's regression (issue #12, test_module.py) for the other wrappers: GPT-2 is
    captured with torch.export, which bakes the mode in."""
    model = gpt2(dropout=0.1).eval()
    ids = batch_for(model, batch=4, seq=8)
    plan = _plan(kind, model, ids)
    with partition(model, None, plan=plan) as wrapper:
        assert wrapper.training is False and plan.capture == "export"
        with torch.no_grad():
            torch.testing.assert_close(wrapper(ids).logits, model(ids).logits)
        wrapper.train()
        with torch.no_grad():  # the training-mode graphs do run dropout
            assert not torch.allclose(wrapper(ids).logits, model.eval()(ids).logits)


@pytest.mark.parametrize("kind", KINDS)
def test_a_loss_without_grad_is_refused_not_a_silent_no_op(kind: str) -> None:
    """Issue #19: a detached loss left every gradient None and step returned the loss."""
    model, x, y = _model().eval(), torch.randn(6, 8), torch.randn(6, 4)
    with _wrap(kind, model, x) as wrapper:
        with pytest.raises(LossError, match="does not require grad"):
            wrapper.step(x, y, lambda out, target: nn.functional.mse_loss(out.detach(), target))
    assert all(p.grad is None for p in model.parameters())


class _WithStatistics(nn.Module):
    """Returns ``(logits, per_expert_load, aux_loss)``: the last two have no batch dimension
    (and the load's 4 experts equal a micro-batch's 4 samples, to mislead a guess by size)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.down(torch.relu(self.up(x)))  # (B, 4)
        share = logits.softmax(-1)
        return logits, share.mean(0), (share * share).sum(-1).mean()  # (B, 4), (4,), ()


# (tp_pipeline: its two Linear layers are one column/row pair, one layer: no two stages.)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "tp_pipeline"])
def test_outputs_without_a_batch_dimension_are_the_whole_batchs(kind: str) -> None:
    """Issue #19: a ``(E,)`` output was concatenated to ``(2E,)`` across micro-batches or
    replicas, and a 0-dim one refused; both are averaged weighted by samples (the whole
    batch's value of a mean over samples), their gradients too."""
    torch.manual_seed(0)
    model, x = _WithStatistics().eval(), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    with _wrap(kind, model, x) as wrapper:
        got = wrapper(x)
        expected = reference(x)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
        (got[0].sum() + 3 * got[1].square().sum() + 5 * got[2]).backward()
        grads = _grads(wrapper, model)
    (expected[0].sum() + 3 * expected[1].square().sum() + 5 * expected[2]).backward()
    for key, p in reference.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, atol=1e-5, rtol=1e-4, msg=key)


#: Whether the wrapper computes with the original model's parameters (else it refuses
#: changes to them and optimizers over them: tensor-parallel ranks hold their own slices).
SHARES = {"pipeline": True, "tensor_parallel": False, "tp_pipeline": False, "replicas": True,
          "replicas_pipeline": True, "replicas_tp": False}


@pytest.mark.parametrize("kind", KINDS)
def test_the_models_own_parameters_are_shared_or_refused_never_ignored(kind: str) -> None:
    """Issue #19: a tensor-parallel module ignored weights loaded into the model after
    partitioning, and an optimizer over ``model.parameters()`` silently did nothing."""
    model, x, y = _model().eval(), torch.randn(6, 8), torch.randn(6, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _wrap(kind, model, x) as wrapper:
        wrapper.step(x, y, nn.functional.mse_loss)
        before = copy.deepcopy(model.state_dict())
        if SHARES[kind]:
            optimizer.step()
            assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])
            model.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
            with torch.no_grad():
                assert bool((wrapper(x) == 0).all())
        else:
            with pytest.raises(TensorParallelError, match="wrapper's parameters"):
                optimizer.step()
            model.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
            with pytest.raises(TensorParallelError, match="changed after partitioning"):
                wrapper(x)


@pytest.mark.parametrize("kind", KINDS)
def test_calls_from_two_threads_run_one_after_another(kind: str) -> None:
    model, x = _model().eval(), torch.randn(6, 8)
    inputs = [torch.randn(6, 8) for _ in range(2)]
    with torch.no_grad():
        expected = [model(v) for v in inputs]
    problems: list[str] = []

    def call(k: int) -> None:
        try:
            for _ in range(20):
                torch.testing.assert_close(wrapper(inputs[k]).detach(), expected[k])
        except Exception as error:  # reported below, with the thread's index
            problems.append(f"thread {k}: {type(error).__name__}: {error}")

    with _wrap(kind, model, x) as wrapper:
        threads = [threading.Thread(target=call, args=(k,), daemon=True) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "a call hung"
    assert not problems, problems[0]


def _innermost(module: nn.Module) -> nn.Module:
    while isinstance(module, ModelWrapper) and isinstance(getattr(module, "module", None),
                                                          nn.Module):
        module = module.module
    return module


@pytest.mark.parametrize("kind", KINDS)
def test_module_and_parameter_names_are_the_models(kind: str) -> None:
    """Issue #19: replicas' ``named_parameters()`` gained ``module.`` prefixes."""
    model, x = _model().eval(), torch.randn(6, 8)
    with _wrap(kind, model, x) as wrapper:
        if kind == "pipeline":
            assert wrapper.module is model
        if SHARES[kind]:
            assert _innermost(wrapper) is model
            names = {k: id(p) for k, p in wrapper.named_parameters()}
            assert names == {k: id(p) for k, p in model.named_parameters()}
            assert [k for k, _ in wrapper.named_buffers()] == [k for k, _ in
                                                               model.named_buffers()]
        else:  # the ranks' slices, none of them the model's tensors
            assert not hasattr(wrapper, "module") or not isinstance(
                _innermost(wrapper), nn.Sequential)
            assert not {id(p) for p in wrapper.parameters()} & {id(p) for p in
                                                                model.parameters()}
        assert list(wrapper.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_an_optimizer_over_the_wrappers_parameters_trains_like_the_models(kind: str) -> None:
    model, x, y = _model().eval(), torch.randn(6, 8), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    expected_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with _wrap(kind, model, x) as wrapper:
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            optimizer.zero_grad()
            wrapper.step(x, y, nn.functional.mse_loss)
            optimizer.step()
            expected_opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            expected_opt.step()
        state = wrapper.state_dict()
        with torch.no_grad():
            out = wrapper(x)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-4, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_switch_the_wrapper_after_partitioning(kind: str) -> None:
    model, x = _model().train(), torch.randn(6, 8)
    with torch.no_grad():
        plain = copy.deepcopy(model).eval()(x)
    with _wrap(kind, model, x) as wrapper, torch.no_grad():
        assert wrapper.eval() is wrapper and not wrapper.training
        torch.testing.assert_close(wrapper(x), plain)   # no dropout
        if SHARES[kind]:
            assert not model.training    # the model is inside: its mode follows
        wrapper.train()
        assert wrapper.training
        assert not torch.allclose(wrapper(x), plain)    # dropout (p=0.5) again
        wrapper.eval()
        torch.testing.assert_close(wrapper(x), plain)
