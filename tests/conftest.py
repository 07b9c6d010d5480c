import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Plans in tests come from a fixed CPU spec, not this machine's timings (which drift): the
# same plans on every machine, and no rank of a multi-process test measures its CPU.
# Tests of the measurement itself call partitioner.cost.measure.measure_cpu directly.
os.environ["PARTITIONER_CPU_SPEC"] = "reference"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
