"""The cost model against published bf16 training runs on H100 (Megatron-Core, GPT models).

For each row of ``data/h100_reference.csv`` (NVIDIA/Megatron-LM's README: the weak-scaling
table of GPT models from 1.7B to 462B parameters on up to 6,144 H100-SXM, and the two end
points of its GPT-3 175B strong-scaling run): the published shape, batch, tensor and pipeline
sizes on 8 H100-SXM per node (NVLink 4, one 400 Gb/s NIC per GPU), predicted by the analytic
model and by the event simulation, and the throughput per GPU (Megatron-Core's model-FLOP
count over the step time) compared with the published figure.

What the README does not publish is fixed here, the same for every row (the first choices
run, kept as they were): micro-batch 1, interleaved 1F1B with the smallest virtual pipeline
size above 1 that divides the layers per stage (the rule of ``test_megatron_reference``),
plain 1F1B for one stage, no activation recomputation, a fused Adam, the stage-to-stage
sends overlapped with compute (the README says so). The README's runs pass
``--overlap-grad-reduce --overlap-param-gather``, which Megatron-LM accepts only with its
distributed optimizer (``megatron/training/arguments.py`` asserts it): the optimizer state
and fp32 master weights sharded over the data-parallel replicas, the gradients
reduce-scattered during the backward and the weights all-gathered during the next forward
(``Config(optimizer_sharding=True, overlap_param_gather=True)``).

Megatron-Core runs attention as one fused kernel (Transformer Engine's flash attention);
``gpt_workload`` is the 2021 layer that writes the ``a s^2`` attention scores out to memory
several times. :func:`fused_attention_workload` replaces those ops by one fused product (see
its docstring); the unfused layer is reported alongside in ``benchmarks/h100_reference.py``.
Rows that miss 15% are strict expected failures, each with its reason; nothing in
``partitioner/cost/devices.py`` was changed for them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from partitioner.cost.cost import Op, Workload
from partitioner.cost.devices import Cluster
from partitioner.cost.transformer_model import GPTShape, gpt_workload, megatron_boundaries
from partitioner.planning.predict import Config, Prediction, predict
from partitioner.planning.simulate import simulate

TABLE = Path(__file__).parent / "data" / "h100_reference.csv"
SEQ, VOCAB, PEAK = 4096, 131072, 989e12


@dataclass(frozen=True)
class H100Row:
    """One published run: its shape, parallel sizes, batch and throughput per GPU."""

    name: str
    source: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    mfu: float
    params: float

    @property
    def shape(self) -> GPTShape:
        return GPTShape(self.layers, self.hidden, self.heads, SEQ, VOCAB)

    @property
    def cluster(self) -> Cluster:
        return Cluster.preset("H100-SXM", nodes=self.gpus // 8, devices_per_node=8)

    def config(self) -> Config:
        dp = self.gpus // (self.tp * self.pp)
        per_stage = self.layers // self.pp
        chunks = [v for v in range(2, per_stage + 1) if per_stage % v == 0]
        virtual = chunks[0] if self.pp > 1 and chunks else 1
        schedule = "interleaved" if virtual > 1 else "1f1b"
        return Config(dp, self.tp, self.pp, self.batch // dp, schedule, virtual, "never",
                      "fused_adam", overlap_grad_reduce=True, overlap_p2p=True,
                      optimizer_sharding=True, overlap_param_gather=True)

    def tflops_of(self, step_time: float) -> float:
        return model_flops(self.shape, self.batch) / step_time / self.gpus / 1e12


def model_flops(shape: GPTShape, batch: int) -> float:
    """Megatron-Core's ``num_floating_point_operations`` for a GPT model (no recomputation).

    ``72 B s l h^2 (1 + s / (6 h) + V / (12 l h))``: three times the forward's products, the
    attention counted without the causal mask.
    """
    n, h, s = shape.layers, shape.hidden, shape.seq
    return 72 * batch * s * n * h * h * (1 + s / (6 * h) + shape.vocab / (12 * n * h))


def fused_attention_workload(shape: GPTShape, batch: int) -> Workload:
    """``gpt_workload`` with attention as one fused kernel and sequence parallelism.

    The scores product, the softmax, the attention dropout, ``probs V`` and the context copy
    (which move ``a s^2`` values through memory) become one product reading Q, K, V and
    writing the context (``4 e s h`` bytes). Its FLOPs are what a causal flash-attention
    kernel executes: half of the ``4 s^2 h`` forward (the mask skips the upper triangle) and a
    backward of 2.5 times that (it recomputes the scores), ``7 s^2 h`` in all; the cost model
    charges a product's backward twice its forward, so the forward is set to ``7/3 s^2 h``.
    It runs at the device's matrix-product efficiency (an assumption: attention kernels
    reach less of the peak than the best GEMM shapes). Activations kept per layer are
    ``34 s h`` bytes, all divided by ``tp`` (Korthikanti et al. 2022, sequence parallelism
    with the scores not stored).
    """
    s, h, e = shape.seq, shape.hidden, 2
    workload = gpt_workload(shape, batch)
    attention = Op("matmul", 7 / 3 * s * s * h, e * 4 * s * h, split=True)
    layers = tuple(
        replace(layer, ops=(*layer.ops[:2], attention, *layer.ops[7:]),
                activation_bytes=34 * s * h, split_activation_bytes=34 * s * h,
                signature=layer.signature + "-fused-attention")
        if layer.name.startswith("block.") else layer
        for layer in workload.layers)
    return replace(workload, layers=layers, name=workload.name + " (fused attention)")


def predicted(row: H100Row, fused: bool = True) -> tuple[Prediction, float, float]:
    """The row's prediction and its analytic and simulated TFLOP/s per GPU."""
    workload = (fused_attention_workload if fused else gpt_workload)(row.shape, row.batch)
    config = row.config()
    prediction = predict(workload, row.cluster, config,
                         megatron_boundaries(row.shape, config.stages))
    simulated = simulate(prediction, row.cluster)
    return prediction, row.tflops_of(prediction.step_time), row.tflops_of(simulated.step_time)


