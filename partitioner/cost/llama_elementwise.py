"""Bytes a Llama decoder layer's element-wise steps move per token, fused or eager.

Between its products a Llama layer normalises (RMSNorm, twice), rotates q and k (rotary
embeddings), gates the MLP (``silu(gate) * up``) and adds the residuals. Fused (one kernel
per step, as ``torch.compile`` or hand-written kernels run them) each step reads its inputs
and writes its output once, in the activations' dtype. Run eagerly, each PyTorch call is a
kernel of its own with its own trip through memory, and the norms and the rotation go
through fp32 as torchtitan's Llama (``torchtitan/models/norms.py`` ``RMSNorm``,
``torchtitan/models/llama/model.py`` ``apply_rotary_emb``, at commit 9dec370, the one its
``benchmarks/llama3_h100_202412_torchtitan.md`` ran) and transformers' ``LlamaRMSNorm``
write them. Per token, ``e`` bytes per activation, 4 per fp32 value, hidden ``h``, KV width
``g``, intermediate ``I`` (forward; a memory-bound op's backward is ``Op.backward`` times
that):

========  =========  =========================================  ==================
step      fused      eager kernels                              eager
========  =========  =========================================  ==================
RMSNorm   ``2 e h``  ``float()``, ``pow``, ``mean``, ``*          ``(28 + 4 e) h``
                     rsqrt``, ``type_as``, ``* weight``
rotary q  ``3 e h``  ``float()``, complex multiply, ``type_as``  ``(16 + 2 e) h``
rotary k  ``3 e g``  the same on k                              ``(16 + 2 e) g``
SwiGLU    ``4 e I``  ``silu(gate)``, ``* up``                   ``5 e I``
========  =========  =========================================  ==================

The residual adds (``3 e h``: one kernel either way), the KV heads' repeat and the heads'
reshape are the same copies fused or not.

Example:
    >>> fused, eager = llama_elementwise(4096, 1024, 14336, 2), \\
    ...     llama_elementwise(4096, 1024, 14336, 2, fused=False)
    >>> eager.norm / fused.norm, eager.rotary_q / fused.rotary_q
    (9.0, 3.3333333333333335)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ElementwiseBytes", "llama_elementwise", "compiled_problem"]

_FP32 = 4


@dataclass(frozen=True)
class ElementwiseBytes:
    """Forward bytes per token of each element-wise step of a Llama decoder layer.

    Attributes:
        norm: one RMSNorm (its weight read aside).
        rotary_q: rotary embedding of the queries.
        rotary_k: rotary embedding of the keys.
        swiglu: ``silu(gate) * up``.
        residual: one residual add.
    """

    norm: float
    rotary_q: float
    rotary_k: float
    swiglu: float
    residual: float


def llama_elementwise(hidden: int, kv_width: int, intermediate: int, element_bytes: int,
                      fused: bool = True) -> ElementwiseBytes:
    """The bytes of the module's table for one token.

    Args:
        hidden: ``h``.
        kv_width: ``g``, the output features of k_proj.
        intermediate: ``I``, the MLP's intermediate size.
        element_bytes: ``e``, bytes per activation (2 for bf16).
        fused: one kernel per step (``True``) or eager PyTorch's kernels (``False``).
    """
    h, g, i, e = hidden, kv_width, intermediate, element_bytes
    if fused:
        return ElementwiseBytes(2 * e * h, 3 * e * h, 3 * e * g, 4 * e * i, 3 * e * h)
    # RMSNorm: cast (e + 4), square (4 + 4), mean (4), scale (4 + 4), cast back (4 + e), then
    # times the weight (e + e), per hidden value.
    norm = (e + _FP32) + 2 * _FP32 + _FP32 + 2 * _FP32 + (_FP32 + e) + 2 * e
    # Rotary: cast (e + 4), complex multiply (4 + 4; the table of angles is small), cast back.
    rotary = (e + _FP32) + 2 * _FP32 + (_FP32 + e)
    return ElementwiseBytes(norm * h, rotary * h, rotary * g, (2 + 3) * e * i, 3 * e * h)


def compiled_problem(compiled: object, *, here: bool = False) -> str | None:
    """Why ``compiled=`` (how these steps will run: fused, or eagerly) cannot be taken, or
    ``None``. ``here``: for this machine's runtimes, which run eagerly; the option
    describes a run on a cluster beyond this machine (``partitioner.request``,
    ``partitioner.planning.options``).

    Example:
        >>> print(compiled_problem("yes"))
        compiled='yes'; pass True (the model runs under torch.compile), False (eagerly) or None
    """
    if compiled is None:
        return None
    if not isinstance(compiled, bool):
        return (f"compiled={compiled!r}; pass True (the model runs under torch.compile), "
                "False (eagerly) or None")
    if here:
        return (f"compiled={compiled} is read by make_plan for a Cluster beyond this machine "
                "(pass make_plan a Cluster.preset(...): how a transformers Llama model's "
                "element-wise steps are costed); the runtimes here run eagerly: omit it")
    return None
