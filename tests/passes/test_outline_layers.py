"""passes/outline_layers.py: each layer of a stage graph called as one module at its own
path, the parameters keeping their names and objects, and left alone where that would
not be exact."""

from __future__ import annotations

import torch
from torch import fx, nn

from partitioner.passes.outline_layers import outline_layers


class Block(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width))
        self.b = nn.Parameter(torch.randn(width))


def _export_style(blocks: int = 3, *, tie_last: bool = False) -> fx.GraphModule:
    """A graph as torch.export leaves it: every parameter a get_attr of the root, the
    layers' call nodes labelled with their paths, no submodule called."""
    root = nn.Module()
    root.layers = nn.ModuleList(Block() for _ in range(blocks))
    if tie_last:
        root.layers[-1].w = root.layers[0].w
    graph = fx.Graph()
    x = graph.placeholder("x")
    attrs = [(graph.get_attr(f"layers.{k}.w"), graph.get_attr(f"layers.{k}.b"))
             for k in range(blocks)]
    if tie_last:
        attrs[-1] = (attrs[0][0], attrs[-1][1])
    for k, (w, b) in enumerate(attrs):
        y = graph.call_function(torch.matmul, (x, w))
        z = graph.call_function(torch.add, (y, b))
        x = graph.call_function(torch.tanh, (z,))
        for node in (y, z, x):
            node.meta["layer_path"] = f"layers.{k}"
            node.meta["layer"] = k
    graph.output(x)
    return fx.GraphModule(root, graph)


def _run(gm: fx.GraphModule, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gm.zero_grad()
    out = gm(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in gm.named_parameters()}


def test_layers_become_module_calls_with_the_same_parameters() -> None:
    gm = _export_style()
    x = torch.randn(5, 4)
    before_out, before_grads = _run(gm, x)
    params = dict(gm.named_parameters())
    result = outline_layers(gm)
    assert result.modified and result.units == ("layers.0", "layers.1", "layers.2")
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == list(result.units)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    # Same names, same Parameter objects: optimizers and checkpoints see no change.
    after = dict(gm.named_parameters())
    assert list(after) == list(params) and all(after[k] is params[k] for k in params)
    out, grads = _run(gm, x)
    assert torch.equal(out, before_out)
    assert all(torch.equal(grads[k], before_grads[k]) for k in before_grads)


def test_hooks_on_a_layer_now_run_once_per_forward() -> None:
    gm = _export_style()
    outline_layers(gm)
    calls: list[str] = []
    for k in range(3):
        gm.get_submodule(f"layers.{k}").register_forward_pre_hook(
            lambda module, args, k=k: calls.append(f"layers.{k}"))
    gm(torch.randn(2, 4))
    assert calls == ["layers.0", "layers.1", "layers.2"]


def test_a_weight_tied_between_layers_stays_with_the_stage() -> None:
    gm = _export_style(tie_last=True)
    x = torch.randn(3, 4)
    before, _ = _run(gm, x)
    result = outline_layers(gm)
    # layers.0 and layers.2 share w: neither can own it; layers.1 is outlined.
    assert result.units == ("layers.1",)
    read = sorted(str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users)
    assert read == ["layers.0.b", "layers.0.w", "layers.2.b"]
    assert torch.equal(_run(gm, x)[0], before)


def test_a_parameter_the_layer_never_reads_keeps_it_inline() -> None:
    gm = _export_style(blocks=2)
    gm.get_submodule("layers.1").unused = nn.Parameter(torch.zeros(2))
    result = outline_layers(gm)
    assert result.units == ("layers.0",)
    assert "layers.1.unused" in dict(gm.named_parameters())


def test_a_layer_whose_input_comes_after_it_starts_is_left_alone() -> None:
    root = nn.Module()
    root.a = Block()
    graph = fx.Graph()
    x = graph.placeholder("x")
    w, b = graph.get_attr("a.w"), graph.get_attr("a.b")
    first = graph.call_function(torch.matmul, (x, w))
    first.meta["layer_path"] = "a"
    late = graph.call_function(torch.neg, (x,))  # not the layer's, read by its second node
    second = graph.call_function(torch.add, (first, late))
    second.meta["layer_path"] = "a"
    graph.output(graph.call_function(torch.add, (second, b)))
    gm = fx.GraphModule(root, graph)
    assert outline_layers(gm).units == ()


def test_non_persistent_buffers_stay_out_of_the_state_dict() -> None:
    gm = _export_style(blocks=1)
    gm.get_submodule("layers.0").register_buffer("scale", torch.ones(4), persistent=False)
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        scale = graph.get_attr("layers.0.scale")
        scaled = graph.call_function(torch.mul, (output.args[0], scale))
        scaled.meta["layer_path"] = "layers.0"
    output.args = (scaled,)
    gm.recompile()
    keys = list(gm.state_dict())
    assert outline_layers(gm).units == ("layers.0",)
    assert list(gm.state_dict()) == keys == ["layers.0.w", "layers.0.b"]


def test_modules_already_called_are_units_as_they_are() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    gm = fx.symbolic_trace(model)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            node.meta["layer_path"] = str(node.target)
    result = outline_layers(gm)
    assert not result.modified and result.units == ("0", "2")  # ReLU holds nothing


def test_a_tensor_parallel_rank_graph_outlines_every_layer() -> None:
    """The rewrite labels what it makes for a node (its collectives too) with the node's
    layer, so each column- and row-parallel Linear is one unit, the collective beside a
    column layer's call included."""
    from partitioner import partition

    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    x = torch.randn(4, 16)
    pm = partition(model, ["cpu", "cpu"], tensor_parallel=2, example_inputs=(x,))
    rank = next(iter(pm.stages.values()))[0].ranks[0]
    assert all("layer_path" in n.meta for n in rank.graph.nodes
               if n.op.startswith("call_"))
    result = outline_layers(rank)  # (a rank's graph alone would wait for its peer)
    assert result.units == ("0", "2", "4", "6")
    assert [n.target for n in rank.graph.nodes if n.op == "call_module"
            and n.target in result.units] == ["0", "2", "4", "6"]
