"""Tests of runtime/replicas.py: how data-parallel replicas in one process split a batch, keep
their weights the master's, draw dropout, and refuse what they cannot do."""

from __future__ import annotations

import copy

import pytest
import torch
from models import grads_match, mlp
from replicated import replicated, same
from torch import nn

from partitioner.errors import BackwardError, ClosedError, LossError, ReplicaError
from partitioner.runtime.replicas import split_batch


def test_batch_smaller_than_the_replicas_refused() -> None:
    model = mlp().double()
    with replicated(model, (torch.randn(4, 12, dtype=torch.float64),), dp=4) as pm:
        with pytest.raises(ReplicaError, match=r"3 sample\(s\) but there are dp=4") as caught:
            pm(torch.randn(3, 12, dtype=torch.float64))
        assert isinstance(caught.value, ValueError)
        assert "at least 4 samples" in str(caught.value)


def test_uneven_split_gives_the_first_replica_the_extra_sample() -> None:
    shares, split = split_batch([torch.arange(5), torch.ones(3), "mode"], 2, 5)
    assert [s[0].tolist() for s in shares] == [[0, 1, 2], [3, 4]]
    assert split == [True, False, False]
    assert shares[1][1].shape == (3,) and shares[1][2] == "mode"


def test_uneven_batch_matches_the_model() -> None:
    model = mlp().double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 12, dtype=torch.float64)
    seen: list[int] = []
    with replicated(model, (x,), dp=2) as pm:
        for replica in pm.replicas:
            replica.register_forward_pre_hook(lambda m, args, kw: seen.append(
                len(args[0])), with_kwargs=True)
        out = pm(x)
        same(out, reference(x))
        out.square().sum().backward()
        reference(x).square().sum().backward()
    assert sorted(seen) == [2, 3]
    grads_match(model, reference)


def test_without_autograd_outputs_carry_no_graph() -> None:
    model = mlp().double()
    x = torch.randn(5, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm, torch.no_grad():
        out = pm(x)
        assert out.grad_fn is None and not out.requires_grad
        same(out, model(x))


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_step_between_forwards_is_picked_up(fused: bool) -> None:
    """Regression: fused optimizers write parameters without bumping their version counters,
    so replicas tracking versions kept stale weights silently."""
    model = mlp().double()
    x = torch.randn(6, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        pm(x).sum().backward()
        before = model[0].weight.detach().clone()
        torch.optim.SGD(pm.parameters(), lr=0.5, fused=fused).step()
        assert not torch.equal(before, model[0].weight)
        # replica 1 computes the second half: stale weights would show there.
        same(pm(x), model(x))
        same(pm.replicas[1].module[0].weight, model[0].weight)


def test_writes_through_data_are_picked_up() -> None:
    model = mlp().double()
    x = torch.randn(6, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        pm(x)
        model[0].weight.data.mul_(2.0)
        same(pm(x), model(x))


def test_two_forwards_then_one_backward() -> None:
    """Unchanged weights are not rewritten, so the first forward's saved activations stay
    valid for its backward."""
    model = mlp().double()
    reference = copy.deepcopy(model)
    x, z = torch.randn(6, 12, dtype=torch.float64), torch.randn(4, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        (pm(x).sum() + pm(z).square().sum()).backward()
    (reference(x).sum() + reference(z).square().sum()).backward()
    grads_match(model, reference)


def test_to_double_after_building_is_picked_up() -> None:
    model = mlp()
    x = torch.randn(6, 12)
    with replicated(model, (x,), dp=2) as pm:
        pm.double()
        out = pm(x.double())
        assert out.dtype == torch.float64
        same(out, model(x.double()))


def test_dropout_masks_differ_per_replica_and_repeat_under_manual_seed() -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)).double().train()
    half = torch.randn(1, 8, dtype=torch.float64).expand(4, 8)
    x = torch.cat([half, half])  # both replicas see the same samples
    with replicated(model, (x,), dp=2) as pm:
        torch.manual_seed(1)
        first = pm(x)
        torch.manual_seed(1)
        again = pm(x)
        other = pm(x)
    same(first, again)
    assert not torch.equal(first[:4], first[4:])
    assert not torch.equal(first, other)


def test_replicas_that_are_pipelines_repeat_under_manual_seed() -> None:
    """Regression: each replica's pipeline drew its stages' seed from torch's global
    generator on its own thread, so which replica got which seed followed thread timing
    (tests/runtime/test_local.py::test_same_seed_same_result_across_runs failed at random)."""
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 8)).double().train()
    x = torch.randn(12, 8, dtype=torch.float64)
    with replicated(model, (x,), dp=2, chunks=3) as pm:
        assert type(pm.replicas[1]).__name__ == "PartitionedModule"
        runs = []
        for _ in range(12):  # the first call in a mode runs the replicas one at a time
            torch.manual_seed(7)
            runs.append(pm(x))
    for run in runs[1:]:
        same(run, runs[0])


