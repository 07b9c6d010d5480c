from __future__ import annotations

import pytest
import torch
from models import Counter
from torch import nn

from partitioner.errors import TraceError
from partitioner.passes.unlift import unlift


def _export(model: nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model, (x,), strict=False)


def test_parameters_and_buffers_are_the_models_own() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    result = unlift(_export(model, torch.randn(3, 4)))
    gm = result.graph_module
    assert gm.get_parameter("0.weight") is model[0].weight
    assert gm.get_buffer("1.running_mean") is model[1].running_mean
    assert not [n for n in gm.graph.nodes if n.op == "placeholder" and "weight" in n.name]
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x)[0], model(x))
    assert result.writes == ()


def test_buffer_updates_are_kept_and_reported() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    result = unlift(_export(model, torch.randn(3, 4)))
    assert set(result.writes) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    result.graph_module(torch.randn(3, 4))
    assert int(model[1].num_batches_tracked) == 1
    counter = Counter()
    counted = unlift(_export(counter, torch.randn(2, 8)))
    counted.graph_module(torch.randn(2, 8))
    counted.graph_module(torch.randn(2, 8))
    assert counted.writes == ("steps",) and int(counter.steps) == 2


def test_a_parameter_updated_in_forward_is_refused() -> None:
    class Decay(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.weight.mul_(0.5)
            return x * self.weight

    program = _export(Decay(), torch.randn(2, 4))
    with pytest.raises(TraceError, match="modifies parameter weight in place"):
        unlift(program, "Decay")


def test_a_no_grad_region_keeps_its_body() -> None:
    """torch.no_grad() in forward becomes a higher-order op whose body is an attribute of the
    program: the unlifted graph must carry it (it was missing: "target not provided")."""
    class Normalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            with torch.no_grad():
                scale = self.b(h).abs().mean() + 1
            return h / scale

    model, x = Normalised(), torch.randn(3, 4)
    gm = unlift(_export(model, x)).graph_module
    torch.testing.assert_close(gm(x)[0], model(x))
