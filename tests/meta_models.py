"""The model the meta-device tests build (on the meta device or for real) and its data.

Four Megatron pairs (Linear 512 -> 2048, GELU, Linear 2048 -> 512) after a LayerNorm:
about 8.4 M parameters, 67 MB in float64, so that a rank's share of it stands out against
the noise of the process's resident memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WIDTH", "HIDDEN", "PAIRS", "build", "build_tied", "build_scaled", "Scaled",
           "init_scaled", "batches", "loss_fn", "train_whole", "param_bytes"]

WIDTH, HIDDEN, PAIRS = 512, 2048, 4


def build(width: int = WIDTH, hidden: int = HIDDEN) -> nn.Sequential:
    """The model, on the current default device and dtype (``torch.device("meta")``)."""
    layers: list[nn.Module] = [nn.LayerNorm(width)]
    for _ in range(PAIRS):
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def build_tied(width: int = WIDTH) -> nn.Sequential:
    """Five square Linear layers, the last one's weight tied to the first's (the pipeline
    puts them on different ranks)."""
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers[:-1])
    model[8].weight = model[0].weight
    return model


class Scaled(nn.Module):
    """Multiplies by a fixed per-feature scale held in a non-persistent buffer (as rotary
    ``inv_freq``: computed at construction, in no state dict)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(width), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel(),
                                            dtype=self.scale.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def build_scaled(width: int = 16, hidden: int = 32) -> nn.Sequential:
    """Two blocks of Linear, :class:`Scaled`, GELU, Linear: each pipeline stage of two holds
    a non-persistent buffer."""
    layers: list[nn.Module] = []
    for _ in range(2):
        layers += [nn.Linear(width, hidden), Scaled(hidden), nn.GELU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def init_scaled(module: nn.Module) -> None:
    """An ``init_fn`` for :func:`build_scaled`: each module's own ``reset_parameters()``."""
    module.reset_parameters()  # type: ignore[operator]


def batches(steps: int, batch: int = 8, width: int = WIDTH
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (input, target) batches, the same in every process."""
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(batch, width, generator=generator, dtype=torch.float64),
             torch.randn(batch, width, generator=generator, dtype=torch.float64))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (a mean: the pipeline weights micro-batches by their rows)."""
    return F.mse_loss(out, target)


def train_whole(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                lr: float = 0.1) -> list[float]:
    """Full-batch SGD on the unpartitioned model (the reference); returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def param_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
