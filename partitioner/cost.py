"""Per-layer and per-stage costs: what the planner minimises.

From the node costs written by ``passes.annotate_cost`` this module sums each layer's FLOPs,
bytes and operation count, finds the bytes live at each boundary, and turns them into a
``PartitionProblem`` for the solver: per micro-batch, each layer's forward + backward time on
each stage's device (roofline: the larger of compute time and memory time, plus a fixed cost
per operation), the time to receive the boundary activations, and each layer's memory.

Memory per layer: parameters and their gradients, buffers, and activations. Under GPipe all
micro-batches are in flight, so a layer holds its activations for the whole mini-batch; a
checkpointed layer holds only one micro-batch's worth (replayed in the backward).

Example:
    >>> LayerCost("fc", 2_000, 4_000, 400, 0, 64, 1, 500).memory(chunks=1, checkpoint=False)
    864
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from partitioner.devices import DeviceSpec, link_bandwidth
from partitioner.solver import PartitionProblem
from passes.group_layers import Layer
from passes.liveness import live_values
from passes.shape_prop import tensor_bytes

__all__ = ["LayerCost", "layer_costs", "boundary_bytes", "layer_time", "build_problem"]


@dataclass(frozen=True)
class LayerCost:
    """A layer's cost for one mini-batch of the example inputs."""

    name: str
    forward_flops: int
    backward_flops: int
    param_bytes: int
    buffer_bytes: int
    activation_bytes: int
    n_ops: int
    bytes_moved: int

    def memory(self, chunks: int, checkpoint: bool) -> int:
        """Bytes this layer holds on its device during a step."""
        activations = self.activation_bytes // chunks if checkpoint else self.activation_bytes
        return 2 * self.param_bytes + self.buffer_bytes + activations


def layer_costs(gm: fx.GraphModule, layers: Sequence[Layer]) -> list[LayerCost]:
    """Sum node costs per layer (``get_attr`` nodes are charged to their first user's layer)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    attr_layer: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for name in layer.nodes:
            for used in nodes[name].all_input_nodes:
                if used.op == "get_attr":
                    attr_layer.setdefault(used.name, index)
    costs = []
    for index, layer in enumerate(layers):
        members = [nodes[n] for n in layer.nodes]
        members += [nodes[a] for a, k in attr_layer.items() if k == index]
        node_costs = [n.meta["cost"] for n in members]
        costs.append(LayerCost(
            layer.name,
            sum(c.forward_flops for c in node_costs),
            sum(c.backward_flops for c in node_costs),
            sum(c.param_bytes for c in node_costs),
            sum(c.buffer_bytes for c in node_costs),
            sum(c.activation_bytes for c in node_costs),
            len(layer.nodes),
            sum(c.input_bytes + c.activation_bytes for c in node_costs)))
    return costs


def boundary_bytes(gm: fx.GraphModule, layers: Sequence[Layer]) -> list[int]:
    """Bytes live at each boundary ``b`` in ``0..L`` (0 and L hold none)."""
    index = {name: k for k, layer in enumerate(layers) for name in layer.nodes}
    unit_of = {n: index[n.name] for n in gm.graph.nodes if n.name in index}
    live = live_values(gm, unit_of, len(layers))
    return [0] + [sum(tensor_bytes(n.meta.get("val")) for n in values) for values in live] + [0]


def layer_time(cost: LayerCost, spec: DeviceSpec, chunks: int, checkpoint: bool) -> float:
    """Seconds of forward + backward (+ replay) for one micro-batch of this layer."""
    flops = cost.forward_flops * (2 if checkpoint else 1) + cost.backward_flops
    compute = flops / chunks / spec.flops
    traffic = 3 * cost.bytes_moved / chunks / spec.memory_bandwidth
    return max(compute, traffic) + 3 * cost.n_ops * spec.op_overhead


def build_problem(costs: Sequence[LayerCost], boundaries: Sequence[int],
                  devices: Sequence[torch.device], specs: Sequence[DeviceSpec], chunks: int,
                  checkpoint: bool, capacity: Sequence[float] | None = None) -> PartitionProblem:
    """The solver's problem for these layers on these devices (times per micro-batch)."""
    compute = [[layer_time(c, spec, chunks, checkpoint) for c in costs] for spec in specs]
    transfer = []
    for j, device in enumerate(devices):
        source = devices[j - 1] if j else device
        bandwidth = link_bandwidth(source, device)
        # Activations go forward and their gradients come back: twice the bytes.
        transfer.append([2 * b / chunks / bandwidth for b in boundaries])
    memory = [float(c.memory(chunks, checkpoint)) for c in costs]
    limits = list(capacity) if capacity is not None else [spec.memory_bytes for spec in specs]
    return PartitionProblem(tuple(map(tuple, compute)), tuple(map(tuple, transfer)),
                            tuple(memory), tuple(float(x) if x != math.inf else math.inf
                                                 for x in limits))
