"""Plain models the tensor-parallel tests split (what a model is, apart from how it is split)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, for examples.models
from examples.models import GPT

__all__ = ["mlp_pair", "Block", "LlamaBlock", "TinyGPT", "gpt2", "batch_for"]


def mlp_pair(width: int = 16, hidden: int = 64) -> nn.Sequential:
    """Linear -> GELU -> Linear: one Megatron pair."""
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


# Not examples.models' attention on purpose: no SDPA dropout_p, drawn from the global generator.
class _Attention(nn.Module):
    """Fused q, k, v projection and scaled_dot_product_attention (nanoGPT)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.c_proj(y))


# Not examples.models' block on purpose: the TP tests match its MLP's Linears as mlp.0 and mlp.2.
class Block(nn.Module):
    """A pre-norm transformer block in plain torch: x + attn(ln(x)), x + mlp(ln(x))."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _Attention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LlamaBlock(nn.Module):
    """Separate q, k, v, eager causal attention with a mask buffer, and a SwiGLU MLP."""

    def __init__(self, n_embd: int = 32, n_head: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm_1 = nn.LayerNorm(n_embd)
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=False)
        self.o = nn.Linear(n_embd, n_embd)
        self.norm_2 = nn.LayerNorm(n_embd)
        self.w1 = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.w3 = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.w2 = nn.Linear(2 * n_embd, n_embd, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        y = self.norm_1(x)
        q = self.q(y).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k(y).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v(y).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = F.softmax(att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.o(y)
        y = self.norm_2(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TinyGPT(GPT):
    """``examples.models.GPT`` (untied LM head) built from :class:`Block`, test-sized."""

    def __init__(self, n_layer: int = 2, n_embd: int = 32, n_head: int = 4, vocab: int = 64,
                 seq: int = 16, dropout: float = 0.0) -> None:
        super().__init__(0, n_embd, n_head, vocab, seq, dropout)  # no blocks of its own kind
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))


def gpt2(n_layer: int = 2, dropout: float = 0.0) -> nn.Module:
    """transformers' GPT2LMHeadModel from a config (tied embeddings, Conv1D layers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                        use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch_for(model: nn.Module, batch: int = 4, seq: int = 8) -> torch.Tensor:
    """One batch of inputs that ``model`` takes."""
    if isinstance(model, nn.Sequential):
        return torch.randn(batch, model[0].in_features)
    if isinstance(model, (Block, LlamaBlock)):
        return torch.randn(batch, seq, 32)
    if isinstance(model, nn.TransformerEncoderLayer):
        return torch.randn(batch, seq, model.self_attn.embed_dim)
    return torch.randint(0, 64, (batch, seq))
