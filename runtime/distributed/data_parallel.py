"""Average a stage's gradients over its data-parallel replicas: bucketed, during backward.

Every replica of a stage holds the same parameters and sees a different shard of the batch;
after a step's backwards, each parameter's gradient must be the average over replicas. A
:class:`GradReducer` does this once per step, not per micro-batch: the pipeline *arms* it
before the stage's last backward action, and from then on a hook on each parameter
(``register_post_accumulate_grad_hook``) marks the parameter ready as soon as its gradient
for the step is complete. Parameters are grouped into buckets of about ``bucket_bytes``, in
reverse order (the order backward produces them); a bucket whose parameters are all ready
is copied into a flat buffer and its all-reduce starts at once, while the rest of the
backward runs. The bucket of the first parameters, which backward reaches last, is kept
small (1 MiB), so little communication is left when the backward ends. Buckets start
strictly in order, so every replica issues the same collectives in the same order (as DDP
does). :meth:`GradReducer.finish` starts what is left (parameters the last backward did
not reach), waits, and puts the averages in ``.grad``. Linear layers routed through
``partitioner.runtime.fused_linear`` compute their gradients straight into their bucket (registered
with ``use_grad_buffer``): no allocation, no copy in and none back (DDP's
``gradient_as_bucket_view``).

Each bucket also carries one flag per parameter, "had a gradient on this replica", so a
parameter no replica produced a gradient for keeps ``grad = None`` (optimizers then skip
it, as in single-process training), and one that some replicas did not reach gets the
average with zeros for them.

Example:
    >>> import torch
    >>> params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(3)]
    >>> buckets = plan_buckets(params, bucket_bytes=8000, last_bucket_bytes=4000)
    >>> [len(b.params) for b in buckets]
    [2, 1]
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.runtime import fused_linear
from partitioner.runtime.distributed.comm_failure import communicating

__all__ = ["Bucket", "GradReducer", "TiedGradients", "plan_buckets", "DEFAULT_BUCKET_BYTES",
           "LAST_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
LAST_BUCKET_BYTES = 1024 * 1024


@dataclass
class Bucket:
    """Parameters reduced together (one dtype and device) and the buffer they travel in."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)
    work: Any = None

    @property
    def numel(self) -> int:
        """Gradient elements (the buffer also holds one flag per parameter)."""
        return sum(p.numel() for p in self.params)

    def views(self) -> list[torch.Tensor]:
        """Each parameter's slice of the buffer, shaped like the parameter."""
        out, offset = [], 0
        for p in self.params:
            out.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


