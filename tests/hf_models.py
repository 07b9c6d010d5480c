"""Small decoders for the meta-device tests: transformers' Llama (grouped-query attention,
rotary), Mistral (sliding-window attention) and Mixtral (mixture of experts), each built
from a config with random weights (no download), and the project's own GPT; their
batches, loss and the whole model's bf16 training (what a partitioned run is compared
with)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH = 96, 8, 4


def config(family: str) -> Any:
    """A tiny config of ``family`` (``"llama"``, ``"mistral"``, ``"mixtral"``, ``"qwen2_moe"``,
    ``"gemma"``, ``"phi3"`` or ``"gpt2"``)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=None)
    if family == "qwen2_moe":  # shared expert beside the routed ones, biased q/k/v
        return transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48)
    if family == "gemma":  # tied embeddings, the embedding scaled by sqrt(hidden)
        return transformers.GemmaConfig(**{**common, "tie_word_embeddings": True},
                                        head_dim=16)
    if family == "phi3":  # fused q/k/v and gate/up products
        return transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2)
    if family == "gpt2":  # Conv1D layers, learned positions; no dropout, to compare
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, use_cache=False,
                                       bos_token_id=0, eos_token_id=0,
                                       attn_implementation="sdpa")
    raise ValueError(f"unknown family {family!r}")


def build(family: str) -> nn.Module:
    """The model of ``family`` with its own initialization (under any default device);
    ``"gpt"`` is the project's own nanoGPT-style decoder (``partitioner.cli.zoo``)."""
    if family == "gpt":
        from partitioner.cli.zoo import gpt

        return gpt(2, 64, 4, VOCAB, SEQ)
    import transformers

    classes = {"llama": transformers.LlamaForCausalLM,
               "mistral": transformers.MistralForCausalLM,
               "mixtral": transformers.MixtralForCausalLM,
               "qwen2_moe": transformers.Qwen2MoeForCausalLM,
               "gemma": transformers.GemmaForCausalLM,
               "phi3": transformers.Phi3ForCausalLM,
               "gpt2": transformers.GPT2LMHeadModel}
    return classes[family](config(family))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of token ids and next-token labels (fixed seed)."""
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return data


def loss_fn(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits (computed in fp32) against the labels."""
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def train_whole(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
                lr: float = 0.5) -> list[float]:
    """SGD steps of the whole model under bf16 autocast (fp32 weights); the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for ids, labels in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(ids)
        loss = loss_fn(output, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
