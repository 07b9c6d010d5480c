from __future__ import annotations

import pytest
import torch

from partitioner.errors import ChunksError, OutputError
from partitioner.runtime.microbatch import CAT, MEAN, SUM, gather, join_rules, scatter


def test_scatter_splits_batched_tensors_and_keeps_the_rest() -> None:
    x, mask = torch.arange(10).reshape(5, 2), torch.ones(1, 2)
    parts = scatter([{"x": x, "mask": mask}, None, 3], 2)
    assert [p[0]["x"].shape[0] for p in parts] == [3, 2]
    assert all(p[0]["mask"] is mask and p[1] is None and p[2] == 3 for p in parts)


def test_gather_inverts_scatter() -> None:
    x = torch.randn(7, 3)
    parts = scatter([x], 3)
    torch.testing.assert_close(gather([p[0] for p in parts]), x)


def test_scatter_refuses_more_chunks_than_rows() -> None:
    with pytest.raises(ChunksError, match="chunks=5 is larger than the batch size 4"):
        scatter([torch.zeros(4)], 5)


def test_leaves_without_a_batch_dimension_are_averaged_by_samples() -> None:
    """Issue #19: a ``(E,)`` leaf was concatenated to ``(2E,)``; a 0-dim one refused."""
    outs = [(torch.ones(3, 2), torch.tensor([1.0, 2.0]), torch.tensor(3.0)),
            (torch.ones(1, 2), torch.tensor([5.0, 6.0]), torch.tensor(7.0))]
    logits, load, aux = gather(outs, sizes=[3, 1])
    assert logits.shape == (4, 2)
    torch.testing.assert_close(load, torch.tensor([2.0, 3.0]))  # 3/4 * first + 1/4 * second
    torch.testing.assert_close(aux, torch.tensor(4.0))


def test_the_captures_finding_beats_a_size_that_matches_by_chance() -> None:
    outs = [(torch.ones(2, 3), torch.full((2,), 1.0)), (torch.ones(2, 3), torch.full((2,), 3.0))]
    assert join_rules(outs, [2, 2]) == [CAT, CAT]  # (2,) looks like 2 samples
    _, load = gather(outs, sizes=[2, 2], rows=[1, MEAN])
    torch.testing.assert_close(load, torch.full((2,), 2.0))
    _, total = gather(outs, sizes=[2, 2], rows=[1, SUM])
    torch.testing.assert_close(total, torch.full((2,), 4.0))
    # A capture's dim 0 that divided by the example batch by chance does not scale: averaged.
    _, load = gather(outs, sizes=[2, 2], rows=[1, 2])
    torch.testing.assert_close(load, torch.full((2,), 2.0))


def test_leaves_that_cannot_be_averaged_are_refused_naming_them() -> None:
    with pytest.raises(OutputError, match=r"output leaf 1 is a torch.int64 tensor of shape \(\)"):
        gather([(torch.ones(2), torch.tensor(1)), (torch.ones(2), torch.tensor(2))])
    with pytest.raises(OutputError, match=r"output leaf 0 has shapes \[\(3,\), \(5,\)\]"):
        gather([torch.ones(3), torch.ones(5)], sizes=[2, 2])
