"""Per-operation and per-layer costs: what a plan's stages take on a device.

A model becomes a :class:`Workload`: its layers in order, each a list of :class:`Op` costed
*per sample* (one row of dim 0), the bytes live at each boundary between layers, and the
batch. Costs per sample let the planner try any micro-batch size: an op on ``n`` samples has
``n`` times the FLOPs and activation bytes, but reads its weights once, so small micro-batches
pay the weight traffic (and the fixed cost per op) more often. That is the per-micro-batch
overhead that makes 8 micro-batches of 8 rows slower than one of 64.

Time of one op on a :class:`~partitioner.cost.devices.DeviceSpec` (roofline):

* a matrix product of ``f`` FLOPs moving ``m`` bytes takes ``max(f / rate(f), m / bw)``,
  where ``rate`` is the device's achievable-efficiency curve (small products reach less of
  the peak), plus repacking its weights on CPUs; its backward is two products of the same
  size (input and weight gradients) plus writing the weight gradient;
* a fused attention kernel (``"attention"``) of ``f`` FLOPs takes ``f / attention_rate(f)``
  (FlashAttention-2 reaches 35% of an H100's peak where products reach 80%), its backward
  :data:`ATTENTION_BACKWARD` times that;
* a memory-bound op (element-wise, normalisation, softmax, copies) takes ``m / bw``, its
  backward ``backward`` times that; views move nothing;
* each op launch adds ``op_overhead``;
* on CPUs, a new tensor too large for ``malloc`` to reuse (glibc: above 32 MiB) is faulted
  in at ``fresh_bandwidth``: an op's output, and in its backward the inputs' gradient and
  the weight gradient.

Under ``tp``-way tensor parallelism the ops marked ``split`` (Megatron's column/row parallel
matrix products and what lies between them) are divided by ``tp``; the layer's
``tp_all_reduces`` all-reduces of its output are charged by :mod:`partitioner.cost.comm`.

Example:
    >>> op = Op("matmul", flops=2 * 1024 * 1024, bytes=8 * 1024, weight_read=4 * 2**20)
    >>> layer = LayerCost("fc", (op,), param_bytes=4 * 2**20)
    >>> from partitioner.cost.devices import DeviceSpec
    >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 8e9, 1e10, 0.9, 5e7, 1.0, 1e-5)
    >>> one = sum(phase_times(layer, cpu, 64))
    >>> eight = 8 * sum(phase_times(layer, cpu, 8))
    >>> round(eight / one, 1)  # eight micro-batches read the weights eight times
    2.9
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.cost.devices import DeviceSpec, dtype_name
from partitioner.cost.grad_flow import is_linear, needs_grad, reaches_inputs
from partitioner.errors import CostModelError
from partitioner.passes.base import attr_value
from partitioner.passes.group_layers import Layer
from partitioner.passes.liveness import live_values
from partitioner.passes.shape_prop import tensor_bytes

__all__ = ["CostModelError", "Op", "LayerCost", "Workload", "layer_costs", "boundary_bytes",
           "workload_from_graph", "op_times", "weight_time", "phase_times",
           "layer_time", "pack_time", "OP_KINDS", "ATTENTION_BACKWARD"]

OP_KINDS = ("matmul", "attention", "memory")

ATTENTION_BACKWARD = 2.5
"""A fused attention kernel's backward FLOPs over its forward's: FlashAttention's backward
recomputes the scores and does five products to the forward's two, and its benchmarks count
it as 2.5 forwards (``flops()`` in flash-attention's ``benchmarks/benchmark_flash_attention.py``),
the count :attr:`~partitioner.cost.devices.DeviceSpec.attention_efficiency` is measured by."""


@dataclass(frozen=True)
class Op:
    """One operation of a layer: its forward cost per sample.

    Attributes:
        kind: ``"matmul"`` (matrix products, convolutions, unfused attention),
            ``"attention"`` (a fused attention kernel: FlashAttention's products and softmax,
            at the device's ``attention_rate``) or ``"memory"``.
        flops: forward FLOPs per sample.
        bytes: activation bytes read and written per sample in the forward.
        weight_read: parameter bytes read per call, whatever the number of samples.
        weight_grad: bytes of the parameters' gradient, written by each backward call (and
            read, added and written again when it accumulates into an existing ``.grad``).
        split: whether tensor parallelism divides this op ``tp`` ways.
        backward: for memory ops, backward bytes over forward bytes (reading the saved input
            and the output gradient, writing the input gradient: 1.5).
        count: how many identical ops this entry stands for.
        out_bytes: bytes per sample of its output (a new tensor every call; part of
            ``bytes``, whose rest is its inputs).
        replay: the share of its forward run again in the backward (per-layer activation
            checkpointing: 1 under full recomputation; a selective policy replays what it
            did not save): added to its backward by :func:`phase_times`.
        input_grad: whether its backward computes its inputs' gradient. Autograd skips it
            where no input needs one (the model's first product on the batch, which no
            parameter is upstream of): a ``matmul`` then runs one product in its backward
            (the weight gradient) instead of two, a ``memory`` op only its weight gradient.
            Traced on 4 gloo ranks, the first stage of ``mlp([1024, 4096, ...])`` spent
            0.4 ms in its input-gradient action against 4 ms in every other stage's
            (docs/benchmarks.md, "A backward with no input to reach").
        queued: whether a schedule that splits its backwards queues this product's weight
            gradient for its ``W`` action: a Linear's (``passes.fuse_weight_grads`` routes
            every ``nn.Linear`` and ``F.linear`` through ``runtime.fused_linear``); other
            products (convolutions) compute theirs with the input gradients, in ``I``
            (:func:`weight_time`).
    """

    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    weight_read: float = 0.0
    weight_grad: float = 0.0
    split: bool = False
    backward: float = 1.5
    count: int = 1
    out_bytes: float = 0.0
    replay: float = 0.0
    input_grad: bool = True
    queued: bool = True

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}" for k in
                    ("flops", "bytes", "weight_read", "weight_grad", "backward", "out_bytes",
                     "replay") if not getattr(self, k) >= 0]
        if self.kind not in OP_KINDS:
            problems.append(f"kind={self.kind!r} (use one of {OP_KINDS})")
        if self.count < 1:
            problems.append(f"count={self.count!r}")
        if problems:
            raise CostModelError("bad Op: " + ", ".join(problems) + "; sizes are >= 0")


@dataclass(frozen=True)
class LayerCost:
    """A layer's cost: its ops per sample, parameters and what it keeps for the backward.

    Attributes:
        name: the layer's name (the module's qualified name).
        ops: its operations, forward costs per sample.
        param_bytes: bytes of its parameters.
        buffer_bytes: bytes of its buffers.
        activation_bytes: bytes per sample autograd keeps for the backward.
        split_param_bytes: the part of ``param_bytes`` tensor parallelism divides.
        split_activation_bytes: the part of ``activation_bytes`` it divides.
        output_bytes: bytes per sample of the layer's output (what a TP all-reduce sums).
        tp_all_reduces: all-reduces of the output per forward (and per backward) under TP.
        signature: equal for layers that cost the same (repeated blocks).
        time_scale: measured over predicted time (``calibrate=True``); scales every phase.
        param_tensors: how many parameter tensors it holds (an optimizer's fixed cost is
            per tensor).
        replayed_all_reduces: of its forward's ``tp_all_reduces``, how many run again in
            its backward when its ops replay their forward (``Op.replay``): all of them
            under full recomputation, the all-gathers' half under a policy that saves the
            reduce-scatters (``partitioner.planning.predict.layer_profile``).
        call_seconds: seconds its forward and its backward pay per call beyond the ops'
            costs, whatever the samples (autograd's bookkeeping, Python; not scaled by
            ``time_scale``): fitted by timing the model at two batch sizes
            (``partitioner.cost.measure.calibrate``), 0 otherwise.
    """

    name: str
    ops: tuple[Op, ...] = ()
    param_bytes: float = 0
    buffer_bytes: float = 0
    activation_bytes: float = 0.0
    split_param_bytes: float = 0.0
    split_activation_bytes: float = 0.0
    output_bytes: float = 0.0
    tp_all_reduces: int = 0
    signature: str = ""
    time_scale: float = 1.0
    param_tensors: int = 0
    replayed_all_reduces: float = 0.0
    call_seconds: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}" for k in
                    ("param_bytes", "buffer_bytes", "activation_bytes", "split_param_bytes",
                     "split_activation_bytes", "output_bytes", "tp_all_reduces",
                     "replayed_all_reduces")
                    if not getattr(self, k) >= 0]
        if len(self.call_seconds) != 2 or not min(self.call_seconds) >= 0:
            problems.append(f"call_seconds={self.call_seconds!r}")
        if not self.time_scale > 0:
            problems.append(f"time_scale={self.time_scale!r}")
        if self.split_param_bytes > self.param_bytes:
            problems.append(f"split_param_bytes={self.split_param_bytes} > param_bytes")
        if problems:
            raise CostModelError(f"bad LayerCost {self.name!r}: " + ", ".join(problems))
        if not self.signature:
            object.__setattr__(self, "signature", _digest(repr((self.ops, self.param_bytes,
                                                                self.activation_bytes))))

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs per sample."""
        return sum(op.flops * op.count for op in self.ops)

    @property
    def splittable(self) -> bool:
        """Whether tensor parallelism can split this layer."""
        return self.split_param_bytes > 0

    def params_on(self, tp: int) -> float:
        """Parameter bytes one tensor-parallel rank holds."""
        return self.param_bytes - self.split_param_bytes + self.split_param_bytes / tp

    def activations_on(self, tp: int) -> float:
        """Activation bytes per sample one tensor-parallel rank keeps (never below 0: a
        small head's split activations, counted at its input, can exceed what it keeps)."""
        return max(self.activation_bytes - self.split_activation_bytes, 0.0) \
            + self.split_activation_bytes / tp


