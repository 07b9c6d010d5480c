"""Sequence parallelism (passes/tensor_parallel/sequence_parallel.py and
runtime/tensor_parallel/sequence.py): TP=2 rank graphs of transformer blocks with their
replicated region on sequence shards train like the model, and keep fewer bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from thread_ranks import on_threads
from torch import nn
from tp_models import Block, TinyGPT

from partitioner.capture import capture
from partitioner.passes.shape_prop import propagate_shapes
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR
from partitioner.passes.tensor_parallel.sequence_parallel import sequence_parallel
from partitioner.passes.tensor_parallel.shard_graph import choose_shardings, shard_graph
from partitioner.runtime.tensor_parallel import collectives, sequence
from partitioner.runtime.tensor_parallel.collectives import ShapeCommunicator
from partitioner.runtime.tensor_parallel.sharding import unshard


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _graph(model: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, list[Any]]:
    if isinstance(model, Block):
        gm = fx.symbolic_trace(model)
        values: list[Any] = [x]
    else:  # transformers' Llama, as partition captures it (torch.export)
        captured = capture(model, (x,))
        gm, values = captured.graph_module, captured.placeholder_values((x,), {})
    propagate_shapes(gm, values)
    return gm, values


def _ranks(model: nn.Module, x: torch.Tensor, tp: int, sp: bool
           ) -> tuple[list[fx.GraphModule], dict[str, Any], list[Any]]:
    gm, values = _graph(model, x)
    shardings = choose_shardings(gm, tp, root=model).shardings
    ranks = [shard_graph(gm, shardings, r).graph_module for r in range(tp)]
    if sp:
        for rank in ranks:
            assert sequence_parallel(rank, gm, tp).modified
    return ranks, shardings, values


def _train(ranks: list[fx.GraphModule], values: list[Any]
           ) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's output after a backward of its sum, and the bytes autograd kept."""
    def one(r: int, member: Any) -> tuple[torch.Tensor, int]:
        setattr(ranks[r], COMM_ATTR, member)
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):  # activations, not the weights
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ranks[r](*values)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.sum().backward()
        return out, sum(kept.values())

    results = on_threads(len(ranks), one)
    return [out for out, _ in results], [kept for _, kept in results]


@pytest.mark.parametrize("kind", ["gpt_block", "llama", "gpt"])
def test_sequence_parallel_block_trains_like_the_model(kind: str) -> None:
    torch.manual_seed(0)
    model = {"gpt_block": lambda: Block(32, 4), "llama": _llama,
             "gpt": lambda: TinyGPT(n_layer=2, seq=8)}[kind]()
    x = torch.randn(2, 8, 32) if kind == "gpt_block" else torch.randint(0, 64, (2, 8))
    ranks, shardings, values = _ranks(model, x, 2, sp=True)
    outs, _ = _train(ranks, values)
    expected = model(x)
    expected = expected if isinstance(expected, torch.Tensor) else expected.logits
    expected.sum().backward()
    for out in outs:
        torch.testing.assert_close(out, expected)
    for name, param in model.named_parameters():
        parts = [rank.get_parameter(name).grad for rank in ranks]
        sharding = shardings.get(name)
        # fp32 sums in another order (each rank's tokens, then over ranks): 1e-4.
        if sharding is not None and sharding.is_split:
            torch.testing.assert_close(unshard(parts, sharding), param.grad, rtol=1e-4,
                                       atol=1e-4)
        else:  # norms and row biases: each rank's tokens' share, summed over ranks
            for part in parts:
                torch.testing.assert_close(part, param.grad, rtol=1e-4, atol=1e-4)


