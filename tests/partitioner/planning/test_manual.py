from __future__ import annotations

import pytest
import torch
from models import ResidualCNN

from partitioner import partition
from partitioner.errors import BalanceError
from partitioner.planning.manual import boundaries_from_balance, boundaries_from_split_points


def test_balance_gives_cumulative_boundaries() -> None:
    assert boundaries_from_balance([3, 2, 2], 7, 3) == (0, 3, 5, 7)


def test_balance_reports_every_problem_at_once() -> None:
    with pytest.raises(BalanceError, match="2 entries but there are 3 devices.*positive"):
        boundaries_from_balance([0, 7], 7, 3)


def test_split_points_accept_module_and_flattened_names() -> None:
    layers = ["stem.0", "stem.1", "layer1.0", "layer1.1", "layer2.0", "head"]
    assert boundaries_from_split_points(["layer1"], layers) == (0, 2, 6)
    assert boundaries_from_split_points(["layer1_1", "head"], layers) == (0, 3, 5, 6)


def test_split_points_out_of_order_and_first_layer() -> None:
    layers = ["a", "b", "c"]
    with pytest.raises(BalanceError, match="not after the previous"):
        boundaries_from_split_points(["c", "b"], layers)
    with pytest.raises(BalanceError, match="is the first layer"):
        boundaries_from_split_points(["a"], layers)


def test_split_points_on_a_cnn() -> None:
    model = ResidualCNN()
    x = torch.randn(4, 3, 8, 8)
    pm = partition(model, devices=["cpu"] * 3, split_points=["layer1", "layer2"], chunks=2)
    assert pm.plan.stages[1].layers == ("layer1.0", "layer1.1")
    assert pm.plan.stages[2].layers[0] == "layer2.0"
    torch.testing.assert_close(pm(x), model(x))


def test_an_unknown_split_point_names_close_modules_or_the_layers() -> None:
    layers = ["stem.0", "stem.1", "layer1.0", "layer1.1", "layer2.0", "head"]
    # Once this read "layers near it: []": a hint with nothing in it.
    with pytest.raises(BalanceError, match=r"'layer_2' names no layer.*did you mean "
                                           r"'layer2'") as caught:
        boundaries_from_split_points(["layer_2"], layers)
    assert "[]" not in str(caught.value)
    with pytest.raises(BalanceError, match=r"'nosuch' names no layer.*the layers are "
                                           r"stem\.0, stem\.1, layer1\.0, layer1\.1, "
                                           r"layer2\.0, head; pass module names"):
        boundaries_from_split_points(["nosuch"], layers)
    many = [str(k) for k in range(11)]
    with pytest.raises(BalanceError, match=r"the layers are 0, 1, 2, 3, 4, 5, \.\.\. "
                                           r"\(11 in all\)"):
        boundaries_from_split_points(["nosuch"], many)
