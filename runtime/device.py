"""The device layer: the one place that knows which devices are accelerators and how to
drive them (streams, events, autocast, the collective backend, memory queries).

Everything else asks here instead of testing for ``"cuda"`` (``tests/test_layout.py`` checks
that no other module does): a worker gets its side stream from :func:`new_stream`, a
hand-off records an :func:`record_event` that the receiver waits on, the process group's
backend is :func:`default_backend`, the planner reads a GPU's name and memory from
:func:`properties`. CPU devices get ``None`` streams and events and a no-op for each wait,
so callers need no branch of their own.

Example:
    >>> cpu = torch.device("cpu")
    >>> is_accelerator(cpu), new_stream(cpu), record_event(cpu)
    (False, None, None)
    >>> backend_for("cpu"), batches_sends("gloo")
    ('gloo', False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from partitioner.errors import DistributedInitError

__all__ = ["ACCELERATOR", "DEVICE_TYPES", "BACKENDS", "is_accelerator", "available", "count",
           "device", "current", "set_current", "new_stream", "on_stream", "model_device",
           "record_event", "wait_event", "keep_alive", "autocast_enabled", "fork_rng",
           "properties", "default_backend", "backend_for", "check_backend", "batches_sends",
           "collective_device", "rank_device", "memory_allocated"]

ACCELERATOR = "cuda"
"""The accelerator's device type (the only spelling of it in the project)."""

DEVICE_TYPES = ("cpu", ACCELERATOR, "meta")
"""The device types a plan may name."""

_ACCELERATOR_BACKEND = "nccl"
BACKENDS = ("gloo", _ACCELERATOR_BACKEND)
"""torch.distributed backends: gloo for CPU tensors, nccl for the accelerator's."""


def is_accelerator(dev: torch.device | str) -> bool:
    """Whether ``dev`` is an accelerator (it has streams, events, its own memory)."""
    return torch.device(dev).type == ACCELERATOR


def available() -> bool:
    """Whether this process sees an accelerator."""
    return torch.cuda.is_available()


def count() -> int:
    """How many accelerators this process sees (0 without any)."""
    return torch.cuda.device_count() if available() else 0


def device(index: int) -> torch.device:
    """Accelerator number ``index`` (``cuda:index``)."""
    return torch.device(ACCELERATOR, index)


def current() -> torch.device:
    """The accelerator this process or thread uses by default."""
    return device(torch.cuda.current_device())


def set_current(dev: torch.device | int) -> None:
    """Make ``dev`` the current accelerator of this thread (a no-op for CPU devices)."""
    if isinstance(dev, int) or is_accelerator(dev):
        torch.cuda.set_device(dev)


def new_stream(dev: torch.device) -> Any:
    """A side stream on ``dev`` for a worker's compute, or ``None`` on a CPU."""
    return torch.cuda.Stream(dev) if is_accelerator(dev) else None


@contextlib.contextmanager
def on_stream(dev: torch.device, stream: Any) -> Iterator[None]:
    """Run the block on ``stream`` (from :func:`new_stream`) with ``dev`` current; nothing
    for ``None``.

    The stream first waits for what ``dev``'s default stream queued before (the inputs and
    parameters the block reads), and the default stream then waits for the block's work, so
    whatever the caller queues after it has the result is ordered after it.
    """
    if stream is None:
        yield
        return
    torch.cuda.set_device(dev)
    default = torch.cuda.default_stream(dev)
    stream.wait_stream(default)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        default.wait_stream(stream)


def record_event(dev: torch.device) -> Any:
    """An event marking what ``dev``'s current stream queued so far, or ``None`` on a CPU."""
    if not is_accelerator(dev):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return event


def wait_event(dev: torch.device, event: Any) -> None:
    """Make ``dev``'s current stream wait for ``event``; on a CPU the thread itself waits
    (a GPU's work handed to a CPU stage must be done before the CPU reads it); a no-op for
    ``None``."""
    if event is None:
        return
    if is_accelerator(dev):
        torch.cuda.current_stream(dev).wait_event(event)
    else:
        event.synchronize()


def keep_alive(tensor: torch.Tensor, dev: torch.device) -> None:
    """Tell the caching allocator that ``dev``'s current stream uses ``tensor``, which lives
    on another accelerator's stream (so its memory is not reused too early)."""
    if is_accelerator(dev) and is_accelerator(tensor.device) and tensor.device != dev:
        tensor.record_stream(torch.cuda.current_stream(dev))


def autocast_enabled() -> bool:
    """Whether autocast is on for the CPU or the accelerator in this thread."""
    return torch.is_autocast_enabled("cpu") or (
        available() and torch.is_autocast_enabled(ACCELERATOR))


def fork_rng(devices: Iterable[torch.device | torch.Tensor]
             ) -> contextlib.AbstractContextManager[Any]:
    """``torch.random.fork_rng`` over the CPU and the accelerators among ``devices`` (tensors
    stand for their device): their generators are restored on exit."""
    indices = sorted({(d.device if isinstance(d, torch.Tensor) else d).index or 0
                      for d in devices
                      if is_accelerator(d.device if isinstance(d, torch.Tensor) else d)})
    return torch.random.fork_rng(devices=indices, device_type=ACCELERATOR)


def properties(dev: torch.device) -> tuple[str, float]:
    """An accelerator's name (as CUDA reports it) and its memory in bytes."""
    props = torch.cuda.get_device_properties(dev)
    return props.name, float(props.total_memory)


def memory_allocated(dev: torch.device) -> int:
    """Bytes the caching allocator holds for tensors on an accelerator (0 on a CPU)."""
    return torch.cuda.memory_allocated(dev) if is_accelerator(dev) else 0


def default_backend() -> str:
    """nccl when this process sees an accelerator, else gloo."""
    return _ACCELERATOR_BACKEND if available() else "gloo"


def backend_for(device_type: str) -> str:
    """The backend for ranks on ``device_type`` devices."""
    return _ACCELERATOR_BACKEND if device_type == ACCELERATOR else "gloo"


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKENDS`.

    Raises:
        DistributedInitError: any other backend.
    """
    if backend not in BACKENDS:
        raise DistributedInitError(f"backend={backend!r}; use 'gloo' (CPU) or "
                                   f"'{_ACCELERATOR_BACKEND}' (GPU)")
    return backend


def batches_sends(backend: str) -> bool:
    """Whether point-to-point messages go in batches with the previous sends (nccl), rather
    than receives posted ahead one by one (gloo)."""
    return _ACCELERATOR_BACKEND in backend


def collective_device(backend: str) -> torch.device:
    """Where a collective's tensors must live for ``backend``: the current accelerator for
    nccl (when one is visible), else the CPU."""
    if batches_sends(backend) and available():
        return current()
    return torch.device("cpu")


def rank_device(backend: str, local_rank: int) -> torch.device | None:
    """The device a rank binds its process group to: its accelerator for nccl (made
    current), none for gloo."""
    if not batches_sends(backend):
        return None
    set_current(local_rank)
    return device(local_rank)


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s first tensor lives (CPU for a model without tensors); the meta
    device when any tensor is there (a meta-built model, this rank's stage materialized)."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return torch.device("meta")
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")