def _rows() -> list[H100Row]:
    lines = [line for line in TABLE.read_text().splitlines() if not line.startswith("#")]
    return [H100Row(r["name"], r["source"], int(r["attention_heads"]), int(r["hidden_size"]),
                    int(r["layers"]), int(r["tensor_parallel"]), int(r["pipeline_parallel"]),
                    int(r["gpus"]), int(r["batch_size"]), float(r["tflops_per_gpu"]),
                    float(r["mfu_percent"]), float(r["published_params_billion"]))
            for r in csv.DictReader(lines)]


ROWS = _rows()
IDS = [r.name for r in ROWS]

# Rows the fused-attention model misses by more than 15%, and why (docs/benchmarks.md).
MISSES = {
    "1.7B": "predicted +52%: attention (a third of the FLOPs at h=2048) costed at the best "
            "GEMM efficiency, and small GEMMs costed near it",
    "7.1B": "predicted +29%: as 1.7B, attention is a sixth of the FLOPs at h=4096",
    "32B": "predicted -18%: the TP all-reduces (t=8, h=7168) are charged in full; "
           "Megatron-Core overlaps them with the GEMMs (--tp-comm-overlap)",
}
EVERY = [pytest.param(r, id=r.name, marks=pytest.mark.xfail(strict=True, reason=MISSES[r.name])
                      if r.name in MISSES else ()) for r in ROWS]


def test_the_table_is_read() -> None:
    assert len(ROWS) == 11 and ROWS[-1].gpus == 4608 and ROWS[0].tflops == 408.8
    assert {r.source for r in ROWS} == {"weak", "strong"}


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_shapes_give_the_published_sizes(row: H100Row) -> None:
    # The README's sizes count an untied output layer: the paper's formula plus V h.
    untied = row.shape.parameters + VOCAB * row.hidden
    assert untied / 1e9 == pytest.approx(row.params, rel=0.035)  # 1.754 ~ "1.7"


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_published_tflops_are_the_published_mfu(row: H100Row) -> None:
    assert row.tflops / (PEAK / 1e12) == pytest.approx(row.mfu / 100, abs=0.006)


def test_fused_attention_costs_what_the_kernel_executes() -> None:
    shape = GPTShape(2, 1024, 8, 4096, 1000)
    s, h = shape.seq, shape.hidden
    block = fused_attention_workload(shape, 4).layers[1]
    assert block.forward_flops == pytest.approx(24 * s * h * h + 7 / 3 * s * s * h)
    assert [op.kind for op in block.ops].count("matmul") == 5
    assert block.activations_on(8) == pytest.approx(34 * s * h / 8)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_every_published_run_fits_the_80_gb_it_ran_on(row: H100Row) -> None:
    prediction, _, _ = predicted(row)
    assert prediction.fits and max(m.total for m in prediction.memory) <= 80 * 2**30
    assert max(simulate(prediction, row.cluster).peak_memory) <= 80 * 2**30


def test_without_the_distributed_optimizer_the_largest_runs_would_not_fit() -> None:
    row = next(r for r in ROWS if r.name == "462B")
    plain = replace(row.config(), optimizer_sharding=False, overlap_param_gather=False)
    prediction = predict(fused_attention_workload(row.shape, row.batch), row.cluster, plain,
                         megatron_boundaries(row.shape, plain.stages))
    assert not prediction.fits


@pytest.mark.parametrize("row", EVERY)
def test_predicted_throughput_is_within_15_percent_of_the_published(row: H100Row) -> None:
    _, analytic, simulated = predicted(row)
    assert analytic == pytest.approx(row.tflops, rel=0.15)
    assert simulated == pytest.approx(row.tflops, rel=0.15)
