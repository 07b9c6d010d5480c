"""A model whose outputs splitting the batch changes is found, and never split silently
(``partitioner.runtime.sample_mixing``; found on 2026-12-05: ``strategy="auto"`` gave
``x - x.mean(0)`` two replicas, outputs 2.4e-3 off the model's, with no note)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partitioner import Mesh, partition
from partitioner.errors import PartitionError
from partitioner.runtime.sample_mixing import mixes_samples

X = torch.randn(16, 8)


class Centred(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class BatchSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(x, dim=0)


class Gram(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (x.T @ x) / x.shape[0]


class SortedBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sort(dim=0).values


class WithLoss(nn.Module):
    """Per-sample outputs and a mean loss: what the runtime joins back exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y, (y ** 2).mean()


class WithStatistic(WithLoss):
    """A statistic not linear in the samples, without a batch dimension: the runtime's
    contract makes it the micro-batches' average (the README), so it is not compared."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y, y.var(0).mean() * y.mean() ** 2


class Noisy(nn.Module):
    """Random in eval mode too: whole and halves cannot be compared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) + torch.rand_like(x)


class Seen(nn.Module):
    """Counts its calls in a buffer and keeps a Python list of what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.seen: list[int] = []
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        return self.drop(x - x.mean(0))


def _stack(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), *middle,
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize("mixer", [Centred, BatchSoftmax, Gram, SortedBatch])
def test_operations_across_the_batch_are_found(mixer: type[nn.Module]) -> None:
    found = mixes_samples(_stack(mixer()), (X,), {})
    assert found is not None and found.startswith("splitting the batch changes output 0")


@pytest.mark.parametrize("model", [
    nn.Linear(8, 8), WithLoss(), WithStatistic(),
    nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True,
                                                     dropout=0.0), 2),
    nn.Sequential(nn.Conv1d(16, 4, 3), nn.BatchNorm1d(4), nn.ReLU()),  # eval: running stats
], ids=["linear", "with_loss", "with_statistic", "transformer", "conv_bn"])
def test_per_sample_models_are_not_flagged(model: nn.Module) -> None:
    x = X if not isinstance(model, (nn.TransformerEncoder, nn.Sequential)) else (
        torch.randn(16, 5, 8) if isinstance(model, nn.TransformerEncoder)
        else torch.randn(16, 16, 8))
    assert mixes_samples(model, (x,), {}) is None


def test_transformers_gpt2_with_padding_is_not_flagged() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (6, 12))
    mask = torch.ones(6, 12, dtype=torch.long)
    mask[1, 8:] = 0
    assert mixes_samples(model, (ids,), {"attention_mask": mask}) is None


def test_what_it_cannot_tell_says_nothing() -> None:
    assert mixes_samples(_stack(Noisy()), (X,), {}) is None  # random outputs
    assert mixes_samples(_stack(Centred()), (X[:1],), {}) is None  # one sample
    with torch.device("meta"):
        meta = _stack(Centred())
    assert mixes_samples(meta, (X,), {}) is None

    class Fixed(nn.Module):  # fails on any other batch size
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(16, -1) - x.mean(0)
    assert mixes_samples(Fixed(), (X,), {}) is None


def test_the_model_is_left_as_it_was() -> None:
    model = _stack(Seen())
    model.train()
    state = copy.deepcopy(model.state_dict())
    generator = torch.get_rng_state()
    assert mixes_samples(model, (X,), {}) is not None
    assert all(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), generator)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    # Its Python attributes are partition's to put back (as under capture).
    model[3].seen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        partition(model, ["cpu"] * 2, example_inputs=(X,))
    assert model[3].seen == [] and float(model[3].calls) == 0


def test_auto_never_splits_the_batch_of_such_a_model() -> None:
    """The search keeps one replica and one micro-batch: the outputs are the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)], Centred(),
                          *[nn.Linear(256, 256) for _ in range(3)])
    x = torch.randn(512, 256)
    reference = copy.deepcopy(model)
    pm = partition(model, ["cpu"] * 2, strategy="auto", example_inputs=(x,))
    assert pm.plan.chunks == 1 and (pm.plan.mesh is None or pm.plan.mesh.dp == 1)
    assert any(n.startswith("splitting the batch changes") for n in pm.plan.notes)
    torch.testing.assert_close(pm(x), reference(x), rtol=1e-4, atol=1e-5)
    for r in pm.plan.candidates:
        assert r["config"]["dp"] == 1 and r["config"]["chunks"] == 1, r["label"]


def test_splitting_it_on_request_warns_and_replicas_are_refused() -> None:
    model = _stack(Centred())
    with pytest.warns(UserWarning, match=r"chunks=4 splits each batch, but splitting the "
                                         r"batch changes output 0"):
        partition(model, ["cpu"] * 2, strategy="pipeline", example_inputs=(X,), chunks=4)
    with pytest.raises(PartitionError, match=r"dp=2 splits the batch, but the model is not "
                                             r"micro-batch safe.*pass dp=1"):
        partition(model, ["cpu"] * 2, strategy="auto", example_inputs=(X,),
                  mesh=Mesh(dp=2, pp=1, tp=1))


def test_a_sequence_first_transformer_is_not_split_along_its_sequence() -> None:
    """``nn.TransformerEncoder`` without ``batch_first`` takes ``(S, B, E)``: dim 0, which
    micro-batches and replicas split, is the sequence, and attention mixes it."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    x = torch.randn(12, 4, 16)
    assert mixes_samples(encoder, (x,), {}) is not None
    batch_first = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
    assert mixes_samples(batch_first, (x.transpose(0, 1),), {}) is None
