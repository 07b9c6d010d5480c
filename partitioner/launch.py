"""``python -m partitioner.launch``: torchrun, with the defaults a partitioned run wants.

Launching is ``torch.distributed.run``'s job (torchrun): the rendezvous, one process per
rank, the environment each rank reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), restarts, and stopping a node's processes when one fails.
This module parses nothing of its own and passes every argument through; it only fills in
two defaults torchrun leaves to the user:

- ``--standalone`` when no rendezvous is given (one node, no ``--rdzv-endpoint``,
  ``--master-port`` or ``--nnodes``): a free port on localhost, so two jobs on one machine
  never fight over 29500;
- ``OMP_NUM_THREADS``, when unset, to the cores this process may use divided among the
  node's ranks (torchrun sets 1 and warns).

Example:
    >>> torchrun_args(["--nproc-per-node", "4", "train.py", "--lr", "0.1"])
    ['--standalone', '--nproc-per-node', '4', 'train.py', '--lr', '0.1']
    >>> thread_env(["--nproc-per-node", "4", "train.py"], environ={}, cpus=16)
    {'OMP_NUM_THREADS': '4'}

Run ``python -m partitioner.launch --help`` for torchrun's options.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["torchrun_args", "thread_env", "main"]


def _parse(argv: Sequence[str]) -> Any:
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(list(argv))


def torchrun_args(argv: Sequence[str]) -> list[str]:
    """torchrun's arguments for ``argv``: unchanged, plus ``--standalone`` on one node
    when no rendezvous is given."""
    parsed = _parse(argv)
    one_node = str(parsed.nnodes) in ("1", "1:1")
    rendezvous = parsed.standalone or parsed.rdzv_endpoint or parsed.master_port is not None
    if one_node and not rendezvous:
        return ["--standalone", *argv]
    return list(argv)


def _local_processes(value: str) -> int:
    if value.isdigit():
        return max(1, int(value))
    from partitioner.runtime import device as accelerators

    if value in ("gpu", "auto") and accelerators.available():
        return accelerators.count()
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    return 1


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def thread_env(argv: Sequence[str], environ: Mapping[str, str] | None = None,
               cpus: int | None = None) -> dict[str, str]:
    """Environment to add: ``OMP_NUM_THREADS`` = cores / local ranks, unless already set."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return {}
    ranks = _local_processes(str(_parse(argv).nproc_per_node))
    return {"OMP_NUM_THREADS": str(max(1, (cpus or _cpus()) // ranks))}


def main(argv: Sequence[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default: this process's arguments) and our defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = torchrun_args(argv)
    os.environ.update(thread_env(argv))
    from torch.distributed.run import main as torchrun

    torchrun(args)


if __name__ == "__main__":
    main()
