"""Published bf16 H100 training runs of Llama 3, and the planner's prediction of each.

Rows (sequence length 8192 throughout):

* torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (Llama 3.1 8B on 8 and 128
  H100s, FSDP only, local batch 2, selective activation checkpointing, eager and
  ``torch.compile``; tokens per second per GPU and peak memory) and
  ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (the bfloat16 "vanilla TP" rows:
  8B on 64 GPUs, FSDP 8 x TP 8, local batch 12; 70B on 256 GPUs, FSDP 32 x TP 8, local batch
  16, full activation checkpointing; both compiled). Their H100s are Grand Teton's 96 GB
  HBM2e parts at a 500 W power limit, not SXM5 at 700 W (the file says so).
* Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 4): 405B on 8,192
  H100s (tp 8, pp 16, dp 64) at 430 TFLOP/s per GPU and on 16,384 (dp 128) at 400, 16M
  tokens per step (2,048 sequences); 80 GB HBM3 at 700 W.

Each row is planned through the planner itself (``make_plan``'s path after the capture:
the Llama workload variants of ``partitioner.planning.llama_plan`` laid on the layer names a
``LlamaForCausalLM`` capture gives, then ``given_mesh_plan`` for the published mesh on the
``H100-SXM`` preset). Throughput is compared as tokens per second; the Llama 3 paper's TFLOP/s
are turned into tokens with torchtitan's count, ``6 (N - N_embedding) + 12 l h s`` FLOPs per
token (the paper does not give its own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from partitioner.cost.cost import LayerCost, Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.llama_model import LlamaModel, llama_variants
from partitioner.cost.transformer_model import LlamaShape, llama_workload
from partitioner.planning.llama_plan import first_fitting, recompute_modes
from partitioner.planning.planner import given_mesh_plan
from partitioner.plans.plan import Mesh, Plan

__all__ = ["Row", "ROWS", "SHAPES", "planned", "tokens_per_second", "flops_per_token",
           "captured_names", "captured_workload"]

SEQ = 8192
SHAPES = {
    "8B": LlamaShape(32, 4096, 32, 8, 14336, SEQ, 128256),
    "70B": LlamaShape(80, 8192, 64, 8, 28672, SEQ, 128256),
    "405B": LlamaShape(126, 16384, 128, 8, 53248, SEQ, 128256),
}
"""Llama 3 / 3.1 shapes (the models' published configs)."""


@dataclass(frozen=True)
class Row:
    """One published run.

    Attributes:
        name: a short label.
        source: where the figure is published.
        model: a key of :data:`SHAPES`.
        mesh: its data x pipeline x tensor mesh.
        batch: sequences per step (the global batch).
        checkpoint: the recomputation the run used, as ``make_plan``'s ``checkpoint=``:
            ``"selective"`` (torchtitan's per-op policy), ``"always"`` (every layer
            recomputed), or ``None`` (not published: the planner chooses).
        tokens: published tokens per second per GPU (``None`` when given as TFLOP/s).
        tflops: published TFLOP/s per GPU (``None`` when given as tokens).
        memory_gib: published peak memory per GPU (``None``: not published).
        device: the preset of the run's GPUs (``partitioner.cost.devices.DEVICES``).
        fused: whether the element-wise steps ran fused (``torch.compile``) or eagerly.
    """

    name: str
    source: str
    model: str
    mesh: Mesh
    batch: int
    checkpoint: str | None
    tokens: float | None = None
    tflops: float | None = None
    memory_gib: float | None = None
    device: str = "H100-SXM"
    fused: bool = True

    @property
    def gpus(self) -> int:
        """Devices of the mesh."""
        return self.mesh.dp * self.mesh.pp * self.mesh.tp

    @property
    def published_tokens(self) -> float:
        """Published tokens per second per GPU (converted from TFLOP/s when need be)."""
        if self.tokens is not None:
            return self.tokens
        assert self.tflops is not None
        return self.tflops * 1e12 / flops_per_token(SHAPES[self.model])


_TITAN = "torchtitan llama3_h100_202412"
_ASYNC = "torchtitan asyncTP_llama3_h100_2025-06 (vanilla TP, bf16)"
_PAPER = "Llama 3 paper, Table 4"
_TETON = "H100-HBM2e-500W"
ROWS = (
    Row("8B FSDP8 eager", _TITAN, "8B", Mesh(dp=8), 16, "selective", 5762, memory_gib=82.4,
        device=_TETON, fused=False),
    Row("8B FSDP8 compile", _TITAN, "8B", Mesh(dp=8), 16, "selective", 6667, memory_gib=77.0,
        device=_TETON),
    Row("8B FSDP128 eager", _TITAN, "8B", Mesh(dp=128), 256, "selective", 5605, memory_gib=67.0,
        device=_TETON, fused=False),
    Row("8B FSDP128 compile", _TITAN, "8B", Mesh(dp=128), 256, "selective", 6514, memory_gib=62.0,
        device=_TETON),
    Row("8B FSDP8 TP8", _ASYNC, "8B", Mesh(dp=8, tp=8), 96, "selective", 4378, device=_TETON),
    Row("70B FSDP32 TP8", _ASYNC, "70B", Mesh(dp=32, tp=8), 512, "always", 597.3,
        device=_TETON),
    Row("405B 8,192 GPUs", _PAPER, "405B", Mesh(dp=64, pp=16, tp=8), 2048, None,
        tflops=430),
    Row("405B 16,384 GPUs", _PAPER, "405B", Mesh(dp=128, pp=16, tp=8), 2048, None,
        tflops=400),
)


def flops_per_token(shape: LlamaShape) -> float:
    """torchtitan's count: ``6 (N - N_embedding) + 12 l h s`` (the head counts, the
    embedding lookup does not)."""
    return 6 * (shape.parameters - shape.vocab * shape.hidden) \
        + 12 * shape.layers * shape.hidden * shape.seq


def captured_names(shape: LlamaShape) -> list[str]:
    """The layers a capture of ``LlamaForCausalLM`` gives (``partitioner.analysis``)."""
    return ["model.embed_tokens", "model.rotary_emb",
            *(f"model.layers.{k}" for k in range(shape.layers)), "model.norm", "lm_head"]


def captured_workload(shape: LlamaShape, batch: int) -> Workload:
    """A stand-in for the captured workload at bf16: the layers' names, the rotary
    embedding free, the Llama costs otherwise (``llama_variants`` replaces them)."""
    plain = llama_workload(shape, batch, element_bytes=2)
    embedding, *blocks, head = plain.layers
    layers = (replace(embedding, name="model.embed_tokens"), LayerCost("model.rotary_emb"),
              *(replace(b, name=f"model.layers.{k}") for k, b in enumerate(blocks)),
              LayerCost("model.norm"), replace(head, name="lm_head"))
    hidden = plain.boundaries[1]
    return Workload(layers, (0.0, *([hidden] * (len(layers) - 1)), 0.0), batch, "bf16", 2,
                    True, "LlamaForCausalLM")


def planned(row: Row, cluster: Cluster | None = None, reserve: float = 0.0) -> Plan:
    """The plan of ``row``'s mesh, as ``make_plan`` makes it once the model is captured."""
    shape = SHAPES[row.model]
    nodes = max(1, row.gpus // 8)
    cluster = cluster or Cluster.preset(row.device, nodes=nodes)
    names = captured_names(shape)
    captured = captured_workload(shape, row.batch)
    variants = llama_variants(LlamaModel(shape, "flash"), names, captured, tp=row.mesh.tp,
                              recompute=recompute_modes(row.checkpoint), fused=row.fused)
    return first_fitting([(w, "never") for w in variants],
                         lambda w, ckpt: given_mesh_plan(w, names, cluster, row.mesh,
                                                         checkpoint=ckpt, reserve=reserve))


def tokens_per_second(plan: Plan, row: Row) -> float:
    """Predicted tokens per second per GPU."""
    assert plan.predicted_step_time is not None
    return row.batch * SEQ / plan.predicted_step_time / row.gpus
