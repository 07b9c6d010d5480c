"""Real models from small configs with random weights, partitioned end to end.

Each model is pipelined on 2 and 4 stages with 1 and 4 micro-batches (outputs and gradients
equal the unpartitioned model's), planned with ``strategy="auto"``, its plan saved and applied
again (same plan, same outputs), and drawn. A quick subset runs by default; the rest is
marked slow (every model is captured by ``torch.export``, a few seconds each).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import grads_match
from torch import nn
from zoo_models import REFUSED, ZOO

import partitioner
from partitioner import partition

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _ids(batch: int = 8, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length))


def gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), (_ids(),), {}


def bert() -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                        intermediate_size=64, vocab_size=64, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    mask = torch.ones(8, 8, dtype=torch.long)
    mask[::2, 5:] = 0  # padded rows: the mask changes the result
    return BertForSequenceClassification(config), (_ids(),), {"attention_mask": mask}


def t5() -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, dropout_rate=0.0, use_cache=False,
                      decoder_start_token_id=0)
    return (T5ForConditionalGeneration(config), (_ids(),),
            {"decoder_input_ids": _ids(length=6)})


def llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, use_cache=False)
    return LlamaForCausalLM(config), (_ids(),), {}


def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                       num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config), (torch.randn(8, 3, 16, 16),), {}


def torch_transformer() -> Case:
    model = nn.Transformer(16, 2, 2, 2, 32, dropout=0.0, batch_first=True)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    return (model, (torch.randn(8, 6, 16), torch.randn(8, 5, 16)),
            {"tgt_mask": causal, "tgt_is_causal": True})


def torch_encoder() -> Case:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return (nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
            (torch.randn(8, 6, 16),), {})


def _torchvision(name: str) -> Callable[[], Case]:
    def make() -> Case:
        try:
            import torchvision
        except Exception as error:  # the index's wheel is built for CUDA torch
            pytest.skip(f"torchvision does not import beside this CPU torch: {error}")
        model = getattr(torchvision.models, name)(num_classes=5)
        return model, (torch.randn(8, 3, 32, 32),), {}
    return make


def _timm(name: str, **config: Any) -> Callable[[], Case]:
    def make() -> Case:
        try:
            import timm
        except ImportError as error:  # timm imports torchvision, which is not installed here
            pytest.skip(f"timm does not import: {error}")
        model = timm.create_model(name, pretrained=False, num_classes=5, **config)
        return model, (torch.randn(8, 3, 32, 32),), {}
    return make


MODELS: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "bert": bert, "t5": t5, "llama": llama, "vit": vit,
    "nn_transformer": torch_transformer, "nn_encoder": torch_encoder,
    "resnet18": _torchvision("resnet18"), "mobilenet_v3": _torchvision("mobilenet_v3_small"),
    "timm_vit": _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4),
    "timm_convnext": _timm("convnext_atto", depths=(1, 1, 1, 1)),
}
QUICK_PIPELINES = {("gpt2", 4, 4), ("nn_transformer", 2, 1), ("nn_encoder", 4, 4)}
QUICK_PLANS = {"bert"}
# The models with attention or MLP pairs, split over 2 tensor-parallel ranks.
TENSOR_PARALLEL = ("gpt2", "bert", "t5", "llama", "vit", "nn_transformer", "nn_encoder")
QUICK_TENSOR_PARALLEL = {"llama"}


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out[0]


def _pipeline_cases() -> list[Any]:
    return [pytest.param(name, stages, chunks, marks=() if (name, stages, chunks) in
                         QUICK_PIPELINES else pytest.mark.slow)
            for name in MODELS for stages in (2, 4) for chunks in (1, 4)]


@pytest.mark.parametrize(("name", "stages", "chunks"), _pipeline_cases())
def test_pipeline_matches_the_model(name: str, stages: int, chunks: int) -> None:
    model, args, kwargs = MODELS[name]()
    reference = copy.deepcopy(model)
    pm = partition(model, ["cpu"] * stages, "pipeline", example_inputs=args,
                   example_kwargs=kwargs, chunks=chunks)
    assert len(pm.plan.stages) == stages and pm.plan.chunks == chunks
    out, expected = _logits(pm(*args, **kwargs)), _logits(reference(*args, **kwargs))
    torch.testing.assert_close(out, expected)
    (out.float() ** 2).mean().backward()
    (expected.float() ** 2).mean().backward()
    grads_match(model, reference)
    pm.close()


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in QUICK_PLANS else pytest.mark.slow)
    for name in MODELS])
def test_auto_plan_round_trip_and_picture(name: str, tmp_path: Path) -> None:
    model, args, kwargs = MODELS[name]()
    model.eval()
    pm = partition(model, ["cpu"] * 2, "auto", example_inputs=args, example_kwargs=kwargs)
    path = tmp_path / "plan.json"
    pm.plan.save(path)
    again = partition(model, None, plan=path, example_inputs=args, example_kwargs=kwargs)
    assert again.plan == pm.plan
    bare = partition(model, None, plan=path)  # the plan's input signature: no inputs needed
    assert bare.plan == pm.plan
    with torch.no_grad():
        expected = _logits(model(*args, **kwargs))
        torch.testing.assert_close(_logits(pm(*args, **kwargs)), expected)
        torch.testing.assert_close(_logits(again(*args, **kwargs)), expected)
        torch.testing.assert_close(_logits(bare(*args, **kwargs)), expected)
    drawn = partitioner.visualize(pm, tmp_path / "x.dot")
    assert drawn.read_text().startswith("digraph")
    pm.close()
    again.close()
    bare.close()


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in QUICK_TENSOR_PARALLEL else pytest.mark.slow)
    for name in TENSOR_PARALLEL])
def test_tensor_parallel_matches_the_model(name: str) -> None:
    model, args, kwargs = MODELS[name]()
    reference = copy.deepcopy(model)
    tm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=args,
                   example_kwargs=kwargs)
    assert tm.plan.mesh is not None and tm.plan.mesh.tp == 2 and tm.plan.shard_specs
    out, expected = _logits(tm(*args, **kwargs)), _logits(reference(*args, **kwargs))
    torch.testing.assert_close(out, expected)
    (out.float() ** 2).mean().backward()
    (expected.float() ** 2).mean().backward()
    for key, param in reference.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(tm.full_tensor(key, grad=True), param.grad,
                                       msg=lambda m, k=key: f"{k}: {m}")
    tm.close()


# ---- More architectures (tests/zoo_models.py): MoE with aux losses, speech, odd patches,
# recurrent stacks, dict outputs, shared layers. Outputs with a batch dimension must equal
# the whole batch's; a leaf without one (a router's aux loss) is the samples-weighted mean
# of its value per micro-batch (or replica), as README "Outputs" documents, so the
# reference computes it that way, from the unpartitioned model run piece by piece.
# Each of the two transformers runs one of the two tests in the default tier.
QUICK_MORE = {"gru_aux", "lstm_stack"}
QUICK_PIPELINE_MORE = QUICK_MORE | {"vit_36_12"}
QUICK_AUTO_MORE = QUICK_MORE | {"albert"}
EVAL_ONLY = {"hf_resnet"}   # BatchNorm: micro-batches normalise with their own statistics


def _flat(out: Any) -> list[torch.Tensor]:
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    return [leaf for leaf in torch.utils._pytree.tree_leaves(out)
            if isinstance(leaf, torch.Tensor)]


def _split(args: tuple[Any, ...], kwargs: dict[str, Any], pieces: int
           ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    cut = lambda v: v.tensor_split(pieces) if isinstance(v, torch.Tensor) else [v] * pieces
    a = [cut(v) for v in args]
    k = {name: cut(v) for name, v in kwargs.items()}
    return [(tuple(v[i] for v in a), {name: v[i] for name, v in k.items()})
            for i in range(pieces)]


def _reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               pieces: int) -> list[torch.Tensor]:
    """The whole batch's outputs; leaves without a batch dimension averaged per piece."""
    whole = _flat(model(*args, **kwargs))
    batch = len(args[0])
    if all(leaf.dim() and leaf.shape[0] % batch == 0 for leaf in whole) or pieces == 1:
        return whole
    parts = [_flat(model(*a, **k)) for a, k in _split(args, kwargs, pieces)]
    return [leaf if leaf.dim() and leaf.shape[0] % batch == 0
            else torch.stack([p[n] for p in parts]).mean(0) for n, leaf in enumerate(whole)]


