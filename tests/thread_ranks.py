"""Run tensor-parallel ranks on threads of one ``ThreadGroup`` (a test helper)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from partitioner.runtime.tensor_parallel.collectives import ThreadGroup


def on_threads(tp: int, fn: Callable[[int, Any], Any], timeout: float = 60) -> list[Any]:
    """``fn(rank, communicator)`` on ``tp`` threads of one group; results in rank order.

    A rank that raises aborts the group (so its peers do not wait forever) and the first
    error is raised here.
    """
    group = ThreadGroup([torch.device("cpu")] * tp, timeout=timeout)
    results: list[Any] = [None] * tp
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(r, group.members[r])
        except BaseException as error:
            group.abort()
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
