"""Launch a small torch.distributed world of subprocesses on loopback, with hard timeouts.

Each rank is ``python <script> <args>`` with torchrun's variables set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), one intra-op thread,
and its own session, so a test can kill a whole world that overran its deadline. Ranks
report by printing ``RESULT {json}`` lines; :func:`results` collects them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


@dataclass
class RankRun:
    """What one rank did: exit code, output, and when it ended (seconds after launch)."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    elapsed: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    """The environment of a rank: this repo and tests importable, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def launch(script: Path | str, world_size: int, args: list[str], *, timeout: float,
           env: dict[str, str] | None = None) -> list[RankRun]:
    """Run ``world_size`` ranks of ``script`` and wait for all (killing all at ``timeout``).

    Raises:
        AssertionError: if the world does not finish within ``timeout`` seconds, with
            every rank's output.
    """
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(world_size):
        rank_env = base_env(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port), **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    return collect(procs, start, timeout)


def collect(procs: list[subprocess.Popen[str]], start: float, timeout: float) -> list[RankRun]:
    """Wait for ``procs`` (rank order) until ``timeout`` seconds after ``start``."""
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() - start < timeout:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic() - start
        time.sleep(0.05)
    overran = [rank for rank in range(len(procs)) if rank not in ended]
    for rank in overran:
        try:
            os.killpg(procs[rank].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    runs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate()
        runs.append(RankRun(rank, proc.returncode, out, err, ended.get(rank, timeout)))
    if overran:
        raise AssertionError(f"ranks {overran} did not finish within {timeout} s:\n"
                             + describe(runs))
    return runs


def describe(runs: list[RankRun]) -> str:
    """Every rank's exit code and the tail of its output, for assertion messages."""
    return "\n".join(f"--- rank {r.rank} exit {r.returncode} after {r.elapsed:.1f} s\n"
                     f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}" for r in runs)


def results(runs: list[RankRun], *, check: bool = True) -> list[list[dict[str, Any]]]:
    """Per rank, the ``RESULT`` records it printed (after checking every rank exited 0)."""
    if check and any(r.returncode != 0 for r in runs):
        raise AssertionError("a rank failed:\n" + describe(runs))
    return [[json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines()
             if line.startswith("RESULT ")] for r in runs]
