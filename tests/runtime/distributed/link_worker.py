"""One rank of ``test_link_probe``: measure the link, print what every rank agreed."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from partitioner.runtime.distributed.link_probe import probe_link

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    latency, bandwidth, busy, wake = probe_link()
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "latency": latency,
                                  "bandwidth": bandwidth, "busy": busy, "wake": wake}),
          flush=True)
    dist.destroy_process_group()
