"""Analytic costs of GPT- and Llama-shaped models, from their shape alone (no graph, no
weights).

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

:class:`LlamaShape` and :func:`llama_workload` do the same for transformers' Llama:
grouped-query attention, SwiGLU, RMSNorm, rotary embeddings, a tied or untied head, and
key/value projections that tensor parallelism splits only when it divides their heads.

Example:
    >>> shape = GPTShape(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200)
    >>> round(shape.parameters / 1e9, 2)
    1.65
    >>> w = gpt_workload(shape, batch=512)
    >>> len(w.layers), round(w.layers[1].forward_flops / 1e12, 3)  # per sequence
    (26, 0.3)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from partitioner.cost.cost import CostModelError, LayerCost, Op, Workload
from partitioner.cost.llama_elementwise import llama_elementwise

__all__ = ["GPTShape", "gpt_workload", "megatron_flops", "megatron_boundaries", "LlamaShape",
           "LlamaTPComm", "LlamaRun", "llama_workload", "ATTENTIONS", "RECOMPUTES"]


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


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama model (transformers' ``LlamaForCausalLM``, no biases).

    Grouped-query attention (``kv_heads`` key/value heads shared by ``heads / kv_heads``
    query heads each), a SwiGLU MLP (``gate``, ``up``: ``h -> I``, ``down``: ``I -> h``),
    RMSNorm (one weight vector), rotary position embeddings (no parameters) and an LM head
    tied to the embedding or not. Per layer of ``s`` tokens, with ``d = h / a`` and the KV
    width ``g = kv d``:

    ====================  ======================  =========================================
    op                    FLOPs                   parameters
    ====================  ======================  =========================================
    q, o projections      ``2 s h^2`` each        ``h^2`` each
    k, v projections      ``2 s h g`` each        ``h g`` each
    scores, probs V       ``2 s^2 h`` each        --
    gate, up, down        ``2 s h I`` each        ``h I`` each
    two RMSNorms          --                      ``h`` each
    ====================  ======================  =========================================

    Tensor parallelism splits q, o, the MLP and the attention by heads; k and v split too
    when ``tp`` divides ``kv_heads``, else every rank holds them whole and slices the
    repeated keys and values to its heads (:meth:`kv_split`, :meth:`tp_comm`).

    Attributes:
        layers: decoder layers ``l``.
        hidden: hidden size ``h``.
        heads: query heads ``a`` (dividing ``h``).
        kv_heads: key/value heads (dividing ``heads``; ``heads`` for multi-head attention,
            1 for multi-query attention).
        intermediate: the MLP's intermediate size ``I``.
        seq: sequence length ``s``.
        vocab: vocabulary size ``V``.
        tied: whether the LM head shares the embedding's weight.

    Raises:
        CostModelError: a size is not a positive int, or the heads do not divide.

    Example:
        >>> shape = LlamaShape(32, 4096, 32, 8, 14336, 8192, 128256)  # Llama 3 8B
        >>> round(shape.parameters / 1e9, 2)
        8.03
        >>> shape.kv_split(4), shape.kv_split(16)
        (True, False)
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    seq: int
    vocab: int
    tied: bool = False

    def __post_init__(self) -> None:
        names = ("layers", "hidden", "heads", "kv_heads", "intermediate", "seq", "vocab")
        problems = [f"{k}={getattr(self, k)!r}" for k in names
                    if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int)
                    or getattr(self, k) < 1]
        if not problems and self.hidden % self.heads:
            problems.append(f"heads={self.heads} does not divide hidden={self.hidden}")
        if not problems and self.heads % self.kv_heads:
            problems.append(f"kv_heads={self.kv_heads} does not divide heads={self.heads}")
        if problems:
            raise CostModelError("bad LlamaShape: " + ", ".join(problems) + "; pass positive "
                                 "ints with heads dividing hidden and kv_heads dividing heads")

    @property
    def kv_width(self) -> int:
        """``g = kv_heads * hidden / heads``: the output features of k_proj and v_proj."""
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: ``2 h^2 + 2 h g + 3 h I + 2 h``."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + 3 * h * self.intermediate + 2 * h

    @property
    def parameters(self) -> int:
        """Every parameter, a tied head counted once (``LlamaForCausalLM.num_parameters()``)."""
        tables = self.vocab * self.hidden * (1 if self.tied else 2)
        return tables + self.layers * self.layer_parameters + self.hidden

    def forward_flops(self, batch: int = 1) -> float:
        """Forward FLOPs of ``batch`` sequences (matrix products only, as counted by
        ``torch.utils.flop_counter`` on the eager attention).

        ``l (4 s h^2 + 4 s h g + 4 s^2 h + 6 s h I) + 2 s h V`` per sequence.
        """
        s, h, g, i = self.seq, self.hidden, self.kv_width, self.intermediate
        layer = 4 * s * h * h + 4 * s * h * g + 4 * s * s * h + 6 * s * h * i
        return float(batch * (self.layers * layer + 2 * s * h * self.vocab))

    def kv_split(self, tp: int) -> bool:
        """Whether ``tp`` ranks split the k and v projections (``tp`` divides the KV heads);
        if not, each rank holds them whole."""
        return self.kv_heads % tp == 0

    def check_tp(self, tp: int) -> None:
        """Raise if ``tp`` splits no attention's heads.

        Raises:
            CostModelError: ``tp`` divides neither the query heads nor the KV heads.
        """
        if self.heads % tp:
            degrees = ", ".join(str(d) for d in range(1, self.heads + 1) if self.heads % d == 0)
            raise CostModelError(
                f"tensor_parallel={tp} divides neither heads={self.heads} nor "
                f"kv_heads={self.kv_heads}; use a degree dividing {self.heads} ({degrees})")

    def layer_parameters_on(self, tp: int) -> float:
        """Parameters one of ``tp`` ranks holds per decoder layer (norms and unsplit KV
        projections whole, the rest divided)."""
        self.check_tp(tp)
        h = self.hidden
        kv = 2 * h * self.kv_width
        split = 2 * h * h + 3 * h * self.intermediate + (kv if self.kv_split(tp) else 0)
        return split / tp + (self.layer_parameters - split)

    def tp_comm(self, tp: int, element_bytes: int = 2) -> LlamaTPComm:
        """Bytes per sequence one decoder layer communicates over ``tp`` ranks."""
        self.check_tp(tp)
        hidden = float(element_bytes * self.seq * self.hidden)
        gathers = 0.0 if self.kv_split(tp) or tp == 1 else 2 * hidden
        return LlamaTPComm(2 * hidden if tp > 1 else 0.0, 2 * hidden if tp > 1 else 0.0,
                           gathers)


@dataclass(frozen=True)
class LlamaTPComm:
    """What one decoder layer of a Llama model communicates per sequence under TP.

    Attributes:
        forward_all_reduce: bytes all-reduced in the forward (after o_proj and down_proj).
        backward_all_reduce: bytes all-reduced in the backward (the input gradients of the
            attention and the MLP, Megatron's ``f``).
        backward_all_gather: bytes all-gathered in the backward when the KV projections are
            whole: the gradients of the repeated keys and values (each ``s h`` values)
            that every rank sliced to its heads.
    """

    forward_all_reduce: float
    backward_all_reduce: float
    backward_all_gather: float


ATTENTIONS = ("eager", "flash")
"""How a Llama workload's attention runs: ``"eager"`` writes the ``(a, s, s)`` scores and
probabilities to memory and keeps the probabilities for the backward (transformers' eager
path); ``"flash"`` is one fused causal kernel (FlashAttention-2, Dao 2023, as torch's SDPA
runs it): no score matrix in memory or kept, and blocks above the causal diagonal skipped,
so its two products do half the nominal ``4 s^2 h`` FLOPs, at the device's attention rate
(an ``"attention"`` op of ``partitioner.cost.cost``)."""

RECOMPUTES = ("none", "selective", "full")
"""Per-layer activation recomputation of a Llama workload (``Op.replay`` of each op, and the
all-reduces a replay runs again, ``LayerCost.replayed_all_reduces``):

* ``"none"`` keeps every decoder layer's activations;
* ``"selective"`` is torchtitan's per-op policy (``selective_ac_option = "op"``, the default
  of its Llama configs: ``_save_list`` in ``parallelize_llama.py`` at commit 9dec370): the
  outputs of every other ``mm`` of a layer (q, v, gate and down), of the fused attention and
  of the reduce-scatters are kept; k, o, up, every element-wise step and the all-gathers are
  replayed;
