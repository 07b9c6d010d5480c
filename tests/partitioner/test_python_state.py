"""Python side effects of ``forward`` while the model is captured are named
(``SideEffectWarning``) and undone, never silently dropped
(``partitioner.passes.python_state``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from partitioner import partition
from partitioner.errors import SideEffectWarning
from partitioner.passes.python_state import changes, restore, snapshot

X = torch.randn(8, 4)


class Logging(nn.Module):
    """Keeps every input it sees in a Python list."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return self.linear(x)


class Counting(nn.Linear):
    """Counts its calls in a Python int (a class attribute until the first call)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def test_a_list_grown_in_forward_is_named_and_emptied_again() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Logging(), nn.Linear(4, 4))
    with pytest.warns(SideEffectWarning, match=r"1\.seen: list of 0 -> list of 1.*"
                                               r"register_buffer"):
        pm = partition(model, ["cpu", "cpu"], example_inputs=(X,))
    assert model[1].seen == []  # no tracing proxy left behind
    out = pm(X)
    assert torch.allclose(out, model(X))


def test_a_counter_moved_in_forward_is_named_and_put_back() -> None:
    model = nn.Sequential(Counting(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.warns(SideEffectWarning, match=r"0\.calls: 0 -> 1"):
        partition(model, ["cpu", "cpu"], example_inputs=(X,))
    assert "calls" not in vars(model[0]) and model[0].calls == 0


def test_a_model_without_python_effects_captures_without_a_warning() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)
        partition(model, ["cpu", "cpu"], example_inputs=(X,))


def test_dicts_and_sets_are_compared_by_size_and_restored_in_place() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    table: dict[str, int] = {"a": 1}
    names = {"x"}
    model[0].table, model[0].names = table, names
    before = snapshot(model)
    table["b"] = 2
    names.add("y")
    model[0].label = "new"
    assert changes(model, before) == ["0.label: <unset> -> 'new'",
                                      "0.names: set of 1 -> set of 2",
                                      "0.table: dict of 1 -> dict of 2"]
    restore(model, before)
    assert model[0].table is table and table == {"a": 1} and names == {"x"}
    assert not hasattr(model[0], "label") and changes(model, before) == []


class Lazy(nn.Linear):
    """Installs something once on its first call and marks it privately (as transformers'
    MoE models mark ``_output_capturing_hooks_installed``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_installed", False):
            self._installed = True
        return super().forward(x)


def test_private_bookkeeping_is_neither_named_nor_put_back() -> None:
    model = nn.Sequential(Lazy(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)
        partition(model, ["cpu", "cpu"], example_inputs=(X,))
    assert model[0]._installed  # left as the first call set it
