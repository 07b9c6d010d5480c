"""Plain example models: what a model is, with nothing about how it is distributed.

The ``partitioner`` command's bundled models (``partitioner plan --list``) are built from
these, so they ship inside the package; ``examples/models.py`` re-exports them for the
examples, benchmarks and tests. Examples hand them to ``partition`` or ``make_plan``; the
plan decides the split. Nothing here imports the rest of the partitioner.

Example:
    >>> import torch
    >>> model = gpt(n_layer=2, n_embd=32, n_head=4, vocab=64, seq=16)
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 64])
    >>> mlp([8, 16, 2])(torch.randn(5, 8)).shape
    torch.Size([5, 2])
    >>> classifier(features=8, width=16, depth=2, classes=3)(torch.randn(5, 8)).shape
    torch.Size([5, 3])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["mlp", "classifier", "ResNetish", "GPT", "gpt"]


def mlp(widths: Sequence[int]) -> nn.Sequential:
    """Linear layers of the given widths with a ReLU between each two (none after the last).

    Every Linear and ReLU is its own child, so a sequential of ``n`` widths has
    ``2 * (n - 1) - 1`` modules.
    """
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class _ResidualMLP(nn.Module):
    """x + MLP(LayerNorm(x)): a pre-norm residual block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def classifier(features: int, width: int, depth: int, classes: int) -> nn.Sequential:
    """Input layer, ``depth`` pre-norm residual MLP blocks, final norm, linear head.

    The model both training examples (``train_pipeline.py``, ``train_distributed.py``) split.
    """
    return nn.Sequential(nn.Linear(features, width),
                         nn.Sequential(*[_ResidualMLP(width) for _ in range(depth)]),
                         nn.LayerNorm(width), nn.Linear(width, classes))


class _ResidualBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a shortcut (1x1 when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.GroupNorm(groups, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetish(nn.Module):
    """A small ResNet: stem, stages of residual blocks, pooled linear head.

    GroupNorm normalises each sample on its own, so splitting a batch into micro-batches
    leaves the maths unchanged (BatchNorm would not).

    Args:
        widths: channels of each stage; each stage after the first halves the resolution.
        blocks: residual blocks per stage.
        classes: outputs of the head.
        in_channels: channels of the input image.
        groups: GroupNorm groups (must divide every width).
    """

    def __init__(self, widths: Sequence[int] = (16, 32, 64), blocks: int = 2,
                 classes: int = 10, in_channels: int = 3, groups: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
                                  nn.GroupNorm(groups, widths[0]), nn.ReLU())
        stages: list[nn.Module] = []
        cin = widths[0]
        for s, cout in enumerate(widths):
            for b in range(blocks):
                stride = 2 if s > 0 and b == 0 else 1
                stages.append(_ResidualBlock(cin, cout, stride, groups))
                cin = cout
        self.blocks = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))  # (B, C, H, W)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # (B, classes)


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # fused q, k, v
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = _MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A nanoGPT-style decoder: token and position embeddings, blocks, final norm, LM head.

    The head is not tied to the token embedding (GPT-2 ties them): tied weights pin the
    first and last layers to one device, which a pipeline plan would otherwise spread out.

    Args:
        n_layer: transformer blocks.
        n_embd: hidden size.
        n_head: attention heads (must divide ``n_embd``).
        vocab: vocabulary size.
        seq: longest sequence (rows of the position embedding).
        dropout: dropout probability after embeddings, attention and MLP.
    """

    def __init__(self, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(seq, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def gpt(n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int,
        dropout: float = 0.0) -> GPT:
    """A :class:`GPT`; ``gpt(48, 1600, 25, 50257, 1024)`` has GPT-2 XL's shapes."""
    return GPT(n_layer, n_embd, n_head, vocab, seq, dropout)
