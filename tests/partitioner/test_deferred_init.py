"""A meta-built stage's initialization is put off until first use, and skipped for what
``dpm.load`` fills (``partitioner.runtime.deferred_init``): same values as an eager build,
``init_fn`` never run on modules whose tensors all come from the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import launch, results
from meta_models import Scaled, batches, build_scaled, build_tied, init_scaled, train_whole
from torch import nn

from partitioner.errors import InitError
from partitioner.runtime.deferred_init import DeferredInit
from partitioner.runtime.materialize import Materializer, materialize_module

WORKER = Path(__file__).with_name("deferred_init_worker.py")
STEPS = 2


def _meta_scaled(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    with torch.device("meta"):
        return build_scaled().to(dtype)


def test_placeholders_are_nan_until_run_then_equal_an_eager_build() -> None:
    model = _meta_scaled()
    later = DeferredInit(Materializer(model, torch.device("cpu"), seed=5, init_fn=init_scaled))
    stage = nn.Sequential(*model[:4])
    materialize_module(stage, later)
    assert all(t.isnan().all() for t in stage.state_dict().values())
    assert later.pending == 5  # two weights, two biases, one scale
    eager = nn.Sequential(*model[:4])
    materialize_module(eager, Materializer(model, torch.device("cpu"), seed=5,
                                           init_fn=init_scaled))
    later.run(loaded=False)
    assert later.pending == 0
    for (name, value), (_, expected) in zip(
            list(stage.named_parameters()) + list(stage.named_buffers()),
            list(eager.named_parameters()) + list(eager.named_buffers()), strict=True):
        assert torch.equal(value, expected), name


def test_after_a_load_only_the_non_persistent_buffers_are_initialized() -> None:
    model = _meta_scaled()
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        init_scaled(module)

    later = DeferredInit(Materializer(model, torch.device("cpu"), init_fn=init))
    stage = nn.Sequential(*model[:4])
    materialize_module(stage, later)
    later.run(loaded=True)
    assert calls == ["Scaled"]
    assert torch.equal(stage[1].scale, torch.linspace(0.5, 1.5, 32))
    assert stage[0].weight.isnan().all()  # left for the file; nothing drew it


def test_a_tensor_shared_by_two_stages_of_a_rank_gets_one_placeholder() -> None:
    with torch.device("meta"):
        model = build_tied(8)
    later = DeferredInit(Materializer(model, torch.device("cpu")))
    first, last = nn.Sequential(model[0]), nn.Sequential(model[8])
    materialize_module(first, later)
    materialize_module(last, later)
    assert first[0].weight.data_ptr() == last[0].weight.data_ptr()
    later.run(loaded=False)
    assert torch.equal(first[0].weight, last[0].weight)
    assert not first[0].weight.isnan().any()


def test_a_meta_tensor_no_module_owns_is_refused_when_its_placeholder_is_asked() -> None:
    later = DeferredInit(Materializer(_meta_scaled(), torch.device("cpu")))
    with pytest.raises(InitError, match="not one of the model's parameters"):
        later.tensor(torch.empty(3, device="meta"))


def _launch(args: dict[str, Any]) -> list[dict[str, Any]]:
    world = args.get("pp", 2) * args.get("tp", 1)
    runs = launch(WORKER, world, [json.dumps(dict(steps=STEPS, **args))], timeout=240)
    return [r[0] for r in results(runs)]


MESHES = [pytest.param({}, id="pp2"), pytest.param({"pp": 1, "tp": 2}, id="tp2"),
          pytest.param({"pp": 2, "tp": 2}, id="pp2xtp2")]
"""A pipeline, a tensor-parallel stage (each rank's slices put off: ``derived``), both."""


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
@pytest.mark.parametrize("mesh", MESHES)
def test_load_skips_the_initialization_of_everything_it_fills(tmp_path: Path,
                                                              mesh: dict[str, int]) -> None:
    """``init_fn`` runs on no Linear at all: only on the modules owning non-persistent
    buffers, which the file cannot hold; training equals the whole model's."""
    torch.manual_seed(0)
    whole = build_scaled().double()
    torch.save(whole.state_dict(), tmp_path / "whole.pt")
    records = _launch(dict(weights=str(tmp_path / "whole.pt"), **mesh))
    expected = {k: v.clone() for k, v in whole.state_dict().items()}
    losses = train_whole(whole, batches(STEPS, width=16))
    for record in records:
        assert record["at_build"] == []
        assert record["nan_before"]
        assert set(record["before_steps"]) <= {"Scaled"}, record["before_steps"]
        for key, value in record["state"].items():
            assert torch.equal(torch.tensor(value, dtype=torch.float64), expected[key]), key
        for value in record["scales"].values():
            assert torch.equal(torch.tensor(value, dtype=torch.float64),
                               torch.linspace(0.5, 1.5, 32, dtype=torch.float64))
        assert record["losses"] == pytest.approx(losses, abs=1e-9)  # micro-batch sums
    # the model's two Scaled, each on one stage (and on each tensor-parallel rank of it)
    assert sum(len(r["before_steps"]) for r in records) == 2 * mesh.get("tp", 1)


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
@pytest.mark.parametrize("mesh", MESHES)
def test_without_a_load_the_first_use_initializes_as_an_eager_build_would(
        mesh: dict[str, int]) -> None:
    records = _launch(dict(mesh))
    model = _meta_scaled(torch.float64)  # as the ranks build it
    source = Materializer(model, torch.device("cpu"), seed=0, init_fn=init_scaled)
    whole = build_scaled().double()
    state = {}
    for record in records:
        assert record["at_build"] == [] and record["nan_before"]
        assert "Linear" in record["before_steps"]
        state.update(record["state"])
    with torch.no_grad():
        for key, tensor in whole.state_dict().items():
            eager = source.tensor(model.get_parameter(key))
            assert torch.equal(torch.tensor(state[key], dtype=torch.float64), eager), key
            tensor.copy_(eager)
    assert isinstance(whole[1], Scaled)
    losses = train_whole(whole, batches(STEPS, width=16))
    for record in records:
        assert record["losses"] == pytest.approx(losses, abs=1e-9)  # micro-batch sums
