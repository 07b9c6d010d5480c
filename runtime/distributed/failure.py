"""When a rank fails, every other rank stops, soon and saying which rank it was.

A pipeline rank blocked in a receive from a dead neighbour would wait for the process
group's timeout (30 minutes by default), and ranks that talk to the dead one only
indirectly would wait on a healthy neighbour that is itself stuck. So each rank runs a
:class:`Watchdog` thread over the rendezvous store (a separate client connection, so it
never queues behind the main thread):

- every ``interval`` it bumps its own heartbeat counter and reads the ``failed`` key;
- it watches the heartbeats of the next ``watch`` ranks on a ring, so every rank is
  watched by others: a counter that has not moved for ``timeout`` seconds (a rank killed
  by a signal, or hung) is published as the failure;
- a rank whose step raises publishes its own failure before re-raising (first writer wins,
  so all ranks name the same root cause; under torchrun the exception also goes to the
  agent's error file) and exits;
- on seeing a failure, a rank prints ``rank R: stopping because rank F failed: ...`` and
  exits with ``exit_code`` (``os._exit``: its main thread may be blocked inside a
  collective that nothing else would interrupt), after the failed rank if that one is still
  exiting, so a launcher that stops the rest on the first exit names the right rank;
- the store's host (rank 0 when not launched by torchrun) keeps the store up until the
  others have seen the failure; if the store itself stops answering, its host is gone, and
  the rank exits naming it;
- a communication error on a healthy rank is usually the echo of a peer's death (gloo's
  bare ``RuntimeError`` included, see ``partitioner.runtime.distributed.comm_failure``), in
  a step, in a save or escaping the program: the rank waits for the root cause to be
  published rather than reporting itself.

A rank that finishes cleanly marks itself exited, so its silence is not a failure; but a
rank still inside a step or a save (which need every rank) for ``timeout`` after another
rank exited cleanly, or whose exchange failed since, names the exited rank: it ran fewer
steps than the others. The store's host, exiting cleanly while others still run, says so
before its store goes. Detection takes about ``interval`` for a raise and ``timeout`` for a
kill or an early exit.

At start, ``partitioner.runtime.distributed.agreement`` checks that the ranks were asked
for the same run and built the same plan (:func:`check_same_plan`, re-exported here).

Example:
    >>> FailurePolicy(timeout=10.0, interval=0.5)
    FailurePolicy(timeout=10.0, interval=0.5, exit_code=1, watch=2)
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

from partitioner.errors import PlanMismatchError, PolicyError
from partitioner.runtime.distributed.agreement import check_same_plan
from partitioner.runtime.distributed.comm_failure import (
    CommunicationError,
    is_communication_failure,
)
from partitioner.runtime.distributed.rendezvous import LockedStore, attempt_prefix, store_client

__all__ = ["FailurePolicy", "Watchdog", "CommunicationError", "PlanMismatchError",
           "check_same_plan", "start_watchdog", "active_watchdog", "format_exception",
           "is_communication_failure", "undo_on_abort"]

_PREFIX = "partitioner/watchdog"


@dataclass(frozen=True)
class FailurePolicy:
    """How failures are detected and handled.

    Args:
        timeout: seconds without a heartbeat after which a rank counts as dead; also the
            longest a failing rank waits for the others to acknowledge its failure.
        interval: seconds between two heartbeats (and two checks).
        exit_code: what a rank stopped by another's failure exits with (non-zero).
        watch: how many ranks (the next ones on a ring) each rank watches.

    Raises:
        ValueError: (a :class:`PartitionError`) for a non-positive time, ``timeout`` not
            above ``2 * interval``, a zero exit code or ``watch < 1``.
    """

    timeout: float = 30.0
    interval: float = 0.5
    exit_code: int = 1
    watch: int = 2

    def __post_init__(self) -> None:
        problems = []
        if not self.interval > 0:
            problems.append(f"interval={self.interval!r} must be > 0")
        if not self.timeout > 2 * self.interval:
            problems.append(f"timeout={self.timeout!r} must exceed 2 * interval "
                            f"({2 * self.interval!r}), or healthy ranks look dead")
        if self.exit_code == 0 or not 0 < self.exit_code < 256:
            problems.append(f"exit_code={self.exit_code!r}; use 1..255 (non-zero)")
        if self.watch < 1:
            problems.append(f"watch={self.watch!r}; watch at least 1 rank")
        if problems:
            raise PolicyError("bad FailurePolicy: " + "; ".join(problems))


class Watchdog:
    """Heartbeats and failure propagation through the rendezvous store (see the module doc).

    Args:
        store: a ``torch.distributed.Store`` client this watchdog may use from its thread.
        rank: this process's rank.
        world_size: the number of ranks.
        policy: timings and exit code.
        store_host: a description of who hosts the store, for messages.
    """

    def __init__(self, store: Any, rank: int, world_size: int, policy: FailurePolicy,
                 store_host: str = "the store") -> None:
        self.store = LockedStore(store)
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.store_host = store_host
        self.store_owner = store_host.rpartition("hosted by ")[2] or "its host"
        #: Whether the store lives in this process (rank 0 when not launched by torchrun).
        self.hosts_store = rank == 0 and self.store_owner == "rank 0"
        self._stop = threading.Event()
        self._dying = threading.Lock()
        self._reported = False
        self._exit_deadline: float | None = None
        #: How many guarded blocks (steps, saves: every rank takes part) are running.
        self._busy = 0
        self._exit_seen: float | None = None
        self._thread = threading.Thread(target=self._loop, name="partitioner-watchdog",
                                        daemon=True)
        count = min(policy.watch, world_size - 1)
        self.watched = tuple((rank + k) % world_size for k in range(1, count + 1))

    def _key(self, kind: str, rank: int | None = None) -> str:
        # Per attempt: a world torchrun restarted must not read the last one's failure.
        prefix = attempt_prefix(_PREFIX)
        return f"{prefix}/{kind}" if rank is None else f"{prefix}/{kind}/{rank}"

    def start(self) -> None:
        """Start the heartbeat thread."""
        self.store.add(self._key("hb", self.rank), 1)
        self._thread.start()

    def _loop(self) -> None:
        now = time.monotonic()
        last = {w: -1 for w in self.watched}
        seen = {w: now for w in self.watched}
        while not self._stop.wait(self.policy.interval):
            try:
                self.store.add(self._key("hb", self.rank), 1)
                cause = self.cause()
                if cause is not None and cause[0] != self.rank:
                    self._die(cause)
                now = time.monotonic()
                for w in self.watched:
                    beat = self.store.add(self._key("hb", w), 0)
                    if beat != last[w] or self.store.add(self._key("exit", w), 0):
                        last[w], seen[w] = beat, now
                    elif now - seen[w] > self.policy.timeout:
                        self._publish(w, f"no heartbeat for {now - seen[w]:.1f} s (killed by "
                                         "a signal, crashed or hung)")
                        self._die(self.cause() or (w, "no heartbeat"))
                self._check_early_exits(now)
            except Exception as error:
                if self._stop.is_set():
                    return
                if self._reported:
                    # This rank failed and said so; the store's host has since exited.
                    _run_abort_hooks()
                    os._exit(self.policy.exit_code)
                self._lost_store(error)
            if self._exit_deadline is not None and time.monotonic() > self._exit_deadline:
                # This rank reported its own failure but its process has not exited.
                self.exit_now()

    def _check_early_exits(self, now: float) -> None:
        """Name a rank that exited cleanly while this one has been in a step ever since."""
        if not self._busy or self._reported or not self.store.add(self._key("exited"), 0):
            self._exit_seen = None
            return
        if self._exit_seen is None:
            # It may have finished its last step a moment before this rank finishes its own.
            self._exit_seen = now
        elif now - self._exit_seen > self.policy.timeout:
            early = self.exited_early(f"still waiting for it after {self.policy.timeout:.0f} s")
            if early is not None:
                self._die(early)

    def exited_early(self, how: str) -> tuple[int, str] | None:
        """Publish (first writer wins) a rank that exited cleanly as the failure, if any.

        Called when this rank, still in a step or a save that needs every rank, lost a peer:
        a rank that ended its program then ran fewer steps (or saves) than this one.

        Returns:
            The published cause, or None if no other rank has exited.
        """
        if not self.store.add(self._key("exited"), 0):
            return None
        gone = [r for r in range(self.world_size)
                if r != self.rank and self.store.add(self._key("exit", r), 0)]
        if not gone:
            return None
        return self._publish(gone[0], _early_exit_reason(gone, self.rank, how))

    def _publish(self, rank: int, reason: str) -> tuple[int, str]:
        text = json.dumps({"rank": rank, "reason": reason})
        winner = self.store.compare_set(self._key("failed"), "", text)
        data = json.loads(winner)
        return int(data["rank"]), str(data["reason"])

    def cause(self) -> tuple[int, str] | None:
        """The published failure, ``(rank, reason)``, if any rank has failed."""
        if not self.store.check([self._key("failed")]):
            return None
        data = json.loads(self.store.get(self._key("failed")))
        return int(data["rank"]), str(data["reason"])

    def _die(self, cause: tuple[int, str], echo: BaseException | None = None) -> None:
        if not self._dying.acquire(blocking=False):
            # The other thread is already stopping the process.
            while True:
                time.sleep(1)
        failed, reason = cause
        print(f"[partitioner] rank {self.rank}: stopping because rank {failed} failed: "
              f"{reason}{_seen_here(echo)}. Rank {failed}'s own output has the cause",
              file=sys.stderr, flush=True)
        try:
            self.store.add(self._key("ack", self.rank), 1)
            if self.hosts_store:
                # The others learn of the failure through this process's store: keep it up
                # until they have (the failed rank itself may be dead).
                self._await_acknowledgements(skip=failed)
            if self.store.add(self._key("raised", failed), 0) and not (
                    failed == 0 and self.store_owner == "rank 0"):
                # Let a rank that raised exit first, so a launcher (torchrun's agent, which
                # then stops the rest) names it, not us, as the first failure. (A failed
                # store host waits for our acknowledgement instead, and takes the store.)
                self._await_gone(failed)
        except Exception:
            pass
        sys.stdout.flush()
        _run_abort_hooks()
        os._exit(self.policy.exit_code)

    def _await_gone(self, rank: int) -> None:
        deadline = time.monotonic() + self.policy.timeout
        while time.monotonic() < deadline and not self.store.add(self._key("gone", rank), 0) \
                and not self.store.add(self._key("exit", rank), 0):
            time.sleep(min(0.05, self.policy.interval))
        time.sleep(0.5)

    def exit_now(self) -> None:
        """End this (failed) process at once with ``exit_code``, telling the others."""
        try:
            self.store.add(self._key("gone", self.rank), 1)
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        _run_abort_hooks()
        os._exit(self.policy.exit_code)

    def _lost_store(self, error: BaseException, echo: BaseException | None = None) -> None:
        if not self._dying.acquire(blocking=False):
            while True:
                time.sleep(1)
        print(f"[partitioner] rank {self.rank}: stopping because the rendezvous store at "
              f"{self.store_host} stopped answering ({type(error).__name__}: {error}); "
              f"{self.store_owner} has most likely failed{_seen_here(echo)}. Its own output "
              "has the cause", file=sys.stderr, flush=True)
        _run_abort_hooks()
        os._exit(self.policy.exit_code)

    def report(self, reason: str, error: BaseException | None = None) -> tuple[int, str]:
        """Publish this rank's failure, so every other rank stops naming it.

        Under torchrun the exception also goes to the agent's error file, so torchrun's own
        summary shows it as the root cause. If this process hosts the store, it waits (at
        most ``timeout``) until the others have seen the failure, since its exit takes the
        store down; any other rank returns at once, to exit first.

        Returns:
            The published root cause (another rank's, if it failed first).
        """
        self._reported = True
        self._exit_deadline = time.monotonic() + 2 * self.policy.timeout
        try:
            self.store.add(self._key("raised", self.rank), 1)
            cause = self._publish(self.rank, reason)
        except Exception:
            return self.rank, reason
        if cause[0] == self.rank:
            print(f"[partitioner] rank {self.rank} failed: {reason}", file=sys.stderr,
                  flush=True)
            if error is not None and os.environ.get("TORCHELASTIC_ERROR_FILE"):
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                get_error_handler().record_exception(error)
            if self.hosts_store:
                self._await_acknowledgements()
        return cause

    def _await_acknowledgements(self, skip: int | None = None) -> None:
        others = [r for r in range(self.world_size) if r not in (self.rank, skip)]
        deadline = time.monotonic() + self.policy.timeout
        while others and time.monotonic() < deadline:
            try:
                others = [r for r in others if not self.store.add(self._key("ack", r), 0)
                          and not self.store.add(self._key("exit", r), 0)]
            except Exception:
                return
            time.sleep(min(0.05, self.policy.interval))

    def wait_for_cause(self, timeout: float, echo: BaseException | None = None
                       ) -> tuple[int, str] | None:
        """Wait up to ``timeout`` seconds for a failure to be published; return it or None.

        With ``echo`` (this rank's failed exchange), a rank that exited cleanly counts as
        the failure too: this rank lost a peer it still needed.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                cause = self.cause()
                if cause is None and echo is not None:
                    cause = self.exited_early(f"here: {_one_line(echo)}")
            except Exception as error:
                self._lost_store(error, echo)
            if cause is not None or time.monotonic() >= deadline:
                return cause
            time.sleep(min(0.05, self.policy.interval))

    def blame(self, error: BaseException) -> None:
        """Stop naming the root cause if ``error`` is the echo of another rank's failure.

        A failed exchange (:func:`is_communication_failure`) is most often how a healthy
        rank learns that a peer died: this waits for the watchdogs to publish the cause
        (up to ``2 * timeout``: a killed rank is noticed after ``timeout``) and stops the
        process naming it. Returns if ``error`` is not such an echo or nothing else failed.
        """
        if not is_communication_failure(error) or self._reported:
            return
        cause = self.wait_for_cause(2 * self.policy.timeout, error)
        if cause is not None and cause[0] != self.rank:
            self._die(cause, error)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Report an exception escaping the block as this rank's failure (then re-raise).

        The block takes part in exchanges with every rank (a step, a save): a failed
        exchange first waits for another rank's failure to be published, and a rank that
        exits cleanly meanwhile counts as failed (see :meth:`blame`).
        """
        self._busy += 1
        try:
            yield
        except BaseException as error:
            self.blame(error)
            self.report(format_exception(error), error)
            raise
        finally:
            self._busy -= 1

    def stop(self) -> None:
        """Mark this rank as cleanly exited and stop the thread.

        Rank 0 outside torchrun hosts the store, so it waits (at most ``timeout``) for the
        others to finish before its process, and the store, go away; if they have not, it
        publishes its early exit as the failure, so they stop naming it.
        """
        if self._stop.is_set():
            return
        try:
            self.store.add(self._key("exit", self.rank), 1)
            self.store.add(self._key("exited"), 1)
            if self.hosts_store and not self._reported:
                self._await_exits()
        except Exception:
            pass
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.policy.interval + 1)

    def _await_exits(self) -> None:
        others = [r for r in range(1, self.world_size)]
        deadline = time.monotonic() + self.policy.timeout
        while others and time.monotonic() < deadline and self.cause() is None:
            others = [r for r in others if not self.store.add(self._key("exit", r), 0)]
            time.sleep(min(0.05, self.policy.interval))
        if others and self.cause() is None:
            self._publish(self.rank, (
                f"rank {self.rank}, which hosts the rendezvous store, ended its program "
                f"normally but ranks {others} were still running {self.policy.timeout:.0f} s "
                "later, and cannot go on without the store; make every rank run the same "
                "steps, or launch with torchrun (its agent hosts the store)"))
        if self.cause() is not None:
            # The others learn of the failure through this process's store.
            self._await_acknowledgements(skip=self.rank)


_ACTIVE: Watchdog | None = None
_ABORT_HOOKS: list[Callable[[], None]] = []


@contextmanager
def undo_on_abort(undo: Callable[[], None]) -> Iterator[None]:
    """Run ``undo`` if the watchdog ends this process while the block runs.

    The watchdog stops a process with ``os._exit`` (its main thread may be stuck in a
    collective), which skips ``finally`` blocks; work that must not be left half done (a
    checkpoint's temporary file) registers its undoing here.
    """
    _ABORT_HOOKS.append(undo)
    try:
        yield
    finally:
        _ABORT_HOOKS.remove(undo)


def _run_abort_hooks() -> None:
    for undo in list(_ABORT_HOOKS):
        try:
            undo()
        except Exception:
            pass


def active_watchdog() -> Watchdog | None:
    """The watchdog of this process, if one was started."""
    return _ACTIVE


def start_watchdog(policy: FailurePolicy | None = None) -> Watchdog:
    """Start this process's watchdog (once; later calls return the running one).

    Needs ``torch.distributed`` initialized: the watchdog talks through its store. Also
    installs an exception hook, so an exception that ends the program is reported as
    this rank's failure and the process exits at once (pending communication cannot hold
    it), and an exit handler that marks a clean exit.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    store, host = store_client()
    watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(),
                        policy or FailurePolicy(), host)
    watchdog.start()
    _ACTIVE = watchdog
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        if not watchdog._reported:
            watchdog.blame(value)
            watchdog.report(format_exception(value), value)
        previous(kind, value, tb)
        watchdog.exit_now()

    sys.excepthook = hook
    atexit.register(watchdog.stop)
    return watchdog


def format_exception(error: BaseException) -> str:
    """One line naming an exception, for failure reports."""
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _one_line(error: BaseException) -> str:
    lines = format_exception(error).splitlines()
    return lines[0] if lines else type(error).__name__


def _seen_here(echo: BaseException | None) -> str:
    return "" if echo is None else f" (here: {_one_line(echo)})"


def _early_exit_reason(gone: list[int], waiting: int, how: str) -> str:
    ranks = f"rank {gone[0]} ended its program" if len(gone) == 1 else \
        f"ranks {gone} ended their programs"
    return (f"{ranks} normally while rank {waiting} still needed it in a step or save "
            f"({how}); a rank ran fewer steps, evaluations or saves than the others: make "
            "every rank make the same calls")
