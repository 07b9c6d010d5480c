"""torch's ``nn.MultiheadAttention`` on one tensor-parallel rank: this rank's heads only.

``nn.MultiheadAttention`` keeps q, k and v in one fused ``in_proj_weight`` of ``3E x E`` rows
(or three ``*_proj_weight`` when ``kdim``/``vdim`` differ from ``E``) and the output
projection in ``out_proj``. Split by heads over ``tp`` ranks, rank ``r`` holds:

=====================  =========================  ==========================================
tensor                 whole shape                rank ``r`` holds
=====================  =========================  ==========================================
``in_proj_weight``     ``(3E, E)``                the rows of its heads in each of q, k, v
                                                  (``Sharding(blocks=(E, E, E))``)
``in_proj_bias``       ``(3E,)``                  the same entries
``q/k/v_proj_weight``  ``(E, E|kdim|vdim)``       the rows of its heads
``bias_k``, ``bias_v``  ``(1, 1, E)``             the entries of its heads
``out_proj.weight``    ``(E, E)``                 the columns of its heads (row-parallel)
``out_proj.bias``      ``(E,)``                   all of it, added once after the sum
=====================  =========================  ==========================================

:func:`head_parallel_attention` is called like ``module(query, key, value, ...)`` on a
rank's copy of the module (holding those slices) and computes exactly what
``F.multi_head_attention_forward`` computes for ``num_heads // tp`` heads, up to the output
projection, whose partial products it sums over the group (one all-reduce; Megatron's
attention). Head-averaged attention weights are summed over the group too (a second
all-reduce, only when asked for); per-head weights stay split along the head dimension.

Dropout on the attention probabilities (split by heads) draws from the rank's own
generator (``ops.sharded_dropout``), so a checkpointed replay draws the same masks; without
dropout the product runs in ``scaled_dot_product_attention``.

Example:
    >>> import torch
    >>> from partitioner.runtime.tensor_parallel.collectives import ShapeCommunicator
    >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> x = torch.randn(3, 5, 8)
    >>> out, weights = head_parallel_attention(mha, ShapeCommunicator(0, 1), x, x, x)
    >>> torch.allclose(out, mha(x, x, x)[0], atol=1e-6), tuple(weights.shape)
    (True, (3, 5, 5))
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partitioner.runtime.tensor_parallel import ops as tpops
from partitioner.runtime.tensor_parallel.collectives import Communicator, reduce_from_tp

__all__ = ["head_parallel_attention", "canonical_mask"]


def head_parallel_attention(module: nn.MultiheadAttention, comm: Communicator, query: Tensor,
                            key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                            need_weights: bool = True, attn_mask: Tensor | None = None,
                            average_attn_weights: bool = True,
                            is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    """``module(query, key, value, ...)`` for this rank's heads, summed over the group.

    Args:
        module: the rank's copy of the ``nn.MultiheadAttention``, holding its slices (see
            the module docstring); ``module.num_heads`` is the whole model's head count.
        comm: the rank's tensor-parallel group (its ``size`` divides ``num_heads``).
        query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
        is_causal: as ``nn.MultiheadAttention.forward``.

    Returns:
        ``(attn_output, attn_weights)``: the whole output on every rank; the weights
        averaged over all heads (whole), per head for this rank's heads (split along the
        head dimension), or ``None``.

    Raises:
        RuntimeError: for inputs ``nn.MultiheadAttention`` refuses too (``is_causal``
            without ``attn_mask``, masks of the wrong shape or dtype).
    """
    batched = query.dim() == 3
    if module.batch_first and batched:
        query, key, value = _seq_first(query, key, value)
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    key_padding_mask = canonical_mask(key_padding_mask, "key_padding_mask", query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint; you may use "
                           "nn.Transformer.generate_square_subsequent_mask to create it")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # scaled_dot_product_attention makes the causal mask itself
    else:
        attn_mask = canonical_mask(attn_mask, "attn_mask", query.dtype)
        is_causal = is_causal and key_padding_mask is None
    out, weights = _heads(module, comm, query, key, value, key_padding_mask, attn_mask,
                          need_weights, is_causal)
    if weights is not None and average_attn_weights:
        # Each rank averages its heads over all heads; the sum over ranks is the mean.
        weights = reduce_from_tp(weights.sum(dim=1) / module.num_heads, comm)
    if not batched:
        out = out.squeeze(1)
        weights = weights.squeeze(0) if weights is not None else None
    elif module.batch_first:
        out = out.transpose(1, 0)
    return out, weights


def canonical_mask(mask: Tensor | None, name: str, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask as an additive float mask (``-inf`` where ``True``), as torch does."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise RuntimeError(f"{name} has dtype {mask.dtype}; only bool and floating masks "
                           "are supported")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _seq_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(B, L, E)`` inputs as ``(L, B, E)``, keeping which of them are the same tensor."""
    if key is value:
        if query is key:
            query = key = value = query.transpose(1, 0)
            return query, key, value
        query, key = query.transpose(1, 0), key.transpose(1, 0)
        return query, key, key
    return query.transpose(1, 0), key.transpose(1, 0), value.transpose(1, 0)


