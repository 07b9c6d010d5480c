"""A tensor-parallel all-reduce between processes is charged as it is entered: from compute.

On one CPU host, a gloo all-reduce that ranks enter straight from their products (a
tensor-parallel forward: products, all-reduce, products, all-reduce) costs more than the
same all-reduce between short computations, which the link probe's ring fit times: the rank
released first computes again while its peer, still in the all-reduce, waits for a core.
The probe times that pattern (``ProbedLink.computing``), the world's link keeps what it
costs beyond the ring (``LinkSpec.computing_all_reduce``), and every tensor-parallel layer
across processes pays it per all-reduce (``predict.layer_profile``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from partitioner.analysis import analyze
from partitioner.cost.comm import all_reduce_time, computing_all_reduce_time
from partitioner.cost.cost import phase_times
from partitioner.cost.devices import REFERENCE_CPU
from partitioner.cost.links import LinkSpec
from partitioner.errors import DeviceError
from partitioner.planning.predict import Config, layer_profile, predict
from partitioner.planning.records import _cluster_dict, _cluster_from
from partitioner.planning.tp_costing import as_split
from partitioner.planning.tp_rules import resolve_shardings
from partitioner.planning.world import REFERENCE_LOOPBACK, world_cluster
from partitioner.planning.world_agreement import computing_excess
from partitioner.runtime.distributed.link_probe import COLLECTIVE_BYTES, ProbedLink

ROWS = ((2, 1e-3, 4e-4), (2, 4e-3, 1.5e-3), (4, 1e-3, 2e-3))


def _wide_split() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                          nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    analysis = analyze(model, (torch.randn(16, 64),))
    assert analysis.workload is not None
    plan = resolve_shardings(analysis.captured.graph_module, model, 2)
    return as_split(analysis.workload, plan.split(), plan.pairs)


def test_each_tensor_parallel_all_reduce_pays_what_the_link_measured_from_compute() -> None:
    workload = _wide_split()
    plain = world_cluster(["box"] * 2, "cpu", cpu=REFERENCE_CPU, link=REFERENCE_LOOPBACK)
    measured = world_cluster(["box"] * 2, "cpu", cpu=REFERENCE_CPU,
                             link=replace(REFERENCE_LOOPBACK, computing_all_reduce=ROWS))
    samples = 16.0
    before, after = (layer_profile(workload, c, samples, 2) for c in (plain, measured))
    charged = 0
    for layer, (f0, b0), (f1, b1) in zip(workload.layers, before, after):
        if not layer.tp_all_reduces:
            assert (f1, b1) == (f0, b0)  # a layer that reduces nothing pays nothing more
            continue
        charged += 1
        f, b = phase_times(layer, REFERENCE_CPU, samples, 2, workload.dtype, 0.0)
        link = measured.intra_node
        assert f1 - f0 == pytest.approx(
            layer.tp_all_reduces * link.computing_excess(2, f / layer.tp_all_reduces))
        assert b1 - b0 == pytest.approx(
            layer.tp_all_reduces * link.computing_excess(2, b / layer.tp_all_reduces))
        assert f1 - f0 >= 4e-4  # at least the shortest compute's figure
    assert charged == 2  # the two row sides
    # Unsplit, nothing all-reduces; a plan's step pays it, and its record keeps the figure.
    assert layer_profile(workload, measured, samples, 1) == layer_profile(
        workload, plain, samples, 1)
    slow, fast = (predict(workload, c, Config(tp=2)) for c in (measured, plain))
    assert slow.step_time > fast.step_time
    assert _cluster_from(_cluster_dict(measured)) == measured


def test_one_process_and_the_presets_pay_nothing_more() -> None:
    link = REFERENCE_LOOPBACK
    assert computing_all_reduce_time(1e6, 2, link, 3e-3) == all_reduce_time(1e6, 2, link)
    assert computing_all_reduce_time(1e6, 1, link, 3e-3) == 0.0


def test_the_rows_are_read_by_group_size_then_interpolated_in_the_compute() -> None:
    link = replace(REFERENCE_LOOPBACK, computing_all_reduce=ROWS)
    assert link.computing_excess(2, 0.0) == 4e-4  # nearest outside
    assert link.computing_excess(2, 2.5e-3) == pytest.approx(9.5e-4)
    assert link.computing_excess(2, 1.0) == 1.5e-3
    assert link.computing_excess(3, 5e-3) == 2e-3  # the next larger size timed
    assert link.computing_excess(8, 5e-3) == 2e-3  # else the largest


@pytest.mark.parametrize("rows", [((1, 1e-3, 1e-4),), ((2, 1e-3, -1e-4),),
                                  ((2, 4e-3, 1e-4), (2, 1e-3, 2e-4)), ((2, 1e-3),)])
def test_bad_rows_are_refused_by_name(rows: tuple) -> None:
    with pytest.raises(DeviceError, match="computing_all_reduce="):
        replace(REFERENCE_LOOPBACK, computing_all_reduce=rows)


def test_the_probe_rows_become_what_they_cost_beyond_the_ring() -> None:
    ring = LinkSpec("ring", 3e9, 5e-5, rings=((2, 4e-4, 1e9), (4, 8e-4, 2e9)))
    got = ProbedLink(5e-5, 3e9, 5e-5, 0.0, (1e-3, 4e-3),
                     computing=((4, 1e-3, 9e-3), (2, 4e-3, 3e-3), (2, 1e-3, 1e-4)))
    rows = computing_excess(got, ring)
    assert [(n, a) for n, a, _ in rows] == [(2, 1e-3), (2, 4e-3), (4, 1e-3)]
    two = all_reduce_time(COLLECTIVE_BYTES[0], 2, ring)
    assert rows[0][2] == 0.0  # faster than the ring's figure: nothing more, never less
    assert rows[1][2] == pytest.approx(3e-3 - two)
    assert rows[2][2] == pytest.approx(9e-3 - all_reduce_time(COLLECTIVE_BYTES[0], 4, ring))
    LinkSpec("measured", 3e9, 5e-5, computing_all_reduce=rows)  # valid as a link's rows
