"""The memory reserve: the share of each device's memory no plan may use.

The memory model counts parameters, gradients, optimizer state and the activations a
schedule keeps; it does not count the allocator's fragmentation, the kernels' workspaces or
the framework's own tensors. Plans therefore use at most ``1 - reserve`` of a device's
memory (its preset's, this machine's, or ``memory_limit=``), 10 % held back by default.

Example:
    >>> usable_memory(80 * 2**30, 0.10) / 2**30
    72.0
    >>> print(reserve_problem(1.0))  # doctest: +NORMALIZE_WHITESPACE
    memory_reserve=1.0 is outside [0, 1); pass the share of each device's memory plans
    leave unused, e.g. memory_reserve=0.1 (the default) or 0.0 to use it all
"""

from __future__ import annotations

from partitioner.plans.explain import format_bytes

__all__ = ["MEMORY_RESERVE", "usable_memory", "reserve_problem", "describe_reserve"]

MEMORY_RESERVE = 0.10
"""The share of each device's memory plans leave unused unless told otherwise."""


def reserve_problem(reserve: object) -> str | None:
    """Why ``reserve`` is not a valid memory reserve, or ``None`` if it is."""
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) \
            or not 0 <= reserve < 1:
        return (f"memory_reserve={reserve!r} is outside [0, 1); pass the share of each "
                "device's memory plans leave unused, e.g. memory_reserve=0.1 (the default) "
                "or 0.0 to use it all")
    return None


def usable_memory(memory: float, reserve: float = MEMORY_RESERVE) -> float:
    """The bytes a plan may use of a device with ``memory`` bytes."""
    return (1.0 - reserve) * memory


def describe_reserve(memory: float, reserve: float) -> str:
    """A note for ``Plan.notes``: how much of the memory plans may use and why.

    Example:
        >>> print(describe_reserve(16 * 2**30, 0.25))
        memory reserve 25%: plans use at most 12 GiB of each device's 16 GiB
    """
    return (f"memory reserve {reserve:.0%}: plans use at most "
            f"{format_bytes(usable_memory(memory, reserve))} of each device's "
            f"{format_bytes(memory)}")
