"""partition_distributed's check that the plan's layers are this rank's model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import make_plan
from partitioner.analysis import analyze
from partitioner.distributed import _check_layers
from partitioner.errors import StrategyError


def _mlp(depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)])


def test_a_rank_with_another_model_is_told_the_ranks_disagree() -> None:
    """Regression: rank 0's plan on a rank whose model has more layers said "not in the plan
    ['7']; re-plan the model", although no plan file was given."""
    plan = make_plan(_mlp(7), ["cpu", "cpu"], balance=[4, 3])
    here = analyze(_mlp(8), (torch.randn(2, 4),), need_costs=False)
    with pytest.raises(StrategyError) as info:
        _check_layers(here, plan, given=False)
    message = str(info.value)
    assert message.startswith("ranks disagree on the model")
    assert "has ['7'] besides" in message and "build the same model" in message
    assert "re-plan" not in message


def test_a_plan_file_for_another_model_says_to_re_plan() -> None:
    plan = make_plan(_mlp(7), ["cpu", "cpu"], balance=[4, 3])
    here = analyze(_mlp(8), (torch.randn(2, 4),), need_costs=False)
    with pytest.raises(StrategyError, match=r"lacks \['7'\], which it has; re-plan the model"):
        _check_layers(here, plan, given=True)