def plan_buckets(params: Sequence[nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 last_bucket_bytes: int = LAST_BUCKET_BYTES) -> list[Bucket]:
    """Group ``params`` into buckets of one dtype and device, last parameter first.

    Buckets are filled from the *first* parameters, whose gradients backward produces
    last: their bucket is capped at ``last_bucket_bytes``, the others at ``bucket_bytes``.
    So the all-reduce still to run when the backward ends is a small one, and the large
    buckets start while backward runs. A parameter larger than a cap gets a bucket of its
    own. The result is ordered for launching: index 0 holds the model's last parameters.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[list[nn.Parameter]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for p in params:
        key = (p.dtype, p.device)
        lists = groups.setdefault(key, [[]])
        cap = last_bucket_bytes if len(lists) == 1 else bucket_bytes
        nbytes = p.numel() * p.element_size()
        if lists[-1] and sizes[key] + nbytes > cap:
            lists.append([])
            sizes[key] = 0
        lists[-1].append(p)
        sizes[key] = sizes.get(key, 0) + nbytes
    position = {id(p): k for k, p in enumerate(params)}
    ordered = [list(reversed(members)) for lists in groups.values()
               for members in reversed(lists) if members]
    ordered.sort(key=lambda members: -position[id(members[0])])
    buckets: list[Bucket] = []
    for members in ordered:
        n = sum(p.numel() for p in members) + len(members)
        buffer = torch.zeros(n, dtype=members[0].dtype, device=members[0].device)
        buckets.append(Bucket(len(buckets), members, buffer))
    return buckets


class GradReducer:
    """Averages the gradients of ``params`` over the replicas in ``group``.

    Args:
        params: the stage's trainable parameters, in the same order on every replica.
        group: the data-parallel process group of this rank.
        bucket_bytes: target bucket size.
        last_bucket_bytes: size of the bucket of the first parameters (launched last).
        predivided: the gradients already carry the factor ``1 / replicas`` (the pipeline
            folds it into the loss weights), so the all-reduce sum is the average as is;
            otherwise each bucket is divided before it is sent.

    Example:
        >>> reducer = GradReducer(stage.parameters(), mesh.group("dp"))   # doctest: +SKIP
        >>> reducer.arm(); last_backward(); reducer.finish()              # doctest: +SKIP
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 last_bucket_bytes: int = LAST_BUCKET_BYTES, *, predivided: bool = False
                 ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group)
        self.predivided = predivided
        self.buckets = plan_buckets(self.params, bucket_bytes, last_bucket_bytes)
        self._where = {id(p): (b.index, k) for b in self.buckets for k, p in enumerate(b.params)}
        self._lock = threading.Lock()
        self._armed = False
        self._next = 0
        #: ("ready", parameter position) and ("launch", bucket index) in the order they
        #: happened during the last step (what tests read to see the overlap).
        self.events: list[tuple[str, int]] = []
        position = {id(p): n for n, p in enumerate(self.params)}
        self._position = position
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in self.params]
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views()):
                if p.is_contiguous():
                    fused_linear.use_grad_buffer(p, view)

    def arm(self) -> None:
        """Reduce from now on: the backward about to run is the step's last on this stage."""
        with self._lock:
            self._armed = True
            self._next = 0
            self.events = []
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = None

    def _on_grad(self, param: torch.Tensor) -> None:
        with self._lock:
            if not self._armed:
                return
            b, k = self._where[id(param)]
            self.buckets[b].ready.add(k)
            self.events.append(("ready", self._position[id(param)]))
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        offset = 0
        for p in bucket.params:
            n = p.numel()
            view = bucket.buffer[offset:offset + n]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():   # not already the bucket's view
                view.copy_(p.grad.reshape(-1))
            offset += n
        flags = [0.0 if p.grad is None else 1.0 for p in bucket.params]
        bucket.buffer[bucket.numel:].copy_(torch.tensor(flags, dtype=bucket.buffer.dtype))
        if not self.predivided:
            # Divide first, so the sum is the average (gloo has no AVG) and cannot overflow.
            bucket.buffer[:bucket.numel].div_(self.size)
        with communicating(f"starting the all-reduce of gradient bucket {bucket.index}"):
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self.events.append(("launch", bucket.index))
        self._next += 1

    def finish(self) -> None:
        """Start the buckets not started yet, wait for all, write the averages to ``.grad``.

        Raises:
            CommunicationError: if an all-reduce fails (a replica died).
        """
        with self._lock:
            for bucket in self.buckets[self._next:]:
                self._launch(bucket)
            self._armed = False
        for bucket in self.buckets:
            with communicating(f"all-reduce of gradient bucket {bucket.index} over the "
                               "data-parallel group"):
                bucket.work.wait()
            self._write_back(bucket)

    def _write_back(self, bucket: Bucket) -> None:
        # A gradient computed into its bucket view (partitioner.runtime.fused_linear) already holds
        # the
        # average. One autograd allocated is overwritten in place, keeping its memory, which
        # the allocator hands back next step (replacing it by the view would free it, and
        # the next step's fresh gradient would fault in new pages). A missing one becomes
        # the view (DDP's gradient_as_bucket_view).
        flags = bucket.buffer[bucket.numel:].tolist()
        for k, (p, average) in enumerate(zip(bucket.params, bucket.views())):
            if flags[k] == 0 or (p.grad is not None and p.grad.data_ptr() == average.data_ptr()):
                continue
            if p.grad is None:
                p.grad = average if p.is_contiguous() else average.clone()
            else:
                p.grad.copy_(average)

    def close(self) -> None:
        """Remove the hooks and the gradient buffers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p in self.params:
            fused_linear.release_grad_buffer(p)


class TiedGradients:
    """Sums the gradients of weights that several stages share (tied embeddings).

    A weight used by stages on different ranks (GPT-2's token embedding, reused by its
    output layer) exists once per rank; each copy gets only its own stage's gradient. Summing
    the copies' gradients over the ranks that share the weight (one group per tie and
    replica, Megatron's "embedding group") gives every copy the full gradient, so the copies,
    equal at the start, stay equal under any deterministic optimizer.

    Args:
        ties: per shared weight held by this rank, the parameter and its tie group.
    """

    def __init__(self, ties: Sequence[tuple[nn.Parameter, Any]]) -> None:
        self.ties = list(ties)

    def reduce(self) -> None:
        """All-reduce (sum) each shared weight's gradient over its group; wait for all.

        Raises:
            CommunicationError: if an all-reduce fails (a peer died).
        """
        works = []
        for param, group in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            works.append(dist.all_reduce(param.grad, group=group, async_op=True))
        for work in works:
            with communicating("all-reduce of a tied weight's gradient"):
                work.wait()
