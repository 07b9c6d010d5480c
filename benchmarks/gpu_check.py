"""The prepared GPU check: one command, a few minutes on one GPU, one table to paste.

Run it first whenever a session is lent a GPU (with the torch already on that machine)::

    pip install --no-deps --no-build-isolation -e . && python benchmarks/gpu_check.py

It runs, in order:

1. the GPU-marked tests (``python -m pytest -m gpu``);
2. a GPT-2-small-shaped model (12 blocks, d=768, 12 heads, 1024 tokens of context, batch
   8 x 256) built on ``cuda:0``: unpartitioned, as a 2-stage pipeline in bf16 (1F1B, 4
   micro-batches), as tensor parallelism over 2 ``cuda:0`` ranks and as 2 data-parallel
   replicas (both fp32: the one-process tensor-parallel and replica runtimes run fp32),
   each timed over ``--steps`` training steps (forward, backward, Adam) beside the plan's
   predicted step time;
   plus the plain pipeline in fp32 and what ``strategy="auto"`` picks on two ``cuda:0``
   devices;
3. one markdown table of the results for ``docs/benchmarks.md``;
4. the host's time per launched op (``gpu_dispatch.py``) and each case's profiled steps:
   kernels per step, the GPU's busy share (``gpu_step_profile.py``; ``--skip-profile``);
5. one Llama 3 8B layer op by op against the cost model (``gpu_llama_block.py``).

Without CUDA it says so and exits 0 (the test suite runs it that way); ``--dry-run`` lists
what it would run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = ("one device", "one device bf16", "pipeline", "pipeline bf16", "tensor parallel",
         "replicas", "auto")
TEST_TIMEOUT = 300.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per case")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--skip-tests", action="store_true", help="skip the GPU-marked tests")
    parser.add_argument("--skip-profile", action="store_true",
                        help="skip the profiled steps of each case (gpu_step_profile.py)")
    parser.add_argument("--skip-layer", action="store_true",
                        help="skip the Llama layer's op-by-op timing (gpu_llama_block.py)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and exit")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 2 or args.seq < 1:
        parser.error("--steps >= 1, --warmup >= 0, --batch >= 2 and --seq >= 1")
    return args


def gpu_tests() -> int:
    """The GPU-marked tests; a run past ``TEST_TIMEOUT`` seconds counts as failed."""
    try:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                                "no:cacheprovider", "-rfEs"], cwd=ROOT, timeout=TEST_TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"gpu_check: the GPU-marked tests ran past {TEST_TIMEOUT:.0f} s")
        return 1


def _timed(step: Callable[[], None], steps: int, warmup: int) -> float:
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64 (as Megatron-LM and nanoGPT do),
# so that tensor parallelism can split the embedding and the head


class SkipCase(Exception):
    """A case this machine cannot run (said, not counted as a failure)."""


def build_case(name: str, args: argparse.Namespace) -> tuple[Any, Callable[[], None],
                                                               float | None]:
    """(module, one training step, predicted seconds per step) of one case on ``cuda:0``."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from examples.models import gpt
    from partitioner import Mesh, partition
    torch.manual_seed(0)
    model = gpt(12, 768, 12, VOCAB, 1024).to("cuda:0")
    x = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda:0")
    y = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda:0")

    def loss_fn(out: Any, target: Any) -> Any:
        return F.cross_entropy(out.float().flatten(0, 1), target.flatten())
    bf16 = name == "one device bf16"
    if name in ("one device", "one device bf16"):
        module: Any = model
        predicted = None
    else:
        options: dict[str, Any] = {
            "pipeline": dict(strategy="pipeline", chunks=4, schedule="1f1b"),
            "pipeline bf16": dict(strategy="pipeline", chunks=4, schedule="1f1b",
                                  precision="bf16"),
            "auto": dict(strategy="auto"),
            "tensor parallel": dict(mesh=Mesh(dp=1, pp=1, tp=2)),
            "replicas": dict(mesh=Mesh(dp=2, pp=1, tp=1)),
        }[name]
        devices = ["cuda:0"] * 2
        if name == "tensor parallel":
            if torch.cuda.device_count() < 2:
                raise SkipCase("tensor-parallel ranks in one process need a GPU each "
                               "(partitioner refuses two on one GPU)")
            devices = ["cuda:0", "cuda:1"]
        module = partition(model, devices, example_inputs=(x,), **options)
        predicted = module.plan.predicted_step_time
        lines = module.plan.explain().splitlines()
        chosen = [line for line in lines if line.startswith("chosen:")]
        print(f"{name}: {(chosen or lines)[0]}", flush=True)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-5)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if hasattr(module, "step"):
            module.step(x, y, loss_fn)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                out = module(x)
            loss_fn(out, y).backward()
        optimizer.step()
    return module, step, predicted


def run_case(name: str, args: argparse.Namespace) -> tuple[float | None, float]:
    """(predicted, measured) seconds per step of one case."""
    module, step, predicted = build_case(name, args)
    try:
        return predicted, _timed(step, args.steps, args.warmup)
    finally:
        if hasattr(module, "close"):
            module.close()


def table(rows: list[tuple[str, float | None, float]], device: str) -> str:
    lines = [f"GPU check on {device} (GPT-2 small shape, `python benchmarks/gpu_check.py`):",
             "", "| case | predicted | measured | measured / predicted |", "|---|---:|---:|---:|"]
    for name, predicted, measured in rows:
        ratio = f"{measured / predicted:.2f}" if predicted else "-"
        pred = f"{predicted * 1e3:.1f} ms" if predicted else "-"
        lines.append(f"| {name} | {pred} | {measured * 1e3:.1f} ms | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        print("would run: the GPU-marked tests; then " + ", ".join(CASES)
              + "; then the host's time per op, each case profiled, one Llama layer op by op")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device here (run it on a machine with a GPU)")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    failed = 0 if args.skip_tests else gpu_tests()
    rows = []
    for name in CASES:
        try:
            predicted, measured = run_case(name, args)
        except SkipCase as why:
            print(f"{name}: skipped ({why})")
            continue
        except Exception as error:
            print(f"{name}: failed ({type(error).__name__}: {error})")
            failed = 1
            continue
        rows.append((name, predicted, measured))
        print(f"{name}: predicted {predicted}, measured {measured}", flush=True)
    print(table(rows, torch.cuda.get_device_name(0)), flush=True)
    import gpu_dispatch
    gpu_dispatch.main([])
    if not args.skip_profile:  # kernels per step and the GPU's busy share, per case
        import gpu_step_profile
        gpu_step_profile.main(["--cases", ",".join(name for name, _, _ in rows), "--rows", "6",
                               "--batch", str(args.batch), "--seq", str(args.seq)])
    if not args.skip_layer:
        import gpu_llama_block
        try:
            gpu_llama_block.main([])
        except Exception as error:
            print(f"Llama layer: failed ({type(error).__name__}: {error})")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
