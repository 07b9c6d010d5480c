"""A workload as mixed-precision training runs it: bf16/fp16 compute, fp32 parameters.

The cost model reads a model's dtype from its parameters (``workload_from_graph``), so a
model built in fp32, as mixed-precision users build it, would be costed at fp32 speed.
``precision="bf16"`` (or ``"fp16"``) runs every stage under autocast
(``partitioner.runtime.precision``); :func:`precision_workload` says what that changes:

* matrix products run at the device's bf16/fp16 rate (``Workload.dtype``);
* activations, the values crossing stages and the bytes element-wise ops move are 2 bytes
  an element instead of 4 (autocast's outputs; a few ops such as softmax in fp32 on some
  devices are not singled out);
* each forward casts the fp32 weights to a 2-byte copy (read 4 bytes, write 2) that the
  products then read (2): the weight traffic of a product doubles;
* parameters stay fp32 and are the master weights: 4 bytes of weight, 4 of gradient and the
  optimizer's fp32 state (Adam: 8), ``per_parameter_bytes(opt, 4, mixed_precision=False)``.
  No bf16 copy of the weights is kept between steps (``Workload.mixed_precision`` is false:
  that flag models the other scheme, bf16 weights with a separate fp32 master copy); the
  cast copy autocast saves for the backward is counted with the activations' reduction
  (it is per micro-batch in flight and not modelled separately).

Example:
    >>> from partitioner.cost.cost import LayerCost, Op, Workload
    >>> w = Workload((LayerCost("fc", (Op("matmul", flops=1e6, bytes=8e3, weight_read=4e6),),
    ...                         param_bytes=4e6, activation_bytes=4e3),), (0.0, 0.0), 8)
    >>> b = precision_workload(w, "bf16")
    >>> b.dtype, b.param_bytes_per_element, b.layers[0].activation_bytes, b.layers[0].ops[0].bytes
    ('bf16', 4, 2000.0, 4000.0)
"""

from __future__ import annotations

from dataclasses import replace

from partitioner.cost.cost import LayerCost, Op, Workload
from partitioner.errors import PrecisionError
from partitioner.runtime.precision import PRECISIONS, precision_problem

__all__ = ["precision_workload", "ACTIVATION_BYTES"]

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one activation element under each precision."""


def precision_workload(workload: Workload, precision: str) -> Workload:
    """``workload`` (costed from an fp32 model) as ``precision`` runs it.

    ``"fp32"`` returns it unchanged (whatever its parameters' dtype).

    Raises:
        PrecisionError: an unknown precision, or a model whose parameters are not fp32
            (autocast keeps the parameters as the master weights: they must be fp32).
    """
    problem = precision_problem(precision)
    if problem is not None:
        raise PrecisionError(problem)
    if precision == "fp32":
        return workload
    if workload.dtype != "fp32" or workload.param_bytes_per_element != 4:
        raise PrecisionError(
            f"precision={precision!r} keeps the parameters as fp32 master weights, but the "
            f"model's parameters are {workload.dtype}; build the model in float32 "
            f"(model.float()) or omit precision (one of {PRECISIONS})")
    share = ACTIVATION_BYTES[precision] / 4
    return replace(workload, layers=tuple(_layer(layer, share) for layer in workload.layers),
                   boundaries=tuple(b * share for b in workload.boundaries),
                   dtype=precision, param_bytes_per_element=4, mixed_precision=False)


def _layer(layer: LayerCost, share: float) -> LayerCost:
    return replace(layer, ops=tuple(_op(op, share) for op in layer.ops),
                   activation_bytes=layer.activation_bytes * share,
                   split_activation_bytes=layer.split_activation_bytes * share,
                   output_bytes=layer.output_bytes * share)


def _op(op: Op, share: float) -> Op:
    # A product reads the weights' 2-byte cast after casting them: 4 + 2 + 2 bytes, twice 4.
    weights = op.weight_read * 2 if op.kind == "matmul" else op.weight_read
    return replace(op, bytes=op.bytes * share, out_bytes=op.out_bytes * share,
                   weight_read=weights)