def test_sequence_parallel_keeps_fewer_activation_bytes_per_rank() -> None:
    torch.manual_seed(0)
    model = Block(64, 4)
    x = torch.randn(2, 32, 64)
    plain, _, values = _ranks(model, x, 2, sp=False)
    split, _, _ = _ranks(model, x, 2, sp=True)
    _, kept_plain = _train(plain, values)
    _, kept_sp = _train(split, values)
    # The second norm's input (whole on every rank under TP alone) is this rank's half of
    # the tokens. (The first norm reads the block's input, whole; the column-parallel
    # products keep their all-gathered input: Megatron re-gathers it in the backward
    # instead, which this runtime does not.)
    one = 2 * 32 * 64 * 4  # one (2, 32, 64) fp32 activation
    for a, b in zip(kept_plain, kept_sp):
        assert a - b >= 0.9 * one / 2, (a, b)


def test_gpt_runs_on_shards_from_the_embedding_to_the_head() -> None:
    """TinyGPT at TP=2: the position embedding ``(T, C)`` is sliced to the rank's positions
    (not the embedding's sum gathered back), and block 1's attention reads ``x.shape`` of a
    shard as the whole value's size (``whole_size``), without an all-gather; the only
    whole value gathered is the output (the head's logits)."""
    torch.manual_seed(0)
    ranks, _, _ = _ranks(TinyGPT(n_layer=2, seq=8), torch.randint(0, 64, (2, 8)), 2, sp=True)
    calls = [n for n in ranks[0].graph.nodes if n.op == "call_function"]
    names = [getattr(n.target, "__name__", str(n.target)) for n in calls]
    assert names.count("reduce_scatter_to_sp") == 5  # embedding, 2 x (attention, MLP)
    assert names.count("all_gather_from_sp") == 5  # every column-parallel entry
    assert names.count("gather_from_tp") == 1  # the head's logits (vocabulary-parallel)
    assert names.count("whole_size") == 2  # x.shape in each block's attention
    scatters = [n for n in calls if n.target is collectives.scatter_to_tp]
    assert [n.args[2] for n in scatters] == [0]  # the (T, C) position embedding, by rows


def test_whole_size_of_a_shard() -> None:
    x = torch.zeros(2, 4, 3)
    assert sequence.whole_size(x, 1, 2) == torch.Size([2, 8, 3])
    assert sequence.whole_size(x, 1, 2, 1) == 8 and sequence.whole_size(x, 1, 2, -1) == 3


def test_reduce_scatter_and_all_gather_are_counted_as_such() -> None:
    comm = ShapeCommunicator(rank=1, size=2)
    x = torch.randn(2, 8, 4, requires_grad=True)
    y = sequence.reduce_scatter_to_sp(x, comm, 1)
    z = sequence.all_gather_from_sp(y, comm, 1)
    z.sum().backward()
    assert y.shape == (2, 4, 4) and z.shape == (2, 8, 4)
    assert comm.counts["reduce_scatter", "forward"] == 1
    assert comm.counts["reduce_scatter", "backward"] == 1
    assert comm.counts["all_reduce", "forward"] == 0


def test_odd_sequence_length_keeps_the_all_reduce() -> None:
    model = Block(32, 4)
    x = torch.randn(2, 7, 32)
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, (x,))
    rank = shard_graph(gm, choose_shardings(gm, 2, root=model).shardings, 0).graph_module
    assert not sequence_parallel(rank, gm, 2).modified


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
def test_sequence_parallel_llama_keeps_its_norms_inputs_halved() -> None:
    """transformers' Llama, 2 layers: its 5 RMSNorms (2 a layer and the final one) each keep
    at least their input; under sequence parallelism each rank keeps half of it."""
    torch.manual_seed(0)
    model = _llama()
    x = torch.randint(0, 96, (2, 32))
    plain, _, values = _ranks(model, x, 2, sp=False)
    split, _, _ = _ranks(model, x, 2, sp=True)
    _, kept_plain = _train(plain, values)
    _, kept_sp = _train(split, values)
    one = 2 * 32 * 64 * 4  # one (2, 32, 64) fp32 activation
    for a, b in zip(kept_plain, kept_sp):
        assert a - b >= 0.9 * 5 * one / 2, (a, b)
