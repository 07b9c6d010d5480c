"""Tests of partitioner/cost/transformer_model.py: GPT and Llama costs from the model's
shape."""

from __future__ import annotations

import doctest
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import partitioner.cost.transformer_model
from partitioner import PartitionError
from partitioner.cost.cost import CostModelError, phase_times
from partitioner.cost.devices import DEVICES
from partitioner.cost.transformer_model import (
    GPTShape,
    LlamaRun,
    LlamaShape,
    LlamaTPComm,
    gpt_workload,
    llama_workload,
    megatron_boundaries,
)


def test_shape_validation() -> None:
    with pytest.raises(CostModelError, match="heads=5 does not divide hidden=64"):
        GPTShape(2, 64, 5, 16, 100)
    with pytest.raises(CostModelError, match="layers=0"):
        GPTShape(0, 64, 4, 16, 100)


def test_block_costs_are_the_papers() -> None:
    s, h, a = 512, 1024, 16
    block = gpt_workload(GPTShape(4, h, a, s, 1000), batch=8).layers[1]
    assert block.forward_flops == 24 * s * h * h + 4 * s * s * h
    assert block.param_bytes == 2 * (12 * h * h + 13 * h)
    assert block.activation_bytes == s * h * (34 + 5 * a * s / h)  # Korthikanti et al.
    assert block.activations_on(8) == s * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert block.tp_all_reduces == 2 and block.splittable


def test_workload_layout() -> None:
    w = gpt_workload(GPTShape(3, 64, 4, 16, 100), batch=4)
    assert [layer.name for layer in w.layers] == ["embedding", "block.0", "block.1",
                                                  "block.2", "head"]
    assert w.boundaries == (0.0, 2048.0, 2048.0, 2048.0, 2048.0, 0.0)
    assert w.dtype == "bf16" and w.mixed_precision and w.batch == 4
    assert len({layer.signature for layer in w.layers}) == 3


def test_megatron_split_is_equal_layers_per_stage() -> None:
    shape = GPTShape(8, 64, 4, 16, 100)
    assert megatron_boundaries(shape, 4) == (0, 3, 5, 7, 10)
    with pytest.raises(CostModelError, match="8 layers do not split evenly into 3"):
        megatron_boundaries(shape, 3)


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.transformer_model).failed == 0


def _llama(shape: LlamaShape, attention: str = "sdpa") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=shape.seq, use_cache=False,
                         tie_word_embeddings=shape.tied, attn_implementation=attention)
    return LlamaForCausalLM(config)


LLAMAS = [LlamaShape(2, 64, 4, 2, 176, 16, 96), LlamaShape(2, 64, 8, 1, 176, 16, 96, tied=True),
          LlamaShape(3, 128, 8, 8, 344, 32, 100), LlamaShape(1, 96, 6, 3, 256, 8, 50, tied=True)]


@pytest.mark.parametrize("shape", LLAMAS, ids=str)
def test_llama_parameters_are_the_models(shape: LlamaShape) -> None:
    model = _llama(shape)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert shape.layer_parameters == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("shape", LLAMAS[:2], ids=str)
