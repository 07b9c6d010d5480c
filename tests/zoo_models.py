"""More architectures for the zoo, each from a tiny config with random weights.

Mixture of experts returning an auxiliary loss, encoder-decoder speech, vision transformers
with odd patch counts, recurrent stacks, models returning dicts, shared layers. Each
builder returns ``(model, example args, example kwargs)``; ``tests/test_model_zoo.py``
partitions them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ZOO", "REFUSED", "Case", "RecurrentTagger", "GRUWithAux", "CountingMoE"]

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _ids(batch: int = 8, length: int = 8, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 100 + length)
    return torch.randint(1, vocab, (batch, length), generator=g)


def _seeded(build: Callable[[], Case]) -> Callable[[], Case]:
    def make() -> Case:
        torch.manual_seed(0)
        return build()
    make.__name__ = build.__name__
    return make


_DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                use_cache=False)


@_seeded
def mixtral() -> Case:
    """Mixture of experts; the router's load-balancing ``aux_loss`` is a 0-dim output."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.01)
    return MixtralForCausalLM(config), (_ids(),), {}


@_seeded
def qwen2_moe() -> Case:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(**_DECODER, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            output_router_logits=True, decoder_sparse_step=1)
    return Qwen2MoeForCausalLM(config), (_ids(),), {}


@_seeded
def whisper() -> Case:
    """Encoder-decoder speech: log-mel features (B, mels, 2 * source positions)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, d_model=32,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                           max_target_positions=16, use_cache=False, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
                           dropout=0.0, suppress_tokens=None, begin_suppress_tokens=None)
    features = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(3))
    return (WhisperForConditionalGeneration(config), (features,),
            {"decoder_input_ids": _ids(length=6)})


@_seeded
def vit_odd_patches() -> Case:
    """ViT on 36-pixel images in 12-pixel patches: 9 patches and a class token, 10 tokens."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=36, patch_size=12, num_channels=3, hidden_size=32,
                       num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                       num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    images = torch.randn(8, 3, 36, 36, generator=torch.Generator().manual_seed(4))
    return ViTForImageClassification(config), (images,), {}


@_seeded
def swin() -> Case:
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                        num_heads=[2, 4], window_size=4, num_labels=5, drop_path_rate=0.0,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    return SwinForImageClassification(config), (images,), {}


class RecurrentTagger(nn.Module):
    """Embedding, a 2-layer bidirectional LSTM, a GRU and a tagging head (B, T, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(32, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))    # (B, T, 32)
        hidden, _ = self.gru(hidden)              # (B, T, 16)
        return self.head(hidden)


class GRUWithAux(nn.Module):
    """A GRU stack returning a dict: logits and a 0-dim auxiliary loss (mean activation²)."""

    def __init__(self) -> None:
        super().__init__()
        self.grus = nn.ModuleList([nn.GRU(8, 8, batch_first=True) for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for gru in self.grus:
            x, _ = gru(x)
        return {"logits": self.head(x[:, -1]), "aux_loss": (x ** 2).mean()}


@_seeded
def lstm_stack() -> Case:
    return RecurrentTagger(), (_ids(),), {}


@_seeded
def gru_aux() -> Case:
    return GRUWithAux(), (torch.randn(8, 6, 8, generator=torch.Generator().manual_seed(6)),), {}


@_seeded
def mamba() -> Case:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                         expand=2, conv_kernel=4, use_cache=False)
    return MambaForCausalLM(config), (_ids(),), {}


@_seeded
def distilbert() -> Case:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                              seq_classif_dropout=0.0, num_labels=3)
    mask = torch.ones(8, 8, dtype=torch.long)
    mask[::2, 5:] = 0
    return DistilBertForSequenceClassification(config), (_ids(),), {"attention_mask": mask}


@_seeded
def albert() -> Case:
    """ALBERT: one layer's weights shared by every layer of the encoder."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                          num_attention_heads=4, intermediate_size=64,
                          max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    return AlbertForMaskedLM(config), (_ids(),), {}


@_seeded
def bart() -> Case:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16,
                        dropout=0.0, attention_dropout=0.0, use_cache=False, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    return (BartForConditionalGeneration(config), (_ids(),),
            {"decoder_input_ids": _ids(length=6)})


@_seeded
def phi() -> Case:
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                       use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return PhiForCausalLM(config), (_ids(),), {}


@_seeded
def gemma() -> Case:
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(**_DECODER, head_dim=8)
    return GemmaForCausalLM(config), (_ids(),), {}


@_seeded
def falcon() -> Case:
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, use_cache=False, hidden_dropout=0.0,
                          attention_dropout=0.0)
    return FalconForCausalLM(config), (_ids(),), {}


@_seeded
def convnext() -> Case:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                            num_labels=5, drop_path_rate=0.0)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    return ConvNextForImageClassification(config), (images,), {}


@_seeded
def hf_resnet() -> Case:
    """transformers' ResNet: BatchNorm, so compared in eval mode (batch statistics differ
    by micro-batch in training)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=5)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    return ResNetForImageClassification(config), (images,), {}


@_seeded
def rwkv() -> Case:
    from transformers import RwkvConfig, RwkvForCausalLM

    config = RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        attention_hidden_size=32, intermediate_size=64, context_length=16,
                        use_cache=False)
    return RwkvForCausalLM(config), (_ids(),), {}


class CountingMoE(nn.Module):
    """Soft mixture of 4 experts that also returns how many samples each expert topped:
    top-1 counts by ``bincount`` (a data-dependent size) or by ``one_hot`` (an int64 ``(E,)``
    without a batch dimension, which micro-batches cannot join)."""

    def __init__(self, bincount: bool) -> None:
        super().__init__()
        self.bincount = bincount
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = self.router(x).softmax(-1)                                    # (B, E)
        mixed = sum(gate[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        top = gate.argmax(-1)
        counts = (torch.bincount(top, minlength=4) if self.bincount
                  else nn.functional.one_hot(top, 4).sum(0))                 # (E,) int64
        return self.head(mixed), counts


#: Models the partitioner refuses, with the error class and words its message must hold.
REFUSED: dict[str, tuple[Callable[[], Case], str, tuple[str, ...]]] = {
    "moe_bincount": (_seeded(lambda: (CountingMoE(True), (torch.randn(8, 8),), {})),
                     "PassError", ("bincount", "one_hot(x, n).sum(0)")),
    "moe_int_counts": (_seeded(lambda: (CountingMoE(False), (torch.randn(8, 8),), {})),
                       "OutputError", ("int64", "shape (4,)", "return it per sample")),
}


ZOO: dict[str, Callable[[], Case]] = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "whisper": whisper,
    "vit_36_12": vit_odd_patches, "swin": swin, "lstm_stack": lstm_stack, "gru_aux": gru_aux,
    "mamba": mamba, "distilbert": distilbert, "albert": albert, "bart": bart, "phi": phi,
    "gemma": gemma, "falcon": falcon, "convnext": convnext, "hf_resnet": hf_resnet,
    "rwkv": rwkv,
}
