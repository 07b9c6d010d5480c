"""Layouts: how one value of a tensor-parallel graph is held across the ranks.

Every value of the graph is, on the ``tp`` ranks, either

- :data:`R` (replicated): every rank holds all of it, identical;
- :class:`Shard` ``(dim, blocks)``: rank ``r`` holds the ``r``-th slice of dimension ``dim``
  (of each part in ``blocks``, for fused projections; see
  ``partitioner.runtime.tensor_parallel.sharding``);

(A partial value, every rank holding a summand, exists only between a row-parallel product
and the all-reduce the rewrite puts right after it, so it needs no layout of its own.)

An operation that takes replicated inputs and makes split outputs needs its replicated
inputs' gradients summed over ranks (each rank only sees its share of the uses): such an
input is required as :data:`R_IN` ("entering the parallel region"), which costs nothing
forward and one all-reduce backward (Megatron's ``f``).

The helpers here map a split dimension through reshapes and permutations.

Example:
    >>> view_groups((2, 16, 32), (2, 16, 4, 8))
    [([0], [0]), ([1], [1]), ([2], [2, 3])]
    >>> shard_through_view((2, 16, 32), (2, 16, 4, 8), 2)
    2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Replicate", "Shard", "EnterRegion", "Layout", "R", "R_IN",
           "view_groups", "shard_through_view", "normalize_dim"]


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole value."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class EnterRegion:
    """A replicated input of an operation whose outputs are split (gradient all-reduced)."""

    def __str__(self) -> str:
        return "R->"


@dataclass(frozen=True)
class Shard:
    """Rank ``r`` holds slice ``r`` of dimension ``dim`` (of each of ``blocks``)."""

    dim: int
    blocks: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return f"S({self.dim})" if self.blocks is None else f"S({self.dim}, {list(self.blocks)})"


Layout = Replicate | Shard | EnterRegion

R = Replicate()
R_IN = EnterRegion()


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative index into ``ndim`` dimensions."""
    return dim + ndim if dim < 0 else dim


def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dimensions of ``a`` and ``b`` that hold the same elements under a view.

    Returns ``None`` when the shapes have different sizes or a zero-sized dimension.
    Dimensions of size 1 join the run before them (the first run, at the start).
    """
    if 0 in a or 0 in b or _product(a) != _product(b):
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [i], [j]
        pa, pb = a[i], b[j]
        while pa != pb:
            if pa < pb:
                i += 1
                gi.append(i)
                pa *= a[i]
            else:
                j += 1
                gj.append(j)
                pb *= b[j]
        i += 1
        j += 1
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i)
            i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    if i < len(a) or j < len(b):
        rest_a, rest_b = list(range(i, len(a))), list(range(j, len(b)))
        if groups:
            groups[-1][0].extend(rest_a)
            groups[-1][1].extend(rest_b)
        else:
            groups.append((rest_a, rest_b))
    return groups


def shard_through_view(a: Sequence[int], b: Sequence[int], dim: int) -> int | None:
    """The dimension of shape ``b`` that holds the split when ``a``, split along ``dim``,
    is viewed as ``b``; ``None`` if the slices are not slices of one dimension of ``b``.

    A contiguous slice of a run of dimensions is a slice of the run's outermost dimension
    when ``dim`` is the outermost non-trivial dimension of its run in ``a``; it lands on the
    outermost non-trivial dimension of the run in ``b``. Divisibility is the caller's check.
    """
    groups = view_groups(a, b)
    if groups is None:
        return None
    for gi, gj in groups:
        if dim not in gi:
            continue
        before = gi[:gi.index(dim)]
        if any(a[k] != 1 for k in before):
            return None
        outer = [k for k in gj if b[k] != 1]
        return outer[0] if outer else None
    return None


def _product(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out
