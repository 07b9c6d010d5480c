"""A language model's wide head on this CPU: predicted against measured step time.

transformers' ``GPT2LMHeadModel`` with its real vocabulary (50,257 words) and a small body
(2 layers of 128): its LM head (512 x 128 x 50,257 per step) is nine tenths of the step, a
product at the full rate whose two intra-op threads run it 1.8x faster than one. Each
mesh of two ``"cpu"`` devices (``tp=2``, ``pp=2``, ``dp=2``) is planned with
``calibrate=True`` and timed in training steps (``zero_grad``, ``pm.step`` with the
synthetic loss tuning uses, an Adam step: what a plan's predicted step covers), then
``strategy="auto"``'s pick against the model on one device. The sharing model once counted
the head's measured excess over its model as work the threads cannot divide: two workers
were predicted to gain 1.46x on it where they gain 1.04-1.09, and every two-device plan
ran 1.27-1.34x its prediction (docs/benchmarks.md, "A wide LM head").

Run:
    python benchmarks/wide_vocab.py          # about two minutes
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner import partition
from partitioner.planning.tune import time_training_steps
from partitioner.plans.plan import Mesh

VOCAB, BATCH, SEQ, SECONDS = 50257, 8, 64, 2.0


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4,
                                     n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False,
                                     attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config), torch.randint(0, VOCAB, (BATCH, SEQ))


def timed(module: torch.nn.Module, ids: torch.Tensor) -> float:
    return time_training_steps(module, (ids,), None, BATCH, min_seconds=SECONDS)


def main() -> None:
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{torch.get_num_threads()} threads; GPT-2, vocabulary {VOCAB}, 2 x 128, "
          f"batch {BATCH} x {SEQ}, calibrate=True\n")
    print("| plan | predicted ms | measured ms | measured / predicted |\n|---|---:|---:|---:|")
    model, ids = model_and_batch()
    for mesh in (Mesh(tp=2), Mesh(pp=2), Mesh(dp=2)):
        pm = partition(model, ["cpu"] * 2, mesh=mesh, example_inputs=(ids,), calibrate=True)
        predicted, label = pm.plan.predicted_step_time, pm.plan.candidates[0]["label"]
        assert predicted is not None
        measured = timed(pm, ids)
        pm.close()
        print(f"| {label} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} "
              f"| {measured / predicted:.2f} |", flush=True)
    pm = partition(model, ["cpu"] * 2, example_inputs=(ids,), calibrate=True)
    predicted, label = pm.plan.predicted_step_time, pm.plan.candidates[0]["label"]
    assert predicted is not None
    picked = timed(pm, ids)
    pm.close()
    alone = timed(model, ids)
    print(f"| auto: {label} | {predicted * 1e3:.1f} | {picked * 1e3:.1f} "
          f"| {picked / predicted:.2f} |")
    print(f"\nauto's pick measured / the model on one device: {picked / alone:.2f} "
          f"({alone * 1e3:.1f} ms alone)")
    print("\ncommand: python benchmarks/wide_vocab.py")


if __name__ == "__main__":
    main()
