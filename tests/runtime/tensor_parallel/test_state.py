"""Tests of runtime/tensor_parallel/state.py: a tensor-parallel model's state dict has the original
keys."""

from __future__ import annotations

import copy

import torch
from torch import nn
from tp_models import batch_for, mlp_pair

from partitioner import partition
from partitioner.runtime.tensor_parallel.sharding import Sharding, unshard
from partitioner.runtime.tensor_parallel.state import TensorParallelState


class TwoRanks(TensorParallelState):
    """Both ranks of a ``Linear(2, 2)`` split by rows, held by two graphs (as train and eval
    mode's are) that share the tensors, and one original entry no graph uses."""

    def __init__(self) -> None:
        super().__init__({"weight": Sharding("colwise", 0, 2)}, {"weight": "w", "bias": "b"})
        ranks = [nn.Linear(2, 1) for _ in range(2)]
        self.graphs = nn.ModuleDict({"train_mode": nn.ModuleList(ranks),
                                     "eval_mode": nn.ModuleList(ranks)})
        self._keep_unused({"count": torch.tensor(3)})

    def _rank_tensors(self, key: str) -> list[tuple[int, torch.Tensor]]:
        kept = self._unused_tensor(key)
        if kept is not None:
            return [(0, kept)]
        return [(r, getattr(rank, key)) for r, rank in enumerate(self.graphs["train_mode"])]

    def full_tensor(self, key: str, grad: bool = False) -> torch.Tensor | None:
        parts = [t.detach() for _, t in self._rank_tensors(key)]
        sharding = self._split_sharding(key)
        return parts[0].clone() if sharding is None else unshard(parts, sharding)


def _whole() -> dict[str, torch.Tensor]:
    return {"weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "bias": torch.tensor([5.0]),
            "count": torch.tensor(7)}


def test_state_dict_has_the_original_keys_and_whole_tensors() -> None:
    model = TwoRanks()
    state = model.state_dict()
    assert list(state) == ["weight", "bias", "count"]
    assert state["weight"].shape == (2, 2)
    assert state["count"].item() == 3


def test_load_splits_each_tensor_into_every_name_of_each_rank() -> None:
    model = TwoRanks()
    model.load_state_dict(_whole())
    first, second = model.graphs["eval_mode"]
    assert first.weight.tolist() == [[1.0, 2.0]] and second.weight.tolist() == [[3.0, 4.0]]
    assert first.bias.tolist() == second.bias.tolist() == [5.0]  # replicated: whole on each
    assert model.unused.t0.item() == 7
    torch.testing.assert_close(model.state_dict()["weight"], _whole()["weight"])


def test_missing_keys_are_reported_and_their_entries_keep_their_values() -> None:
    model = TwoRanks()
    bias = model.graphs["train_mode"][1].bias.detach().clone()
    result = model.load_state_dict({"weight": _whole()["weight"]}, strict=False)
    assert sorted(result.missing_keys) == ["bias", "count"]
    assert result.unexpected_keys == []
    torch.testing.assert_close(model.graphs["train_mode"][1].bias.detach(), bias)
    assert model.unused.t0.item() == 3


def test_a_nested_model_keeps_its_prefix() -> None:
    outer = nn.ModuleDict({"net": TwoRanks()})
    assert list(outer.state_dict()) == ["net.weight", "net.bias", "net.count"]
    outer.load_state_dict({f"net.{k}": v for k, v in _whole().items()})
    assert outer["net"].graphs["train_mode"][1].weight.tolist() == [[3.0, 4.0]]


def test_load_in_a_mode_whose_stages_are_not_built_yet() -> None:
    """Regression: loading right after ``eval()`` built the eval stages inside the hook, too
    late for their entries, and strict loading reported them all missing."""
    model, other = mlp_pair(), mlp_pair()
    x = batch_for(model)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    pm.eval()
    other.eval()
    pm.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pm(x), other(x))
    pm.close()


def test_clip_grad_norm_counts_each_gradient_once_and_clips_like_torch() -> None:
    """Replicated parameters (the LayerNorms) have a copy on each rank, split ones a slice:
    the norm is the unsplit model's, and the clipped gradients are the unsplit ones'."""
    from tp_models import Block

    torch.manual_seed(0)
    model = Block(32, 4)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 32)
    tm = partition(model, ["cpu", "cpu"], tensor_parallel=2, example_inputs=(x,))
    try:
        tm(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        naive = torch.nn.utils.get_total_norm([p.grad for p in tm.parameters()])
        norm = tm.clip_grad_norm_(0.01)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        assert float(naive) > float(expected) * 1.0001  # the naive norm double-counts
        torch.testing.assert_close(norm.float(), expected)
        for key, param in reference.named_parameters():
            torch.testing.assert_close(tm.full_tensor(key, grad=True), param.grad)
        inf = tm.clip_grad_norm_(1e9, norm_type=float("inf"))
        expected_inf = max(float(p.grad.abs().max()) for p in reference.parameters())
        assert abs(float(inf) - expected_inf) < 1e-7
    finally:
        tm.close()
