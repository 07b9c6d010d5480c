"""One rank of ``test_link_probe``: measure the link, print what every rank agreed."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from partitioner.runtime.distributed.link_probe import probe_link

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    got = probe_link()
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "latency": got.latency,
                                  "bandwidth": got.bandwidth, "busy": got.busy_latency,
                                  "wake": got.wake, "collective": list(got.collective),
                                  "scalar": got.scalar, "pairs": got.pairs,
                                  "optimizer_gain": got.optimizer_gain,
                                  "staggered": got.staggered,
                                  "posting": got.posting,
                                  "computing": got.computing}),
          flush=True)
    dist.destroy_process_group()
