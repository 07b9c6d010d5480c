"""The grad-mode and autocast blocks of a ``forward``, which symbolic tracing cannot record.

``torch.fx.symbolic_trace`` runs ``forward`` on proxies; a ``with torch.no_grad():`` (or
``torch.enable_grad()``, ``torch.set_grad_enabled(...)``, ``torch.inference_mode()``,
``torch.autocast(...)``, and the same as decorators) runs while tracing and leaves no node,
so the graph runs the block's ops in whatever mode its caller is in: a scale computed under
``no_grad`` gets a gradient (the partitioned model's gradients differ from the model's), an
``autocast(enabled=False)`` block runs in bf16 under ``precision="bf16"``. The capture
(``partitioner.capture``) watches for them while tracing, with :class:`ModeBlocks` and
:func:`modes`, marks each node recorded inside one, and when any of those computes something
the graph uses (:func:`live_in_blocks`; a block whose results nobody reads, such as RWKV's
one-off rescaling of its weights for inference, is dead code either way) raises
:class:`ModeLost`, so the model is captured with ``torch.export``, which keeps each block as
a higher-order op (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``) over a graph of
its own.

Example:
    >>> import torch
    >>> blocks = ModeBlocks()
    >>> with blocks:
    ...     with torch.no_grad():
    ...         inside = blocks.depth
    ...     after = blocks.depth
    >>> inside, after
    (1, 0)
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.fx as fx

from partitioner.runtime.device import ACCELERATOR

__all__ = ["ModeBlocks", "ModeLost", "modes", "MODE_BLOCKS", "IN_BLOCK", "live_in_blocks",
           "refuse_live_blocks"]

IN_BLOCK = "mode_block"
"""The ``node.meta`` key the capture's tracer sets on a node recorded inside a block."""

MODE_BLOCKS: tuple[Any, ...] = (
    torch.autograd.grad_mode.no_grad, torch.autograd.grad_mode.enable_grad,
    torch.autograd.grad_mode.set_grad_enabled, torch.autograd.grad_mode.inference_mode,
    torch.amp.autocast_mode.autocast)
"""The context managers (and decorators) whose blocks symbolic tracing runs but cannot
record."""


class ModeLost(Exception):
    """``forward`` computes inside a grad-mode or autocast block, which symbolic tracing runs
    but cannot record (``torch.export`` keeps it as a higher-order op)."""


class ModeBlocks:
    """While inside (``with``), :attr:`depth` counts the :data:`MODE_BLOCKS` blocks being
    run, even one that changes nothing observable at the time (``autocast(enabled=False)``
    with autocast off, ``no_grad`` under ``no_grad``): what it does at run time differs.
    The classes' ``__enter__``/``__exit__`` are wrapped for the duration (one thread
    traces at a time: the capture's)."""

    def __init__(self) -> None:
        self.depth = 0
        self._saved: list[tuple[Any, Any, Any]] = []
        self._thread = threading.get_ident()
        self._open: set[int] = set()  # the blocks entered here and not yet left

    def __enter__(self) -> ModeBlocks:
        self._thread = threading.get_ident()
        self._saved = [(cls, cls.__enter__, cls.__exit__) for cls in MODE_BLOCKS]
        for cls, enter, leave in self._saved:
            cls.__enter__ = self._entering(enter)
            cls.__exit__ = self._exiting(leave)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, enter, leave in self._saved:
            cls.__enter__ = enter
            cls.__exit__ = leave
        self._saved = []

    def _entering(self, enter: Any) -> Any:
        def wrapped(block: Any) -> Any:
            if threading.get_ident() == self._thread:  # other threads' blocks are theirs
                self._open.add(id(block))
                self.depth += 1
            return enter(block)
        return wrapped

    def _exiting(self, leave: Any) -> Any:
        def wrapped(block: Any, *exc: Any) -> Any:
            if id(block) in self._open:  # not one entered before the watch began
                self._open.discard(id(block))
                self.depth -= 1
            return leave(block, *exc)
        return wrapped


def modes() -> tuple[Any, ...]:
    """Grad mode, inference mode and the CPU's and the accelerator's autocast states: what a
    call such as ``torch.set_grad_enabled(False)`` outside any ``with`` changes."""
    states: list[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for device in ("cpu", ACCELERATOR):
        try:
            states += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
        except (RuntimeError, TypeError):  # a build without that device type's autocast
            states.append(None)
    return tuple(states)


def live_in_blocks(graph: fx.Graph) -> list[str]:
    """The targets of the nodes marked :data:`IN_BLOCK` that the graph's output depends on,
    or that write in place into a tensor it depends on: what the traced graph would compute
    in the wrong mode. Nodes nobody reads are dead code either way."""
    live: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output" or node in live or _writes_into(node, live):
            live.add(node)
            live.update(node.all_input_nodes)
    return [str(n.target) for n in graph.nodes if n in live and n.meta.get(IN_BLOCK)
            and n.op not in ("placeholder", "output")]


def refuse_live_blocks(graph: fx.Graph) -> None:
    """Raise :class:`ModeLost` if :func:`live_in_blocks` finds any node."""
    lost = live_in_blocks(graph)
    if lost:
        raise ModeLost(f"forward computes {lost[0]} inside torch.no_grad(), torch.enable_grad() "
                       "or torch.autocast(...), which symbolic tracing drops")


def _writes_into(node: fx.Node, live: set[fx.Node]) -> bool:
    """Whether ``node`` is an in-place op (``x.mul_(...)``) on a tensor in ``live``."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    first = node.args[0] if node.args else None
    return (isinstance(name, str) and name.endswith("_") and not name.startswith("_")
            and isinstance(first, fx.Node) and first in live)
