from __future__ import annotations

import pytest
import torch

from partitioner.errors import ChunksError
from partitioner.runtime.microbatch import gather, scatter


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


def test_gather_refuses_scalars() -> None:
    with pytest.raises(ValueError, match="0-dim"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
