"""One rank of the transformers meta-device tests: ``python hf_meta_worker.py <json args>``.

Builds a tiny transformers decoder (``family``) on the meta device, partitions it over the
world (``pp``, ``tp``, ``dp``) in bf16 with ``init_fn=model._init_weights`` (counting the
modules it fills), loads the whole model's weights (``weights``: a file or a folder),
trains ``steps`` SGD steps and prints ``RESULT {json}``: the losses, which modules
``init_fn`` filled, what the rank holds.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from hf_models import batches, build, loss_fn
from torch import nn

from partitioner import partition_distributed


def main() -> None:
    args: dict[str, Any] = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    data = batches(args["steps"])
    with torch.device("meta"):
        model = build(args["family"])
    filled: list[str] = []

    def init_fn(module: nn.Module) -> None:
        filled.append(type(module).__name__)
        model._init_weights(module)  # transformers' own initialization, rotary included

    # The project's GPT: its modules' own reset_parameters().
    own = init_fn if hasattr(model, "_init_weights") else None
    dpm = partition_distributed(model, (data[0][0],), pp=args.get("pp"), tp=args.get("tp"),
                                dp=args.get("dp"), chunks=2, precision="bf16", init_fn=own)
    if args.get("weights"):
        dpm.load(args["weights"])
    optimizer = torch.optim.SGD(dpm.parameters(), lr=args.get("lr", 0.5))
    losses = []
    for ids, labels in data:
        optimizer.zero_grad()
        losses.append(dpm.step(ids, labels, loss_fn))
        optimizer.step()
    print("RESULT " + json.dumps(dict(
        rank=dpm.mesh.rank, stage=dpm.stage_index, losses=losses, filled=filled,
        keys=sorted(dpm.stage.state_dict()))), flush=True)
    dpm.close()


if __name__ == "__main__":
    main()