@dataclass(frozen=True)
class Workload:
    """A model as the planner sees it: layers in order, boundaries, batch and precision.

    Attributes:
        layers: per-layer costs.
        boundaries: ``L + 1`` bytes per sample live at each boundary (0 and ``L`` hold none).
        batch: samples per training step.
        dtype: the compute dtype name (``"fp32"``, ``"bf16"``, ...).
        param_bytes_per_element: bytes of one parameter (4 for fp32, 2 for bf16).
        mixed_precision: whether an fp32 master copy of low-precision weights is kept.
        name: a label.
        notes: remarks about the model the planner must respect (e.g. batch norm).
        microbatch_safe: whether splitting the batch leaves the maths unchanged.
        splits: into how many pieces (micro-batches times replicas) the batch may be split,
            when the captured graph holds only for some sizes (``torch.export`` guards on
            the batch); ``None``: any.
        fsdp: parameters, gradients and optimizer state are sharded over the data-parallel
            replicas (FSDP, ``torch.distributed.fsdp.fully_shard``): each holds ``1/dp`` of
            them, and a step all-gathers the parameters in the forward and again in the
            backward and reduce-scatters the gradients (``3/2`` of an all-reduce's traffic;
            :attr:`reduce_scale` times the gradients' bytes: ``cost.comm.fsdp_time``).
        optimizer_scale: measured / predicted seconds of the optimizer step, from the
            model's own Adam step timed on this machine (``calibrate=True``); 1 otherwise.
    """

    layers: tuple[LayerCost, ...]
    boundaries: tuple[float, ...]
    batch: int
    dtype: str = "fp32"
    param_bytes_per_element: int = 4
    mixed_precision: bool = False
    name: str = "model"
    notes: tuple[str, ...] = field(default=())
    microbatch_safe: bool = True
    splits: tuple[int, ...] | None = None
    fsdp: bool = False
    optimizer_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "boundaries", tuple(float(b) for b in self.boundaries))
        problems = []
        if not self.layers:
            problems.append("no layers")
        if len(self.boundaries) != len(self.layers) + 1:
            problems.append(f"{len(self.boundaries)} boundaries for {len(self.layers)} layers "
                            f"(need {len(self.layers) + 1})")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            problems.append(f"batch={self.batch!r} (need an int >= 1)")
        if not self.optimizer_scale > 0:
            problems.append(f"optimizer_scale={self.optimizer_scale!r} (need a number > 0)")
        if problems:
            raise CostModelError(f"bad Workload {self.name!r}: " + "; ".join(problems))

    @property
    def reduce_scale(self) -> float:
        """Gradient bytes FSDP reduces per parameter byte: fp32 gradients where the
        parameters are low-precision copies of an fp32 master (torchtitan's default
        ``MixedPrecisionPolicy``), else the parameters' own dtype."""
        return 4 / self.param_bytes_per_element if self.mixed_precision else 1.0

    @property
    def max_tp(self) -> int:
        """1 when no layer can be split by tensor parallelism, else unbounded (0)."""
        return 0 if any(layer.splittable for layer in self.layers) else 1

    @property
    def param_bytes(self) -> float:
        """Bytes of every parameter."""
        return sum(layer.param_bytes for layer in self.layers)