* ``"full"`` keeps each layer's input only and replays its whole forward, its collectives
  included (Megatron's and torchtitan's full activation checkpointing, a layer at a time).

Korthikanti et al.'s selective recomputation (the attention core's ``s^2`` activations) is
what ``attention="flash"`` does inside its kernel."""


@dataclass(frozen=True)
class LlamaRun:
    """How a Llama model is trained, as far as one layer's costs depend on it.

    Attributes:
        sequence_parallel: Megatron's sequence parallelism (Korthikanti et al. 2022): the
            norms and residual adds between the column/row pairs run on ``s / tp`` tokens
            each, so every activation a layer keeps is divided by ``tp``; the all-reduce
            after each row-parallel product becomes a reduce-scatter and the entry of each
            column-parallel pair an all-gather, the same bytes on a ring (an all-reduce is
            a reduce-scatter then an all-gather), so the layer's communication is unchanged.
        attention: one of :data:`ATTENTIONS`.
        recompute: one of :data:`RECOMPUTES`.
        fused: each element-wise step one kernel (``torch.compile``, fused kernels), or
            eager PyTorch's kernels, the norms and rotary in fp32 (``False``; bytes of
            :mod:`partitioner.cost.llama_elementwise`).

    Raises:
        CostModelError: an unknown attention or recompute mode.
    """

    sequence_parallel: bool = False
    attention: str = "eager"
    recompute: str = "none"
    fused: bool = True

    def __post_init__(self) -> None:
        problems = [f"{name}={value!r} (use one of {known})" for name, value, known in
                    (("attention", self.attention, ATTENTIONS),
                     ("recompute", self.recompute, RECOMPUTES)) if value not in known]
        if problems:
            raise CostModelError("bad LlamaRun: " + ", ".join(problems))

    def label(self) -> str:
        """A short description, e.g. ``"sp, flash, full recompute"``."""
        parts = ["sp"] if self.sequence_parallel else []
        eager = [] if self.fused else ["eager element-wise"]
        return ", ".join([*parts, self.attention, f"{self.recompute} recompute", *eager])


def _llama_block(shape: LlamaShape, e: int, kv_split: bool,
                 run: LlamaRun = LlamaRun()) -> LayerCost:
    s, h, a, g, i = shape.seq, shape.hidden, shape.heads, shape.kv_width, shape.intermediate
    sh, sp = s * h, run.sequence_parallel
    flash = run.attention == "flash"
    scores = 0 if flash else a * s * s
    step = llama_elementwise(h, g, i, e, run.fused)
    norm = Op("memory", bytes=s * step.norm, weight_read=e * h, weight_grad=e * h, split=sp)
    add = Op("memory", bytes=s * step.residual, split=sp)
    # A causal fused kernel skips the upper triangle: half of the two products' 4 s^2 h.
    core = (Op("attention", 2 * s * sh, e * 4 * sh, split=True),) if flash else (
        Op("matmul", 2 * s * sh, e * (2 * sh + scores), split=True),
        Op("memory", bytes=2 * e * scores, split=True),  # mask and softmax
        Op("matmul", 2 * s * sh, e * (scores + 2 * sh), split=True))
    plain = (
        norm,
        Op("matmul", 2 * sh * h, e * 2 * sh, e * h * h, e * h * h, split=True),  # q
        Op("matmul", 4 * sh * g, e * (sh + 2 * s * g), 2 * e * h * g, 2 * e * h * g,
           split=kv_split),  # k, v
        Op("memory", bytes=s * step.rotary_q, split=True),
        Op("memory", bytes=s * step.rotary_k, split=kv_split),
        Op("memory", bytes=4 * e * sh, split=kv_split),  # repeat k, v to the query heads
        *core,
        Op("memory", bytes=2 * e * sh, split=True),  # heads back to (s, h)
        Op("matmul", 2 * sh * h, 2 * e * sh, e * h * h, e * h * h, split=True),  # o
        add,
        norm,
        Op("matmul", 4 * sh * i, e * (sh + 2 * s * i), 2 * e * h * i, 2 * e * h * i,
           split=True),  # gate, up
        Op("memory", bytes=s * step.swiglu, split=True),  # silu(gate) * up
        Op("matmul", 2 * sh * i, e * (s * i + sh), e * h * i, e * h * i, split=True),  # down
        add,
    )
    ops = tuple(replace(op, replay=share) for op, share in
                zip(plain, _replayed(run.recompute, flash, len(core)), strict=True))
    kv = 2 * h * g
    split_params = e * (2 * h * h + 3 * h * i + (kv if kv_split else 0))
    # Kept for the backward: both norms' inputs and outputs (whole, or split by sequence
    # parallelism); q and the repeated k, v (transformers repeats KV heads before the
    # attention), the probabilities (eager only), o's input and the MLP's four (s, I)
    # tensors split. Full recomputation keeps the layer's input only.
    whole = 4 * e * sh
    split = e * (4 * sh + 4 * s * i + scores)
    if run.recompute == "full":
        whole, split = e * sh, 0
    if sp:
        whole, split = 0, whole + split
    if run.recompute == "selective":
        # Kept: q, v, the attention's output and gate's split; down's output whole (its
        # (s, h) partial sums under SP); the layer's input whole, or split under SP with
        # the reduce-scatter's output.
        whole = e * sh if sp else 2 * e * sh
        split = e * ((4 if sp else 2) * sh + s * g + s * i)
    tag = f"{sp:d}{run.attention[0]}{run.recompute[0]}{run.fused:d}"
    return LayerCost("block", ops, e * shape.layer_parameters, 0, whole + split,
                     split_params, split, e * sh, 2,
                     f"llama-block-{s}-{h}-{a}-{g}-{i}-{e}-{kv_split}-{tag}",
                     replayed_all_reduces=_REPLAYED_ALL_REDUCES[run.recompute])


# Of the layer's two all-reduces (as reduce-scatter + all-gather under SP), those a replay
# runs again: torchtitan's selective policy keeps the reduce-scatters' outputs.
_REPLAYED_ALL_REDUCES = {"none": 0.0, "selective": 1.0, "full": 2.0}


def _replayed(recompute: str, flash: bool, core: int) -> tuple[float, ...]:
    """``Op.replay`` of each op of :func:`_llama_block`, in order, for ``recompute``.

    torchtitan's selective policy counts the layer's ``mm`` calls (q 1, k 2, v 3, o 4, gate
    5, up 6, down 7; the attention's are not ``mm``) and replays the even ones: half of the
    k, v op and of the gate, up op, all of o.
    """
    if recompute != "selective":
        return (1.0 if recompute == "full" else 0.0,) * (14 + core)
    products = (0.0, 0.5)  # q, then k and v
    core_shares = (0.0,) if flash else (1.0, 1.0, 1.0)  # eager attention: bmm, not mm
    return (1.0, *products, 1.0, 1.0, 1.0, *core_shares, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0,
            0.0, 1.0)


def llama_workload(shape: LlamaShape, batch: int, tp: int = 1, element_bytes: int = 2,
                   mixed_precision: bool = True, run: LlamaRun = LlamaRun(),
                   fsdp: bool = False) -> Workload:
    """The :class:`~partitioner.cost.cost.Workload` of a Llama model: embedding, decoder
    layers, head (final RMSNorm and LM head).

    Args:
        shape: the model's shape.
        batch: sequences per training step.
        tp: the tensor-parallel degree the workload is for: the k and v projections count
            as split only when it divides ``shape.kv_heads``.
        element_bytes: bytes per value (2 for bf16).
        mixed_precision: whether fp32 master weights and optimizer state are kept.
        run: sequence parallelism, the attention kernel and per-layer recomputation
            (:class:`LlamaRun`).
        fsdp: parameters, gradients and optimizer state sharded over the data-parallel
            replicas (``Workload.fsdp``).

    Returns:
        ``layers + 2`` layers; a tied head holds its own copy of the table (a pipeline's
        last stage does). Each decoder layer all-reduces its output twice per pass (under
        sequence parallelism, a reduce-scatter and an all-gather of the same traffic); the
        backward all-gathers of whole KV projections (:meth:`LlamaShape.tp_comm`) are not
        charged, since a layer's cost has no room for them.

    Raises:
        CostModelError: if ``tp`` divides neither the heads nor the KV heads.

    Example:
        >>> shape = LlamaShape(2, 64, 8, 2, 176, 16, 96)
        >>> w = llama_workload(shape, batch=4, tp=4)
        >>> sum(layer.forward_flops for layer in w.layers) == shape.forward_flops()
        True
        >>> w.layers[1].params_on(4) == 2 * shape.layer_parameters_on(4)
        True
        >>> sp = llama_workload(shape, batch=4, tp=4, run=LlamaRun(sequence_parallel=True))
        >>> sp.layers[1].activations_on(4) == sp.layers[1].activation_bytes / 4
        True
    """
    shape.check_tp(tp)
    e, s, h, v = element_bytes, shape.seq, shape.hidden, shape.vocab
    block = _llama_block(shape, e, shape.kv_split(tp), run)
    blocks = [replace(block, name=f"block.{k}") for k in range(shape.layers)]
    embedding = LayerCost(
        "embedding", (Op("memory", bytes=2 * e * s * h, weight_grad=e * v * h, split=True),),
        e * v * h, 0, 0.0, e * v * h, 0.0, e * s * h, 1, f"llama-embedding-{s}-{h}-{v}-{e}")
    head = _llama_head(shape, e, run.sequence_parallel)
    hidden = float(e * s * h)
    layers = (embedding, *blocks, head)
    boundaries = (0.0, *([hidden] * (len(layers) - 1)), 0.0)
    return Workload(layers, boundaries, batch, {2: "bf16", 4: "fp32"}.get(e, "bf16"), e,
                    mixed_precision, f"Llama l={shape.layers} h={h} kv={shape.kv_heads}",
                    fsdp=fsdp)


def _llama_head(shape: LlamaShape, e: int, sequence_parallel: bool) -> LayerCost:
    """The final RMSNorm (on sequence shards under sequence parallelism), the vocabulary-
    parallel LM head and the cross-entropy, its logits in fp32."""
    s, h, v = shape.seq, shape.hidden, shape.vocab
    ops = (Op("memory", bytes=2 * e * s * h, weight_read=e * h, weight_grad=e * h,
              split=sequence_parallel),
           Op("matmul", 2 * s * h * v, e * (s * h + s * v), e * v * h, e * v * h, split=True),
           Op("memory", bytes=(e + 8) * s * v, split=True))
    kept = 2 * e * s * h + 4 * s * v
    split = kept if sequence_parallel else 4 * s * v
    return LayerCost("head", ops, e * (v * h + h), 0, kept, e * v * h, split, e * s * h, 1,
                     f"llama-head-{s}-{h}-{v}-{e}-{sequence_parallel:d}")
