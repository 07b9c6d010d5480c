"""``python -m partitioner.cli``: the ``partitioner`` command."""

from __future__ import annotations

import sys

from partitioner.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
