"""passes/non_persistent: graphs cut from a model keep its non-persistent buffers out of
their state dicts (a rotary embedding's ``inv_freq`` is never saved nor demanded)."""

from __future__ import annotations

import torch
from torch import nn

from partitioner.analysis import analyze, build_stage_graphs
from partitioner.api import make_plan
from partitioner.passes.non_persistent import keep_non_persistent, non_persistent_names


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.register_buffer("count", torch.zeros(()))  # persistent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale + self.count


def test_names_include_nested_modules() -> None:
    model = nn.Sequential(Scaled(), Scaled())
    assert non_persistent_names(model) == {"0.scale", "1.scale"}


def test_keep_non_persistent_marks_only_the_named_buffers() -> None:
    model = nn.Sequential(Scaled())
    gm = torch.fx.symbolic_trace(model)
    assert "0.scale" in gm.state_dict()  # what fx does
    keep_non_persistent(gm, non_persistent_names(model))
    assert sorted(gm.state_dict()) == ["0.count", "0.proj.bias", "0.proj.weight"]


def test_stage_graphs_hold_the_models_state_dict_keys_only() -> None:
    model = nn.Sequential(Scaled(), Scaled())
    x = torch.randn(3, 4)
    plan = make_plan(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,), balance=[1, 1])
    graphs = build_stage_graphs(analyze(model, (x,)), plan)
    keys = [k for gm in graphs for k in gm.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())
    assert all("scale" not in k for k in keys)
