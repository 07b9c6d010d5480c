"""passes/place_graph.py: a stage graph and everything it holds on its device, and each
stage of a replica (virtual stages too) on the device its schedule places it on.

No second device exists on a CPU-only machine: "meta" stands for the stage's device (what
a GPU would be); ``tests/runtime/test_cuda.py`` runs the same paths on a GPU.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from partitioner.build import stage_devices
from partitioner.passes.place_graph import place_graph
from partitioner.plans.plan import Plan, Stage
from partitioner.runtime.device import model_device

META = torch.device("meta")


class _Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("shift", torch.zeros(3))
        self.plain = torch.arange(3.0)  # neither parameter nor buffer: a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        return x * self.scale + self.shift + self.plain + positions


def _tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    found = dict(gm.named_parameters())
    found.update(gm.named_buffers())
    found.update({k: v for k, v in vars(gm).items() if isinstance(v, torch.Tensor)})
    return found


def _devices_named(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if "device" in str(n.kwargs)
            and "cpu" in str(n.kwargs)]


def test_an_exported_graph_leaves_constants_and_devices_behind_on_to() -> None:
    """What the pass exists for: ``GraphModule.to`` moves parameters and buffers only."""
    gm = torch.export.export(_Positions(), (torch.ones(2, 3),), strict=False).module()
    gm.to(META)
    assert any(t.device.type == "cpu" for t in _tensors(gm).values())
    assert _devices_named(gm)


def test_every_tensor_and_the_capture_device_follow_the_stage() -> None:
    gm = torch.export.export(_Positions(), (torch.ones(2, 3),), strict=False).module()
    origin = model_device(gm)
    assert origin == torch.device("cpu")
    assert place_graph(gm, META, origin).modified
    assert {k: t.device.type for k, t in _tensors(gm).items()} == dict.fromkeys(
        _tensors(gm), "meta")
    assert _devices_named(gm) == []
    out = gm(torch.ones(2, 3, device=META))
    assert out.device == META and out.shape == (2, 3)


def test_without_the_capture_device_node_arguments_stay() -> None:
    gm = torch.export.export(_Positions(), (torch.ones(2, 3),), strict=False).module()
    place_graph(gm, META)
    assert all(t.device == META for t in _tensors(gm).values())
    assert _devices_named(gm)  # only a graph known to be captured elsewhere is rewritten


def test_already_in_place_is_not_modified() -> None:
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert not place_graph(gm, torch.device("cpu"), torch.device("cpu")).modified


def _plan(schedule: str, virtual: int, pp: int = 2) -> Plan:
    n = pp * virtual
    return Plan("pipeline", ("cpu",) * pp, tuple(Stage(k, "cpu", (f"l{k}",)) for k in range(n)),
                chunks=4, schedule=schedule, virtual_stages=virtual)


def test_virtual_stages_of_a_replica_land_on_its_schedules_devices() -> None:
    """Regression (seen on a GPU): a replica's copied graphs were moved with
    ``zip(graphs, group)``, so virtual stages past the first ``pp`` stayed on the CPU."""
    a, b = torch.device("cuda", 2), torch.device("cuda", 3)
    assert stage_devices(_plan("interleaved", 2), [a, b]) == [a, b, a, b]
    assert stage_devices(_plan("v_shape", 2), [a, b]) == [a, b, b, a]
    assert stage_devices(_plan("1f1b", 1), [a, b]) == [a, b]
