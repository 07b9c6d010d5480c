"""Tests of runtime/materialize.py: a meta-built model's tensors made real, deterministically
whatever the split, in one process (``partition(meta_model, ["cpu", "cpu"], ...)``)."""

from __future__ import annotations

import pytest
import torch
from meta_models import batches, build
from torch import nn

from partitioner import partition
from partitioner.errors import InitError, PartitionError, StrategyError
from partitioner.runtime.materialize import Materializer, materialize_module, module_seed
from partitioner.runtime.tensor_parallel.module import ShardStore
from partitioner.runtime.tensor_parallel.sharding import Sharding

WIDTH, HIDDEN = 16, 32


def _meta(width: int = WIDTH, hidden: int = HIDDEN) -> nn.Module:
    with torch.device("meta"):
        return build(width, hidden).double()


def _example() -> tuple[torch.Tensor]:
    return (batches(1, width=WIDTH)[0][0],)


def _whole(seed: int = 0) -> nn.Module:
    """The meta model materialized whole on the CPU (one device: the reference layout)."""
    model = _meta()
    materialize_module(model, Materializer(model, torch.device("cpu"), seed=seed))
    return model


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("balance", [[13], [7, 6], [2, 11]])
def test_init_is_the_same_whatever_the_split(balance: list[int]) -> None:
    pm = partition(_meta(), ["cpu"] * len(balance), "pipeline", example_inputs=_example(),
                   balance=balance, seed=4)
    expected = _state(_whole(seed=4))
    got = _state(pm)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_another_seed_gives_other_weights() -> None:
    a, b = _state(_whole(seed=1)), _state(_whole(seed=2))
    assert not torch.equal(a["1.weight"], b["1.weight"])


def test_a_module_is_initialized_by_its_reset_parameters_under_its_own_seed() -> None:
    torch.manual_seed(module_seed(3, "1"))
    expected = nn.Linear(WIDTH, HIDDEN, dtype=torch.float64)
    model = _whole(seed=3)
    torch.testing.assert_close(model[1].weight, expected.weight, rtol=0, atol=0)
    torch.testing.assert_close(model[1].bias, expected.bias, rtol=0, atol=0)


def test_materializing_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    _whole()
    torch.testing.assert_close(torch.rand(3), expected)


def test_meta_pipeline_trains_like_the_whole_model() -> None:
    """Transparency: outputs and gradients of the meta-built pipeline equal the whole
    model's, initialized alike."""
    model = _meta()
    pm = partition(model, ["cpu", "cpu"], "pipeline", example_inputs=_example(), chunks=2)
    whole = _whole()
    x, y = batches(1, width=WIDTH)[0]
    out, expected = pm(x), whole(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    ((out - y) ** 2).mean().backward()
    ((expected - y) ** 2).mean().backward()
    # The model's modules now hold the stages' tensors (and their gradients).
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, param in whole.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-12, msg=name)
    assert all(p.device.type == "cpu" for p in pm.parameters())


def test_init_fn_fills_each_module_instead_of_reset_parameters() -> None:
    seen: list[str] = []

    def init_fn(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    pm = partition(_meta(), ["cpu", "cpu"], "pipeline", example_inputs=_example(),
                   init_fn=init_fn)
    assert all(bool((p == 0.5).all()) for p in pm.parameters())
    assert sorted(set(seen)) == ["LayerNorm", "Linear"]


class _Positional(nn.Module):
    """Holds a parameter and has no reset_parameters(): nothing can initialize it alone."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table.sum(0)


def _with_positional() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(_Positional(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                             nn.Linear(WIDTH, WIDTH))


def test_a_module_without_reset_parameters_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(InitError, match=r"0 \(_Positional\).*init_fn=") as caught:
        partition(_with_positional(), ["cpu", "cpu"], "pipeline",
                  example_inputs=(torch.randn(2, WIDTH),))
    assert isinstance(caught.value, PartitionError) and isinstance(caught.value, TypeError)


def test_init_fn_initializes_a_module_without_reset_parameters() -> None:
    def init_fn(module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            nn.init.normal_(param)

    pm = partition(_with_positional(), ["cpu", "cpu"], "pipeline",
                   example_inputs=(torch.randn(2, WIDTH),), init_fn=init_fn)
    table = pm.state_dict()["0.table"]
    assert table.device.type == "cpu" and float(table.abs().sum()) > 0


def test_init_fn_for_a_real_model_is_refused() -> None:
    with pytest.raises(InitError, match="meta device"):
        partition(build(WIDTH, HIDDEN), ["cpu", "cpu"], "pipeline",
                  example_inputs=(torch.randn(2, WIDTH),), init_fn=lambda m: None)


def test_a_meta_model_with_tensor_parallel_in_one_process_is_refused() -> None:
    with pytest.raises(StrategyError, match="pipeline only.*partition_distributed"):
        partition(_meta(), ["cpu", "cpu"], example_inputs=_example(), tensor_parallel=2)


def test_weights_tied_within_a_stage_stay_one_tensor() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                              nn.ReLU(), nn.Linear(WIDTH, 2))
    model[2].weight = model[0].weight
    partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(torch.randn(2, WIDTH),),
              balance=[4, 1])
    assert model[0].weight.device.type == "cpu"
    assert model[2].weight is model[0].weight


def test_a_tensor_not_in_the_model_is_refused() -> None:
    model = _meta()
    with pytest.raises(InitError, match="not one of the model's"):
        Materializer(model, torch.device("cpu")).tensor(torch.empty(3, device="meta"))


def test_shard_store_cuts_its_slice_from_the_materialized_value() -> None:
    """A tensor-parallel rank slices the whole layer the materializer builds, not the meta
    tensor, and gets the same slice as from the whole model."""
    model = _meta()
    whole = _whole()
    original = model[1].weight
    store = ShardStore({"1.weight": Sharding("colwise", 0, 2)},
                       source=Materializer(model, torch.device("cpu")).tensor)
    piece = store.tensor("1.weight", original, 1, torch.device("cpu"))
    torch.testing.assert_close(piece, whole[1].weight[HIDDEN // 2:], rtol=0, atol=0)
    assert original.is_meta