def _loss(leaves: list[torch.Tensor]) -> torch.Tensor:
    return sum((leaf.float() ** 2).mean() for leaf in leaves if leaf.is_floating_point())


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in QUICK_PIPELINE_MORE else pytest.mark.slow)
    for name in ZOO])
def test_more_architectures_pipeline_like_the_model(name: str) -> None:
    model, args, kwargs = ZOO[name]()
    if name in EVAL_ONLY:
        model.eval()
    reference = copy.deepcopy(model)
    pm = partition(model, ["cpu"] * 2, "pipeline", example_inputs=args, example_kwargs=kwargs,
                   chunks=2)
    assert len(pm.plan.stages) == 2
    out, expected = _flat(pm(*args, **kwargs)), _reference(reference, args, kwargs, 2)
    assert [o.shape for o in out] == [e.shape for e in expected]
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want)
    _loss(out).backward()
    _loss(expected).backward()
    grads_match(model, reference)
    pm.close()


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in QUICK_AUTO_MORE else pytest.mark.slow)
    for name in ZOO])
def test_more_architectures_run_auto_s_plan_like_the_model(name: str) -> None:
    model, args, kwargs = ZOO[name]()
    model.eval()
    pm = partition(model, ["cpu"] * 2, "auto", example_inputs=args, example_kwargs=kwargs)
    pieces = pm.plan.chunks * (pm.plan.mesh.dp if pm.plan.mesh is not None else 1)
    with torch.no_grad():
        expected = _reference(model, args, kwargs, pieces)
        out = _flat(pm(*args, **kwargs))
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want)
    pm.close()


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_be_split_is_refused_naming_the_reason_and_the_fix(name: str) -> None:
    """Never a silent wrong result: a data-dependent output size is refused at partition
    time, integer counts without a batch dimension at the first call."""
    build, kind, words = REFUSED[name]
    model, args, kwargs = build()
    with pytest.raises(partitioner.PartitionError) as info:
        pm = partition(model, ["cpu"] * 2, "pipeline", example_inputs=args,
                       example_kwargs=kwargs, chunks=2)
        pm(*args, **kwargs)
    assert type(info.value).__name__ == kind
    for word in words:
        assert word in str(info.value)