def test_llama_flops_are_the_models(shape: LlamaShape) -> None:
    model = _llama(shape, "eager")  # the flop counter sees eager attention's products
    ids = torch.randint(0, shape.vocab, (2, shape.seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    assert counter.get_total_flops() == shape.forward_flops(batch=2)
    workload = llama_workload(shape, batch=2)
    assert sum(layer.forward_flops for layer in workload.layers) == shape.forward_flops()


def test_llama_kv_projections_split_only_when_tp_divides_the_kv_heads() -> None:
    shape = LlamaShape(2, 64, 8, 2, 176, 16, 96)  # d = 8, g = 16
    h, g, i = 64, 16, 176
    norms_and_kv = 2 * h + 2 * h * g
    assert shape.layer_parameters_on(2) == (2 * h * h + 3 * h * i + 2 * h * g) / 2 + 2 * h
    assert shape.layer_parameters_on(4) == (2 * h * h + 3 * h * i) / 4 + norms_and_kv
    split, whole = llama_workload(shape, 8, tp=2), llama_workload(shape, 8, tp=4)
    assert split.layers[1].params_on(2) == 2 * shape.layer_parameters_on(2)
    assert whole.layers[1].params_on(4) == 2 * shape.layer_parameters_on(4)
    assert split.layers[1].signature != whole.layers[1].signature
    hidden = 2 * 16 * 64
    assert shape.tp_comm(2) == LlamaTPComm(2 * hidden, 2 * hidden, 0.0)
    assert shape.tp_comm(4) == LlamaTPComm(2 * hidden, 2 * hidden, 2 * hidden)
    assert shape.tp_comm(1) == LlamaTPComm(0.0, 0.0, 0.0)


def test_llama_degree_dividing_no_heads_is_refused() -> None:
    shape = LlamaShape(2, 96, 6, 2, 176, 16, 96)
    with pytest.raises(CostModelError, match=r"tensor_parallel=4 divides neither heads=6 nor "
                       r"kv_heads=2; use a degree dividing 6 \(1, 2, 3, 6\)") as info:
        llama_workload(shape, 8, tp=4)
    assert isinstance(info.value, PartitionError) and isinstance(info.value, ValueError)
    with pytest.raises(CostModelError, match="kv_heads=3 does not divide heads=4"):
        LlamaShape(2, 64, 4, 3, 176, 16, 96)
    with pytest.raises(CostModelError, match="intermediate=0"):
        LlamaShape(2, 64, 4, 2, 0, 16, 96)


LLAMA3_8B = LlamaShape(32, 4096, 32, 8, 14336, 8192, 128256)


def test_sequence_parallelism_divides_every_activation_by_tp() -> None:
    """Megatron's sequence parallelism: the norms' and residual adds' activations, whole
    under plain tensor parallelism (4 e s h per layer), are split by sequence too; the
    collectives keep their bytes (reduce-scatter + all-gather = all-reduce on a ring)."""
    e, s, h = 2, LLAMA3_8B.seq, LLAMA3_8B.hidden
    plain = llama_workload(LLAMA3_8B, 1, tp=8, run=LlamaRun(attention="flash"))
    sp = llama_workload(LLAMA3_8B, 1, tp=8, run=LlamaRun(True, "flash"))
    block, sp_block = plain.layers[1], sp.layers[1]
    assert block.activation_bytes == sp_block.activation_bytes
    assert block.activations_on(8) - sp_block.activations_on(8) == pytest.approx(
        4 * e * s * h * (1 - 1 / 8))
    assert sp_block.activations_on(8) == pytest.approx(sp_block.activation_bytes / 8)
    assert sp.layers[-1].activations_on(8) == pytest.approx(sp.layers[-1].activation_bytes / 8)
    assert (sp_block.tp_all_reduces, sp_block.output_bytes) == (2, block.output_bytes)
    norms = [op for op in sp_block.ops if op.kind == "memory" and op.weight_read]
    assert len(norms) == 2 and all(op.split for op in norms)
    assert not any(op.split for op in block.ops if op.kind == "memory" and op.weight_read)


def test_flash_attention_keeps_no_scores_and_skips_the_causal_half() -> None:
    s, h, a = LLAMA3_8B.seq, LLAMA3_8B.hidden, LLAMA3_8B.heads
    eager = llama_workload(LLAMA3_8B, 1).layers[1]
    flash = llama_workload(LLAMA3_8B, 1, run=LlamaRun(attention="flash")).layers[1]
    assert eager.activation_bytes - flash.activation_bytes == 2 * a * s * s
    assert eager.forward_flops - flash.forward_flops == pytest.approx(2 * s * s * h)


def test_full_recomputation_keeps_each_layers_input_and_replays_its_forward() -> None:
    e, s, h = 2, LLAMA3_8B.seq, LLAMA3_8B.hidden
    run = LlamaRun(True, "flash", "full")
    block = llama_workload(LLAMA3_8B, 1, tp=8, run=run).layers[1]
    assert block.activation_bytes == e * s * h and block.activations_on(8) == e * s * h / 8
    assert all(op.replay == 1.0 for op in block.ops) and block.time_scale == 1.0
    assert block.replayed_all_reduces == block.tp_all_reduces == 2
    kept = llama_workload(LLAMA3_8B, 1, tp=8, run=LlamaRun(True, "flash")).layers[1]
    assert not any(op.replay for op in kept.ops) and kept.replayed_all_reduces == 0
    spec = DEVICES["H100-SXM"]
    forward, backward = phase_times(block, spec, 2, 8, "bf16")
    assert (forward, backward - forward) == pytest.approx(phase_times(kept, spec, 2, 8, "bf16"))
    assert run.label() == "sp, flash, full recompute"
    with pytest.raises(CostModelError, match=r"recompute='some' \(use one of"):
        LlamaRun(recompute="some")


def test_selective_recomputation_is_torchtitans_per_op_policy() -> None:
    """torchtitan's op policy keeps every odd mm of a layer (q, v, gate, down), the
    attention's and the reduce-scatters' outputs; replays k, o, up, every element-wise step
    and the all-gathers."""
    e, s, h, g, i = 2, LLAMA3_8B.seq, 4096, 1024, 14336
    run = LlamaRun(False, "flash", "selective")
    block = llama_workload(LLAMA3_8B, 1, run=run).layers[1]
    products = [op for op in block.ops if op.kind == "matmul"]  # q, kv, o, gate-up, down
    assert [op.replay for op in products] == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert all(op.replay == 1.0 for op in block.ops if op.kind == "memory")
    assert [op.replay for op in block.ops if op.kind == "attention"] == [0.0]
    replayed = sum(op.flops * op.replay for op in products)
    assert replayed == 2 * s * h * (g + h + i)  # k, o, up
    # Kept: the input, q, v, the attention's output, gate's and down's outputs.
    assert block.activation_bytes == e * s * (4 * h + g + i)
    assert block.replayed_all_reduces == 1.0  # the all-gathers, half of two all-reduces
    full = llama_workload(LLAMA3_8B, 1, run=LlamaRun(False, "flash", "full")).layers[1]
    none = llama_workload(LLAMA3_8B, 1, run=LlamaRun(False, "flash")).layers[1]
    assert full.activation_bytes < block.activation_bytes < none.activation_bytes
    spec = DEVICES["H100-SXM"]
    times = [phase_times(layer, spec, 2, 1, "bf16")[1] for layer in (none, block, full)]
    assert times[0] < times[1] < times[2]


def test_fsdp_divides_parameters_gradients_and_optimizer_state_by_dp() -> None:
    from partitioner.cost.devices import Cluster
    from partitioner.planning.predict import Config, predict

    cluster = Cluster.preset("H100-SXM")
    run = LlamaRun(False, "flash", "full")
    plain = llama_workload(LLAMA3_8B, 16, run=run)
    sharded = llama_workload(LLAMA3_8B, 16, run=run, fsdp=True)
    config = Config(dp=8, chunks=2)
    bounds = (0, len(plain.layers))
    mem = predict(plain, cluster, config, bounds).memory[0]
    fsdp = predict(sharded, cluster, config, bounds).memory[0]
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == pytest.approx(
        (mem.params / 8, mem.grads / 8, mem.optimizer / 8))
    assert fsdp.activations == mem.activations


def test_fsdp_s_first_layer_is_gathered_and_reduced_outside_any_window() -> None:
    """FSDP gathers a rank's first layer before its first forward and reduce-scatters that
    layer's gradients (fp32 where the parameters are bf16) after its last backward: both
    the analytic prediction and the simulation add them, whatever the overlap hides."""
    from dataclasses import replace

    from partitioner.cost.comm import fsdp_ends_time, fsdp_time
    from partitioner.cost.devices import Cluster
    from partitioner.planning.predict import Config, predict
    from partitioner.planning.simulate import predict_step

    cluster = Cluster.preset("H100-SXM", nodes=2)
    run = LlamaRun(True, "flash", "selective")
    sharded = llama_workload(LLAMA3_8B, 32, run=run, fsdp=True, mixed_precision=True)
    assert sharded.reduce_scale == 2.0 and sharded.param_bytes_per_element == 2
    config = Config(dp=16, chunks=1)
    bounds = (0, len(sharded.layers))
    p = predict(sharded, cluster, config, bounds)
    link = cluster.group_link(list(range(16)))
    ends = fsdp_ends_time(sharded.layers[0].param_bytes, 16, link, 2.0)
    assert p.stages[0].fsdp_ends == pytest.approx(ends) and ends > 0
    grads = p.stages[0].grad_bytes
    assert p.dp_times[0] == pytest.approx(fsdp_time(grads, 16, link, 2.0))
    assert fsdp_time(grads, 16, link, 2.0) > fsdp_time(grads, 16, link)  # fp32 reduced
    # The all-gathers and reduce-scatter hide behind the backward; the ends do not.
    window = p.stages[0].backward
    assert p.dp_times[0] < window
    assert p.step_time == pytest.approx(p.pipeline_time + ends + p.optimizer_times[0])
    hidden = replace(p, stages=tuple(replace(s, fsdp_ends=0.0) for s in p.stages))
    simulated, plain = predict_step(p, cluster), predict_step(hidden, cluster)
    assert simulated.step_time - plain.step_time == pytest.approx(ends, rel=1e-6)
