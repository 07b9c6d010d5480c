"""The cost model against Megatron-LM's published weak-scaling results (SC'21, Table 1).

For each row of ``data/megatron_table1_subset.csv`` (copied from ``shared/reference``): the
model's shape, 8 A100-80GB per node on NVLink, 8 x 200 Gb/s InfiniBand per node, the batch
and the published tensor/pipeline sizes, run as Megatron-LM ran them in 2021: interleaved
1F1B, full activation recomputation, blocking sends between stages, the data-parallel
all-reduce after the backward, fp16 with fp32 master weights and a fused Adam, equal transformer
layers per stage. The micro-batch size is not published per row; we use 1 (the most
micro-batches, so the smallest pipeline bubble and activation memory) and two model chunks
per device where the layers divide, else the smallest count that does (3 for the 530B
model's 3 layers per stage). Throughput is counted with the paper's formula,
``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` FLOPs per step.

Nothing in the cost model is fitted to these rows: device figures are datasheet and public
microbenchmark numbers (``partitioner/cost/devices.py``). ``HELD_OUT`` holds three more rows of the
same table that are not in the CSV; they are checked alike and were not used to set anything.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import pytest

from partitioner.cost.devices import Cluster
from partitioner.cost.transformer_model import (
    GPTShape,
    gpt_workload,
    megatron_boundaries,
    megatron_flops,
)
from partitioner.planning.auto import search
from partitioner.planning.predict import Config, predict
from partitioner.planning.simulate import simulate

TABLE = Path(__file__).parent / "data" / "megatron_table1_subset.csv"
SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class Row:
    params: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    @property
    def shape(self) -> GPTShape:
        return GPTShape(self.layers, self.hidden, self.heads, SEQ, VOCAB)

    @property
    def cluster(self) -> Cluster:
        return Cluster.preset("A100-80GB", nodes=self.gpus // 8, devices_per_node=8)

    def config(self) -> Config:
        dp = self.gpus // (self.tp * self.pp)
        per_stage = self.layers // self.pp
        chunks = [v for v in range(2, per_stage + 1) if per_stage % v == 0]
        virtual = chunks[0] if self.pp > 1 and chunks else 1
        schedule = "gpipe" if self.pp == 1 else "interleaved" if virtual > 1 else "1f1b"
        return Config(dp, self.tp, self.pp, self.batch // dp, schedule, virtual, "always",
                      "fused_adam", overlap_grad_reduce=False, overlap_p2p=False)

    def tflops_of(self, step_time: float) -> float:
        return megatron_flops(self.shape, self.batch) / step_time / self.gpus / 1e12


def _rows() -> list[Row]:
    lines = [line for line in TABLE.read_text().splitlines() if not line.startswith("#")]
    rows = []
    for record in csv.DictReader(lines):
        rows.append(Row(float(record["params_billion"]), int(record["attention_heads"]),
                        int(record["hidden_size"]), int(record["layers"]),
                        int(record["tensor_parallel"]), int(record["pipeline_parallel"]),
                        int(record["gpus"]), int(record["batch_size"]),
                        float(record["tflops_per_gpu"])))
    return rows


ROWS = _rows()
IDS = [f"{r.params:g}B" for r in ROWS]

# More rows of the same Table 1 (shape, t, p, GPUs, batch, TFLOP/s per GPU; the shapes give
# the paper's parameter counts, a test below), kept out of the CSV and out of every choice of
# device figures. The 76.1B row is predicted 15.1% above the published figure (the model is
# optimistic by about 10% on most rows; see docs/design/003-cost-model.md): a known miss,
# recorded as such rather than tuned away.
HELD_OUT = [Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
_MISSED = pytest.mark.xfail(strict=True, reason="predicted +15.1%, outside 15%")
EVERY = [pytest.param(r, id=f"{r.params:g}B") for r in ROWS] + [
    pytest.param(r, id=f"{r.params:g}B held out", marks=_MISSED if r.params == 76.1 else ())
    for r in HELD_OUT]


def test_the_table_is_read() -> None:
    assert len(ROWS) == 5 and ROWS[-1].pp == 35 and ROWS[0].tflops == 137


@pytest.mark.parametrize("row", ROWS + HELD_OUT, ids=IDS + [f"{r.params:g}B" for r in HELD_OUT])
def test_parameter_count_matches_the_paper(row: Row) -> None:
    assert row.shape.parameters / 1e9 == pytest.approx(row.params, rel=0.03)  # 1.65 ~ "1.7"


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_physical_flops_are_the_paper_s_formula(row: Row) -> None:
    # Forward, replayed forward and a backward of twice the work per block; the logits are
    # not recomputed: 4 x blocks + 3 x logits.
    workload = gpt_workload(row.shape, row.batch)
    blocks = sum(layer.forward_flops for layer in workload.layers[1:-1])
    logits = next(op.flops for op in workload.layers[-1].ops if op.kind == "matmul")
    assert (4 * blocks + 3 * logits) * row.batch == pytest.approx(
        megatron_flops(row.shape, row.batch), rel=1e-12)


@pytest.mark.parametrize("row", EVERY)
def test_predicted_throughput_is_within_15_percent_of_the_published(row: Row) -> None:
    workload = gpt_workload(row.shape, row.batch)
    config = row.config()
    prediction = predict(workload, row.cluster, config,
                         megatron_boundaries(row.shape, config.stages))
    assert prediction.fits, prediction.memory
    simulated = simulate(prediction, row.cluster)
    assert row.tflops_of(simulated.step_time) == pytest.approx(row.tflops, rel=0.15)
    assert row.tflops_of(prediction.step_time) == pytest.approx(row.tflops, rel=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS + HELD_OUT, ids=IDS + [f"{r.params:g}B" for r in HELD_OUT])
def test_auto_finds_at_least_the_published_throughput(row: Row) -> None:
    workload = gpt_workload(row.shape, row.batch)
    config = row.config()
    published = predict(workload, row.cluster, config,
                        megatron_boundaries(row.shape, config.stages))
    result = search(workload, row.cluster, optimizer="fused_adam", overlap_grad_reduce=False,
                    overlap_p2p=False, budget=None)
    assert not result.timed_out and result.best.fits
    assert result.best.step_time <= published.step_time
    assert row.tflops_of(result.best.step_time) >= row.tflops
