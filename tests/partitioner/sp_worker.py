"""One rank of the multi-process sequence-parallel tests: ``python sp_worker.py '<cfg json>'``.

Launched by ``tests/distributed_harness.py``. Every rank builds the same float64 TinyGPT,
partitions one copy with ``sequence_parallel=True`` and one without (same ``pp`` x ``tp``),
trains both and the unpartitioned model for 3 SGD steps on the same batches (with ``meta``,
also one step of a meta-built float32 model, split with and without SP), and reports the
runs' losses, the weights' worst difference from the unpartitioned model's, the
collectives its stage graph holds and ran, and the sequence lengths its layer norms saw.
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tp_models import TinyGPT

from partitioner import partition_distributed
from partitioner.errors import StrategyError
from partitioner.passes.tensor_parallel.rewrite import COMM_ATTR

torch.set_num_threads(1)
SEQ = 8


class _NormRows(TorchFunctionMode):
    """The sequence length (dim 1) of every ``F.layer_norm`` input while active (not the
    runtime's shape predictions on fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is F.layer_norm and not isinstance(args[0], FakeTensor):  # real runs only
            self.rows.add(int(args[0].shape[1]))
        return func(*args, **(kwargs or {}))


class _Kept:
    """The bytes of the activations autograd keeps for the backward (parameters aside)."""

    def __init__(self, dpm: nn.Module) -> None:
        self.params = {p.data_ptr() for p in dpm.parameters()}
        self.seen: set[tuple[int, int]] = set()
        self.held: list[torch.Tensor] = []  # so that no address is reused while counting
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel())
        if t.data_ptr() not in self.params and key not in self.seen:
            self.seen.add(key)
            self.held.append(t)
            self.bytes += t.numel() * t.element_size()
        return t


def _graphs(dpm: nn.Module) -> list[fx.GraphModule]:
    return [m for m in dpm.modules() if isinstance(m, fx.GraphModule) and hasattr(m, COMM_ATTR)]


def _name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _run(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]],
         cfg: dict[str, Any], sequence_parallel: bool) -> dict[str, Any]:
    """3 steps of ``model`` partitioned over the world; what the rank saw."""
    dpm = partition_distributed(model, (data[0][0],), pp=cfg["pp"], tp=cfg["tp"], dp=1,
                                chunks=cfg["chunks"], schedule="1f1b", checkpoint="never",
                                backend="gloo", sequence_parallel=sequence_parallel)
    graphs = _graphs(dpm)
    targets = Counter(_name(n) for g in graphs for n in g.graph.nodes
                      if n.op == "call_function")
    # What makes each stage output: a sequence shard must be gathered before it leaves.
    made_by = sorted({_name(a) for g in graphs for n in g.graph.nodes if n.op == "output"
                      for a in n.all_input_nodes})
    for g in graphs:
        getattr(g, COMM_ATTR).counts.clear()
    optimizer = torch.optim.SGD(dpm.parameters(), lr=0.5, momentum=0.9)
    losses, watch, kept = [], _NormRows(), _Kept(dpm)
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        if i == 0:
            with watch, torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
                losses.append(dpm.step(x, y, _loss))
        else:
            losses.append(dpm.step(x, y, _loss))
        optimizer.step()
    counts: Counter[str] = Counter()
    for g in graphs:
        counts.update({f"{k}/{p}": v for (k, p), v in getattr(g, COMM_ATTR).counts.items()
                       if v})
    state = dpm.state_dict()  # whole tensors, gathered over the tp group
    out = {"losses": losses, "state": state, "norm_rows": sorted(watch.rows),
           "nodes": {k: targets[k] for k in ("reduce_scatter_to_sp", "all_gather_from_sp",
                                              "reduce_from_tp", "gather_from_tp")},
           "counts": dict(counts), "stage": dpm.stage_index, "output_made_by": made_by,
           "kept_bytes": kept.bytes,
           "predicted_memory": dpm.plan.stages[dpm.stage_index].predicted_memory}
    dist.barrier()
    dpm.close()
    return out


def main(cfg: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, seq=SEQ).double()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (cfg["batch"], SEQ), generator=g),
             torch.randint(0, 64, (cfg["batch"], SEQ), generator=g)) for _ in range(3)]
    reference = copy.deepcopy(model)
    sp = _run(copy.deepcopy(model), data, cfg, True)
    tp = _run(copy.deepcopy(model), data, cfg, False)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    expected = []
    for x, y in data:
        opt.zero_grad()
        loss = _loss(reference(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    whole = reference.state_dict()
    worst = {name: max(float((run["state"][k] - whole[k]).abs().max()) for k in run["state"])
             for name, run in (("sp", sp), ("tp", tp))}
    record = {"rank": dist.get_rank(), "expected": expected, "worst": worst,
              "keys": len(sp["state"]), "dtype": str(next(iter(sp["state"].values())).dtype)}
    for name, run in (("sp", sp), ("tp", tp)):
        record[name] = {k: v for k, v in run.items() if k != "state"}
    if cfg["pp"] > 1:  # virtual stages are not split over tp ranks: refused on every rank
        try:
            partition_distributed(copy.deepcopy(model), (data[0][0],), pp=cfg["pp"],
                                  tp=cfg["tp"], dp=1, chunks=cfg["pp"] * 2,
                                  schedule="interleaved", virtual_stages=2, backend="gloo",
                                  sequence_parallel=True)
            record["virtual_refused"] = None
        except StrategyError as error:
            record["virtual_refused"] = str(error)
    if cfg.get("meta"):  # each rank materializes its slice; the pass sees meta shapes
        record["meta"] = {}
        for name, on in (("sp", True), ("tp", False)):
            with torch.device("meta"):
                built = TinyGPT(n_layer=2, seq=SEQ)
            run = _run(built, data[:1], cfg, on)
            record["meta"][name] = {"losses": run["losses"], "nodes": run["nodes"]}
    print("RESULT " + json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
