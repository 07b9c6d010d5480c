"""SearchSpace: the one value the search, its enumeration and the plan it records read."""

from __future__ import annotations

import pytest
import torch
from models import mlp

from partitioner import partition
from partitioner.cost.devices import Cluster
from partitioner.cost.transformer_model import GPTShape, gpt_workload
from partitioner.errors import ChunksError, PartitionError, ScheduleError, StrategyError
from partitioner.planning.auto import configurations, search
from partitioner.planning.given_mesh import auto_best_space
from partitioner.planning.space import SearchSpace
from partitioner.request import PlanRequest

GPT = gpt_workload(GPTShape(8, 1024, 16, 1024, 50304), batch=64)
CLUSTER = Cluster.preset("A100-80GB")


def test_keywords_are_sugar_for_the_value() -> None:
    space = SearchSpace(chunks=4, checkpoint="never", schedules=("1f1b",), tp=2)
    by_value = list(configurations(GPT, CLUSTER, space))
    by_keywords = list(configurations(GPT, CLUSTER, chunks=4, checkpoint="never",
                                      schedules=["1f1b"], tp=2))
    assert by_value == by_keywords and by_value
    assert {(c.chunks, c.checkpoint, c.schedule, c.tp) for c in by_value} == \
        {(4, "never", "1f1b", 2)}


def test_search_reads_the_value() -> None:
    fixed = search(GPT, CLUSTER, SearchSpace(dp=2, pp=4), executable_only=False, budget=None)
    assert all((p.config.dp, p.config.pp) == (2, 4) for p in fixed.ranked)
    assert fixed.best == search(GPT, CLUSTER, executable_only=False, budget=None, dp=2,
                                pp=4).best


def test_fixing_and_freeing() -> None:
    space = SearchSpace(dp=2, tp=2, pp=2, chunks=8, schedules=["gpipe"])
    assert space.schedules == ("gpipe",)  # any sequence is kept as a tuple
    assert space.fixing(chunks=None).chunks is None
    assert space.without_mesh() == SearchSpace(chunks=8, schedules=("gpipe",))
    # auto's best beside a given mesh searches what the caller fixed for the mesh
    assert auto_best_space(space) == SearchSpace()
    with pytest.raises(TypeError, match="chunk is not a search choice; pass one of"):
        space.fixing(chunk=4)


def test_of_request_takes_what_the_user_fixed() -> None:
    request = PlanRequest.make(["cpu", "cpu"], chunks=2, checkpoint="always",
                               schedule="1f1b", virtual_stages=None)
    space = SearchSpace.of_request(request, tp_degrees=[2])
    assert (space.chunks, space.checkpoint, space.schedules, space.tp_degrees) == \
        (2, "always", ("1f1b",), (2,))
    assert (space.dp, space.tp, space.pp) == (None, None, None)


@pytest.mark.parametrize(("fields", "error", "match"), [
    ({"tp": 0}, StrategyError, r"tp=0; pass a positive int"),
    ({"dp": True}, StrategyError, r"dp=True; pass a positive int"),
    ({"chunks": 2.5}, ChunksError, r"chunks=2.5; pass a positive int"),
    ({"checkpoint": "sometimes"}, StrategyError, r"sometimes"),
    ({"schedules": ("zb",)}, ScheduleError, r"schedule='zb' is not a registered schedule"),
    ({"optimizer": "lion"}, StrategyError, r"optimizer='lion' is unknown; pass one of"),
    ({"optimizer_sharding": "yes"}, StrategyError, r"optimizer_sharding='yes'"),
])
def test_bad_choices_are_refused_by_name(fields: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SearchSpace(**fields)
    assert issubclass(error, PartitionError)


def test_tensor_parallel_refuses_virtual_stages() -> None:
    """They were dropped without a word before the request reached the tensor-parallel
    pipeline, which runs one model chunk per stage."""
    x = torch.randn(8, 32)
    with pytest.raises(ScheduleError, match="virtual_stages=2 with tensor parallelism"):
        partition(mlp(), ["cpu"] * 4, tensor_parallel=2, example_inputs=(x,),
                  schedule="interleaved", virtual_stages=2)
