"""One Llama 3 8B decoder layer on a GPU, op by op, beside what the cost model charges.

``make_plan``'s Llama rows (``benchmarks/llama_published.py``) predict torchtitan's H100 runs
1.36-1.49x faster than published. Whether the layer's costs or the device's rate is wrong
can be read on one GPU: this times transformers' ``LlamaDecoderLayer`` (bf16, ``sdpa``
attention, sequences of 8192 tokens) forward and backward, and each of its products and
its fused causal attention alone, beside ``partitioner.cost.cost.op_times`` for the same op
on the GPU's preset (``partitioner.cost.device_names``: an H200 gets ``"H200"``). What the
layer takes beyond its products and attention is its element-wise work (norms, rotary,
SwiGLU, residual adds, the heads' copies), compared with the element-wise ops' sum.

Run by ``benchmarks/gpu_check.py`` (or alone: ``python benchmarks/gpu_llama_block.py``;
``--small`` for a shape that runs on a CPU in seconds, to try the script).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner.cost.cost import op_times, phase_times  # noqa: E402
from partitioner.cost.device_names import preset_for  # noqa: E402
from partitioner.cost.devices import DEVICES  # noqa: E402
from partitioner.cost.transformer_model import LlamaRun, LlamaShape, llama_workload  # noqa: E402

# The ops of ``transformer_model._llama_block``, in its order.
OPS = ("input norm", "q", "k, v", "rotary q", "rotary k", "repeat k, v", "attention",
       "heads back", "o", "residual add", "post norm", "gate, up", "silu * up", "down",
       "residual add")
LLAMA3_8B = LlamaShape(32, 4096, 32, 8, 14336, 8192, 128256)
SMALL = LlamaShape(2, 256, 8, 2, 704, 256, 512)


class Clock:
    """Median seconds of a callable on ``device`` (CUDA events on a GPU)."""

    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start: Any, end: Any) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)

    def time(self, run: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
        """Median of ``run()``'s seconds; ``before()`` (untimed) prepares each call."""
        times = []
        for k in range(self.warmup + self.reps):
            state = before() if before else None
            start = self._now()
            run() if state is None else run(state)  # type: ignore[call-arg]
            end = self._now()
            if k >= self.warmup:
                times.append(self._elapsed(start, end))
        return statistics.median(times)


def product(clock: Clock, s: int, k: int, n: int, count: int = 1) -> tuple[float, float]:
    """Forward and backward seconds of ``count`` products ``(s, k) @ (k, n)`` in bf16."""
    dev = clock.device
    x = torch.randn(s, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, requires_grad=True) / k**0.5
          for _ in range(count)]
    ws = [w.detach().requires_grad_() for w in ws]
    grad = torch.randn(s, n, device=dev, dtype=torch.bfloat16)
    forward = clock.time(lambda: [F.linear(x, w) for w in ws])

    def prepare() -> Any:
        x.grad = None
        for w in ws:
            w.grad = None
        return [F.linear(x, w) for w in ws]
    backward = clock.time(lambda ys: torch.autograd.backward(ys, [grad] * count), prepare)
    return forward, backward


def attention(clock: Clock, shape: LlamaShape) -> tuple[float, float]:
    """Forward and backward seconds of the causal fused attention over every query head."""
    dev, d = clock.device, shape.hidden // shape.heads
    q, k, v = (torch.randn(1, shape.heads, shape.seq, d, device=dev, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def run() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    forward = clock.time(run)

    def prepare() -> Any:
        q.grad = k.grad = v.grad = None
        return run()
    return forward, clock.time(lambda out: out.backward(grad), prepare)


def decoder_layer(clock: Clock, shape: LlamaShape) -> tuple[float, float]:
    """Forward and backward seconds of transformers' ``LlamaDecoderLayer`` (sdpa, bf16)."""
    import transformers
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=1, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=shape.seq, rope_theta=500000.0, use_cache=False)
    config._attn_implementation = "sdpa"
    dev = clock.device
    layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(dev, torch.bfloat16)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(dev)
    hidden = torch.randn(1, shape.seq, shape.hidden, device=dev, dtype=torch.bfloat16,
                         requires_grad=True)
    positions = torch.arange(shape.seq, device=dev)[None]
    cos_sin = rotary(hidden, positions)
    grad = torch.randn_like(hidden)

    def run() -> Any:
        out = layer(hidden, position_embeddings=cos_sin, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out
    forward = clock.time(run)

    def prepare() -> Any:
        hidden.grad = None
        layer.zero_grad(set_to_none=True)
        return run()
    return forward, clock.time(lambda out: out.backward(grad), prepare)


def rows(shape: LlamaShape, clock: Clock, spec_name: str) -> list[tuple[str, tuple[float, float],
                                                                         tuple[float, float]]]:
    """(name, predicted (fwd, bwd), measured (fwd, bwd)) for each measured piece."""
    spec = DEVICES[spec_name]
    block = llama_workload(shape, 1, run=LlamaRun(attention="flash", fused=False)).layers[1]
    assert len(block.ops) == len(OPS), "the block's ops changed: update OPS"
    predicted = {name: (0.0, 0.0) for name in OPS}
    for name, op in zip(OPS, block.ops, strict=True):
        f, b = op_times(op, spec, 1, dtype="bf16")
        predicted[name] = (predicted[name][0] + f, predicted[name][1] + b)
    s, h, g, i = shape.seq, shape.hidden, shape.kv_width, shape.intermediate
    measured = {
        "q": product(clock, s, h, h), "k, v": product(clock, s, h, g, 2),
        "o": product(clock, s, h, h), "gate, up": product(clock, s, h, i, 2),
        "down": product(clock, s, i, h), "attention": attention(clock, shape),
    }
    layer = decoder_layer(clock, shape)
    out = [(name, predicted[name], measured[name]) for name in measured]
    elementwise = [name for name in predicted if name not in measured]
    out.append(("element-wise (layer - the above)",
                tuple(sum(predicted[n][k] for n in elementwise) for k in (0, 1)),  # type: ignore[misc]
                tuple(layer[k] - sum(m[k] for m in measured.values()) for k in (0, 1))))
    out.append(("decoder layer", phase_times(block, spec, 1, dtype="bf16"), layer))
    return out


def table(results: list[tuple[str, tuple[float, float], tuple[float, float]]], title: str) -> str:
    lines = [title, "", "| op | predicted fwd / bwd (ms) | measured fwd / bwd (ms) "
             "| measured / predicted fwd / bwd |", "|---|---:|---:|---:|"]
    for name, pred, meas in results:
        ratio = " / ".join(f"{m / p:.2f}" if p > 0 else "-" for p, m in zip(pred, meas))
        lines.append(f"| {name} | {pred[0] * 1e3:.3f} / {pred[1] * 1e3:.3f} | "
                     f"{meas[0] * 1e3:.3f} / {meas[1] * 1e3:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a small shape (tries the script)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        print("gpu_llama_block: skipped, no CUDA device here (--small tries it on the CPU)")
        return 0
    device = torch.device("cuda:0" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    spec_name = (preset_for(name, memory) if cuda else None) or "H100-SXM"
    shape = SMALL if args.small else LLAMA3_8B
    clock = Clock(device, args.reps, args.warmup)
    results = rows(shape, clock, spec_name)
    print(table(results, f"One Llama layer (h={shape.hidden}, kv={shape.kv_heads}, "
                         f"I={shape.intermediate}, {shape.seq} tokens, bf16) on {name}, "
                         f"predicted on the {spec_name!r} preset "
                         "(`python benchmarks/gpu_llama_block.py`):"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
