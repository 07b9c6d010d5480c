"""Freed host memory kept for the next step instead of page-faulting it back in.

A training step frees and allocates the same tensors every step: activations, weight
gradients (``zero_grad(set_to_none=True)``, PyTorch's default), the optimizer's temporaries.
On the GPU, PyTorch's caching allocator keeps freed blocks for the next step. On the CPU,
tensors come from the C library's ``malloc``. glibc's ``malloc`` serves allocations above a
threshold (128 KiB, rising to 32 MiB as large blocks are freed) from fresh ``mmap`` pages.
It also hands the free top of its heap back to the kernel. So every step pays again to fault
in and zero the same memory (about 3.5 GB/s on the 2-core VM this was written on).

:func:`keep_freed_memory` raises glibc's mmap and trim thresholds (``mallopt``), so freed
memory stays in the process for reuse, as on the GPU. Measured on that VM (same process and
model, without and with it):

* an Adam step over 16.8M parameters after a pipeline's backward: 67 ms, then 28 ms;
* GPT-2-small (124M + untied head), 2 micro-batches of 4 x 64 tokens: forward + backward
  2380 ms, then 2238 ms; Adam 367 ms, then 252 ms; peak RSS 3.4 GB, then 3.8 GB.

It is opt-in, because the process then keeps its peak memory and more. A loop that
allocates and frees one 64 MiB tensor settled at 731 MB resident: ``posix_memalign``'s
padding keeps a freed block from fitting the next request until enough free blocks merge.
:func:`release_host_memory` hands the free part back (``malloc_trim``), as
``torch.cuda.empty_cache`` does on the GPU.

:func:`steady_host_memory` is the default for CPU devices, applied when a process plans or
calibrates for them (``partitioner.cost.machine.spec_for``): glibc's mmap threshold fixed at
its own largest, 32 MiB, and its trim threshold at 256 MiB, instead of where the process's
history left them. Tensors of 32 MiB and more are still mapped afresh (the cost model charges
it: ``fresh_threshold``); smaller ones are reused while the free top of the heap stays under
256 MiB, whatever ran in the process before. Left to glibc, the thresholds follow the
process's history: on the 2-core VM one ``dp=2 x pp=2`` plan of a convolutional network
took 90-94 ms a step in a process that had not planned before building it, page-faulting
17,600-17,900 pages a step back in, and 73-74 ms with the thresholds fixed (trim threshold
64 or 128 MiB: 76-93 faults a step; docs/benchmarks.md, "One process: the allocator's history").
``PARTITIONER_HOST_MEMORY=system`` leaves glibc's settings alone. The CPU calibration keeps
its runs apart by the mode (:func:`host_memory_mode`; ``partitioner.cost.calibration_cache``).
Where the C library is not glibc, neither does anything.

Example:
    >>> host_memory_kept()  # until keep_freed_memory() is called
    False
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading

from partitioner.errors import DeviceError

__all__ = ["keep_freed_memory", "steady_host_memory", "release_host_memory",
           "host_memory_kept", "host_memory_mode", "cpu_host_memory_mode", "fresh_allocation_bytes",
           "HOST_MEMORY_ENV"]

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# 1 GiB: any tensor up to it is reused from the heap, and up to 2 GiB of free memory at the
# top of the heap stays in the process (mallopt takes an int).
_MMAP_THRESHOLD = 2**30
_TRIM_THRESHOLD = 2**31 - 1
# steady_host_memory: the mmap threshold at glibc's own largest (DEFAULT_MMAP_THRESHOLD_MAX on
# 64-bit systems) from the start, the free top of the heap handed back above 256 MiB. Adam
# over four 24 MiB weights faulted 1.22 of a weight's size back in a step with the trim
# threshold where glibc's own adjustment ends (64 MiB; 77-81 ms a step), 0.05 at 256 MiB,
# none at 512 (41 ms), 0.27-0.47 left to glibc (53-61 ms). A 1 GiB trim threshold kept
# 0.8 GiB more resident after tune=True on regret.py's wide MLP (4.30 against 3.46 GiB peak)
# and ran that benchmark's contenders out of the VM's 23 GiB.
_STEADY_MMAP_THRESHOLD = 32 * 2**20
_STEADY_TRIM_THRESHOLD = 256 * 2**20

HOST_MEMORY_ENV = "PARTITIONER_HOST_MEMORY"
"""Set to ``system`` to leave glibc's allocator settings as they are (``steady``, or unset:
the default; anything else is refused)."""

_lock = threading.Lock()
_mode = "system"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Make freed host memory stay in the process for reuse (once per process; call it
    before training, in every process that trains).

    Returns:
        Whether freed memory is now kept (False where the C library is not glibc).
    """
    global _mode
    with _lock:
        if _mode == "kept":
            return True
        if _set(_MMAP_THRESHOLD, _TRIM_THRESHOLD):
            _mode = "kept"
        return _mode == "kept"


