"""What a failed send, receive or collective looks like, and one error for all of them.

When a rank dies, its peers learn of it from their own communication: gloo raises a bare
``RuntimeError`` ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
from whatever send, receive or collective was waiting on it; ``torch.distributed`` raises
its ``DistError`` subclasses (a backend or store failure). Such an error on a healthy rank
is an *echo* of another rank's failure, and must not be reported as this rank's own (the
failure watchdog, ``partitioner.runtime.distributed.failure``, waits for the root cause
instead). So every piece of the runtime that talks to other ranks wraps its calls in
:func:`communicating`, which turns these errors into one
:class:`~partitioner.errors.CommunicationError` that says what was being exchanged with
whom; and :func:`is_communication_failure` recognises an echo even where it escaped
unwrapped (a tensor-parallel collective inside a stage, a user's own ``all_reduce``),
through the chain of causes.

Example:
    >>> try:
    ...     with communicating("the loss all-reduce"):
    ...         raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    ... except CommunicationError as error:
    ...     print(str(error)[:60])
    the loss all-reduce failed: RuntimeError: [gloo/transport/tc
    >>> is_communication_failure(ValueError("a user's mistake"))
    False
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from partitioner.errors import CommunicationError

__all__ = ["CommunicationError", "communicating", "is_communication_failure", "ECHO_HINT"]

ECHO_HINT = ("a peer rank most likely died or stopped early; the first rank that failed "
             "is named in the logs, look there for the root cause")
"""What a rank whose communication failed can say about the cause."""

# Pieces of the messages gloo's TCP transport raises as plain RuntimeErrors.
_TRANSPORT_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                      "Broken pipe", "Connection refused", "Socket Timeout")


def _is_echo(error: BaseException) -> bool:
    if isinstance(error, CommunicationError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(m in text for m in _TRANSPORT_MARKERS)


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error``, or an exception it was raised from, is a failed exchange.

    Follows ``__cause__`` and ``__context__``, so an error wrapped on its way up (a stage's
    ``StageExecutionError`` around a tensor-parallel all-reduce, say) still counts.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if _is_echo(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


@contextmanager
def communicating(what: str, hint: str = ECHO_HINT) -> Iterator[None]:
    """Raise a :class:`CommunicationError` naming ``what`` if the exchange inside fails.

    Any ``RuntimeError`` raised inside the block counts (gloo raises nothing more specific),
    so keep only ``torch.distributed`` calls in it.

    Args:
        what: the exchange, with its peers (``"receiving activations from rank 1"``).
        hint: what the reader should do (default: look for the rank that failed first).

    Raises:
        CommunicationError: from the original error.
    """
    try:
        yield
    except CommunicationError:
        raise
    except RuntimeError as error:
        raise CommunicationError(f"{what} failed: {type(error).__name__}: "
                                 f"{_first_line(error)}; {hint}") from error


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    # gloo's own advice ("This is typically caused by a remote worker crashing...") is
    # replaced by the hint.
    return lines[0].split(" This is typically caused")[0] if lines else ""
