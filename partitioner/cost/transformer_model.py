"""Analytic costs of a GPT-shaped model, from its shape alone (no graph, no weights).

For models too large to capture here, or to check the cost model against published
measurements, :func:`gpt_workload` lists the operations of Megatron-LM's GPT layer with
their physical sizes (per sample, i.e. per sequence of ``s`` tokens, hidden size ``h``,
``a`` heads, vocabulary ``V``, ``e`` bytes per element):

====================  =========================  ======================================
op                    FLOPs                      bytes moved (forward)
====================  =========================  ======================================
LayerNorm             --                         ``2 e s h``
QKV projection        ``6 s h^2``                ``e (s h + 3 s h)``, weights ``3 e h^2``
scores ``Q K^T``      ``2 s^2 h``                ``e (2 s h + a s^2)``
scale-mask-softmax    --                         ``2 e a s^2`` (fused kernel)
attention dropout     --                         ``(2 e + 1) a s^2`` (1-byte mask)
``probs V``           ``2 s^2 h``                ``e (a s^2 + 2 s h)``
context copy          --                         ``2 e s h`` (permute to contiguous)
output projection     ``2 s h^2``                ``2 e s h``, weights ``e h^2``
bias-dropout-add      --                         ``(3 e + 1) s h`` (fused)
LayerNorm             --                         ``2 e s h``
MLP up                ``8 s h^2``                ``5 e s h``, weights ``4 e h^2``
bias-GeLU             --                         ``8 e s h`` (fused)
MLP down              ``8 s h^2``                ``5 e s h``, weights ``4 e h^2``
bias-dropout-add      --                         ``(3 e + 1) s h``
====================  =========================  ======================================

That is ``24 s h^2 + 4 s^2 h`` FLOPs per layer forward, the count in Narayanan et al.
(SC'21); tensor parallelism splits the products and what lies between them (Megatron's
column/row pairs) and all-reduces the layer's output twice per pass. Activations kept per
layer are ``s h (34 + 5 a s / h)`` bytes (Korthikanti et al. 2022), ``24 s h + 5 a s^2`` of
them split by tensor parallelism. The first layer is the embedding (vocabulary-parallel, one
all-reduce), the last the final LayerNorm, the logits (tied to the embedding) and the
vocabulary-parallel cross-entropy in fp32.

Example:
    >>> shape = GPTShape(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200)
    >>> round(shape.parameters / 1e9, 2)
    1.65
    >>> w = gpt_workload(shape, batch=512)
    >>> len(w.layers), round(w.layers[1].forward_flops / 1e12, 3)  # per sequence
    (26, 0.3)
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.cost.cost import CostModelError, LayerCost, Op, Workload

__all__ = ["GPTShape", "gpt_workload", "megatron_flops", "megatron_boundaries"]


@dataclass(frozen=True)
class GPTShape:
    """The shape of a GPT model.

    Attributes:
        layers: transformer layers ``l``.
        hidden: hidden size ``h``.
        heads: attention heads ``a`` (dividing ``h``).
        seq: sequence length ``s``.
        vocab: vocabulary size ``V``.

    Raises:
        CostModelError: a size is not a positive int, or ``heads`` does not divide ``hidden``.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)!r}" for k in
                    ("layers", "hidden", "heads", "seq", "vocab")
                    if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int)
                    or getattr(self, k) < 1]
        if not problems and self.hidden % self.heads:
            problems.append(f"heads={self.heads} does not divide hidden={self.hidden}")
        if problems:
            raise CostModelError("bad GPTShape: " + ", ".join(problems)
                                 + "; pass positive ints with heads dividing hidden")

    @property
    def parameters(self) -> float:
        """``12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))`` (the paper's count)."""
        n, h = self.layers, self.hidden
        return 12 * n * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * n * h))


def megatron_flops(shape: GPTShape, batch: int) -> float:
    """FLOPs per iteration as Narayanan et al. count them, recomputation included.

    ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``.

    Example:
        >>> f = megatron_flops(GPTShape(24, 2304, 24, 2048, 51200), 512)
        >>> round(f / 1e15, 2)
        15.47
    """
    n, h, s = shape.layers, shape.hidden, shape.seq
    return 96 * batch * s * n * h * h * (1 + s / (6 * h) + shape.vocab / (16 * n * h))


