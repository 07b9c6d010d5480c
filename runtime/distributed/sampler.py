"""Give each data-parallel replica its shard of every epoch (``DistributedSampler``-like).

Shards go by *replica*, not by rank: every stage of a pipeline replica must see the same
batch (stage 0 reads the inputs, the last stage the targets), so all ranks of one replica
get the same indices. Each epoch is one permutation of the dataset (``seed + epoch``, as
``DistributedSampler`` does), cut into global batches of ``batch_size * num_replicas``; a
replica takes a *contiguous* ``batch_size`` slice of each. So concatenating the replicas'
k-th batches in replica order gives exactly the k-th batch a single process would draw
with batch size ``batch_size * num_replicas`` from :func:`epoch_order` — which is what
makes a data-parallel run comparable, sample for sample, with single-process training.
With ``batch_size=1`` the slices interleave as in ``DistributedSampler``.

The last, incomplete global batch is split evenly between the replicas, padded with its
own first indices until each gets the same number of samples (``DistributedSampler``'s
rule); with ``drop_last`` it is dropped instead.

Example:
    >>> shards = [list(ReplicaSampler(range(8), num_replicas=2, replica=r, batch_size=2,
    ...                               shuffle=False)) for r in range(2)]
    >>> shards
    [[0, 1, 4, 5], [2, 3, 6, 7]]
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from partitioner.errors import SamplerError

__all__ = ["ReplicaSampler", "epoch_order", "SamplerError"]


def epoch_order(n: int, epoch: int, *, seed: int = 0, shuffle: bool = True) -> list[int]:
    """The order of the dataset's ``n`` indices in ``epoch`` (shared by every replica).

    Example:
        >>> epoch_order(4, 0, shuffle=False)
        [0, 1, 2, 3]
    """
    if not shuffle:
        return list(range(n))
    generator = torch.Generator().manual_seed(seed + epoch)
    return [int(k) for k in torch.randperm(n, generator=generator)]


class ReplicaSampler(Sampler[int]):
    """Indices of one replica's shard of each epoch.

    Args:
        dataset: anything with ``len()``.
        num_replicas: data-parallel replicas (a mesh's ``dp``).
        replica: this rank's replica (a mesh's ``replica``).
        batch_size: the per-replica batch size the loader will use.
        shuffle: permute each epoch (else dataset order).
        seed: the permutation seed; must be the same on every rank.
        drop_last: drop the last incomplete global batch instead of padding it.

    Raises:
        SamplerError: for a replica outside ``0..num_replicas-1`` or a size below 1.
    """

    def __init__(self, dataset: Sized, num_replicas: int, replica: int, *, batch_size: int = 1,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        problems = []
        if num_replicas < 1:
            problems.append(f"num_replicas={num_replicas}; pass at least 1")
        elif not 0 <= replica < num_replicas:
            problems.append(f"replica={replica} is outside 0..{num_replicas - 1}")
        if batch_size < 1:
            problems.append(f"batch_size={batch_size}; pass at least 1")
        if problems:
            raise SamplerError("; ".join(problems))
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.replica = replica
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    @classmethod
    def from_mesh(cls, dataset: Sized, mesh: Any, **options: Any) -> ReplicaSampler:
        """The sampler of this rank's replica in ``mesh`` (a
        ``partitioner.runtime.distributed.mesh.Mesh``)."""
        return cls(dataset, mesh.shape.dp, mesh.replica, **options)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call before each epoch, on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        n, global_batch = len(self.dataset), self.batch_size * self.num_replicas
        if self.drop_last:
            return n // global_batch * self.batch_size
        full, rest = divmod(n, global_batch)
        return full * self.batch_size + math.ceil(rest / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(len(self.dataset), self.epoch, seed=self.seed, shuffle=self.shuffle)
        global_batch = self.batch_size * self.num_replicas
        full, rest = divmod(len(order), global_batch)
        for k in range(full):
            start = k * global_batch + self.replica * self.batch_size
            yield from order[start:start + self.batch_size]
        if rest and not self.drop_last:
            tail = order[full * global_batch:]
            share = math.ceil(rest / self.num_replicas)
            # Pad the tail so every replica gets `share` samples (DistributedSampler's rule).
            padded = (tail * math.ceil(share * self.num_replicas / len(tail)))[
                :share * self.num_replicas]
            yield from padded[self.replica * share:(self.replica + 1) * share]
