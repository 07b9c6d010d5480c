"""One rank of the meta-device tests: ``python meta_worker.py <json args>``.

Builds the test model on the meta device, partitions it over the world (``pp``, ``tp``,
optionally ``memory_limit``), fills it from the whole model's weights file, trains
``steps`` SGD steps and saves a consolidated checkpoint. Prints ``RESULT {json}`` with what
the rank holds and how much memory it took (``/proc/self/status``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from meta_models import batches, build, build_tied, loss_fn

from partitioner import partition_distributed


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``, ``RssAnon``), in KiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main() -> None:
    args: dict[str, Any] = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    data = batches(args["steps"])
    # A small run first, so that what is measured below is the model's share, not the
    # first call's one-time costs (process groups, code paths loaded on first use).
    with torch.device("meta"):
        small = build(16, 32)
    partition_distributed(small, example_inputs=(batches(1, width=16)[0][0],),
                          pp=args.get("pp", 2), tp=args.get("tp"), chunks=2).close()
    with torch.device("meta"):
        model = build_tied() if args.get("tied") else build()
    before = status_kib("VmHWM")
    dpm = partition_distributed(
        model, example_inputs=(data[0][0],), pp=args.get("pp"), tp=args.get("tp"),
        chunks=2, strategy=args.get("strategy"), memory_limit=args.get("memory_limit"),
        seed=args.get("seed", 0), schedule=args.get("schedule"),
        virtual_stages=args.get("virtual_stages"))
    built = status_kib("VmHWM")
    if args.get("weights"):
        dpm.load(args["weights"])
    loaded = status_kib("VmHWM")
    optimizer = torch.optim.SGD(dpm.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x, y, loss_fn))
        optimizer.step()
    if args.get("save"):
        dpm.save(args["save"])
    held = sum(p.numel() * p.element_size() for p in dpm.parameters())
    print("RESULT " + json.dumps(dict(
        rank=dpm.mesh.rank, stage=dpm.stage_index, balance=list(dpm.plan.balance),
        param_bytes=held, losses=losses, hwm_before_kib=before, hwm_built_kib=built,
        hwm_loaded_kib=loaded, hwm_end_kib=status_kib("VmHWM"),
        still_meta=sum(p.is_meta for p in model.parameters()))), flush=True)
    dpm.close()


if __name__ == "__main__":
    main()
