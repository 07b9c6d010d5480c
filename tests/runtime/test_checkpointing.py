"""Tests of runtime/checkpointing.py: the checkpoint modes every layer takes from one place."""

from __future__ import annotations

import doctest

import pytest

import partitioner.runtime.checkpointing
from partitioner.errors import ChunksError, PartitionError
from partitioner.runtime.checkpointing import (
    ALWAYS,
    CHECKPOINT_MODES,
    EXCEPT_LAST,
    NEVER,
    checkpoint_problem,
    checkpoint_stop,
)


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_checkpoint_stop_is_torchgpipe_s_rule(chunks: int) -> None:
    assert checkpoint_stop(ALWAYS, chunks) == chunks
    assert checkpoint_stop(EXCEPT_LAST, chunks) == chunks - 1
    assert checkpoint_stop(NEVER, chunks) == 0


def test_every_mode_is_known_and_listed_once() -> None:
    assert CHECKPOINT_MODES == ("always", "except_last", "never")
    assert all(checkpoint_problem(mode) is None for mode in CHECKPOINT_MODES)


@pytest.mark.parametrize("mode", ["sometimes", "Always", "", None, 1])
def test_unknown_modes_are_named_with_the_known_ones(mode: object) -> None:
    expected = (f"checkpoint={mode!r} is not a checkpoint mode; "
                "use one of 'always', 'except_last', 'never'")
    assert checkpoint_problem(mode) == expected
    with pytest.raises(ChunksError) as caught:
        checkpoint_stop(mode, 4)  # type: ignore[arg-type]
    assert str(caught.value) == expected
    assert isinstance(caught.value, PartitionError) and isinstance(caught.value, ValueError)


def test_doctests() -> None:
    result = doctest.testmod(partitioner.runtime.checkpointing)
    assert result.attempted > 0 and result.failed == 0