def _block(shape: GPTShape, e: int) -> LayerCost:
    s, h, a = shape.seq, shape.hidden, shape.heads
    sh, scores = s * h, a * s * s
    ln = Op("memory", bytes=2 * e * sh, weight_read=2 * e * h, weight_grad=2 * e * h)
    fused_add = Op("memory", bytes=(3 * e + 1) * sh, weight_read=e * h, weight_grad=e * h)
    ops = (
        ln,
        Op("matmul", 6 * sh * h, e * 4 * sh, 3 * e * h * h, 3 * e * h * h, split=True),
        Op("matmul", 2 * s * sh, e * (2 * sh + scores), split=True),
        Op("memory", bytes=2 * e * scores, split=True),
        Op("memory", bytes=(2 * e + 1) * scores, split=True),
        Op("matmul", 2 * s * sh, e * (scores + 2 * sh), split=True),
        Op("memory", bytes=2 * e * sh, split=True),
        Op("matmul", 2 * sh * h, 2 * e * sh, e * h * h, e * h * h, split=True),
        fused_add,
        ln,
        Op("matmul", 8 * sh * h, 5 * e * sh, 4 * e * h * h, 4 * e * h * h, split=True),
        Op("memory", bytes=8 * e * sh, split=True),
        Op("matmul", 8 * sh * h, 5 * e * sh, 4 * e * h * h, 4 * e * h * h, split=True),
        fused_add,
    )
    params = e * (12 * h * h + 13 * h)
    kept_split = 24 * sh + 5 * scores
    return LayerCost("block", ops, params, 0, 10 * sh + kept_split, e * 12 * h * h,
                     kept_split, e * sh, 2, f"gpt-block-{s}-{h}-{a}-{e}")


def _embedding(shape: GPTShape, e: int) -> LayerCost:
    s, h, v = shape.seq, shape.hidden, shape.vocab
    ops = (Op("memory", bytes=2 * e * s * h, weight_grad=e * v * h, split=True),
           Op("memory", bytes=3 * e * s * h, weight_grad=e * s * h),
           Op("memory", bytes=(2 * e + 1) * s * h))
    return LayerCost("embedding", ops, e * (v + s) * h, 0, 3 * s * h, e * v * h, 0.0,
                     e * s * h, 1, f"gpt-embedding-{s}-{h}-{v}-{e}")


def _head(shape: GPTShape, e: int) -> LayerCost:
    s, h, v = shape.seq, shape.hidden, shape.vocab
    ops = (Op("memory", bytes=2 * e * s * h, weight_read=2 * e * h, weight_grad=2 * e * h),
           Op("matmul", 2 * s * h * v, e * (s * h + s * v), e * v * h, e * v * h,
              split=True),
           Op("memory", bytes=(e + 8) * s * v, split=True))
    kept = 2 * e * s * h + 4 * s * v
    return LayerCost("head", ops, e * (v * h + 2 * h), 0, kept, e * v * h, 4 * s * v,
                     e * s * h, 1, f"gpt-head-{s}-{h}-{v}-{e}")


def gpt_workload(shape: GPTShape, batch: int, element_bytes: int = 2,
                 mixed_precision: bool = True) -> Workload:
    """The :class:`~partitioner.cost.cost.Workload` of a GPT model: embedding, blocks, head.

    Args:
        shape: the model's shape.
        batch: sequences per training step (the global batch).
        element_bytes: bytes per value (2 for bf16/fp16 training).
        mixed_precision: whether fp32 master weights and optimizer state are kept.

    Returns:
        ``layers + 2`` layers named ``embedding``, ``block.0`` .. and ``head``; boundaries
        are one hidden state (``e s h`` bytes) per sequence.
    """
    e = element_bytes
    block = _block(shape, e)
    blocks = [LayerCost(f"block.{k}", block.ops, block.param_bytes, 0, block.activation_bytes,
                        block.split_param_bytes, block.split_activation_bytes,
                        block.output_bytes, block.tp_all_reduces, block.signature)
              for k in range(shape.layers)]
    layers = (_embedding(shape, e), *blocks, _head(shape, e))
    hidden = float(e * shape.seq * shape.hidden)
    boundaries = (0.0, *([hidden] * (len(layers) - 1)), 0.0)
    return Workload(layers, boundaries, batch, {2: "bf16", 4: "fp32"}.get(e, "bf16"), e,
                    mixed_precision, f"GPT l={shape.layers} h={shape.hidden}")


def megatron_boundaries(shape: GPTShape, stages: int) -> tuple[int, ...]:
    """Megatron-LM's split: equal transformer layers per (virtual) stage, the embedding on
    the first and the head on the last.

    Example:
        >>> megatron_boundaries(GPTShape(4, 64, 4, 16, 100), 2)
        (0, 3, 6)
    """
    if shape.layers % stages:
        raise CostModelError(f"{shape.layers} layers do not split evenly into {stages} "
                             "stages; Megatron needs layers divisible by the stage count")
    per = shape.layers // stages
    return (0, *(1 + k * per for k in range(1, stages)), shape.layers + 2)
