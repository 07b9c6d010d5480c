"""Tests of partitioner/planning/options.py: Options as values, the keywords folded into them
in one place, conflicts refused; the one Mesh (runtime/mesh.py) from plan files to ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import partitioner
from partitioner import make_plan, partition
from partitioner.errors import (
    ChunksError,
    MeshError,
    OptionsError,
    PrecisionError,
    ScheduleError,
    StrategyError,
)
from partitioner.planning.options import (
    Options,
    Precision,
    Schedule,
    Sharding,
    one_process_options,
    resolve_options,
)
from partitioner.planning.world import Degrees
from partitioner.plans.plan import Mesh as PlanMesh
from partitioner.plans.plan import Plan
from partitioner.runtime.distributed.mesh import Mesh as ProcessMeshAlias
from partitioner.runtime.distributed.mesh import MeshShape, ProcessMesh
from partitioner.runtime.mesh import Mesh


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 2)), torch.randn(8, 8)


def test_keywords_fold_into_one_value() -> None:
    opts = resolve_options(None, pp=2, chunks=4, schedule="1f1b", precision="bf16",
                           optimizer_sharding=True, checkpoint="never", tune=2, seed=3)
    assert opts.mesh == Degrees(pp=2)
    assert opts.schedule == Schedule("1f1b", chunks=4)
    assert opts.precision == Precision("bf16")
    assert opts.sharding == Sharding("optimizer") and opts.sharding.optimizer is True
    assert (opts.checkpoint, opts.tune, opts.seed) == ("never", 2, 3)


def test_keywords_that_agree_with_options_are_accepted() -> None:
    given = Options(mesh=Mesh(dp=2, pp=2), schedule=Schedule(chunks=4))
    assert resolve_options(given, pp=2, dp=2, tp=1, chunks=4, mesh=Mesh(dp=2, pp=2)) == given


@pytest.mark.parametrize("options, given, named", [
    (Options(mesh=Mesh(pp=4)), {"mesh": Mesh(pp=2)}, "mesh=Mesh"),
    (Options(schedule=Schedule(chunks=2)), {"chunks": 4}, "chunks=4"),
    (Options(schedule=Schedule("gpipe")), {"schedule": "1f1b"}, "schedule='1f1b'"),
    (Options(precision=Precision("bf16")), {"precision": "fp32"}, "precision='fp32'"),
    (Options(sharding=Sharding("fsdp")), {"optimizer_sharding": True}, "optimizer_sharding"),
    (None, {"optimizer_sharding": False, "sharding": "optimizer"}, "sharding='optimizer'"),
    (Options(strategy="pipeline"), {"strategy": "auto"}, "strategy='auto'"),
    (Options(tune=2), {"tune": 3}, "tune=3"),
])
def test_one_setting_given_twice_differently_is_refused(options: Options | None,
                                                         given: dict, named: str) -> None:
    with pytest.raises(OptionsError, match=named):
        resolve_options(options, **given)


@pytest.mark.parametrize("options, given", [
    (Options(mesh=Mesh(pp=4)), {"pp": 2}),
    (None, {"mesh": Mesh(pp=4), "pp": 2}),
    (Options(mesh=Degrees(dp=2)), {"dp": 4}),
])
def test_sizes_that_disagree_with_the_mesh_are_refused(options: Options | None,
                                                        given: dict) -> None:
    with pytest.raises(MeshError, match="but .*=\\d given; pass the degrees once"):
        resolve_options(options, **given)


@pytest.mark.parametrize("make, error", [
    (lambda: Schedule("zb"), ScheduleError),
    (lambda: Schedule(chunks=0), ChunksError),
    (lambda: Schedule(virtual_stages=True), ScheduleError),
    (lambda: Precision("fp8"), PrecisionError),
    (lambda: Precision("fp16", loss_scale=-1.0), PrecisionError),
    (lambda: Sharding("zero3"), OptionsError),
    (lambda: Options(strategy="fast"), StrategyError),
    (lambda: Options(mesh=(2, 2)), MeshError),
    (lambda: resolve_options(None, mesh=(2, 2)), MeshError),  # type: ignore[arg-type]
    (lambda: Options(schedule="1f1b"), OptionsError),  # type: ignore[arg-type]
    (lambda: Options(checkpoint="sometimes"), StrategyError),
    (lambda: resolve_options(None, stages=2), OptionsError),
    (lambda: resolve_options({"chunks": 2}), OptionsError),  # type: ignore[arg-type]
    (lambda: one_process_options(Options(mesh=Degrees(pp=2))), MeshError),
    (lambda: one_process_options(Options(sharding=Sharding("optimizer"))), OptionsError),
])
def test_bad_values_are_refused_when_made(make: object, error: type) -> None:
    with pytest.raises(error):
        make()  # type: ignore[operator]


def test_partition_with_options_runs_what_the_keywords_run() -> None:
    model, x = _mlp()
    by_keywords = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), chunks=2,
                            schedule="1f1b", checkpoint="never")
    by_value = partition(model, ["cpu", "cpu"], example_inputs=(x,), options=Options(
        strategy="pipeline", schedule=Schedule("1f1b", chunks=2), checkpoint="never"))
    for pm in (by_keywords, by_value):
        assert (pm.plan.chunks, pm.plan.schedule, pm.plan.checkpoint) == (2, "1f1b", "never")
        out = pm(x)
        out.sum().backward()
        torch.testing.assert_close(out, model(x))
        pm.close()
    assert by_keywords.plan.balance == by_value.plan.balance


def test_make_plan_takes_the_same_options() -> None:
    model, x = _mlp()
    plan = make_plan(model, ["cpu"] * 4, example_inputs=(x,),
                     options=Options(mesh=Mesh(dp=2, pp=2), schedule=Schedule(chunks=2)))
    assert plan.mesh == Mesh(dp=2, pp=2) and plan.chunks == 2
    with pytest.raises(OptionsError, match="chunks=4"):
        make_plan(model, ["cpu"] * 4, example_inputs=(x,), chunks=4,
                  options=Options(schedule=Schedule(chunks=2)))


def test_partition_refuses_what_one_process_cannot_do() -> None:
    model, x = _mlp()
    with pytest.raises(OptionsError, match="one-process runtimes shard nothing"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,),
                  options=Options(sharding=Sharding("optimizer")))


def test_one_mesh_from_plan_files_to_ranks() -> None:
    assert PlanMesh is Mesh and partitioner.Mesh is Mesh
    assert MeshShape(2, 1, 1) == Mesh(pp=2) and hash(MeshShape(pp=2)) == hash(Mesh(pp=2))
    assert MeshShape.infer(8, pp=2) == Mesh(dp=4, pp=2)
    assert ProcessMeshAlias is ProcessMesh
    model, x = _mlp()
    loaded = Plan.from_dict(make_plan(model, ["cpu"] * 4, example_inputs=(x,),
                                      mesh=Mesh(dp=2, pp=2)).to_dict())
    assert type(loaded.mesh) is Mesh and loaded.mesh == MeshShape(pp=2, dp=2)
    with pytest.raises(MeshError, match="tp=0"):
        Mesh(tp=0)
    mesh = Mesh(dp=2, pp=2, tp=2)
    assert mesh.coords(5).stage == 1 and mesh.groups("tp")[0] == (0, 1)


def test_partition_distributed_folds_the_same_options_before_any_collective() -> None:
    from partitioner import partition_distributed
    from partitioner.errors import TuneError

    model, x = _mlp()
    with pytest.raises(MeshError, match="options.mesh=.* but pp=2 given"):
        partition_distributed(model, (x,), pp=2, options=Options(mesh=Mesh(pp=4)))
    with pytest.raises(OptionsError, match="optimizer_sharding=True and sharding 'fsdp'"):
        partition_distributed(model, (x,), optimizer_sharding=True,
                              options=Options(sharding=Sharding("fsdp")))
    with pytest.raises(TuneError, match="strategy=None"):
        partition_distributed(model, (x,), options=Options(tune=True))
