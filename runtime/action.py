"""One step of a pipeline schedule: a stage running the forward or backward of a micro-batch.

An :class:`Action` prints as ``"1F0"`` (stage 1, forward, micro-batch 0) and reads back
with :meth:`Action.parse`; a :data:`Schedule` is, per stage, the ordered actions it runs
(``partitioner.runtime.schedule`` states the rules a schedule must keep).

Example:
    >>> schedule = ((Action.parse("0F0"), Action.parse("0B0")),)
    >>> [str(a) for a in schedule[0]]
    ['0F0', '0B0']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from partitioner.errors import ScheduleError

__all__ = ["Action", "Phase", "Schedule"]


class Phase(str, Enum):
    """What an action runs of a stage for one micro-batch.

    ``B`` is the whole backward. A zero-bubble schedule splits it in two: ``I`` computes
    the gradients of the stage's inputs (what the previous stage waits for) and ``W`` the
    gradients of its weights, which nobody waits for, so the schedule may defer them to fill
    bubbles. A micro-batch runs ``F`` then either ``B`` or ``I`` then ``W`` on each stage.
    """

    FORWARD = "F"
    BACKWARD = "B"
    INPUT = "I"
    WEIGHT = "W"

    @property
    def gives_input_grad(self) -> bool:
        """Whether this phase produces the gradients the previous stage waits for."""
        return self in (Phase.BACKWARD, Phase.INPUT)

    @property
    def frees(self) -> bool:
        """Whether this phase ends a micro-batch's stay on the stage (its last action)."""
        return self in (Phase.BACKWARD, Phase.WEIGHT)


_ACTION_TEXT = re.compile(r"(\d+)([FBIW])(\d+)")


@dataclass(frozen=True, order=True)
class Action:
    """One stage running one phase of one micro-batch.

    Args:
        stage: Index of the stage, from 0 (of the virtual stage, when stages hold several).
        phase: A :class:`Phase`: ``F``, ``B``, or the halves of ``B``, ``I`` and ``W``.
        microbatch: Index ``i`` of the micro-batch, from 0.

    Raises:
        ScheduleError: If an index is not an int >= 0 or ``phase`` is not a :class:`Phase`.

    Example:
        >>> a = Action(1, Phase.FORWARD, 0)
        >>> str(a), Action.parse("1F0") == a
        ('1F0', True)
    """

    stage: int
    phase: Phase
    microbatch: int

    def __post_init__(self) -> None:
        problems = [
            *_index_problem("stage", self.stage, "number stages from 0"),
            *_index_problem("microbatch", self.microbatch, "number micro-batches from 0"),
        ]
        if not isinstance(self.phase, Phase):
            problems.append(
                f"Action phase must be a Phase, got {self.phase!r}; "
                "pass Phase.FORWARD, Phase.BACKWARD, Phase.INPUT or Phase.WEIGHT "
                "(Phase('F') converts a letter)"
            )
        if problems:
            raise ScheduleError("; ".join(problems))

    def __str__(self) -> str:
        return f"{self.stage}{self.phase.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads an action written as ``str(action)`` does, such as ``"1F0"``.

        Args:
            text: Stage, phase letter (``F``, ``B``, ``I`` or ``W``) and micro-batch; outer
                spaces are ignored.

        Returns:
            The action.

        Raises:
            ScheduleError: If ``text`` is not of that form.

        Example:
            >>> Action.parse("2B3")
            Action(stage=2, phase=<Phase.BACKWARD: 'B'>, microbatch=3)
        """
        found = _ACTION_TEXT.fullmatch(text.strip()) if isinstance(text, str) else None
        if found is None:
            raise ScheduleError(
                f"cannot read {text!r} as an action; write stage, phase and micro-batch "
                "like '1F0' (phase F for forward, B for backward, I and W for its input- and "
                "weight-gradient halves)"
            )
        stage, letter, microbatch = found.groups()
        return cls(int(stage), Phase(letter), int(microbatch))


Schedule = tuple[tuple[Action, ...], ...]
"""Per stage ``j``, the ordered actions that stage runs."""


def _index_problem(name: str, value: object, fix: str) -> list[str]:
    # bool is an int to Python but never a meaningful index.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return []
    return [f"Action {name} must be an int >= 0, got {value!r}; {fix}"]
