import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Plans in tests come from a fixed CPU spec, not this machine's timings (which drift): the
# same plans on every machine, and no rank of a multi-process test measures its CPU.
# Tests of the measurement itself call partitioner.cost.measure.measure_cpu directly.
os.environ["PARTITIONER_CPU_SPEC"] = "reference"
# Tests never touch the user's calibration cache (~/.cache/partitioner, or the folder the
# user's PARTITIONER_CACHE_DIR names): runs measured here, under the load of a test run,
# would change the user's plans. A folder of this session's own, inherited by subprocesses
# and the ranks of multi-process tests, removed when the session ends.
os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="partitioner-test-cache-")
atexit.register(shutil.rmtree, os.environ["PARTITIONER_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() or os.environ.get("PARTITIONER_GPU_TEST_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
