"""A progress bar over the named steps of a slow command (tqdm on a terminal, else nothing).

tqdm is optional (the ``cli`` extra); without it, or when stderr is not a terminal, the steps
pass silently.

Example:
    >>> steps = Progress(["building the model", "planning"])
    >>> steps.advance(); steps.advance(); steps.close()
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A progress bar over named steps: :meth:`advance` after each, :meth:`close` at the end."""

    def __init__(self, steps: list[str]) -> None:
        self.steps = steps
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar: Any = None
        else:
            self.bar = tqdm(total=len(steps), desc=steps[0], file=sys.stderr, leave=False,
                            disable=None, bar_format="{desc:36s} {bar} {n}/{total} {elapsed}")

    def advance(self) -> None:
        """Mark the current step done and name the next."""
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n < len(self.steps):
                self.bar.set_description(self.steps[self.bar.n])

    def close(self) -> None:
        """Remove the bar from the terminal."""
        if self.bar is not None:
            self.bar.close()