def test_batch_norm_statistics_come_from_replica_0() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double().train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        pm(x)
        reference(x[:4])
        same(model[1].running_mean, reference[1].running_mean)
        second = copy.deepcopy(reference)
        pm(x)  # replica 1 starts again from replica 0's statistics
        reference(x[:4])
        second(x[4:])
        same(model[1].running_mean, reference[1].running_mean)
        same(pm.replicas[1].module[1].running_var, second[1].running_var)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_step_returns_the_batch_loss_and_its_gradients(reduction: str) -> None:
    model = mlp().double()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 12, dtype=torch.float64)
    y = torch.randn(7, 6, dtype=torch.float64)
    loss_fn = lambda out, target: nn.functional.mse_loss(out, target, reduction=reduction)
    with replicated(model, (x,), dp=2) as pm:
        loss = pm.step(x, y, loss_fn, reduction)
    want = loss_fn(reference(x), y)
    want.backward()
    assert loss == pytest.approx(want.item(), abs=1e-10)
    grads_match(model, reference)


def test_step_refuses_bad_losses_and_targets() -> None:
    model = mlp().double()
    x = torch.randn(4, 12, dtype=torch.float64)
    y = torch.randn(4, 6, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        with pytest.raises(ReplicaError, match="loss_reduction='avg'"):
            pm.step(x, y, nn.functional.mse_loss, "avg")
        with pytest.raises(LossError, match="scalar"):
            pm.step(x, y, lambda out, target: out - target)
        with pytest.raises(ReplicaError, match="targets have no tensor of 4 samples"):
            pm.step(x, y[:3], nn.functional.mse_loss)


class _Reduced(nn.Module):
    def __init__(self, reduce: str) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y.sum() if self.reduce == "sum" else y.mean()


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_scalar_outputs_are_the_whole_batchs(reduce: str) -> None:
    """Issue #19: a 0-dim output was a ReplicaError; the capture says how it was reduced
    over the batch, and the replicas' values are summed or averaged by samples alike."""
    x = torch.randn(5, 3)
    model = _Reduced(reduce)
    reference = copy.deepcopy(model)
    with replicated(model, (x,), dp=2) as pm:
        out = pm(x)
        expected = reference(x)
        torch.testing.assert_close(out, expected)
        out.backward()
    expected.backward()
    torch.testing.assert_close(model.linear.weight.grad, reference.linear.weight.grad)


def test_second_backward_refused() -> None:
    model = mlp().double()
    x = torch.randn(4, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        loss = pm(x).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(BackwardError, match="twice"):
            loss.backward()


def test_errors_name_their_replica() -> None:
    model = mlp().double()
    x = torch.randn(4, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        pm.replicas[1].register_forward_pre_hook(lambda m, a: 1 / 0)
        with pytest.raises(ZeroDivisionError) as caught:
            pm(x)
    assert "replica 1 of 2" in "".join(caught.value.__notes__)


def test_clip_grad_norm_is_the_models() -> None:
    model = mlp().double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 12, dtype=torch.float64)
    with replicated(model, (x,), dp=2) as pm:
        pm(x).square().sum().backward()
        norm = pm.clip_grad_norm_(0.01)
    reference(x).square().sum().backward()
    same(norm, nn.utils.clip_grad_norm_(reference.parameters(), 0.01))
    grads_match(model, reference)


def test_close_is_idempotent_and_refuses_running_after() -> None:
    model = mlp().double()
    x = torch.randn(4, 12, dtype=torch.float64)
    pm = replicated(model, (x,), dp=2)
    pm.close()
    pm.close()
    with pytest.raises(ClosedError, match="run the replicas"):
        pm(x)
    with pytest.raises(ClosedError, match="train"):
        pm.step(x, x[:, :6], nn.functional.mse_loss)
    assert list(pm.state_dict()) == list(model.state_dict())