def op_times(op: Op, spec: DeviceSpec, samples: float, tp: int = 1, dtype: str = "fp32",
             accumulate: float = 0.0) -> tuple[float, float]:
    """Seconds of ``op``'s forward and backward for ``samples`` samples on one rank.

    ``accumulate`` is the share of backward calls whose weight gradient is added to an
    existing ``.grad`` (``(m - 1) / m`` with ``m`` micro-batches): three more passes over it.

    Example:
        >>> from partitioner.cost.devices import DEVICES
        >>> f, b = op_times(Op("memory", bytes=1e6), DEVICES["A100-80GB"], 1000)
        >>> round(b / f, 2)
        1.5
    """
    share = tp if op.split else 1
    flops = op.flops * samples / share
    traffic = op.bytes * samples / share
    weights = op.weight_read / share
    grads = op.weight_grad / share * (1 + 3 * accumulate)
    bandwidth, overhead = spec.achievable_bandwidth, spec.op_overhead
    if op.kind == "attention":
        # One fused kernel each way, the backward doing ATTENTION_BACKWARD times the FLOPs.
        product = flops / spec.attention_rate(flops, dtype) if flops else 0.0
        forward = max(product, traffic / bandwidth) + overhead
        backward = ATTENTION_BACKWARD * max(product, traffic / bandwidth) + overhead
    elif op.kind == "matmul":
        one = _product_pass(op, spec, samples, tp, dtype)
        pack = pack_time(op, spec, tp)
        forward = one + pack
        # Two products: the input gradient (which repacks the weights again) and the weight
        # gradient (whose output is weight-sized: the gradient traffic below); the weight
        # gradient's alone where no input needs a gradient.
        products = 2 if op.input_grad else 1
        backward = products * one + (pack if op.input_grad else 0.0) + grads / bandwidth
    else:
        forward = (traffic + weights) / bandwidth + overhead
        if op.input_grad:
            backward = op.backward * traffic / bandwidth + grads / bandwidth + overhead
        else:  # nothing to send back: its weight gradient, if it has one
            backward = grads / bandwidth + overhead if op.weight_grad else 0.0
    if spec.fresh_bandwidth:
        # New tensors too large for the allocator to reuse are faulted in: the output, and in
        # the backward the inputs' gradient and a new weight gradient (added to ``.grad``).
        out = op.out_bytes * samples / share
        forward += spec.fresh_time(out)
        backward += spec.fresh_time(traffic - out) * op.input_grad \
            + spec.fresh_time(op.weight_grad / share)
    return forward * op.count, backward * op.count


