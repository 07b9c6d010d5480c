"""The device layer (``partitioner.runtime.device``): on a CPU every stream and event is
``None`` and every wait a no-op, so callers need no branch of their own."""

from __future__ import annotations

import pytest
import torch

from partitioner.errors import DistributedInitError
from partitioner.runtime import device as accelerators


def test_a_cpu_has_no_stream_and_no_event() -> None:
    cpu = torch.device("cpu")
    assert not accelerators.is_accelerator(cpu) and not accelerators.is_accelerator("cpu")
    assert accelerators.new_stream(cpu) is None and accelerators.record_event(cpu) is None
    accelerators.wait_event(cpu, None)
    with accelerators.on_stream(cpu, None):
        pass
    x = torch.ones(2)
    accelerators.keep_alive(x, cpu)
    assert accelerators.memory_allocated(cpu) == 0


def test_the_accelerator_is_named_once() -> None:
    assert accelerators.is_accelerator(accelerators.device(1))
    assert str(accelerators.device(1)) == f"{accelerators.ACCELERATOR}:1"
    assert accelerators.backend_for("cpu") == "gloo"
    assert accelerators.backend_for(accelerators.ACCELERATOR) in accelerators.BACKENDS


def test_backend_choice_and_where_collectives_run() -> None:
    expected = "gloo" if not torch.cuda.is_available() else accelerators.BACKENDS[1]
    assert accelerators.default_backend() == expected
    assert accelerators.check_backend("gloo") == "gloo"
    with pytest.raises(DistributedInitError, match="backend='mpi'; use 'gloo'"):
        accelerators.check_backend("mpi")
    assert not accelerators.batches_sends("gloo")
    assert accelerators.batches_sends(accelerators.BACKENDS[1])
    assert accelerators.collective_device("gloo") == torch.device("cpu")
    assert accelerators.rank_device("gloo", 3) is None


def test_autocast_enabled_sees_the_cpu() -> None:
    assert not accelerators.autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert accelerators.autocast_enabled()


def test_fork_rng_restores_the_cpu_generator() -> None:
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    with accelerators.fork_rng([torch.device("cpu"), torch.ones(1)]):
        torch.rand(5)
    assert torch.equal(torch.rand(1), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_streams_and_events_on_a_gpu() -> None:
    dev = accelerators.device(0)
    stream = accelerators.new_stream(dev)
    with accelerators.on_stream(dev, stream):
        y = torch.ones(4, device=dev) * 2
    event = accelerators.record_event(dev)
    accelerators.wait_event(dev, event)
    assert y.sum().item() == 8 and accelerators.memory_allocated(dev) > 0
    name, memory = accelerators.properties(dev)
    assert name and memory > 0
