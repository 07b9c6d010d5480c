"""Tests of runtime/host_memory.py: freed host memory kept for the next step.

Each case runs in a fresh interpreter: the allocator's settings are process-wide.
"""

from __future__ import annotations

import doctest
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import partitioner.runtime.host_memory

ROOT = Path(__file__).resolve().parents[2]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _run(code: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "PARTITIONER_HOST_MEMORY"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                         env={**clean, "OMP_NUM_THREADS": "1", **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Page faults taken by five steps that each allocate, fill and free 64 MiB (a tensor above
# glibc's largest mmap threshold), after 20 steps to warm up (kept, a freed block is reused
# once enough freed blocks have merged: about ten steps).
def _counting(warmup: int) -> str:
    """Script lines: ``step()`` run ``warmup`` times, then five times counting page faults."""
    return f"""
    for _ in range({warmup}):
        step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
"""


_FAULTS = """
    import json, resource, torch
    from partitioner.runtime.host_memory import keep_freed_memory, host_memory_kept
    kept = keep_freed_memory() if {keep} else False
    def step():
        torch.empty(16 * 2**20).fill_(1.0)
""" + _counting(20) + """
    print(json.dumps({{"kept": kept, "state": host_memory_kept(), "faults": faults}}))
"""


@pytest.mark.slow  # seconds of subprocesses or big models: the second tier
@pytest.mark.skipif(not GLIBC, reason="keeping freed memory needs glibc's mallopt")
def test_kept_memory_is_reused_instead_of_faulted_in_again() -> None:
    default = _run(_FAULTS.format(keep=False))
    kept = _run(_FAULTS.format(keep=True))
    assert not default["kept"] and not default["state"]
    assert kept["kept"] and kept["state"]
    pages = 5 * 64 * 2**20 // 4096
    assert default["faults"] > pages / 2  # every step faults its 64 MiB in again
    assert kept["faults"] < pages / 20  # reused: almost none


@pytest.mark.slow  # a Python subprocess
@pytest.mark.skipif(not GLIBC, reason="keeping freed memory needs glibc's mallopt")
def test_the_runtime_leaves_the_allocator_alone_unless_asked() -> None:
    result = _run("""
        import json, torch
        from torch import fx, nn
        from partitioner.runtime.host_memory import (host_memory_kept, keep_freed_memory,
                                         release_host_memory)
        from partitioner.runtime.local import LocalPipeline
        class Stage(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(4, 4)
            def forward(self, x):
                return (self.linear(x),)
        pipe = LocalPipeline([fx.symbolic_trace(Stage()) for _ in range(2)],
                             [torch.device("cpu")] * 2, chunks=2)
        pipe.run([torch.randn(8, 4)])[0].sum().backward()
        pipe.close()
        untouched = host_memory_kept()
        kept = keep_freed_memory() and keep_freed_memory()  # idempotent
        big = torch.ones(64 * 2**20 // 4)
        del big
        print(json.dumps({"untouched": untouched, "kept": kept,
                          "released": release_host_memory()}))
    """)
    assert result == {"untouched": False, "kept": True, "released": True}


# Page faults of five steps that each allocate, fill and free six 8 MiB tensors in the main
# thread (below glibc's largest mmap threshold), after five steps to warm up, in the mode the
# process is left in by planning for CPU devices (the reference spec: nothing is measured).
_PLANNED_FAULTS = """
    import json, resource, torch
    from partitioner.cost.machine import local_cluster
    from partitioner.runtime.host_memory import cpu_host_memory_mode, host_memory_mode
    expected, before = cpu_host_memory_mode(), host_memory_mode()
    local_cluster(["cpu", "cpu"])
    def step():
        tensors = [torch.empty(2 * 2**20).fill_(1.0) for _ in range(6)]
        del tensors
""" + _counting(5) + """
    print(json.dumps({"expected": expected, "before": before, "after": host_memory_mode(),
                      "faults": faults}))
"""


@pytest.mark.skipif(not GLIBC, reason="steady host memory needs glibc's mallopt")
def test_planning_for_cpus_makes_freed_tensors_reused_unless_told_not_to() -> None:
    steady = _run(_PLANNED_FAULTS, PARTITIONER_CPU_SPEC="reference")
    system = _run(_PLANNED_FAULTS, PARTITIONER_CPU_SPEC="reference",
                  PARTITIONER_HOST_MEMORY="system")
    assert (steady["before"], steady["expected"], steady["after"]) == ("system", "steady",
                                                                       "steady")
    assert (system["before"], system["expected"], system["after"]) == ("system",) * 3
    pages = 5 * 6 * 8 * 2**20 // 4096
    # Left to glibc, how much is faulted in again depends on what the process freed before
    # (all 61,440 pages in some runs of this test, none in others): no bound is asserted.
    assert steady["faults"] < pages / 20  # reused
    assert steady["faults"] <= max(system["faults"], pages / 20)


@pytest.mark.skipif(not GLIBC, reason="without glibc there is one mode, system")
def test_the_calibration_cache_is_kept_apart_by_the_allocator_mode() -> None:
    code = """
        import json
        from partitioner.cost.calibration_cache import cache_file
        print(json.dumps({"path": str(cache_file())}))
    """
    steady = _run(code, PARTITIONER_CACHE_DIR="/nonexistent")["path"]
    system = _run(code, PARTITIONER_CACHE_DIR="/nonexistent",
                  PARTITIONER_HOST_MEMORY="system")["path"]
    assert steady != system
    assert steady.startswith("/nonexistent/cpu-") and system.startswith("/nonexistent/cpu-")


def test_an_unknown_host_memory_setting_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from partitioner import partition
    from partitioner.errors import DeviceError, PartitionError
    from partitioner.runtime.host_memory import cpu_host_memory_mode
    monkeypatch.setenv("PARTITIONER_HOST_MEMORY", "sytem")
    with pytest.raises(DeviceError, match="PARTITIONER_HOST_MEMORY='sytem'.*'system'"):
        cpu_host_memory_mode()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    if GLIBC:  # elsewhere the mode is "system" whatever the variable says
        with pytest.raises(PartitionError, match="sytem"):
            partition(model, ["cpu", "cpu"], example_inputs=(torch.randn(8, 4),))


def test_doctests() -> None:
    assert doctest.testmod(partitioner.runtime.host_memory).failed == 0
