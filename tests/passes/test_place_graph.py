"""passes/place_graph.py: a stage graph and everything it holds on its device, and each
stage of a replica (virtual stages too) on the device its schedule places it on.

No second device exists on a CPU-only machine: "meta" stands for the stage's device (what
a GPU would be); ``tests/runtime/test_cuda.py`` runs the same paths on a GPU.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from models import NoGradRotary

from partitioner import partition
from partitioner.build import stage_devices
from partitioner.passes.place_graph import place_graph
from partitioner.passes.unbake_meta import replace_device
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
    """The nodes naming the CPU as a device, in ``gm``'s graph and every graph it holds."""
    return [n.name for graph in gm.modules() if isinstance(graph, fx.GraphModule)
            for n in graph.graph.nodes if "device(type='cpu')" in str((n.args, n.kwargs))]


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


def test_a_no_grad_blocks_graph_follows_the_stage_too() -> None:
    """Regression (seen on an H200 with transformers 5.17's Llama): ``torch.export`` keeps a
    ``torch.no_grad()`` block as ``wrap_with_set_grad_enabled`` over a submodule graph, whose
    ``.to(cpu)`` and ``_assert_tensor_metadata(device=cpu)`` stayed when the stage moved."""
    gm = torch.export.export(NoGradRotary(), (torch.ones(2, 5, 8),), strict=False).module()
    inner = [name for name, m in gm.named_children() if isinstance(m, fx.GraphModule)]
    assert inner and any("cpu" in str((n.args, n.kwargs))
                         for n in getattr(gm, inner[0]).graph.nodes)
    assert place_graph(gm, META, torch.device("cpu")).modified
    assert _devices_named(gm) == []
    assert gm(torch.ones(2, 5, 8, device=META)).device == META


def test_a_meta_built_model_with_a_no_grad_block_runs_what_the_model_does() -> None:
    """Built on meta, the block's graph held the CPU the fake capture ran on ("Cannot copy
    out of meta tensor" in shape propagation, reported as the example inputs' fault)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = NoGradRotary()
    x = torch.randn(2, 5, 8)
    with partition(model, ["cpu", "cpu"], "pipeline", example_inputs=(x,),
                   init_fn=NoGradRotary.init) as pm:
        whole = NoGradRotary()
        whole.load_state_dict(pm.state_dict())
        torch.testing.assert_close(pm(x), whole(x))


def _autocast_types(gm: fx.GraphModule) -> list[str]:
    return [n.args[0] for graph in gm.modules() if isinstance(graph, fx.GraphModule)
            for n in graph.graph.nodes if n.target is torch.ops.higher_order.wrap_with_autocast]


def test_an_autocast_blocks_device_type_follows_a_real_device() -> None:
    """``torch.autocast(x.device.type, enabled=False)`` captured on the CPU is
    ``wrap_with_autocast("cpu", ...)``: on a GPU stage it must name cuda, or the stage's
    bf16 autocast stays on inside the block (rotary frequencies in bf16). The graph is only
    rewritten here, not run (no GPU)."""
    gm = torch.export.export(NoGradRotary(), (torch.ones(2, 5, 8),), strict=False).module()
    assert _autocast_types(gm) == ["cpu"]
    place_graph(gm, META, torch.device("cpu"))
    assert _autocast_types(gm) == ["cpu"]  # autocast has no meta type: left
    gm = torch.export.export(NoGradRotary(), (torch.ones(2, 5, 8),), strict=False).module()
    assert replace_device(gm, torch.device("cpu"), torch.device("cuda", 1)).modified
    assert _autocast_types(gm) == ["cuda"]
    assert "device(type='cuda', index=1)" in str([
        (n.args, n.kwargs) for graph in gm.modules() if isinstance(graph, fx.GraphModule)
        for n in graph.graph.nodes])
    assert not replace_device(gm, torch.device("cpu"), torch.device("cuda", 1)).modified