def steady_host_memory() -> bool:
    """Fix glibc's mmap threshold at 32 MiB, the largest its dynamic adjustment gives, and
    its trim threshold at 256 MiB (once per process; nothing if :func:`keep_freed_memory` came
    first, or where ``PARTITIONER_HOST_MEMORY=system``): a training step's freed tensors up
    to 32 MiB are reused by the next whatever ran in the process before, as its CPU spec was
    measured.

    Returns:
        Whether the mode is now ``"steady"`` or ``"kept"`` (False where the C library is
        not glibc or the variable says ``system``).
    """
    global _mode
    possible = _steady_possible()  # the variable checked on every call
    with _lock:
        if _mode != "system":
            return True
        if possible and _set(_STEADY_MMAP_THRESHOLD, _STEADY_TRIM_THRESHOLD):
            _mode = "steady"
        return _mode != "system"


def _mallopt() -> ctypes.CDLL | None:
    libc = _libc()
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def _steady_possible() -> bool:
    """Whether the steady mode can apply here (glibc, and the variable does not opt out).

    Raises:
        DeviceError: ``PARTITIONER_HOST_MEMORY`` is set to neither ``steady`` nor ``system``.
    """
    value = os.environ.get(HOST_MEMORY_ENV, "")
    if value not in ("", "steady", "system"):
        raise DeviceError(f"{HOST_MEMORY_ENV}={value!r}; set it to 'system' (glibc's own "
                          "allocator thresholds) or 'steady' (the default for CPU devices), "
                          "or unset it")
    return _mallopt() is not None and value != "system"


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    libc = _mallopt()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) \
        & bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def fresh_allocation_bytes() -> float | None:
    """Tensors of at least this many bytes get newly mapped memory on every allocation.

    glibc's ``malloc`` maps blocks above its mmap threshold on their own and unmaps them when
    freed; the threshold rises as such blocks are freed, up to 32 MiB. Kept
    (:func:`keep_freed_memory`): 1 GiB. None where the C library is not glibc (unknown).
    """
    if _libc() is None:
        return None
    return float(_MMAP_THRESHOLD if _mode == "kept" else _STEADY_MMAP_THRESHOLD)


def host_memory_kept() -> bool:
    """Whether :func:`keep_freed_memory` is in effect in this process."""
    return _mode == "kept"


def host_memory_mode() -> str:
    """``"kept"`` (:func:`keep_freed_memory`), ``"steady"`` (:func:`steady_host_memory`) or
    ``"system"`` (glibc's settings as they were)."""
    return _mode


def cpu_host_memory_mode() -> str:
    """The mode CPU work of this process runs under: :func:`host_memory_mode` once
    :func:`steady_host_memory` has run (which planning or calibrating for a CPU does)."""
    possible = _steady_possible()
    return "steady" if _mode == "system" and possible else _mode


def release_host_memory() -> bool:
    """Hand the process's free heap memory back to the kernel (``malloc_trim(0)``).

    Returns:
        Whether any memory was released (False where the C library is not glibc).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))
