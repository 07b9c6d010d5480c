"""Before ranks build anything together, they check that they were asked for the same run.

Ranks launched with different options would otherwise meet in different collectives and
wait for each other forever: ``--pp 2`` on one rank and ``--pp 1`` on another make
different meshes, and ``dist.new_group`` for a pipeline group that the other rank never
creates blocks until the process group's timeout (30 minutes). So the first thing the
ranks exchange is their settings, through the rendezvous store with a bounded wait
(:func:`check_same_settings`), not through a collective that could itself be mismatched:
each rank writes its settings under its own key, then reads every rank's. Mismatched
settings raise :class:`~partitioner.errors.PlanMismatchError` on every rank, naming which
rank asked for what; a rank that never arrives raises
:class:`~partitioner.errors.CommunicationError` naming it.

Once the ranks have built their plans, :func:`check_same_plan` compares a hash of every
rank's plan, stage graphs and parameter shapes (a collective: by then the ranks agree on
the settings, so they run the same collectives).

Example:
    >>> mismatches([{"pp": 2, "dp": 1}, {"pp": 1, "dp": 1}])
    ['pp: rank 0 asked for 2, rank 1 for 1']
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from partitioner.errors import PlanMismatchError
from partitioner.runtime.distributed.comm_failure import CommunicationError, communicating
from partitioner.runtime.distributed.rendezvous import attempt_prefix

__all__ = ["check_same_settings", "check_same_plan", "exchange", "mismatches",
           "SETTINGS_TIMEOUT", "PlanMismatchError"]

SETTINGS_TIMEOUT = 120.0
"""Seconds a rank waits for the others to arrive at the settings check."""

_PREFIX = "partitioner/agree"


def exchange(store: Any, name: str, rank: int, world_size: int, value: str, *,
             timeout: float, poll: float = 0.02) -> list[str]:
    """Every rank's ``value`` through ``store``, in rank order (all ranks call it).

    Each call with the same ``name`` is a new round (counted per rank in the store), so a
    process may check again later; a restart under torchrun starts afresh.

    Args:
        store: a ``torch.distributed.Store`` every rank reaches.
        name: what is exchanged (part of the keys).
        rank: this rank.
        world_size: how many ranks take part.
        value: this rank's value.
        timeout: seconds to wait for the slowest rank.
        poll: seconds between two looks at the store.

    Raises:
        CommunicationError: naming the ranks that did not arrive within ``timeout``.
    """
    prefix = f"{attempt_prefix(_PREFIX)}/{name}"
    round_ = int(store.add(f"{prefix}/rounds/{rank}", 1)) - 1
    keys = [f"{prefix}/{round_}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise CommunicationError(
                f"ranks {missing} did not reach the {name} check within {timeout:.0f} s "
                f"(rank {rank} did): they run another program or other options, or are "
                "stuck before it; start every rank with the same command")
        time.sleep(poll)
    values = [bytes(store.get(key)).decode() for key in keys]
    # The store's host (rank 0) leaves last: on a mismatch every rank raises and exits, and
    # a slower rank still reading from a store whose host is gone gets a network error
    # instead of the mismatch. The other ranks touch the store no more once they count out.
    left = f"{prefix}/{round_}/left"
    if rank != 0:
        store.add(left, 1)
        return values
    while int(store.add(left, 0)) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(poll)
    return values


def mismatches(per_rank: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per setting that differs between ranks, which ranks asked for which value.

    Nested mappings (a plan's dict) are compared key by key, named ``plan.chunks``.
    """
    per_rank = [_flatten(settings) for settings in per_rank]
    problems = []
    names = sorted({k for settings in per_rank for k in settings})
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, settings in enumerate(per_rank):
            by_value.setdefault(_json(settings.get(name)), []).append(rank)
        if len(by_value) > 1:
            asked = [f"{_ranks(ranks)} {'asked for ' if k == 0 else 'for '}{_short(value)}"
                     for k, (value, ranks) in enumerate(by_value.items())]
            problems.append(f"{name}: {', '.join(asked)}")
    return problems


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _short(text: str) -> str:
    text = "None" if text == "null" else text
    return text if len(text) <= 80 else text[:77] + "..."


def check_same_settings(settings: Mapping[str, Any], *, what: str = "settings",
                        timeout: float = SETTINGS_TIMEOUT) -> None:
    """Refuse to go on unless every rank was asked for the same run (all ranks call it).

    Call it right after ``torch.distributed`` starts, before any collective whose shape
    depends on the settings (mesh groups, plan broadcasts). The world size, backend and
    torch version are added to ``settings``.

    Args:
        settings: this rank's requested options (JSON-able; others are compared by repr),
            e.g. ``{"pp": 2, "dp": None, "tp": 1, "chunks": 4, "schedule": "1f1b"}``.
        what: what the settings are, for the keys and the message (``"mesh shapes"``).
        timeout: seconds to wait for the other ranks to arrive.

    Raises:
        PlanMismatchError: on every rank, naming which rank asked for what.
        CommunicationError: if a rank does not arrive within ``timeout``.

    Example:
        >>> check_same_settings({"pp": args.pp, "dp": args.dp})   # doctest: +SKIP
    """
    mine = {**settings, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "torch": torch.__version__}
    store = dist.distributed_c10d._get_default_store()
    text = _json(mine)
    per_rank = [json.loads(v) for v in exchange(store, what, dist.get_rank(),
                                                dist.get_world_size(), text, timeout=timeout)]
    problems = mismatches(per_rank)
    if problems:
        shown = problems[:6] + ([f"{len(problems) - 6} more"] if len(problems) > 6 else [])
        raise PlanMismatchError(
            f"the ranks were asked for different {what}: {'; '.join(shown)}. Every rank "
            "must be asked for the same run: launch all of them with the same command line "
            "and options")


def check_same_plan(digest: str, summary: str) -> None:
    """Refuse to go on unless every rank passes the same ``digest`` (collective).

    Args:
        digest: a hash of what must agree (the plan, the stage graphs, parameter shapes).
        summary: a short human description of this rank's plan, shown on mismatch.

    Raises:
        PlanMismatchError: on every rank, listing which ranks hold which plan.
        CommunicationError: if the exchange fails (a peer died).
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    with communicating("comparing the ranks' plans (all_gather_object over every rank)"):
        dist.all_gather_object(gathered, (digest, summary))
    by_digest: dict[str, list[int]] = {}
    for rank, (d, _) in enumerate(gathered):
        by_digest.setdefault(d, []).append(rank)
    if len(by_digest) == 1:
        return
    listed = "; ".join(f"ranks {ranks} have plan {d[:12]} ({gathered[ranks[0]][1]})"
                       for d, ranks in by_digest.items())
    raise PlanMismatchError(
        f"the ranks built different plans: {listed}. Every rank must build the same plan: "
        "run the same model code with the same example inputs and options on every rank, "
        "and fix the split with balance=, split_points= or plan= (a saved plan file)")
