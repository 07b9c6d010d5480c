"""Time to a trainable rank for a meta-built transformers Llama filled from a file: with
initialization skipped for what ``dpm.load`` fills (``runtime/deferred_init.py``) against
initializing first, as an eager build does.

A ``LlamaForCausalLM`` (default: hidden 2048, 6 layers, GQA 16/4 heads, vocab 32000,
about 400 M parameters, fp32) is saved once with real weights; then in a fresh gloo world
of 2 ranks (pp=2, one intra-op thread each) each contender builds it under
``torch.device("meta")`` and runs ``partition_distributed(model, (ids,), pp=2,
init_fn=model._init_weights)`` and ``dpm.load(file)``:

- ``deferred``: as the runtime does: ``load`` fills the parameters, ``init_fn`` runs only
  on the modules owning non-persistent buffers (the rotary embedding);
- ``eager``: ``dpm.initialize()`` before ``load``: every module initialized first, then
  overwritten (what every build did before deferral).

Per contender, rank 0's and rank 1's seconds for ``partition_distributed``, the
initialization, ``load`` and the first training step, the modules ``init_fn`` filled, and
the first step's loss (the same for both: the weights come from the file).

Run:
    python benchmarks/meta_load.py                   # about 2 min on 2 cores
    python benchmarks/meta_load.py --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers

CONTENDERS = ("deferred", "eager")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=16, help="sequence length, batch 2")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: pp=2 x tp ranks (tp=2: 4 ranks)")
    return parser.parse_args()


def config(args: argparse.Namespace) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
        vocab_size=args.vocab, max_position_embeddings=256, tie_word_embeddings=False)


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (2, args.tokens), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def loss_fn(logits: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.logits if hasattr(logits, "logits") else logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def contender(name: str, args: argparse.Namespace, weights: str) -> dict[str, Any]:
    from partitioner import partition_distributed

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(args))
    filled: list[str] = []

    def init_fn(module: torch.nn.Module) -> None:
        filled.append(type(module).__name__)
        model._init_weights(module)

    ids, labels = batch(args)
    times: dict[str, float] = {}
    start = time.perf_counter()
    dpm = partition_distributed(model, (ids,), pp=2, tp=args.tp, chunks=1, init_fn=init_fn)
    times["partition"] = time.perf_counter() - start
    start = time.perf_counter()
    if name == "eager":
        dpm.initialize()
    times["initialize"] = time.perf_counter() - start
    start = time.perf_counter()
    dpm.load(weights)
    times["load"] = time.perf_counter() - start
    start = time.perf_counter()
    loss = dpm.step(ids, labels, loss_fn)
    times["first step"] = time.perf_counter() - start
    dpm.close()
    return dict(times=times, filled=len(filled), loss=loss,
                kinds=sorted(set(filled)))


def _entry(rank: int, name: str, args: argparse.Namespace, port: int, weights: str,
           out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2 * args.tp)
    result = contender(name, args, weights)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def spawn(name: str, args: argparse.Namespace, weights: str) -> list[dict[str, Any]]:
    out = Path(tempfile.mkdtemp())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    world = 2 * args.tp
    mp.spawn(_entry, (name, args, port, weights, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        weights = str(Path(folder, "llama.pt"))
        torch.manual_seed(0)
        whole = transformers.LlamaForCausalLM(config(args))
        params = sum(p.numel() for p in whole.parameters())
        torch.save(whole.state_dict(), weights)
        del whole
        print(f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, vocab "
              f"{args.vocab}: {params / 1e6:.0f} M parameters ({params * 4 / 2**20:.0f} MiB "
              f"fp32); pp=2 x tp={args.tp} on {2 * args.tp} gloo ranks; "
              f"torch {torch.__version__}; load at start "
              f"{os.getloadavg()[0]:.2f}")
        print(f"{'contender':<9} {'rank':>4} {'partition s':>11} {'init s':>7} {'load s':>7} "
              f"{'step s':>7} {'ready s':>8} {'init_fn calls':>13} {'loss':>9}")
        for name in args.contenders:
            for rank, record in enumerate(spawn(name, args, weights)):
                t = record["times"]
                ready = t["partition"] + t["initialize"] + t["load"]
                print(f"{name:<9} {rank:>4} {t['partition']:>11.2f} {t['initialize']:>7.2f} "
                      f"{t['load']:>7.2f} {t['first step']:>7.2f} {ready:>8.2f} "
                      f"{record['filled']:>13} {record['loss']:>9.5f}  {record['kinds']}",
                      flush=True)
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
