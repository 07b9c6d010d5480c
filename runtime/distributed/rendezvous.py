"""The rendezvous store of a run, and a check that every rank was launched into one world.

``torch.distributed`` trusts each process's ``WORLD_SIZE``: ranks launched with different
world sizes (two nodes given different ``--nproc-per-node``, a hand-written launch script)
wait for each other inside ``init_process_group`` until its timeout, 30 minutes, saying
nothing. So :func:`rendezvous_store` makes the store ``init_process_group`` would make (a
TCP store hosted by rank 0, or torchrun's agent), and before the process group starts,
:func:`check_same_world` compares the world sizes through it: the first rank to arrive
writes its size, a rank that finds another marks the mismatch, and every rank stops at
once with a :class:`~partitioner.errors.DistributedInitError` naming each rank's size.

Once the group runs, the failure watchdog talks through the same store on a connection of
its own (:func:`store_client`), shared with the main thread under a lock
(:class:`LockedStore`), so it never queues behind a blocked main thread's request.

Example:
    >>> store = rendezvous_store("tcp://127.0.0.1:29500", 0, 2,
    ...                          timedelta(minutes=30))  # doctest: +SKIP
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=2)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from partitioner.errors import DistributedInitError

__all__ = ["rendezvous_store", "check_same_world", "store_client", "LockedStore",
           "attempt_prefix", "DistributedInitError"]

_PREFIX = "partitioner/world"


def attempt_prefix(name: str) -> str:
    """``name`` under this launch attempt's key space (torchrun's ``TORCHELASTIC_RESTART_COUNT``).

    torchrun's agent keeps one store across ``--max-restarts``: every key a failed attempt
    wrote (gloo's addresses of dead processes, a watchdog's failure mark) is still there
    when the restarted world arrives, so every key this package and the process group use
    lives under the attempt.

    Example:
        >>> attempt_prefix("partitioner/world")  # outside torchrun: attempt 0
        'partitioner/world/attempt_0'
    """
    return f"{name}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _address(init_method: str) -> tuple[str, int]:
    if init_method.startswith("env://"):
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    else:
        parsed = urlparse(init_method)
        host, port = parsed.hostname or "", str(parsed.port or "")
    try:
        return host, int(port)
    except ValueError as error:
        raise DistributedInitError(f"the rendezvous port {port!r} of {init_method!r} is not "
                                   "a number; pass tcp://HOST:PORT or set MASTER_PORT") from error


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: timedelta
                     ) -> Any | None:
    """The store of the default process group, after :func:`check_same_world`.

    Args:
        init_method: ``"env://"`` or ``"tcp://HOST:PORT"``; for anything else (``file://``)
            returns None and ``init_process_group`` makes its own store, unchecked.
        rank: this process's rank.
        world_size: the world size this process was launched with.
        timeout: how long to wait for every rank to arrive.

    Raises:
        DistributedInitError: the ranks' world sizes differ, or not all arrived in time.
    """
    if not init_method.startswith(("env://", "tcp://")):
        return None
    host, port = _address(init_method)
    # Under torchrun the agent hosts the store (as torch's own env:// rendezvous assumes).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent,
                          timeout=timeout, wait_for_workers=False, multi_tenant=True)
    check_same_world(store, rank, world_size, timeout.total_seconds(),
                     hosts_store=rank == 0 and not agent)
    # The process group's keys (gloo's listening addresses among them) per attempt: a
    # restarted world reading the last attempt's would connect to dead ranks and fail.
    return dist.PrefixStore(attempt_prefix("default_pg"), store)


def check_same_world(store: Any, rank: int, world_size: int, timeout: float,
                     poll: float = 0.05, *, hosts_store: bool = False) -> None:
    """Wait until ``world_size`` ranks arrived, or fail at once if a rank's size differs.

    ``hosts_store``: this process hosts the store (rank 0 outside torchrun); on a mismatch
    it stays until every rank that arrived has read the world sizes (at most
    :data:`TOLD_WAIT` seconds): leaving at once took the store away from a rank still
    reading them, which then failed with "Connection reset by peer" instead of the sizes
    (the slow tier, 2026-12-04).

    Raises:
        DistributedInitError: naming every rank's world size, or the ranks still missing
            after ``timeout`` seconds.
    """
    prefix = attempt_prefix(_PREFIX)
    store.set(f"{prefix}/rank/{rank}", str(world_size))
    first = bytes(store.compare_set(f"{prefix}/size", "", str(world_size))).decode()
    if first != str(world_size):
        # Marked before this rank counts as arrived: whoever counts it sees the mark.
        store.set(f"{prefix}/mismatch", str(rank))
    store.add(f"{prefix}/arrived", 1)
    deadline = time.monotonic() + timeout
    while True:
        arrived = int(store.add(f"{prefix}/arrived", 0))
        if store.check([f"{prefix}/mismatch"]):
            error = _mismatch(store, prefix, max(world_size, int(first)))
            store.add(f"{prefix}/told", 1)
            if hosts_store:
                _wait_until_told(store, prefix, poll)
            raise error
        if arrived >= world_size:
            return
        if time.monotonic() > deadline:
            raise DistributedInitError(
                f"only {arrived} of {world_size} ranks started within {timeout:.0f} s; start "
                "every rank (torchrun: every node), or check that they reach this address")
        time.sleep(poll)


TOLD_WAIT = 10.0
"""Seconds the store's host waits, on a mismatch, for the other ranks to read it."""


def _wait_until_told(store: Any, prefix: str, poll: float) -> None:
    deadline = time.monotonic() + TOLD_WAIT
    while time.monotonic() < deadline:
        arrived = int(store.add(f"{prefix}/arrived", 0))
        if int(store.add(f"{prefix}/told", 0)) >= arrived:
            return
        time.sleep(poll)


def _mismatch(store: Any, prefix: str, largest: int) -> DistributedInitError:
    sizes = [f"rank {r}: {bytes(store.get(f'{prefix}/rank/{r}')).decode()}"
             for r in range(largest) if store.check([f"{prefix}/rank/{r}"])]
    return DistributedInitError(
        f"the ranks were launched with different world sizes ({', '.join(sizes)}); launch "
        "every rank with the same WORLD_SIZE (torchrun: the same --nnodes and "
        "--nproc-per-node on every node)")


class LockedStore:
    """A store client shared by the watchdog thread and the main thread, one call at a time."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return bool(self._store.check(keys))

    def get(self, key: str) -> bytes:
        with self._lock:
            return bytes(self._store.get(key))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self._lock:
            return bytes(self._store.compare_set(key, expected, desired))


def store_client() -> tuple[Any, str]:
    """A fresh client of the default group's store, and a description of its host.

    The client has its own connection (a TCP store's), so a watchdog thread using it is
    not held up by the main thread's requests.
    """
    store: Any = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        client = dist.TCPStore(store.host, store.port, is_master=False,
                               timeout=timedelta(seconds=60), wait_for_workers=False)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        owner = "torchrun's agent on the first node" if agent else "rank 0"
        return client, f"{store.host}:{store.port}, hosted by {owner}"
    return store, "the default store"
