"""Activation checkpointing modes: which micro-batches replay their forward in the backward.

The modes are torchgpipe's. A checkpointed micro-batch keeps only its stage input through
the forward and runs the forward again just before its backward, trading compute for the
memory of its activations:

* ``always``: every micro-batch is checkpointed;
* ``except_last``: all but the last, whose backward runs first under GPipe, so replaying
  it would only repeat work whose activations are needed at once;
* ``never``: none; every micro-batch keeps its activations until its backward.

Plans, specs, the planner and the runtimes all take the names from here.

One more name is a planning request, not a runtime mode: ``selective``, torchtitan's per-op
recomputation inside each transformer block (``partitioner.cost.transformer_model``), which
``make_plan`` costs for a transformers Llama model planned for a cluster beyond this machine
(``partitioner.planning.llama_plan``). The runtimes here replay whole stages, so the fronts
that build one refuse it (:func:`runnable_checkpoint_problem`).

Example:
    >>> [checkpoint_stop(mode, 4) for mode in CHECKPOINT_MODES]
    [4, 3, 0]
"""

from __future__ import annotations

from partitioner.errors import ChunksError

__all__ = ["ALWAYS", "CHECKPOINT_MODES", "EXCEPT_LAST", "NEVER", "SELECTIVE", "REQUEST_MODES",
           "checkpoint_problem", "checkpoint_stop", "request_checkpoint_problem",
           "runnable_checkpoint_problem"]

ALWAYS = "always"
EXCEPT_LAST = "except_last"
NEVER = "never"

CHECKPOINT_MODES = (ALWAYS, EXCEPT_LAST, NEVER)
"""Every checkpoint mode, in the order messages list them."""

SELECTIVE = "selective"
REQUEST_MODES = (*CHECKPOINT_MODES, SELECTIVE)
"""What a planning request may ask for: a runtime mode, or ``selective`` (planned only)."""


def checkpoint_problem(mode: object) -> str | None:
    """Why ``mode`` is not a checkpoint mode, or ``None`` if it is.

    Example:
        >>> print(checkpoint_problem("sometimes"))
        checkpoint='sometimes' is not a checkpoint mode; use one of 'always', 'except_last', 'never'
    """
    return _unlisted(mode, CHECKPOINT_MODES)


def request_checkpoint_problem(mode: object) -> str | None:
    """Why ``mode`` is neither a checkpoint mode nor ``"selective"``, or ``None``.

    Example:
        >>> print(request_checkpoint_problem("selective"))
        None
    """
    return _unlisted(mode, REQUEST_MODES)


def _unlisted(mode: object, modes: tuple[str, ...]) -> str | None:
    if isinstance(mode, str) and mode in modes:
        return None
    listed = ", ".join(repr(m) for m in modes)
    return f"checkpoint={mode!r} is not a checkpoint mode; use one of {listed}"


def runnable_checkpoint_problem(mode: object) -> str | None:
    """Why a front that builds a runtime cannot run ``checkpoint=mode``, or ``None``.

    Example:
        >>> print(runnable_checkpoint_problem("selective"))  # doctest: +ELLIPSIS
        checkpoint='selective' is torchtitan's per-op recomputation, ... or 'never'
    """
    if mode == SELECTIVE:
        return ("checkpoint='selective' is torchtitan's per-op recomputation, which only "
                "make_plan costs, for a transformers Llama model planned for a Cluster beyond "
                "this machine; the runtimes here replay a whole stage's forward: pass "
                "'always', 'except_last' or 'never'")
    return checkpoint_problem(mode) if mode is not None else None


def checkpoint_stop(mode: str, chunks: int) -> int:
    """Micro-batches ``i < checkpoint_stop`` are checkpointed (torchgpipe's rule).

    Args:
        mode: A name of :data:`CHECKPOINT_MODES`.
        chunks: The number of micro-batches ``m``.

    Returns:
        ``m`` for ``always``, ``m - 1`` for ``except_last``, 0 for ``never``.

    Raises:
        ChunksError: If ``mode`` is not a checkpoint mode.
    """
    problem = checkpoint_problem(mode)
    if problem is not None:
        raise ChunksError(problem)
    return {ALWAYS: chunks, EXCEPT_LAST: chunks - 1, NEVER: 0}[mode]
