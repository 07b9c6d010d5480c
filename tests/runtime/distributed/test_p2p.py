"""Point-to-point boundaries: predicted metas, checks, tags, and real transfers on gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_harness import launch, results

from partitioner.errors import ChunksError, ScheduleError
from partitioner.runtime.distributed.p2p import (
    Boundary,
    BoundaryMismatchError,
    PipeLinks,
    TensorMeta,
    message_tag,
)

WORKER = Path(__file__).with_name("dist_worker.py")


def test_boundary_records_tensor_metas_and_keeps_other_leaves() -> None:
    b = Boundary.of(({"h": torch.zeros(2, 3)}, torch.arange(4), 5, "mode"))
    assert b.leaves == (TensorMeta((2, 3), torch.float32), TensorMeta((4,), torch.int64), 5,
                        "mode")
    assert b.tensor_positions == (0, 1)
    assert b.grad_positions == (0,)   # integers carry no gradient back


def test_assemble_rebuilds_the_structure_from_received_tensors() -> None:
    b = Boundary.of(({"h": torch.zeros(2, 3)}, 7, torch.zeros(1, dtype=torch.int32)))
    got = b.assemble([torch.ones(2, 3), torch.tensor([3], dtype=torch.int32)])
    assert torch.equal(got[0]["h"], torch.ones(2, 3))
    assert got[1] == 7
    assert got[2].tolist() == [3]


def test_boundary_of_fake_tensors_equals_that_of_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = (torch.randn(4, 8), torch.ones(3, dtype=torch.bool))
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(t) for t in real)
        predicted = Boundary.of(fake)
    assert predicted == Boundary.of(real)


def test_check_names_every_leaf_that_differs() -> None:
    b = Boundary.of((torch.zeros(2, 3), 4, torch.zeros(2)))
    with pytest.raises(BoundaryMismatchError) as info:
        b.check((torch.zeros(2, 5), 3, torch.zeros(2, dtype=torch.float64)), "stage 0")
    message = str(info.value)
    assert "leaf 0 is (2, 5) float32, predicted (2, 3) float32" in message
    assert "leaf 1 is 3, predicted 4" in message
    assert "leaf 2 is (2,) float64, predicted (2,) float32" in message
    assert message.startswith("stage 0")


def test_check_refuses_another_structure_and_returns_the_tensors() -> None:
    b = Boundary.of((torch.zeros(1), torch.zeros(2)))
    with pytest.raises(BoundaryMismatchError, match="structure"):
        b.check([torch.zeros(1), torch.zeros(2)], "stage 1")
    tensors = b.check((torch.ones(1), torch.ones(2)), "stage 1")
    assert [t.shape for t in tensors] == [torch.Size([1]), torch.Size([2])]


def test_message_tags_are_distinct_and_bounded() -> None:
    tags = {message_tag(d, i, k, b) for d in (0, 1) for i in range(50) for k in range(20)
            for b in range(6)}
    assert len(tags) == 2 * 50 * 20 * 6
    assert message_tag(1, 8191, 1023, 127) < 2**31    # a C int, as gloo's tags are
    with pytest.raises(BoundaryMismatchError, match="more than 1024 tensors"):
        message_tag(0, 0, 1024)
    with pytest.raises(ScheduleError, match="at most 128 virtual stages"):
        message_tag(0, 0, 0, 128)
    with pytest.raises(ChunksError, match="at most 8192 micro-batches per step; pass fewer"):
        message_tag(0, 8192, 0)


@pytest.mark.slow
def test_transfers_between_two_processes_in_every_posting_mode() -> None:
    """Out-of-order sends, pytrees, ints, bools, empty tensors; eager and batched posting,
    and a group per direction (a gloo mesh's pipeline has its second group)."""
    records = [r[0] for r in results(launch(WORKER, 2, ["p2p", "{}"], timeout=120))]
    assert len(records) == 2
    for record in records:
        assert record["eager"] is True, record
        assert record["batched"] is True, record
        assert record["directions"] is True, record
        assert record["reverse_group"] is True, record


def test_a_message_travels_on_its_directions_group_at_both_ends() -> None:
    """Messages to a higher rank on the pipeline's group, to a lower rank on the second:
    the sender and the receiver of one message pick the same group."""
    up, down = object(), object()
    low = PipeLinks(up, None, None, torch.device("cpu"), rank=0, reverse_group=down,
                    stage_ranks=(0, 1))
    high = PipeLinks(up, None, None, torch.device("cpu"), rank=1, reverse_group=down,
                     stage_ranks=(0, 1))
    assert low._group(0, 1) is high._group(0, 1) is up
    assert low._group(1, 0) is high._group(1, 0) is down
    one = PipeLinks(up, None, None, torch.device("cpu"), rank=1)
    assert one._group(1, 0) is one._group(0, 1) is up
    with pytest.raises(ValueError, match="reverse_group needs this rank"):
        PipeLinks(up, None, None, torch.device("cpu"), reverse_group=down)
    with pytest.raises(ValueError, match="unbatched links"):
        PipeLinks(up, None, None, torch.device("cpu"), rank=0, reverse_group=down,
                  batched=True)
