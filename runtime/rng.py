"""Per-stage random number generators, so dropout is reproducible under pipelining.

Stages run on several threads at once; drawing dropout masks from torch's one global
generator would make the masks depend on thread timing, and a checkpointed stage could not
replay its forward exactly. The ``private_rng`` pass rewrites dropout in each stage graph to
call :func:`dropout` here, which draws from the generator the running worker installed with
:func:`use_generator`. A checkpointed recomputation installs a copy of the state saved before
the original forward, so it draws the very same mask. Every other random op of a stage
graph (``torch.randn_like`` of a reparameterisation, ``torch.rand``) runs through
:func:`seeded_op`, seeded from that generator, for the same reasons.

A tensor-parallel rank installs a second generator, its own, with :func:`use_shard_generator`:
dropout on a split tensor draws from it
(``partitioner.runtime.tensor_parallel.ops.sharded_dropout``), while
dropout on replicated tensors keeps drawing alike on every rank.

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> with use_generator(g):
    ...     y = dropout(torch.ones(4), 0.5, True)
    >>> sorted(set(y.tolist())) <= [0.0, 2.0]
    True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.runtime.device import fork_rng

__all__ = ["draw_seed", "seeded_call", "seeded_op", "use_generator", "current_generator",
           "use_shard_generator", "current_shard_generator", "dropout", "dropout_module",
           "fork"]

_local = threading.local()


@contextmanager
def _install(slot: str, generator: torch.Generator | None) -> Iterator[None]:
    """Set this thread's ``slot`` to ``generator`` for the block, then restore it."""
    previous = getattr(_local, slot, None)
    setattr(_local, slot, generator)
    try:
        yield
    finally:
        setattr(_local, slot, previous)


def use_generator(generator: torch.Generator | None) -> AbstractContextManager[None]:
    """Make ``generator`` the one :func:`dropout` draws from on this thread."""
    return _install("generator", generator)


def current_generator() -> torch.Generator | None:
    """The generator installed on this thread, if any."""
    return getattr(_local, "generator", None)


def use_shard_generator(generator: torch.Generator | None) -> AbstractContextManager[None]:
    """Make ``generator`` the one dropout on a split tensor draws from on this thread.

    Example:
        >>> g = torch.Generator()
        >>> with use_shard_generator(g):
        ...     current_shard_generator() is g
        True
        >>> current_shard_generator() is None
        True
    """
    return _install("shard_generator", generator)


def current_shard_generator() -> torch.Generator | None:
    """The tensor-parallel rank's own generator installed on this thread, if any."""
    return getattr(_local, "shard_generator", None)


def fork(generator: torch.Generator) -> torch.Generator:
    """A new generator starting from ``generator``'s current state (for replays)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A seed in ``[0, 2**62)`` drawn from ``generator`` (torch's global CPU generator when
    ``None``), on the generator's own device: a GPU generator cannot draw a CPU tensor.

    Example:
        >>> draw_seed(torch.Generator().manual_seed(0)) == draw_seed(
        ...     torch.Generator().manual_seed(0))
        True
    """
    device = generator.device if generator is not None else None
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout drawing its mask from the thread's generator."""
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    generator = current_generator()
    if generator is None:
        return torch.nn.functional.dropout(x, p, True)
    if generator.device != x.device:
        raise RuntimeError(f"the stage generator is on {generator.device} but dropout's "
                           f"input is on {x.device}")
    mask = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
    return x * mask / (1.0 - p)


_GLOBAL = threading.Lock()


def seeded_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module``, whose randomness happens inside it, with torch's global generators
    seeded from the thread's (stage's) generator.

    For modules a capture keeps whole (``nn.MultiheadAttention``, whose attention dropout
    draws from torch's global generator): a checkpointed replay then draws the same masks
    as the forward it replays, and masks do not depend on thread timing. Stages share the
    global generators, so such calls run one at a time.
    """
    if not module.training:
        return module(*args, **kwargs)
    return _seeded(module, args, kwargs, [])


def _seeded(call: Any, args: tuple[Any, ...], kwargs: dict[str, Any], devices: list[Any]) -> Any:
    """``call(*args, **kwargs)`` with torch's global generators (of the tensors' devices and
    ``devices``) seeded from the thread's generator, restored afterwards, one call at a time;
    as it is where no generator is installed."""
    generator = current_generator()
    if generator is None:
        return call(*args, **kwargs)
    seed = draw_seed(generator)
    devices = devices + [t for t in pytree.tree_leaves((args, kwargs))
                         if isinstance(t, torch.Tensor)]
    with _GLOBAL, fork_rng(devices):
        torch.manual_seed(seed)
        return call(*args, **kwargs)


def seeded_op(op: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``op``, a random op of a stage graph, with torch's global generators seeded from
    the thread's (stage's) generator, as :func:`seeded_call` runs a module: a checkpointed
    replay draws what the forward drew, and the draws do not depend on thread timing.
    ``op`` names it (a graph's code holds names, not function objects): ``"torch.randn_like"``,
    ``"aten.bernoulli.p"``, or ``".normal_"`` for a method of ``args[0]``. Outside a stage
    (no generator installed) it is called as it is.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> with use_generator(fork(g)):
        ...     a = seeded_op("torch.randn", 3)
        >>> with use_generator(fork(g)):
        ...     b = seeded_op("torch.randn", 3)
        >>> torch.equal(a, b)
        True
    """
    call, rest = _resolve(op, args)
    # A method's tensor (args[0]) is ``call``'s own: its device is forked too.
    devices: list[Any] = [t for t in args[:len(args) - len(rest)] if isinstance(t, torch.Tensor)]
    if kwargs.get("device") is not None:
        devices.append(torch.device(kwargs["device"]))
    return _seeded(call, rest, kwargs, devices)


def _resolve(op: str, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The callable :func:`seeded_op`'s ``op`` names, and the arguments it takes."""
    if op.startswith("."):
        return getattr(args[0], op[1:]), args[1:]
    if op.startswith("torch."):
        return getattr(torch, op.removeprefix("torch.")), args
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload), args


def dropout_module(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """:func:`dropout` with an ``nn.Dropout``'s own ``p`` and train/eval mode."""
    return dropout(x, float(module.p), module.training)  # type: ignore[arg-type]
