"""Tensor parallelism on torch's own attention: nn.MultiheadAttention and nn.Transformer*.

Each attention splits by heads (q, k, v rows of each rank's heads, out_proj row-parallel,
one all-reduce); outputs, gradients and state dicts equal the unsplit model's.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import PartitionError, partition
from partitioner.plans.plan import ShardSpec
from partitioner.runtime.tensor_parallel.sharding import ShardSizeError

E, H, B, L = 16, 4, 2, 5


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def check(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
          tp: int | dict[str, str] = 2, train: bool = True, **options: Any) -> Any:
    """Outputs and gradients equal the unsplit model's; the state dict loads into it and
    back. Returns the partitioned module (close it)."""
    kwargs = kwargs or {}
    model.train(train)
    reference = copy.deepcopy(model)
    devices = options.pop("devices", ["cpu"] * (tp if isinstance(tp, int) else 2))
    pm = partition(model, devices, tensor_parallel=tp, example_inputs=args,
                   example_kwargs=kwargs, **options)
    out, expected = pm(*args, **kwargs), reference(*args, **kwargs)
    torch.testing.assert_close(out, expected)
    if train:
        _first(out).pow(2).mean().backward()
        _first(expected).pow(2).mean().backward()
        for key, param in reference.named_parameters():
            torch.testing.assert_close(pm.full_tensor(key, grad=True), param.grad,
                                       msg=lambda m, k=key: f"{k}: {m}")
    unsplit = copy.deepcopy(reference)
    with torch.no_grad():
        for param in unsplit.parameters():
            param.add_(1.0)
    unsplit.load_state_dict(pm.state_dict())  # whole tensors under the model's own keys
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(unsplit.state_dict()[key], value)
    with torch.no_grad():
        for param in unsplit.parameters():
            param.mul_(0.5)
    pm.load_state_dict(unsplit.state_dict())  # and split again
    torch.testing.assert_close(pm(*args, **kwargs), unsplit(*args, **kwargs))
    return pm


class SelfAttention(nn.Module):
    """A model holding an nn.MultiheadAttention (symbolic tracing keeps the call whole)."""

    def __init__(self, batch_first: bool, heads: int = H) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, heads, batch_first=batch_first)
        self.proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = self.attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask)
        return self.proj(out)


def masks(which: str) -> dict[str, torch.Tensor]:
    out = {}
    if which in ("attn_mask", "both"):
        out["attn_mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)  # causal
    if which in ("key_padding_mask", "both"):
        padding = torch.zeros(B, L, dtype=torch.bool)
        padding[1, -2:] = True
        out["key_padding_mask"] = padding
    return out


def inputs(batch_first: bool, width: int = E, length: int = L) -> torch.Tensor:
    return torch.randn((B, length, width) if batch_first else (length, B, width))


def with_biases(model: nn.Module) -> nn.Module:
    """torch starts attention biases at zero; the tests need them to matter."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name:
                param.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("which", ["none", "attn_mask", "key_padding_mask", "both"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_in_a_model(batch_first: bool, which: str) -> None:
    model = with_biases(SelfAttention(batch_first))
    pm = check(model, (inputs(batch_first),), masks(which))
    assert pm.plan.shard_specs["attn.in_proj_weight"] == ShardSpec(0, "colwise")
    assert pm.plan.shard_specs["attn.out_proj.weight"] == ShardSpec(1, "rowwise")
    assert pm.shardings["attn.in_proj_weight"].blocks == (E, E, E)
    assert "attn: heads" in pm.plan.notes
    pm.close()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_model_itself(batch_first: bool, tp: int) -> None:
    """An nn.MultiheadAttention as the whole model (captured by torch.export), returning
    its head-averaged weights too."""
    model = with_biases(nn.MultiheadAttention(E, H, batch_first=batch_first))
    x = inputs(batch_first)
    pm = check(model, (x, x, x), masks("both"), tp=tp)
    assert pm.plan.shard_specs["in_proj_weight"] == ShardSpec(0, "colwise")
    pm.close()


def test_per_head_attention_weights() -> None:
    model = with_biases(nn.MultiheadAttention(E, H, batch_first=True))
    x = inputs(True)
    pm = check(model, (x, x, x), {"average_attn_weights": False})
    pm.close()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer(norm_first: bool, tp: int) -> None:
    model = with_biases(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True,
                                                   norm_first=norm_first))
    pm = check(model, (inputs(True),), tp=tp)
    assert "self_attn: heads" in pm.plan.notes
    assert "megatron pair: linear1 colwise -> linear2 rowwise" in pm.plan.notes
    pm.close()


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer(norm_first: bool) -> None:
    """Self-attention and cross-attention on the memory (query and key differ)."""
    model = with_biases(nn.TransformerDecoderLayer(E, H, 32, dropout=0.0, batch_first=True,
                                                   norm_first=norm_first))
    memory = inputs(True, length=3)
    pm = check(model, (inputs(True), memory),
               {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(L)})
    assert {"self_attn: heads", "multihead_attn: heads"} <= set(pm.plan.notes)
    pm.close()


def test_encoder_layer_in_eval_mode() -> None:
    model = with_biases(nn.TransformerEncoderLayer(E, H, 32, batch_first=True))
    padding = masks("key_padding_mask")["key_padding_mask"]
    pm = check(model, (inputs(True),), {"src_key_padding_mask": padding}, train=False)
    pm.close()


def _forward_counts(pm: Any) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for stage in pm.stages.values():
        for s in stage:
            counts.update(s.group.members[0].counts)
    return counts


def test_each_encoder_layer_forward_runs_exactly_two_all_reduces() -> None:
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.0), 2,
                                  enable_nested_tensor=False)
    x = inputs(False)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    with torch.no_grad():
        pm(x)
    assert _forward_counts(pm) == Counter({("all_reduce", "forward"): 4})
    pm.close()


