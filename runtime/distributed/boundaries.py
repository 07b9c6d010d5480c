"""What crosses a pipeline stage's boundaries, predicted without running the model.

A rank holds one stage (or ``v`` virtual stages), yet must know the shapes and dtypes it
will receive before the first message arrives (to post its receives) and what it sends (to
check it). :class:`BoundaryPredictor` runs stages ``0..j`` on fake tensors (no compute, no
data) once per distinct micro-batch signature (``j`` the last stage it holds) and keeps
the result; every rank predicts the same boundaries from the same graphs and the same
stage-0 inputs.

Example:
    >>> import torch
    >>> from torch import fx, nn
    >>> graphs = [fx.symbolic_trace(nn.Linear(4, 3)), fx.symbolic_trace(nn.Linear(3, 2))]
    >>> predict = BoundaryPredictor(graphs, 1, [torch.device("cpu")] * 2)
    >>> interface = predict.interface([torch.randn(5, 4)])[1]
    >>> sent = interface.inputs
    >>> interface.outputs is None, [tuple(m.shape) for m in sent.metas(sent.tensor_positions)]
    (True, [(5, 3)])
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from partitioner.runtime.distributed.p2p import Boundary, BoundaryMismatchError
from partitioner.runtime.distributed.transport import StageInterface
from partitioner.runtime.precision import autocast

__all__ = ["BoundaryPredictor"]


class BoundaryPredictor:
    """What crosses this rank's stages' boundaries, predicted by running stages ``0..j`` on
    fake tensors (no compute, no data), once per distinct micro-batch signature.

    Args:
        graphs: every (virtual) stage's graph (other stages only lend their structure and
            shapes).
        stages: this rank's stage, or its virtual stages ``j, j + P, ...``.
        devices: where each stage's parameters live on this rank.
        precision: the stages' autocast precision (it sets the dtypes that cross).
    """

    def __init__(self, graphs: Sequence[fx.GraphModule], stages: int | Sequence[int],
                 devices: Sequence[torch.device], precision: str = "fp32") -> None:
        self.graphs = list(graphs)
        self.precision = precision
        self.stages = [stages] if isinstance(stages, int) else list(stages)
        self.devices = list(devices)
        self._cache: dict[Any, dict[int, StageInterface]] = {}

    def __call__(self, micro: list[list[Any]]) -> list[dict[int, StageInterface]]:
        return [self.interface(values) for values in micro]

    def interface(self, values: list[Any]) -> dict[int, StageInterface]:
        """Each of this rank's stages' interface for one micro-batch of stage-0 values."""
        key = _signature(values)
        if key not in self._cache:
            self._cache[key] = self._predict(values)
        return self._cache[key]

    def _predict(self, values: list[Any]) -> dict[int, StageInterface]:
        j, last = max(self.stages), len(self.graphs) - 1
        boundaries: list[Boundary] = []
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad(), \
                _eval_mode(self.graphs[:j + 1]):
            current = pytree.tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, values)
            for k in range(min(j, last - 1) + 1):
                device = self.devices[k]
                current = pytree.tree_map(
                    lambda v, d=device: v.to(d) if isinstance(v, torch.Tensor) else v, current)
                gm = self.graphs[k]
                try:
                    with _fake_meta_tensors(gm, device), _without_fsdp_hooks(gm), \
                            autocast(self.precision, device.type):
                        out = type(gm).forward(gm, *current)
                except Exception as error:
                    raise BoundaryMismatchError(
                        f"cannot predict what stage {k} sends on ({type(error).__name__}: "
                        f"{error}); values crossing stages must have shapes that follow from "
                        "the input shapes (no data-dependent shapes at a boundary)") from error
                boundaries.append(Boundary.of(out))
                current = list(out)
        return {k: StageInterface(boundaries[k - 1] if k > 0 else None,
                                  boundaries[k] if k < last else None) for k in self.stages}


def _signature(values: list[Any]) -> Any:
    leaves, spec = pytree.tree_flatten(values)
    return str(spec), tuple((tuple(v.shape), v.dtype, v.device.type)
                            if isinstance(v, torch.Tensor) else ("value", repr(v))
                            for v in leaves)


@contextmanager
def _fake_meta_tensors(gm: nn.Module, device: torch.device) -> Iterator[None]:
    """``gm``'s meta tensors (a stage of a meta-built model this rank does not hold) as
    fake tensors on ``device`` (no memory), so the stage is predicted where, and in the
    precision that, it runs; put back afterwards. Call inside the fake mode."""
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in gm.modules():
        stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for store in stores:
            for name, tensor in list(store.items()):
                # An FSDP stage's parameters are DTensors: predicted as whole fake tensors.
                sharded = type(tensor).__name__ == "DTensor"
                meta = tensor is not None and tensor.is_meta and device.type != "meta"
                if tensor is not None and (sharded or meta):
                    swapped.append((store, name, tensor))
                    store[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    try:
        yield
    finally:
        for store, name, tensor in swapped:
            store[name] = tensor


@contextmanager
def _without_fsdp_hooks(gm: nn.Module) -> Iterator[None]:
    """An FSDP stage's layers (``passes/outline_layers.py``) called without FSDP's hooks:
    the prediction runs on whole fake tensors, with nothing to gather or reduce."""
    from torch.distributed.fsdp import FSDPModule

    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in gm.modules()
             if m is not gm and isinstance(m, FSDPModule)]
    for module, _, _ in saved:
        module._forward_pre_hooks, module._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for module, pre, post in saved:
            module._forward_pre_hooks, module._forward_hooks = pre, post


@contextmanager
def _eval_mode(graphs: Sequence[nn.Module]) -> Iterator[None]:
    # Eval mode keeps batch norm from updating real running statistics with fake values.
    modes = {m: m.training for gm in graphs for m in gm.modules()}
    for m in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