def weight_time(layer: LayerCost, spec: DeviceSpec, samples: float, tp: int = 1,
                dtype: str = "fp32", accumulate: float = 0.0) -> float:
    """Seconds of a layer's backward that a split backward's ``W`` action runs: the weight
    gradients of its queued products (:attr:`Op.queued`: one product each, the gradient's
    write, and its faulting in where too large for the allocator), scaled like
    :func:`phase_times`; the rest of its backward (input gradients, element-wise ops,
    other parameters' gradients) is ``I``'s.

    Example:
        >>> from partitioner.cost.devices import DeviceSpec
        >>> cpu = DeviceSpec("cpu", {"fp32": 1e11}, 8e9, 1e10, 0.9, 5e7, 1.0, 1e-5)
        >>> op = Op("matmul", flops=2 * 1024 * 1024, bytes=8 * 1024, weight_read=4 * 2**20,
        ...         weight_grad=4 * 2**20)
        >>> layer = LayerCost("fc", (op, Op("memory", bytes=8 * 1024)), param_bytes=4 * 2**20)
        >>> w, (f, b) = weight_time(layer, cpu, 64), phase_times(layer, cpu, 64)
        >>> round(w / b, 2)  # one of two products, the gradient's write; no element-wise op
        0.54
    """
    total = 0.0
    for op in layer.ops:
        if op.kind != "matmul" or not op.weight_grad or not op.queued:
            continue
        share = tp if op.split else 1
        grads = op.weight_grad / share * (1 + 3 * accumulate)
        seconds = _product_pass(op, spec, samples, tp, dtype) \
            + grads / spec.achievable_bandwidth
        if spec.fresh_bandwidth:
            seconds += spec.fresh_time(op.weight_grad / share)
        total += seconds * op.count
    return total * layer.time_scale


def pack_time(op: Op, spec: DeviceSpec, tp: int = 1) -> float:
    """Seconds a ``matmul`` op's product repacks its weights (its forward, and its input
    gradient's again), one rank's share of them: no time without a ``pack_bandwidth``."""
    share = tp if op.split else 1
    return op.weight_read / share / spec.pack_bandwidth if spec.pack_bandwidth else 0.0


