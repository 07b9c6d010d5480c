"""The (pp, dp, tp) mesh: coordinates, axis groups, initialization errors, real groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed_harness import launch, results

from partitioner.runtime.distributed.mesh import (
    AXES,
    Coords,
    DistributedInitError,
    MeshError,
    MeshShape,
    init_distributed,
)

WORKER = Path(__file__).with_name("dist_worker.py")


@pytest.mark.parametrize("shape", [MeshShape(), MeshShape(pp=4), MeshShape(dp=3),
                                   MeshShape(pp=2, dp=2), MeshShape(pp=2, dp=3, tp=2)])
def test_coords_and_rank_are_inverse(shape: MeshShape) -> None:
    coords = [shape.coords(r) for r in range(shape.world_size)]
    assert [shape.rank_of(c) for c in coords] == list(range(shape.world_size))
    assert len(set(coords)) == shape.world_size


def test_layout_puts_tp_fastest_then_dp_then_pp() -> None:
    shape = MeshShape(pp=2, dp=2, tp=2)
    assert shape.coords(0) == Coords(0, 0, 0)
    assert shape.coords(1) == Coords(0, 0, 1)
    assert shape.coords(2) == Coords(0, 1, 0)
    assert shape.coords(4) == Coords(1, 0, 0)
    assert shape.coords(7).stage == 1 and shape.coords(7).replica == 1 \
        and shape.coords(7).shard == 1


@pytest.mark.parametrize("axis", AXES)
def test_groups_along_an_axis_partition_the_world(axis: str) -> None:
    shape = MeshShape(pp=2, dp=3, tp=2)
    groups = shape.groups(axis)
    members = sorted(r for g in groups for r in g)
    assert members == list(range(shape.world_size))
    assert all(len(g) == shape.size(axis) for g in groups)
    for group in groups:
        others = [a for a in AXES if a != axis]
        fixed = {tuple(getattr(shape.coords(r), a) for a in others) for r in group}
        assert len(fixed) == 1   # a group varies only along its own axis


def test_groups_of_two_by_two() -> None:
    shape = MeshShape(pp=2, dp=2)
    assert shape.groups("pp") == ((0, 2), (1, 3))
    assert shape.groups("dp") == ((0, 1), (2, 3))
    assert shape.groups("tp") == ((0,), (1,), (2,), (3,))


def test_infer_fills_the_missing_axis() -> None:
    assert MeshShape.infer(8, pp=2) == MeshShape(pp=2, dp=4)
    assert MeshShape.infer(8, dp=2) == MeshShape(pp=4, dp=2)
    assert MeshShape.infer(4) == MeshShape(pp=4, dp=1)
    assert MeshShape.infer(8, pp=2, dp=2, tp=2) == MeshShape(2, 2, 2)


def test_infer_refuses_sizes_that_do_not_fit_the_world() -> None:
    with pytest.raises(MeshError, match="do not divide the world of 6"):
        MeshShape.infer(6, pp=4)
    with pytest.raises(MeshError, match="launch 4 processes"):
        MeshShape.infer(8, pp=2, dp=2)


def test_bad_sizes_axes_and_ranks_are_refused() -> None:
    with pytest.raises(MeshError, match="pp=0"):
        MeshShape(pp=0)
    with pytest.raises(MeshError, match="dp=True"):
        MeshShape(dp=True)
    with pytest.raises(MeshError, match="unknown mesh axis 'ep'"):
        MeshShape().groups("ep")
    with pytest.raises(MeshError, match="rank 4 is outside"):
        MeshShape(pp=2, dp=2).coords(4)
    assert issubclass(MeshError, ValueError)


@pytest.mark.slow
def test_init_without_torchrun_variables_says_how_to_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedInitError, match="RANK is not set.*torchrun"):
        init_distributed("gloo")


def test_init_refuses_unknown_backend_and_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DistributedInitError, match="backend='mpi'"):
        init_distributed("mpi", "tcp://127.0.0.1:1")
    with pytest.raises(DistributedInitError, match="init_method='udp://x'"):
        init_distributed("gloo", "udp://x")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(DistributedInitError, match="MASTER_ADDR"):
        init_distributed("gloo", "env://")


@pytest.mark.slow
def test_axis_groups_of_a_real_world_of_four() -> None:
    runs = launch(WORKER, 4, ["mesh", json.dumps({"pp": 2, "dp": 2})], timeout=120)
    records = [r[0] for r in results(runs)]
    for rank, record in enumerate(records):
        shape = MeshShape(pp=2, dp=2)
        c = shape.coords(rank)
        assert record["coords"] == [c.stage, c.replica, c.shard]
        for axis in AXES:
            assert record["ranks"][axis] == list(shape.line(axis, rank))
            # An all-reduce of the ranks over the axis group sums exactly its members.
            assert record["sums"][axis] == sum(shape.line(axis, rank))
        assert record["device_mesh_shape"] == [2, 2, 1]
        assert record["device_mesh_dp_is_ours"]
    assert [(r["prev"], r["next"]) for r in records] == [(None, 2), (None, 3), (0, None),
                                                         (1, None)]
