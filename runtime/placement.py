"""Where each virtual stage runs: a schedule's stage-to-device map, as data.

A :data:`Placement` lists, for virtual stage ``k = 0 .. P v - 1``, the pipeline device ``j``
that holds it (torch.distributed.pipelining calls it ``stage_index_to_group_rank``). Every
schedule in the registry (``partitioner.runtime.schedule_registry``) carries its placement
function; the validator, the runtimes, the predictor and the simulator read the map instead
of assuming one. Two shapes exist today:

* :func:`looped`, GPipe's, 1F1B's and Megatron's interleaving: stage ``k`` on ``k % P``;
* a V (``partitioner.runtime.schedule_generators.v_shape``): down the devices, then back up.

Example:
    >>> looped(3, 2)
    (0, 1, 2, 0, 1, 2)
    >>> stages_on((0, 1, 1, 0), 0)
    (0, 3)
"""

from __future__ import annotations

from partitioner.errors import ScheduleError
from partitioner.runtime.action import Action, Schedule

__all__ = ["Placement", "looped", "placement_of", "stages_on", "devices_of", "placement_problems"]

Placement = tuple[int, ...]
"""Per virtual stage ``k``, the pipeline device ``j`` that runs it."""


def looped(n_stages: int, virtual: int = 1) -> Placement:
    """Virtual stage ``k`` on device ``k % P`` (``P v`` stages in all)."""
    return tuple(k % n_stages for k in range(n_stages * virtual))


def placement_of(schedule: Schedule) -> Placement:
    """The placement a schedule's lists spell out: stage ``k`` on the device whose list
    holds its actions.

    Raises:
        ScheduleError: A stage whose actions sit in several lists, or a stage with none.
    """
    found: dict[int, set[int]] = {}
    for j, actions in enumerate(schedule):
        for action in (a for a in actions if isinstance(a, Action)):
            found.setdefault(action.stage, set()).add(j)
    problems = [f"stage {k} runs on devices {sorted(js)}" for k, js in sorted(found.items())
                if len(js) > 1]
    problems += [f"stage {k} has no actions" for k in range(len(found)) if k not in found]
    if problems:
        raise ScheduleError("the schedule places no stage on one device: "
                            + "; ".join(problems) + "; give each stage's actions one list")
    return tuple(next(iter(found[k])) for k in range(len(found)))


def stages_on(placement: Placement, device: int) -> tuple[int, ...]:
    """The virtual stages device ``j`` holds, in stage order."""
    return tuple(k for k, j in enumerate(placement) if j == device)


def devices_of(placement: Placement, devices: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Each virtual stage's device name, from the ``P`` pipeline devices."""
    return tuple(devices[j] for j in placement)


def placement_problems(placement: Placement, n_stages: int, virtual: int) -> list[str]:
    """What is wrong with ``placement`` for ``P`` devices of ``v`` stages each."""
    problems = []
    if len(placement) != n_stages * virtual:
        problems.append(f"placement names {len(placement)} stages but P={n_stages} devices "
                        f"of virtual={virtual} stages hold {n_stages * virtual}")
    held = [len(stages_on(placement, j)) for j in range(n_stages)]
    if any(j not in range(n_stages) for j in placement) or any(h != virtual for h in held):
        problems.append(f"placement {placement} must put {virtual} stage(s) on each of the "
                        f"devices 0..{n_stages - 1}")
    return problems
