"""One worker thread per device.

Each device of a plan gets its own thread, so stages on different devices run at the same
time: on CPU devices the threads overlap because torch releases the GIL inside kernels; on
GPUs each worker also owns a CUDA stream, so a stage's kernels never queue behind another
stage's on the default stream.

Example:
    >>> import torch

from partitioner.runtime.device import new_stream, on_stream
    >>> w = Worker(torch.device("cpu"))
    >>> w.submit(lambda: 1 + 1).result()
    2
    >>> w.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from partitioner.runtime.device import new_stream, on_stream

__all__ = ["Worker", "shared_threads", "use_threads", "thread_default",
           "restore_thread_default"]

T = TypeVar("T")


def shared_threads(devices: Sequence[torch.device]) -> int:
    """Intra-op threads per CPU worker so that the CPU workers share the caller's threads.

    Each worker thread keeps its own OpenMP team. With the default (one intra-op thread per
    core in every thread), k CPU workers would run k teams on the same cores, and a team
    whose barrier waits on a descheduled thread stalls: on 2 cores two stages with 2 threads
    each ran the pipeline benchmark 20-30% slower than with 1 thread each. So the caller's
    ``torch.get_num_threads()`` is divided among the CPU workers (at least 1 each).
    """
    n_cpu = sum(1 for d in devices if d.type == "cpu")
    return max(1, torch.get_num_threads() // max(n_cpu, 1))


_THREADS = threading.RLock()


def _in_fresh_thread(fn: Callable[[], T]) -> T:
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def _set_thread_count(executor: ThreadPoolExecutor, threads: int) -> None:
    """``torch.set_num_threads(threads)`` on ``executor``'s thread, and only there.

    torch also stores the count as the default of every thread that starts computing later
    (user threads, autograd's device threads); a throwaway thread puts the previous default
    back, so making a pipeline does not change the threads of anything else.
    """
    with _THREADS:
        default = thread_default()
        if executor.submit(use_threads, threads).result():
            restore_thread_default(default)


def use_threads(threads: int) -> bool:
    """Give the calling thread ``threads`` intra-op threads; ``True`` if that changed them.

    torch also stores the count as the default of threads that start computing later:
    put it back with :func:`restore_thread_default` once the calls are over.
    """
    # Reading the count first also initialises it: torch sets a thread's count from the
    # stored default on its first parallel op (or get_num_threads), which would otherwise
    # undo the count set here once the default is put back.
    if torch.get_num_threads() == threads:
        return False
    torch.set_num_threads(threads)
    return True


def thread_default() -> int:
    """The intra-op threads a thread starting now would get."""
    return _in_fresh_thread(torch.get_num_threads)


def restore_thread_default(default: int) -> None:
    """Make ``default`` again the count of threads that start computing later (only)."""
    with _THREADS:
        _in_fresh_thread(lambda: torch.set_num_threads(default))


class Worker:
    """A single thread bound to one device (and, on CUDA, one stream).

    Args:
        device: the device its work runs on.
        threads: intra-op threads of the worker's thread (``torch.set_num_threads`` there);
            ``None`` leaves torch's default.
    """

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads}; pass a positive count or None")
        self.device = device
        self.threads = threads
        self.stream = new_stream(device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"partitioner-{device}")
        if threads is not None:
            _set_thread_count(self._executor, threads)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on this worker's thread, in its device and stream context."""
        def run() -> T:
            with on_stream(self.device, self.stream):
                return fn(*args)
        return self._executor.submit(run)

    def close(self) -> None:
        """Stop the thread once queued work is done."""
        self._executor.shutdown(wait=True)
