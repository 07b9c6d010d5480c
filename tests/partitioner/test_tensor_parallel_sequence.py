"""partition(..., tensor_parallel=2, sequence_parallel=True): the one-process tensor-parallel
runtime with each rank graph's replicated region on sequence shards
(partitioner/build.py build_tensor_parallel, passes/tensor_parallel/sequence_parallel.py)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from tp_models import Block

from partitioner import Plan, partition
from partitioner.errors import PlanFormatError, StageExecutionError, StrategyError
from partitioner.plans.plan import Stage


def _forward_counts(pm: Any) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for stage in pm.stages.values():
        for s in stage:
            counts.update(s.group.members[0].counts)
    return counts


def test_sequence_parallel_blocks_train_like_the_model() -> None:
    """Outputs and gradients equal the model's; after 3 SGD steps the weights too."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(32, 4), Block(32, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 32)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,),
                   sequence_parallel=True)
    try:
        ours = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
        theirs = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            out, expected = pm(x), reference(x)
            torch.testing.assert_close(out, expected)
            out.pow(2).mean().backward()
            expected.pow(2).mean().backward()
            if step == 0:
                for key, param in reference.named_parameters():
                    torch.testing.assert_close(pm.full_tensor(key, grad=True), param.grad,
                                               msg=lambda m, k=key: f"{k}: {m}")
            for opt in (ours, theirs):
                opt.step()
                opt.zero_grad()
        state = pm.state_dict()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")
    finally:
        pm.close()


def test_each_block_reduce_scatters_instead_of_all_reducing() -> None:
    torch.manual_seed(0)
    blocks = 2
    model = nn.Sequential(*[Block(32, 4) for _ in range(blocks)])
    x = torch.randn(2, 8, 32)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,),
                   sequence_parallel=True)
    try:
        with torch.no_grad():
            pm(x)
        counts = _forward_counts(pm)
        assert counts["reduce_scatter", "forward"] == 2 * blocks
        assert counts["all_reduce", "forward"] == 0
        # The residual stream stays on shards from block to block: one all-gather per
        # column-parallel entry but the first (the input is whole), and the output's; the
        # second block's attention reads x.shape of a shard without one (whole_size).
        assert counts["all_gather", "forward"] == 2 * blocks
    finally:
        pm.close()


def test_sequence_parallel_needs_tensor_parallel() -> None:
    with pytest.raises(StrategyError, match="pass tensor_parallel=<degree> with it"):
        partition(nn.Linear(4, 4), ["cpu"], example_inputs=(torch.randn(2, 4),),
                  sequence_parallel=True)


def test_a_sequence_the_degree_does_not_divide_is_refused_by_name() -> None:
    """Planned on 8 tokens, called on 7: refused before any collective, naming the sizes
    (not a shape mismatch further down, nor tokens dropped)."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(32, 4), Block(32, 4))
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2,
                   example_inputs=(torch.randn(2, 8, 32),), sequence_parallel=True)
    try:
        torch.testing.assert_close(pm(torch.randn(2, 6, 32)).shape, torch.Size([2, 6, 32]))
        # The stage runtime names the stage, micro-batch and node around it.
        with pytest.raises(StageExecutionError,
                           match=r"ShardSizeError: .*2 does not divide 7.*pad them"):
            pm(torch.randn(2, 7, 32))
    finally:
        pm.close()


def test_the_plan_records_sequence_parallelism_and_a_saved_plan_runs_it(tmp_path: Any) -> None:
    """A plan file is applied exactly: SP is in it, and partition(plan=file) runs it."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(32, 4), Block(32, 4))
    x = torch.randn(2, 8, 32)
    pm = partition(model, ["cpu"] * 2, tensor_parallel=2, example_inputs=(x,),
                   sequence_parallel=True)
    try:
        assert pm.plan.sequence_parallel and "sequence parallel" in pm.plan.table()
        pm.plan.save(tmp_path / "plan.json")
    finally:
        pm.close()
    assert Plan.load(tmp_path / "plan.json").sequence_parallel
    again = partition(model, None, plan=tmp_path / "plan.json", example_inputs=(x,))
    try:
        assert again.plan.sequence_parallel
        with torch.no_grad():
            torch.testing.assert_close(again(x), model(x))
        counts = _forward_counts(again)
        assert counts["reduce_scatter", "forward"] == 4 and counts["all_reduce", "forward"] == 0
    finally:
        again.close()


def test_a_plan_with_sequence_parallelism_and_no_tensor_parallel_ranks_is_invalid() -> None:
    with pytest.raises(PlanFormatError, match="sequence_parallel is true but the mesh has tp=1"):
        Plan("pipeline", ("cpu",), (Stage(0, "cpu", ("fc",)),), sequence_parallel=True)


@pytest.mark.parametrize("strategy", ["auto", "pipeline"])
def test_the_plan_costs_sequence_parallelism_as_it_runs(strategy: str) -> None:
    """The plan's memory and time are those of the run: each split block keeps its
    activations divided by tp and runs its norms on s / tp tokens
    (partitioner/cost/sequence_cost.py), with the split searched or fixed."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(64, 4), Block(64, 4))
    x = torch.randn(8, 64, 64)
    kwargs: dict[str, Any] = dict(tensor_parallel=2, example_inputs=(x,), chunks=1,
                                  checkpoint="never", strategy=strategy)
    plain = partition(model, ["cpu"] * 2, **kwargs)
    sp = partition(model, ["cpu"] * 2, sequence_parallel=True, **kwargs)
    try:
        assert sp.plan.sequence_parallel and not plain.plan.sequence_parallel
        ours, theirs = sp.plan.stages[0], plain.plan.stages[0]
        assert ours.predicted_memory < theirs.predicted_memory
        assert ours.predicted_time < theirs.predicted_time
        assert any("sequence parallel" in note for note in sp.plan.notes)
    finally:
        sp.close()
        plain.close()
