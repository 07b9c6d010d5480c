"""Tests of runtime/wrapper.py: what every partitioned model shares (keys, mode, close, clip)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import ClosedError, PartitionError
from partitioner.runtime.tensor_parallel.shard_state import ShardState
from partitioner.runtime.tensor_parallel.sharding import Sharding
from partitioner.runtime.wrapper import GroupNorms, ModelWrapper, NormCombiner, local_norms


class Holder(ModelWrapper):
    """Holds the whole model under ``module`` (as PartitionedModule does)."""

    inner = "module"

    def __init__(self, module: nn.Module, combine_norms: NormCombiner = local_norms,
                 counted: list[str] | None = None) -> None:
        super().__init__("the plan", module.training, combine_norms=combine_norms)
        self.module = module
        self.released = 0
        self._counted = counted

    def _norm_grads(self) -> list[torch.Tensor]:
        if self._counted is None:
            return super()._norm_grads()
        return [self.module.get_parameter(n).grad for n in self._counted]

    def _release(self) -> None:
        self.released += 1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def _backward(*models: nn.Module) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for model in models:
        model(x).pow(2).sum().backward()


def test_state_dict_has_the_models_keys_and_loads_back() -> None:
    model = _model()
    held = Holder(model)
    assert list(held.state_dict()) == list(model.state_dict())
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    held.load_state_dict(other.state_dict())  # strict: every key found under module.
    for key, value in other.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)
    model.load_state_dict(held.state_dict())


def test_a_nested_wrapper_keeps_the_outer_prefix() -> None:
    outer = nn.ModuleDict({"net": Holder(_model())})
    assert list(outer.state_dict()) == [f"net.{k}" for k in _model().state_dict()]
    outer.load_state_dict({f"net.{k}": v for k, v in _model().state_dict().items()})


def test_metadata_carries_the_models_module_names() -> None:
    """The versions a model's modules read when loading are kept under their own names."""
    model = _model()
    metadata = Holder(model).state_dict()._metadata  # type: ignore[attr-defined]
    assert sorted(metadata) == sorted(model.state_dict()._metadata)  # type: ignore[attr-defined]
    assert metadata["1"] == model.state_dict()._metadata["1"]  # type: ignore[attr-defined]


def test_shards_are_gathered_whole_and_cut_on_load() -> None:
    """A rank holding slices: its state dict cuts whole tensors to the rank's slice on load
    (gathering needs peers, covered by the multi-process tests)."""

    class Rank(ModelWrapper):
        inner = "stage"

        def __init__(self) -> None:
            shards = ShardState({"weight": Sharding("colwise", 0, 2)}, rank=1)
            super().__init__(None, True, shards=shards)
            self.stage = nn.Linear(2, 2)  # rank 1's rows of a Linear(2, 4)
            self.stage.weight = nn.Parameter(torch.zeros(2, 2))

    rank = Rank()
    whole = torch.arange(8.0).reshape(4, 2)
    rank.load_state_dict({"weight": whole, "bias": torch.ones(2)})
    assert rank.stage.weight.tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert rank.stage.bias.tolist() == [1.0, 1.0]  # not split: whole on every rank


@pytest.mark.parametrize("training", [True, False])
def test_starts_in_the_models_mode_and_leaves_its_modules_alone(training: bool) -> None:
    """Regression (issue #12): a wrapper of a model in eval mode started in training mode."""
    model = _model().train(training)
    model[1].train(not training)  # a model may hold modules in the other mode on purpose
    held = Holder(model)
    assert held.training is training
    assert model[1].training is not training


def test_close_is_idempotent_and_a_closed_wrapper_refuses_to_run() -> None:
    held = Holder(_model())
    assert not held.closed
    held.close()
    held.close()
    assert held.closed and held.released == 1
    with pytest.raises(ClosedError, match="cannot train: this Holder was closed") as info:
        held._ensure_open("train")
    assert isinstance(info.value, PartitionError) and isinstance(info.value, RuntimeError)
    assert "partition the model again" in str(info.value)
    assert sorted(held.state_dict()) == sorted(_model().state_dict())  # still readable


def test_with_block_closes() -> None:
    with Holder(_model()) as held:
        held._ensure_open("run")
    assert held.closed and held.released == 1


def test_plan_is_kept() -> None:
    assert Holder(_model()).plan == "the plan"


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_clip_grad_norm_of_a_whole_model_is_torchs(norm_type: float) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    held = Holder(model)
    _backward(model, reference)
    norm = held.clip_grad_norm_(0.1, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type)
    assert norm.dtype == expected.dtype
    torch.testing.assert_close(norm, expected)
    assert float(expected) > 0.1  # it did clip
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_clip_counts_what_the_subclass_counts_and_scales_every_gradient() -> None:
    model = _model()
    held = Holder(model, counted=["0.weight"])
    _backward(model)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = held.clip_grad_norm_(1e-3)
    torch.testing.assert_close(norm, before["0.weight"].norm())
    factor = 1e-3 / (float(norm) + 1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[name] * factor)


def test_clip_combines_partial_norms_with_the_peers() -> None:
    """A peer holding gradients equal to ours: the sum of p-th powers doubles, the largest
    value stays."""
    model = _model()
    held = Holder(model, combine_norms=lambda partial, op: partial if op == "max"
                  else 2 * partial)
    _backward(model)
    local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    largest = max(float(p.grad.abs().max()) for p in model.parameters())
    assert float(held.clip_grad_norm_(1e9, float("inf"))) == pytest.approx(largest)
    assert float(held.clip_grad_norm_(1e9)) == pytest.approx(float(local) * 2 ** 0.5)


def test_clip_without_gradients_is_zero_and_nonfinite_norms_can_be_refused() -> None:
    model = _model()
    held = Holder(model)
    assert float(held.clip_grad_norm_(1.0)) == 0.0
    _backward(model)
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        held.clip_grad_norm_(1.0, error_if_nonfinite=True)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_group_norms_all_reduce_and_count_copies_once(world_of_one: None) -> None:
    combine = GroupNorms(copies=2)
    partial = torch.tensor(6.0, dtype=torch.float64)
    assert float(combine(partial, "sum")) == 3.0  # two copies of the same gradients
    assert float(combine(partial, "max")) == 6.0
    assert float(partial) == 6.0  # the partial value itself is left as it was


def test_names_walk_the_models_tree_once_and_keep_tensors_held_beside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Replicas read every copy's names on every step: a second walk of a transformers
    # model's modules cost milliseconds a step at dp=4.
    model = _model()
    held = Holder(model)
    held.extra = nn.Linear(2, 2)  # beside the model: under its own name
    held.register_buffer("flag", torch.ones(1))
    walks: list[nn.Module] = []
    original = nn.Module.named_modules

    def counted(self: nn.Module, *args: object, **kwargs: object) -> Iterator[object]:
        walks.append(self)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(nn.Module, "named_modules", counted)
    names = [name for name, _ in held.named_parameters()]
    assert sum(walk is model for walk in walks) == 1
    assert names == [*(n for n, _ in model.named_parameters()), "extra.weight", "extra.bias"]
    assert [name for name, _ in held.named_buffers()][-1] == "flag"
    with_prefix = dict(held.named_parameters(prefix="pm"))
    assert "pm.extra.weight" in with_prefix and "pm.0.weight" in with_prefix
    held.again = held.extra  # one module under two names beside the model: named once
    assert [name for name, _ in held.named_parameters()].count("again.weight") == 0
    assert len(list(held.named_parameters(remove_duplicate=False))) == len(names) + 2
