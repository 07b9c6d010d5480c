"""One rank of the deferred-initialization tests: ``python deferred_init_worker.py <json>``.

Builds :func:`meta_models.build_scaled` on the meta device, partitions it over the world
(``pp``, ``tp``: default a 2-stage pipeline) with an ``init_fn`` that records the modules
it fills, builds the optimizer, then (``weights`` given) loads the whole model's state dict
or (no weights) reads the stage's state dict first. Trains ``steps`` SGD steps. Prints
``RESULT {json}``: the modules initialized at each point, the state dict it held before
training, the losses.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from meta_models import batches, build_scaled, init_scaled, loss_fn
from torch import nn

from partitioner import partition_distributed

CALLS: list[str] = []


def counting_init(module: nn.Module) -> None:
    CALLS.append(type(module).__name__)
    init_scaled(module)


def main() -> None:
    args: dict[str, Any] = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    data = batches(args["steps"], width=16)
    with torch.device("meta"):
        model = build_scaled()
    dpm = partition_distributed(model, example_inputs=(data[0][0],), pp=args.get("pp", 2),
                                tp=args.get("tp", 1), chunks=2, init_fn=counting_init,
                                seed=args.get("seed", 0))
    # Built before load (as resuming does, load(path, optimizer)): it holds the tensors
    # the load fills, and building it initializes nothing.
    optimizer = torch.optim.SGD(dpm.parameters(), lr=0.1)
    at_build = list(CALLS)
    nan_before = bool(dpm.stage.get_submodule(_first_linear(dpm.stage)).weight.isnan().all())
    if args.get("weights"):
        dpm.load(args["weights"])
    state = {k: v.tolist() for k, v in dpm.state_dict().items()}  # tp: gathered whole
    before_steps = list(CALLS)
    scales = {name: b.tolist() for name, b in dpm.named_buffers()}
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(dpm.step(x, y, loss_fn))
        optimizer.step()
    print("RESULT " + json.dumps(dict(
        rank=dpm.mesh.rank, at_build=at_build, before_steps=before_steps,
        nan_before=nan_before, state=state, scales=scales, losses=losses,
        after_steps=list(CALLS))), flush=True)
    dpm.close()


def _first_linear(stage: nn.Module) -> str:
    return next(name for name, sub in stage.named_modules() if isinstance(sub, nn.Linear))


if __name__ == "__main__":
    main()
