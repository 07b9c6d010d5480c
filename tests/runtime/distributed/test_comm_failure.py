"""A failed exchange is one CommunicationError, and an echo is recognised through causes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from partitioner.errors import CommunicationError, PartitionError, StageExecutionError
from partitioner.runtime.distributed.comm_failure import communicating, is_communication_failure

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:4331. This is typically caused by a remote worker crashing. Check the "
        "logs of the remote worker before reporting an error. GLHF!")


def test_a_gloo_error_becomes_a_communication_error_saying_what_and_what_to_do() -> None:
    with pytest.raises(CommunicationError) as caught:
        with communicating("the loss all-reduce over every rank"):
            raise RuntimeError(GLOO)
    message = str(caught.value)
    assert message.startswith("the loss all-reduce over every rank failed: RuntimeError: ")
    assert "Connection closed by peer" in message
    assert "This is typically caused" not in message     # gloo's advice gives way to ours
    assert "the first rank that failed is named in the logs" in message
    assert isinstance(caught.value, PartitionError) and isinstance(caught.value, RuntimeError)
    assert caught.value.__cause__ is not None


def test_communicating_keeps_a_communication_error_and_other_exceptions_as_they_are() -> None:
    inner = CommunicationError("receiving from rank 1 failed")
    with pytest.raises(CommunicationError) as caught:
        with communicating("outer"):
            raise inner
    assert caught.value is inner
    with pytest.raises(KeyError):
        with communicating("outer"):
            raise KeyError("not an exchange")


def test_an_echo_is_recognised_through_the_errors_that_wrap_it() -> None:
    # A tensor-parallel all-reduce inside a stage fails; the stage wraps the gloo error.
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as error:
            raise StageExecutionError("stage 1 raised", 1, 0, None) from error
    except StageExecutionError as wrapped:
        assert is_communication_failure(wrapped)
    assert is_communication_failure(CommunicationError("x"))
    assert is_communication_failure(dist.DistNetworkError("the store went away"))
    assert is_communication_failure(RuntimeError("Read error: Connection reset by peer"))


def test_a_rank_s_own_mistake_is_not_an_echo() -> None:
    assert not is_communication_failure(ValueError("balance sums to 9"))
    assert not is_communication_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    try:
        try:
            raise ValueError("loss is nan")
        except ValueError as error:
            raise RuntimeError("step failed") from error
    except RuntimeError as wrapped:
        assert not is_communication_failure(wrapped)
