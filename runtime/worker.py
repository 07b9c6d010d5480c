"""One worker thread per device.

Each device of a plan gets its own thread, so stages on different devices run at the same
time: on CPU devices the threads overlap because torch releases the GIL inside kernels; on
GPUs each worker also owns a CUDA stream, so a stage's kernels never queue behind another
stage's on the default stream.

Example:
    >>> import torch
    >>> w = Worker(torch.device("cpu"))
    >>> w.submit(lambda: 1 + 1).result()
    2
    >>> w.close()
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, TypeVar

import torch

__all__ = ["Worker"]

T = TypeVar("T")


class Worker:
    """A single thread bound to one device (and, on CUDA, one stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"partitioner-{device}")

    def _context(self) -> Any:
        if self.stream is None:
            return nullcontext()
        return torch.cuda.stream(self.stream)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on this worker's thread, in its device and stream context."""
        def run() -> T:
            if self.stream is None:
                return fn(*args)
            torch.cuda.set_device(self.device)
            default = torch.cuda.default_stream(self.device)
            # Order against what the caller queued before, and make what we queue visible
            # to whatever the caller queues after it has our result.
            self.stream.wait_stream(default)
            try:
                with self._context():
                    return fn(*args)
            finally:
                default.wait_stream(self.stream)
        return self._executor.submit(run)

    def close(self) -> None:
        """Stop the thread once queued work is done."""
        self._executor.shutdown(wait=True)