def _product_pass(op: Op, spec: DeviceSpec, samples: float, tp: int, dtype: str) -> float:
    """Seconds of one product of a ``matmul`` op's size (its forward, either gradient):
    the roofline of its FLOPs and of its activations and weights read, plus the launch."""
    share = tp if op.split else 1
    flops = op.flops * samples / share
    moved = (op.bytes * samples + op.weight_read) / share
    product = flops / spec.matmul_rate(flops, dtype) if flops else 0.0
    return max(product, moved / spec.achievable_bandwidth) + spec.op_overhead


def phase_times(layer: LayerCost, spec: DeviceSpec, samples: float, tp: int = 1,
                dtype: str = "fp32", accumulate: float = 0.0) -> tuple[float, float]:
    """Seconds of a layer's forward and backward for a micro-batch of ``samples``, with its
    ``call_seconds``; the backward includes what each op replays of its forward
    (``Op.replay``, and that share of the forward's call). Tensor-parallel communication is
    not included (see :mod:`partitioner.cost.comm`)."""
    forward = backward = replayed = 0.0
    for op in layer.ops:
        f, b = op_times(op, spec, samples, tp, dtype, accumulate)
        forward += f
        replayed += f * op.replay
        backward += b + f * op.replay
    call, again = layer.call_seconds, replayed / forward if forward > 0 else 0.0
    return (forward * layer.time_scale + call[0],
            backward * layer.time_scale + call[1] + call[0] * again)


def layer_time(layer: LayerCost, spec: DeviceSpec, samples: float, *, tp: int = 1,
               checkpoint: bool = False, dtype: str = "fp32", accumulate: float = 0.0) -> float:
    """Seconds of forward + backward (+ replayed forward when checkpointed) of one layer."""
    forward, backward = phase_times(layer, spec, samples, tp, dtype, accumulate)
    return forward * (2 if checkpoint else 1) + backward


def _weights(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return list(module.parameters()) + list(module.buffers())
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = attr_value(gm, str(arg.target))
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def _is_view(node: fx.Node) -> bool:
    """Whether the node moves no data: every tensor it returns is a view (or none at all)."""
    leaves = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return all(v._base is not None for v in leaves)


def _node_op(gm: fx.GraphModule, node: fx.Node, batch: int,
             tracked: set[str]) -> tuple[Op, bool] | None:
    """The op of one call node (per sample) and whether it multiplies by a weight;
    ``tracked`` (:func:`needs_grad`) says whether its backward reaches its inputs."""
    cost = node.meta["cost"]
    input_grad = reaches_inputs(node, tracked)
    queued = is_linear(gm, node)
    weights = _weights(gm, node)
    param_bytes = sum(t.numel() * t.element_size() for t in weights if t.requires_grad
                      or isinstance(t, torch.nn.Parameter))
    weight_bytes = sum(t.numel() * t.element_size() for t in weights)
    out = cost.activation_bytes
    if cost.forward_flops > 0:
        inputs = cost.input_bytes - weight_bytes if node.op == "call_module" else \
            sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes
                if a.op != "get_attr")
        traffic = max(inputs, 0) + out
        return Op("matmul", cost.forward_flops / batch, traffic / batch, weight_bytes,
                  param_bytes, split=param_bytes > 0, out_bytes=out / batch,
                  input_grad=input_grad, queued=queued), param_bytes > 0
    if _is_view(node):
        return None
    inputs = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes
                 if a.op != "get_attr")
    # A gathered row of an embedding table is read once; its gradient is the whole table.
    read = min(weight_bytes, out)
    return Op("memory", 0.0, (inputs + out) / batch, read, param_bytes,
              out_bytes=out / batch, input_grad=input_grad), False


