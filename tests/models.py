"""Small plain models the tests partition (what a model is, apart from how it is split)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = ["mlp", "nested_sequential", "ResidualCNN", "LongSkip", "gpt2", "BatchBranch",
           "FixedBatch", "Scaled", "Counter", "encoder_model"]


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


class BatchBranch(nn.Module):
    """Three layers and a branch on the batch size (torch.fx cannot trace it; torch.export
    records ``batch > 4``): micro-batches of 4 rows or fewer would take the other branch."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        if x.shape[0] > 4:
            h = h * 2
        return self.layers[2](torch.tanh(self.layers[1](h)))


class FixedBatch(BatchBranch):
    """Reshapes with a constant batch of 8: torch.export fixes the batch dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        if h.shape[0] > 1:
            h = h.reshape(8, -1)
        return self.layers[2](torch.tanh(self.layers[1](h)))


class Scaled(nn.Module):
    """``forward(x, scale=2.0, flag=True)`` as timm's ViTs: defaults a later layer uses."""

    def __init__(self, width: int = 8, traceable: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.traceable = traceable

    def forward(self, x: torch.Tensor, scale: float = 2.0, flag: bool = True) -> torch.Tensor:
        h = torch.tanh(self.layers[1](torch.tanh(self.layers[0](x))))
        if not self.traceable and flag:  # a Python branch on an input: torch.export only
            h = h + 1
        return self.layers[2](h) * scale


class Counter(nn.Module):
    """Counts its calls in a buffer (``self.steps += 1``), as some models count steps."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Encoder(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        block = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=mask))


def encoder_model(width: int = 16, layers: int = 4) -> nn.Module:
    """An embedding, an ``nn.TransformerEncoder`` and a head; ``forward(x, mask=None)``."""
    return _Encoder(width, layers)


class _NoGradRotary(nn.Module):
    """A rotary embedding as transformers 5.17 wrote it: ``@torch.no_grad()`` and a
    ``.to(x.device)`` inside, which ``torch.export`` keeps in a submodule graph of its own
    (``wrap_with_set_grad_enabled``) with the capture's device baked in."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inv = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)
        inv = inv.to(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv @ positions[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class NoGradRotary(nn.Module):
    """Two linears around :class:`_NoGradRotary` (inputs ``(batch, seq, 8)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary = _NoGradRotary()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.rotary(x, positions)
        return self.second(self.first(x) * cos + sin)

    @staticmethod
    def init(module: nn.Module) -> None:
        """An ``init_fn`` for a meta-built one: the linears' own reset, the frequencies."""
        if isinstance(module, _NoGradRotary):
            fresh = _NoGradRotary().inv_freq
            module.inv_freq = fresh.to(module.inv_freq.device)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()


def grads_match(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter of ``model`` has the gradient of its twin in ``reference`` (or none
    where the twin has none)."""
    grads = dict(reference.named_parameters())
    for key, param in model.named_parameters():
        if grads[key].grad is None:
            assert param.grad is None, f"{key} got a gradient the model does not give it"
            continue
        assert param.grad is not None, f"{key} got no gradient"
        torch.testing.assert_close(param.grad, grads[key].grad, msg=key)