def _heads(module: nn.MultiheadAttention, comm: Communicator, query: Tensor, key: Tensor,
           value: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None,
           need_weights: bool, is_causal: bool) -> tuple[Tensor, Tensor | None]:
    """The rank's heads on ``(L, B, E)`` inputs: whole output ``(L, B, E)``, rank's weights."""
    tgt_len, bsz, _ = query.shape
    heads = module.num_heads // comm.size
    q, k, v = _project(module, query, key, value)
    local = q.shape[-1]  # this rank's heads times the head size
    head_dim = local // heads
    attn_mask = _rank_heads(attn_mask, module.num_heads, comm, tgt_len, key.shape[0], bsz)
    if module.bias_k is not None and module.bias_v is not None:
        k = torch.cat([k, module.bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, module.bias_v.repeat(1, bsz, 1)])
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = (F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None
                            else None)
    q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)  # (B*h, L, hd)
    k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
    v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
    if module.add_zero_attn:
        zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = (F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None
                            else None)
    src_len = k.size(1)
    if key_padding_mask is not None:
        padding = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1)
                   .reshape(bsz * heads, 1, src_len))
        attn_mask = padding if attn_mask is None else attn_mask + padding
    p = float(module.dropout) if module.training else 0.0
    if need_weights or p > 0.0:
        out, weights = _explicit(q, k, v, attn_mask, p, is_causal, bsz, heads)
    else:
        out, weights = _fused(q, k, v, attn_mask, is_causal, bsz, heads), None
    out = out.transpose(0, 1).reshape(tgt_len * bsz, local)
    # Row-parallel output projection: partial sums over this rank's heads, then the bias.
    out = reduce_from_tp(F.linear(out, module.out_proj.weight), comm)
    if module.out_proj.bias is not None:
        out = out + module.out_proj.bias
    return out.view(tgt_len, bsz, out.size(1)), weights if need_weights else None


def _project(module: nn.MultiheadAttention, query: Tensor, key: Tensor,
             value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of this rank's heads (each ``(L or S, B, local)``)."""
    bias = module.in_proj_bias
    b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
    if module.in_proj_weight is None:  # kdim or vdim differ from embed_dim
        return (F.linear(query, module.q_proj_weight, b_q),
                F.linear(key, module.k_proj_weight, b_k),
                F.linear(value, module.v_proj_weight, b_v))
    weight = module.in_proj_weight
    if query is key and key is value:
        # One product for the three, as torch's packed projection does.
        q, k, v = F.linear(query, weight, bias).chunk(3, dim=-1)
        return q, k, v
    w_q, w_k, w_v = weight.chunk(3)
    return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)


def _rank_heads(attn_mask: Tensor | None, num_heads: int, comm: Communicator, tgt_len: int,
                src_len: int, bsz: int) -> Tensor | None:
    """The mask as ``(1 or B*h, L, S)``: a per-head 3-D mask keeps this rank's heads."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != (tgt_len, src_len):
            raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, "
                               f"but should be {(tgt_len, src_len)}.")
        return attn_mask.unsqueeze(0)
    if attn_mask.dim() != 3 or tuple(attn_mask.shape) != (bsz * num_heads, tgt_len, src_len):
        raise RuntimeError(f"attn_mask has shape {tuple(attn_mask.shape)}; pass (L, S) or "
                           f"(batch * heads, L, S) = {(bsz * num_heads, tgt_len, src_len)}")
    heads = num_heads // comm.size
    per_head = attn_mask.view(bsz, num_heads, tgt_len, src_len)
    mine = per_head.narrow(1, comm.rank * heads, heads)
    return mine.reshape(bsz * heads, tgt_len, src_len)


def _explicit(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, p: float,
              is_causal: bool, bsz: int, heads: int) -> tuple[Tensor, Tensor]:
    """Softmax attention with its (dropped-out) probabilities, as torch returns them:
    ``(B*h, L, hd)`` and ``(B, h, L, S)``."""
    if is_causal and attn_mask is None:
        # What scaled_dot_product_attention's is_causal means (top-left aligned).
        attn_mask = torch.full((q.shape[1], k.shape[1]), float("-inf"), dtype=q.dtype,
                               device=q.device).triu(1).unsqueeze(0)
    q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
    if attn_mask is not None:
        scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
    else:
        scores = torch.bmm(q_scaled, k.transpose(-2, -1))
    probs = F.softmax(scores, dim=-1)
    if p > 0.0:
        probs = tpops.sharded_dropout(probs, p, True)
    return torch.bmm(probs, v), probs.view(bsz, heads, probs.shape[1], probs.shape[2])


def _fused(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
           bsz: int, heads: int) -> Tensor:
    """``scaled_dot_product_attention`` over ``(B, h, ., hd)``; returns ``(B*h, L, hd)``."""
    if attn_mask is not None:
        attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1
                     else attn_mask.view(bsz, heads, -1, attn_mask.shape[-1]))
    shape: Any = (bsz, heads, -1, q.shape[-1])
    out = F.scaled_dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape),
                                         attn_mask, 0.0, is_causal)
    return out.reshape(bsz * heads, -1, q.shape[-1])
