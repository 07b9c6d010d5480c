"""passes/unbake_meta: a graph captured from a meta-built model runs on a real device."""

from __future__ import annotations

import torch
from torch import nn

from partitioner.capture import capture
from partitioner.passes.unbake_meta import holds_meta_device, unbake_meta


class Rotary(nn.Module):
    """A rotary-like module: a non-persistent buffer cast with ``.to(device)``, positions
    made with ``arange(device=...)`` (what transformers' Llama does)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(1, 5).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # int() of a size defeats symbolic tracing: captured by export, as Llama is.
        positions = torch.arange(int(x.shape[1]), device=x.device).float()
        freq = self.inv_freq.to(x.device, torch.float32)
        return self.proj(x) * (positions[:, None] * freq).cos()


def _exported_on_meta() -> torch.fx.GraphModule:
    with torch.device("meta"):
        model = Rotary()
    return capture(model, (torch.ones(2, 3, 4, device="meta"),)).graph_module


def test_a_graph_captured_on_meta_holds_the_meta_device_and_loses_it() -> None:
    gm = _exported_on_meta()
    assert any(holds_meta_device((n.args, n.kwargs)) for n in gm.graph.nodes)
    result = unbake_meta(gm, torch.device("cpu"))
    assert result.modified
    assert not any(holds_meta_device((n.args, n.kwargs)) for n in gm.graph.nodes)


def test_the_unbaked_graph_computes_what_the_model_does_on_real_tensors() -> None:
    gm = _exported_on_meta()
    torch.manual_seed(0)
    real = Rotary()
    for name, tensor in [*real.named_parameters(), *real.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        target = gm.get_submodule(owner) if owner else gm
        store = target._parameters if leaf in target._parameters else target._buffers
        store[leaf] = tensor
    x = torch.randn(2, 3, 4)
    unbake_meta(gm, torch.device("cpu"))
    (out,) = gm(x)  # export graphs return their outputs flat
    torch.testing.assert_close(out, real(x))


def test_other_devices_and_a_meta_target_are_left_alone() -> None:
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert not unbake_meta(gm, torch.device("cpu")).modified
    meta = _exported_on_meta()
    assert not unbake_meta(meta, torch.device("meta")).modified
