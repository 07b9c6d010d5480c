"""Small plain models the tests partition (what a model is, apart from how it is split)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = ["mlp", "nested_sequential", "ResidualCNN", "LongSkip", "gpt2"]


def mlp(widths: tuple[int, ...] = (12, 32, 32, 16, 6)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def nested_sequential() -> nn.Sequential:
    block = lambda: nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))
    return nn.Sequential(nn.Sequential(block(), nn.Tanh()), block(),
                         nn.Sequential(nn.Sequential(nn.Linear(10, 4))))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(2, cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.GroupNorm(2, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.down(x))


class ResidualCNN(nn.Module):
    """ResNet-style: stem, two stages of residual blocks, pooled head (GroupNorm is per-sample,
    so micro-batching leaves the maths unchanged)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU())
        self.layer1 = nn.Sequential(_Block(8, 8, 1), _Block(8, 8, 1))
        self.layer2 = nn.Sequential(_Block(8, 16, 2), _Block(16, 16, 1))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class LongSkip(nn.Module):
    """Six layers; the output of the first is added after the sixth (a skip over 3+ stages)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.tanh(self.layers[0](x))
        h = first
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return h + first * x.sum(dim=1, keepdim=True)


def gpt2(dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                        use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout,
                        attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)
