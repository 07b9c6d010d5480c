"""transformers' ``LlamaForCausalLM`` costed by its shape, laid on the captured layers.

A graph captured on the meta device gives every product's FLOPs, but not how the model is
trained at scale: a fused causal attention that keeps no ``(a, s, s)`` scores, sequence
parallelism, per-layer recomputation, FSDP. :func:`recognise_llama` recognises a Llama
model from its config and the example batch (:class:`LlamaModel`); :func:`llama_variants`
returns the workloads of ``partitioner.cost.transformer_model.llama_workload`` with the
captured layers' names, one per recomputation mode the planner may try, each costed as such
runs are:

* attention as the kernel the model's ``attn_implementation`` picks on a GPU (``"sdpa"``,
  transformers' default, runs FlashAttention-2 for bf16 causal attention; ``"eager"`` keeps
  the probabilities);
* Megatron's sequence parallelism wherever tensor parallelism splits the layers;
* parameters, gradients and optimizer state sharded over the data-parallel replicas (FSDP,
  as torchtitan trains Llama; ``Workload.fsdp``);
* no recomputation, or each decoder layer's forward replayed in its backward (``"full"``).

Layers the shape does not describe (``model.rotary_emb``) keep their captured costs.

Example:
    >>> import torch, transformers
    >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176,
    ...     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    ...     vocab_size=96)
    >>> with torch.device("meta"):
    ...     model = transformers.LlamaForCausalLM(config)
    >>> found = recognise_llama(model, [torch.zeros(4, 16, dtype=torch.long)])
    >>> found.shape.layers, found.shape.kv_heads, found.shape.seq
    (2, 2, 16)
    >>> found.attention
    'flash'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from partitioner.cost.cost import LayerCost, Workload
from partitioner.cost.transformer_model import LlamaRun, LlamaShape, llama_workload

__all__ = ["LlamaModel", "recognise_llama", "llama_variants", "llama_layers"]

_BLOCK = re.compile(r"model\.layers\.(\d+)$")


@dataclass(frozen=True)
class LlamaModel:
    """A recognised Llama model.

    Attributes:
        shape: its shape for the example batch's sequence length.
        attention: ``"flash"`` (transformers' ``"sdpa"`` and the fused kernels) or
            ``"eager"`` (``partitioner.cost.transformer_model.ATTENTIONS``).
    """

    shape: LlamaShape
    attention: str


def recognise_llama(model: nn.Module, inputs: Sequence[Any] | None) -> LlamaModel | None:
    """A transformers Llama model's shape for the example batch, else ``None``.

    Recognised: a ``LlamaForCausalLM`` (config ``model_type == "llama"``) without biases,
    whose head dimension is ``hidden / heads``, called with token ids ``(batch, seq)``.
    """
    config: Any = getattr(model, "config", None)
    if type(model).__name__ != "LlamaForCausalLM" or config is None or \
            getattr(config, "model_type", None) != "llama":
        return None
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return None
    ids = next((x for x in inputs or () if isinstance(x, torch.Tensor)), None)
    if ids is None or ids.dim() != 2:
        return None
    h, heads = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    if head_dim * heads != h:
        return None
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    shape = LlamaShape(int(config.num_hidden_layers), h, heads, kv,
                       int(config.intermediate_size), int(ids.shape[1]),
                       int(config.vocab_size), bool(getattr(config, "tie_word_embeddings",
                                                            False)))
    eager = getattr(config, "_attn_implementation", None) == "eager"
    return LlamaModel(shape, "eager" if eager else "flash")


def llama_layers(names: Sequence[str], shape: LlamaShape, shaped: Workload,
                 captured: Workload) -> tuple[LayerCost, ...] | None:
    """``shaped``'s layers (``llama_workload``'s embedding, blocks, head) under the captured
    layers' ``names``; layers it does not describe keep ``captured``'s cost. ``None`` when
    the names are not a Llama model's (embedding, each decoder layer once, norm, head)."""
    embedding, *blocks, head = shaped.layers
    norm_op, *head_ops = head.ops
    e = shaped.param_bytes_per_element
    norm = LayerCost("model.norm", (norm_op,), e * shape.hidden, 0,
                     head.activation_bytes - 4 * shape.seq * shape.vocab,
                     0.0, head.split_activation_bytes - 4 * shape.seq * shape.vocab,
                     head.output_bytes, 0, head.signature + "-norm")
    lm_head = LayerCost("lm_head", tuple(head_ops), head.param_bytes - norm.param_bytes, 0,
                        4.0 * shape.seq * shape.vocab, head.split_param_bytes,
                        4.0 * shape.seq * shape.vocab, head.output_bytes, 1,
                        head.signature + "-lm")
    known = {"model.embed_tokens": embedding, "model.norm": norm, "lm_head": lm_head}
    out, seen = [], set()
    for name, own in zip(names, captured.layers):
        match = _BLOCK.match(name)
        if match and int(match.group(1)) < shape.layers:
            cost = blocks[int(match.group(1))]
        elif name in known:
            cost = known[name]
        else:
            out.append(own)
            continue
        seen.add(name)
        out.append(replace(cost, name=name))
    return tuple(out) if len(seen) == shape.layers + 3 else None


def llama_variants(model: LlamaModel, names: Sequence[str], captured: Workload, *,
                   tp: int, recompute: Sequence[str], fused: bool = True) -> list[Workload]:
    """The Llama workloads of ``captured`` (already at the run's precision), one per mode
    of ``recompute``, in order; empty when the layers are not a Llama model's.

    Args:
        model: :func:`recognise_llama`'s.
        names: the captured layers' names, as ``captured.layers``.
        captured: the workload costed from the graph.
        tp: the tensor-parallel degree whose split of the k and v projections is costed.
        recompute: modes of ``partitioner.cost.transformer_model.RECOMPUTES``.
        fused: the element-wise steps fused (``torch.compile``), or eager PyTorch's
            kernels (``LlamaRun.fused``).
    """
    shape, attention = model.shape, model.attention
    low = captured.dtype in ("bf16", "fp16")
    e = 2 if low else 4
    tp = tp if shape.heads % tp == 0 else 1
    found = []
    for mode in recompute:
        run = LlamaRun(sequence_parallel=True, attention=attention, recompute=mode,
                       fused=fused)
        shaped = llama_workload(shape, captured.batch, tp, e, mixed_precision=low, run=run,
                                fsdp=True)
        layers = llama_layers(names, shape, shaped, captured)
        if layers is None:
            return []
        note = (f"costed as Llama ({run.label()}, FSDP over the replicas): "
                f"{shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}")
        found.append(replace(captured, layers=layers, param_bytes_per_element=e,
                             mixed_precision=low, fsdp=True, splits=_splits(captured),
                             notes=(*captured.notes, note)))
    return found


def _splits(captured: Workload) -> tuple[int, ...] | None:
    """The captured splits of the batch, or ``None`` (any) when the capture held for every
    split it was checked for: the analysis checks at most 256 pieces, which would cap
    ``dp x chunks`` at 256 on clusters of thousands of devices."""
    splits = captured.splits
    if splits is None or splits == tuple(range(1, len(splits) + 1)):
        return None
    return splits
