"""head_parallel_attention: the ranks' heads, summed, equal torch's nn.MultiheadAttention."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from thread_ranks import on_threads
from torch import nn

from partitioner.runtime import rng
from partitioner.runtime.tensor_parallel.attention import canonical_mask, head_parallel_attention
from partitioner.runtime.tensor_parallel.collectives import ShapeCommunicator
from partitioner.runtime.tensor_parallel.sharding import Sharding, shard_tensor

E, H, B, L, S = 16, 4, 2, 5, 6


def rank_copy(mha: nn.MultiheadAttention, rank: int, tp: int) -> nn.MultiheadAttention:
    """Rank ``rank``'s copy of ``mha``, holding the slices of its heads."""
    blocks = (E, E, E)
    split = {"in_proj_weight": Sharding("colwise", 0, tp, blocks),
             "in_proj_bias": Sharding("colwise", 0, tp, blocks),
             **{f"{p}_proj_weight": Sharding("colwise", 0, tp) for p in "qkv"},
             "bias_k": Sharding("colwise", 2, tp), "bias_v": Sharding("colwise", 2, tp),
             "out_proj.weight": Sharding("rowwise", 1, tp)}
    out = copy.deepcopy(mha)
    for name, param in mha.named_parameters():
        if name in split:
            owner, _, leaf = name.rpartition(".")
            module = out.get_submodule(owner) if owner else out
            setattr(module, leaf, nn.Parameter(shard_tensor(param, split[name], rank)))
    return out


def on_ranks(mha: nn.MultiheadAttention, tp: int, *inputs: torch.Tensor,
             **options: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    def one(rank: int, comm: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return head_parallel_attention(rank_copy(mha, rank, tp), comm, *inputs, **options)
    return on_threads(tp, one)


def attention(**options: Any) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, **options)
    with torch.no_grad():  # torch starts the biases at zero; a test of them must not
        for name, param in mha.named_parameters():
            if "bias" in name:
                param.normal_()
    return mha


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("options", [
    {"batch_first": True}, {"batch_first": False}, {"kdim": 12, "vdim": 10},
    {"add_bias_kv": True, "add_zero_attn": True}, {"bias": False}],
    ids=["batch_first", "seq_first", "kdim_vdim", "bias_kv_zero_attn", "no_bias"])
def test_ranks_sum_to_torch_attention(options: dict[str, Any], tp: int) -> None:
    mha = attention(**options)
    first = options.get("batch_first", False)
    shape = (B, L, E) if first else (L, B, E)
    query = torch.randn(shape)
    key = torch.randn(*shape[:-1], options.get("kdim", E))
    value = torch.randn(*shape[:-1], options.get("vdim", E))
    expected, weights = mha(query, key, value)
    ranks = on_ranks(mha, tp, query, key, value)
    for out, averaged in ranks:
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(averaged, weights)


@pytest.mark.parametrize("masks", ["attn_mask", "key_padding_mask", "both", "per_head"])
def test_masks(masks: str) -> None:
    mha = attention(batch_first=True)
    x = torch.randn(B, L, E)
    options: dict[str, Any] = {}
    if masks in ("attn_mask", "both"):
        options["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
    if masks in ("key_padding_mask", "both"):
        padding = torch.zeros(B, L, dtype=torch.bool)
        padding[1, -2:] = True
        # A boolean mask alone; as a float beside the float attn_mask (torch warns on a mix).
        options["key_padding_mask"] = (padding if masks == "key_padding_mask" else
                                       canonical_mask(padding, "key_padding_mask", x.dtype))
    if masks == "per_head":  # (batch * heads, L, S): each rank takes its heads' masks
        options["attn_mask"] = torch.randn(B * H, L, L)
    expected, _ = mha(x, x, x, need_weights=False, **options)
    for out, weights in on_ranks(mha, 2, x, x, x, need_weights=False, **options):
        torch.testing.assert_close(out, expected)
        assert weights is None


def test_per_head_weights_stay_split_by_heads() -> None:
    mha = attention(batch_first=True)
    x = torch.randn(B, L, E)
    _, weights = mha(x, x, x, average_attn_weights=False)  # (B, H, L, L)
    ranks = on_ranks(mha, 2, x, x, x, average_attn_weights=False)
    torch.testing.assert_close(torch.cat([w for _, w in ranks], dim=1), weights)
    assert ranks[0][1] is not None and ranks[0][1].shape == (B, H // 2, L, L)


def test_unbatched_and_causal() -> None:
    mha = attention()
    x = torch.randn(L, E)
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    expected, weights = mha(x, x, x, attn_mask=mask, is_causal=True)
    for out, averaged in on_ranks(mha, 2, x, x, x, attn_mask=mask, is_causal=True):
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(averaged, weights)
    expected, _ = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
    out, _ = on_ranks(mha, 2, x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(out, expected)


def test_gradients_flow_to_every_slice() -> None:
    mha = attention(batch_first=True)
    x = torch.randn(B, L, E)
    mha(x, x, x)[0].sum().backward()

    def one(rank: int, comm: Any) -> dict[str, torch.Tensor]:
        mine = rank_copy(mha, rank, 2)
        head_parallel_attention(mine, comm, x, x, x)[0].sum().backward()
        return {n: p.grad for n, p in mine.named_parameters()}
    grads = on_threads(2, one)
    blocks = Sharding("colwise", 0, 2, (E, E, E))
    for rank in range(2):
        torch.testing.assert_close(grads[rank]["in_proj_weight"],
                                   shard_tensor(mha.in_proj_weight.grad, blocks, rank))
        torch.testing.assert_close(grads[rank]["out_proj.bias"], mha.out_proj.bias.grad)


def test_dropout_on_split_heads_draws_from_the_rank_generator() -> None:
    mha = attention(batch_first=True, dropout=0.5)
    x = torch.randn(B, L, E)
    comm = ShapeCommunicator(0, 1)
    outs = []
    for _ in range(2):
        with rng.use_shard_generator(torch.Generator().manual_seed(3)):
            outs.append(head_parallel_attention(mha, comm, x, x, x)[0])
    torch.testing.assert_close(outs[0], outs[1])  # the same generator state, the same masks
    mha.eval()
    whole = mha(x, x, x)[0]
    assert not torch.allclose(outs[0], whole)  # the masks did drop something
    torch.testing.assert_close(head_parallel_attention(mha, comm, x, x, x)[0], whole)


def test_masks_of_other_dtypes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="only bool and floating"):
        canonical_mask(torch.zeros(2, 3, dtype=torch.int64), "key_padding_mask",
                       torch.float32)
