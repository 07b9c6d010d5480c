"""The parts of ``strategy="auto"`` that need no world: the tensor-parallel check, the
replica's slice of the batch (``partitioner.distributed_plan``)."""

from __future__ import annotations

import pytest
import torch
from models import mlp
from tp_models import TinyGPT

from partitioner.analysis import analyze
from partitioner.distributed_plan import local_batch, tensor_parallel_check, virtual_stages_of
from partitioner.errors import StrategyError
from partitioner.planning.predict import Config
from partitioner.planning.world import Degrees, search_world, world_cluster
from partitioner.runtime.mesh import Mesh


@pytest.fixture(scope="module")
def gpt() -> tuple[TinyGPT, object]:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)  # 4 attention heads
    return model, analyze(model, (torch.randint(0, 64, (8, 8)),))


def test_heads_that_do_not_divide_are_refused(gpt: tuple[TinyGPT, object]) -> None:
    check = tensor_parallel_check(*gpt)
    assert check(Config(tp=1, pp=2, dp=4)) is None
    assert check(Config(tp=2, pp=2)) is None and check(Config(tp=4)) is None
    why = check(Config(tp=8))
    assert why is not None and why.startswith("tp=8: ")


def test_merged_layers_bound_the_stages() -> None:
    torch.manual_seed(0)
    model = mlp((8, 16, 16, 16, 16, 8))
    analysis = analyze(model, (torch.randn(4, 8),))
    check = tensor_parallel_check(model, analysis)
    # Linear pairs stay in one stage: 9 layers merge into 5 under tp=2.
    assert check(Config(tp=2, pp=5)) is None
    why = check(Config(tp=2, pp=8))
    assert why is not None and "leaves 5 layers: too few for pp=8" in why


def test_fixed_tp_is_kept_only_where_the_pass_splits(gpt: tuple[TinyGPT, object]) -> None:
    model, analysis = gpt
    cluster = world_cluster(["box"] * 8, "cpu")
    check = tensor_parallel_check(model, analysis)
    fixed = search_world(analysis.workload, cluster, Degrees(tp=4), check=check)
    assert fixed.best.config.tp == 4
    with pytest.raises(StrategyError, match=r"no configuration with tp=8 runs here: tp=8: "):
        search_world(analysis.workload, cluster, Degrees(tp=8), check=check)


def test_each_replica_plans_with_its_share_of_the_batch() -> None:
    x, mask = torch.arange(12.0).reshape(6, 2), torch.ones(6, 3)
    inputs, kwargs = local_batch((x, 7), {"mask": mask}, 3)
    assert inputs is not None and kwargs is not None
    assert torch.equal(inputs[0], x[:2]) and inputs[1] == 7
    assert torch.equal(kwargs["mask"], mask[:2])
    assert local_batch((x,), None, 1) == ((x,), None)


def test_virtual_stages_with_tensor_parallel_ranks_are_refused_not_run_unsplit() -> None:
    """A rank's virtual stages run whole: with tp=2 each tp rank ran the whole stage, the
    split silently not applied. Refused, naming both values and the fix."""
    with pytest.raises(StrategyError, match=r"virtual_stages=2 with tp=2.*pass tp=1"):
        virtual_stages_of(None, 2, "interleaved", Mesh(dp=1, pp=2, tp=2), 2, None)
    assert virtual_stages_of(None, 2, "interleaved", Mesh(dp=1, pp=2, tp=1), 2, None) == 2
    assert virtual_stages_of(None, None, "1f1b", Mesh(dp=1, pp=2, tp=2), 2, None) == 1
