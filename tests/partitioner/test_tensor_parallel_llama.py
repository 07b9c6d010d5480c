"""transformers' LlamaForCausalLM split by partition(..., tensor_parallel=tp) in one process:
grouped-query and multi-query attention, SwiGLU, RMSNorm, rotary embeddings, tied and
untied embeddings. Outputs, every gradient and three SGD steps equal the unsplit model's."""

from __future__ import annotations

import copy

import pytest
import torch
from models import grads_match
from torch import nn

from partitioner import PartitionError, partition
from partitioner.cost.transformer_model import LlamaShape
from partitioner.runtime.tensor_parallel.sharding import ShardSizeError


def llama(heads: int, kv_heads: int, tied: bool, hidden: int = 64,
          attention: str = "sdpa") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=32,
                         use_cache=False, tie_word_embeddings=tied,
                         attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def gathered_grads(pm: nn.Module, model: nn.Module) -> nn.Module:
    """A copy of ``model`` holding the split module's gradients, gathered whole."""
    whole = copy.deepcopy(model)
    for key, param in whole.named_parameters():
        param.grad = pm.full_tensor(key, grad=True)
    return whole


@pytest.mark.parametrize("heads, kv_heads, tp, tied, kv_kind, attention", [
    (4, 2, 2, False, "colwise", "sdpa"),    # GQA, KV heads split
    pytest.param(8, 4, 4, True, "colwise", "sdpa", marks=pytest.mark.slow),
    (8, 2, 4, False, "replicate", "sdpa"),  # GQA, KV projections whole, sliced per rank
    pytest.param(4, 1, 2, True, "replicate", "sdpa", marks=pytest.mark.slow),  # MQA
    pytest.param(8, 2, 4, False, "replicate", "eager",  # q @ k.T, softmax, @ v
                 marks=pytest.mark.slow),
], ids=["gqa-tp2", "gqa-tp4-tied", "gqa-whole-kv-tp4", "mqa-tp2-tied", "eager-whole-kv-tp4"])
def test_llama_trains_equal_to_the_unsplit_model(heads: int, kv_heads: int, tp: int,
                                                 tied: bool, kv_kind: str,
                                                 attention: str) -> None:
    model = llama(heads, kv_heads, tied, attention=attention)
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 96, (4, 8)), torch.randint(0, 96, (4, 8))
    pm = partition(model, ["cpu"] * tp, tensor_parallel=tp, example_inputs=(ids,))
    kinds = {name: spec.kind for name, spec in pm.plan.shard_specs.items()}
    layer = "model.layers.1."
    assert kinds[layer + "self_attn.q_proj.weight"] == "colwise"
    assert kinds.get(layer + "self_attn.k_proj.weight", "replicate") == kv_kind
    assert kinds.get(layer + "self_attn.v_proj.weight", "replicate") == kv_kind
    assert kinds[layer + "self_attn.o_proj.weight"] == "rowwise"
    assert kinds[layer + "mlp.gate_proj.weight"] == kinds[layer + "mlp.up_proj.weight"] \
        == "colwise"
    assert kinds[layer + "mlp.down_proj.weight"] == "rowwise"
    assert not any("norm" in name for name in kinds)
    # the analytic model holds what one rank holds (KV projections whole or split)
    shape = LlamaShape(2, 64, heads, kv_heads, 176, 8, 96, tied)
    on_rank = sum(pm.local_tensors(key)[0].numel() for key, _ in
                  reference.named_parameters() if key.startswith(layer))
    assert on_rank == shape.layer_parameters_on(tp)
    ours = torch.optim.SGD(pm.parameters(), lr=0.5)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        out, expected = pm(ids).logits, reference(ids).logits
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
        nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten()).backward()
        if step == 0:
            grads_match(gathered_grads(pm, model), reference)
        ours.step()
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    state, expected_state = pm.state_dict(), reference.state_dict()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, k=key: f"{k}: {m}")
    pm.close()


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_llama_with_a_degree_dividing_no_heads_is_refused_with_a_fix() -> None:
    model = llama(6, 2, tied=False, hidden=96)
    ids = torch.randint(0, 96, (2, 8))
    with pytest.raises(ShardSizeError, match=r"6 query heads and 2 KV heads.*"
                       r"tensor_parallel=4.*\(1, 2, 3, 6\)") as info:
        partition(model, ["cpu"] * 4, tensor_parallel=4, example_inputs=(ids,))
    assert isinstance(info.value, PartitionError) and isinstance(info.value, ValueError)
    # the fix the message gives: keep the attention whole, split the rest
    pm = partition(model, ["cpu"] * 4, tensor_parallel={"model.layers.*.self_attn.*": "replicate"},
                   example_inputs=(ids,))
    assert "model.layers.0.mlp.down_proj.weight" in pm.plan.shard_specs
    with torch.no_grad():
        torch.testing.assert_close(pm(ids).logits, model(ids).logits)
    pm.close()