def test_encoder_with_masks() -> None:
    model = with_biases(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, 32, dropout=0.0), 2, enable_nested_tensor=False))
    options = {"mask": masks("attn_mask")["attn_mask"],
               "src_key_padding_mask": masks("key_padding_mask")["key_padding_mask"],
               "is_causal": False}
    pm = check(model, (inputs(False),), options)
    pm.close()


@pytest.mark.parametrize("train", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_transformer(train: bool) -> None:
    """Encoder self-attention, decoder self- and cross-attention: all split by heads."""
    model = with_biases(nn.Transformer(E, H, 1, 1, 32, dropout=0.0, batch_first=True))
    tgt = inputs(True, length=3)
    # tgt_is_causal given: torch's guess from the mask's values cannot be exported.
    options = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(3),
               "tgt_is_causal": True}
    pm = check(model, (inputs(True), tgt), options, train=train)
    for name in ("encoder.layers.0.self_attn", "decoder.layers.0.self_attn",
                 "decoder.layers.0.multihead_attn"):
        assert f"{name}: heads" in pm.plan.notes
    pm.close()


@pytest.mark.slow
def test_pipeline_stages_of_attention_ranks() -> None:
    model = with_biases(nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True), 2,
        enable_nested_tensor=False))
    pm = check(model, (inputs(True),), devices=["cpu"] * 4, chunks=2, checkpoint="always")
    assert (pm.plan.mesh.pp, pm.plan.mesh.tp) == (2, 2)
    pm.close()


@pytest.mark.slow
def test_attention_dropout_replays_under_checkpointing() -> None:
    """Dropout on split heads draws from each rank's generator: a checkpointed replay draws
    the same masks, so the gradients equal those of a run that keeps its activations."""
    grads = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        model = nn.TransformerEncoderLayer(E, H, 32, dropout=0.2, batch_first=True)
        x = torch.randn(4, L, E)
        pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,),
                       chunks=2, checkpoint=checkpoint)
        torch.manual_seed(1)
        pm(x).pow(2).mean().backward()
        grads.append(pm.full_tensor("self_attn.in_proj_weight", grad=True))
        pm.close()
    torch.testing.assert_close(grads[0], grads[1])


def test_heads_that_do_not_divide_name_the_module_and_the_fix() -> None:
    model = nn.TransformerEncoderLayer(12, 3, 32, dropout=0.0, batch_first=True)
    x = torch.randn(B, L, 12)
    with pytest.raises(ShardSizeError) as info:
        partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,))
    assert isinstance(info.value, PartitionError) and isinstance(info.value, ValueError)
    message = str(info.value)
    for part in ("self_attn (nn.MultiheadAttention, 3 heads)", "tensor_parallel=2",
                 "dividing 3", "tensor_parallel={'self_attn': 'replicate'}"):
        assert part in message, message
    pm = check(model, (x,), tp={"self_attn": "replicate"})  # the fix works
    assert "self_attn.in_proj_weight" not in pm.plan.shard_specs
    pm.close()


def test_an_attention_export_cannot_keep_whole_is_kept_unsplit() -> None:
    """Called with two argument structures, the attention is inlined by torch.export: its
    projections stay whole and the result is still exact."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H)
            self.proj = nn.Linear(E, E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] > 1:  # symbolic tracing cannot branch on a size: export runs
                x = x * 2
            y = self.attn(x, x, x)[0]
            return self.proj(self.attn(y, x, x, need_weights=False)[0])

    pm = check(with_biases(Twice()), (inputs(False),))
    assert "attn.in_proj_weight" not in pm.plan.shard_specs
    pm.close()