def layer_costs(gm: fx.GraphModule, layers: Sequence[Layer],
                batch: int | None = None) -> list[LayerCost]:
    """Per-layer costs from a graph annotated by ``partitioner.passes.annotate_cost``.

    Args:
        gm: the captured graph after shape propagation and cost annotation.
        layers: its layers (``partitioner.passes.group_layers``).
        batch: samples in the example inputs (default: dim 0 of the first placeholder).

    Returns:
        One :class:`LayerCost` per layer, per sample; parameters reached through
        ``get_attr`` are charged to their first user's layer (tied weights once).
    """
    if batch is None:
        batch = _batch_of(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    attr_layer: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for name in layer.nodes:
            for used in nodes[name].all_input_nodes:
                if used.op == "get_attr":
                    attr_layer.setdefault(used.name, index)
    tracked = needs_grad(gm)
    return [_layer_cost(gm, index, layer, nodes, attr_layer, batch, tracked)
            for index, layer in enumerate(layers)]


def _batch_of(gm: fx.GraphModule) -> int:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            for leaf in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                    return int(leaf.shape[0])
    return 1


def _layer_cost(gm: fx.GraphModule, index: int, layer: Layer, nodes: dict[str, fx.Node],
                attr_layer: dict[str, int], batch: int, tracked: set[str]) -> LayerCost:
    members = [nodes[n] for n in layer.nodes]
    owned = members + [nodes[a] for a, k in attr_layer.items() if k == index]
    node_costs = [n.meta["cost"] for n in owned]
    ops, weight_products = [], 0
    for node in members:
        made = _node_op(gm, node, batch, tracked)
        if made is not None:
            ops.append(made[0])
            weight_products += made[1]
    params = sum(c.param_bytes for c in node_costs)
    split = sum(op.weight_grad for op in ops if op.split)
    kept = sum(tensor_bytes(n.meta.get("val")) for n in members if not _is_view(n)) / batch
    kept_split = sum(op.bytes for op in ops if op.split) / 2
    output = tensor_bytes(members[-1].meta.get("val")) / batch
    return LayerCost(layer.name, tuple(ops), params, sum(c.buffer_bytes for c in node_costs),
                     kept, min(split, params), kept_split, output,
                     math.ceil(weight_products / 2), _signature(gm, members, tracked),
                     param_tensors=sum(_parameter_tensors(gm, n) for n in owned))


def _parameter_tensors(gm: fx.GraphModule, node: fx.Node) -> int:
    """Parameter tensors a node holds: a ``get_attr`` of one, or a module's own."""
    if node.op == "get_attr" and node.meta["cost"].param_bytes > 0:
        return 1
    if node.op == "call_module":
        return sum(1 for _ in gm.get_submodule(str(node.target)).parameters())
    return 0


def _signature(gm: fx.GraphModule, members: list[fx.Node], tracked: set[str]) -> str:
    """Equal for layers that cost the same: the same ops on the same shapes, their
    backwards reaching their inputs alike (the model's first layer on the batch does not)."""
    parts: list[Any] = []
    for node in members:
        target = type(gm.get_submodule(str(node.target))).__name__ \
            if node.op == "call_module" else str(getattr(node.target, "__name__", node.target))
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        weights = tuple(tuple(t.shape) for t in _weights(gm, node))
        parts.append((node.op, target, shape, weights, reaches_inputs(node, tracked)))
    return _digest(repr(parts))


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def boundary_bytes(gm: fx.GraphModule, layers: Sequence[Layer]) -> list[int]:
    """Bytes live at each boundary ``b`` in ``0..L`` for the example batch (0 and L hold none)."""
    index = {name: k for k, layer in enumerate(layers) for name in layer.nodes}
    unit_of = {n: index[n.name] for n in gm.graph.nodes if n.name in index}
    live = live_values(gm, unit_of, len(layers))
    return [0] + [sum(tensor_bytes(n.meta.get("val")) for n in values) for values in live] + [0]


_NORMS = ("batch_norm", "BatchNorm", "SyncBatchNorm")


def workload_from_graph(gm: fx.GraphModule, layers: Sequence[Layer], batch: int,
                        name: str = "model") -> Workload:
    """The :class:`Workload` of a captured, shape-propagated, cost-annotated graph.

    Args:
        gm: the graph (``partitioner.passes.annotate_cost`` has run).
        layers: its layers.
        batch: samples in the example inputs (dim 0).
        name: a label.

    Returns:
        The workload; its dtype is that of the first floating-point parameter, and
        ``microbatch_safe`` is false when the graph has batch norm (micro-batches would
        change its statistics).
    """
    costs = layer_costs(gm, layers, batch)
    bounds = [b / batch for b in boundary_bytes(gm, layers)]
    floats = [p for p in gm.parameters() if p.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.float32
    norms = [n.name for n in gm.graph.nodes if any(
        word in (type(gm.get_submodule(str(n.target))).__name__ if n.op == "call_module"
                 else str(n.target)) for word in _NORMS)]
    notes = (f"batch norm at {norms[0]}: micro-batches would change its statistics",) \
        if norms else ()
    return Workload(tuple(costs), tuple(bounds), batch, dtype_name(dtype),
                    torch.empty((), dtype=dtype).element_size(), dtype != torch.float32,
                    name, notes, microbatch_safe=not norms)
