"""Graph passes: each takes a ``GraphModule`` and returns a ``PassResult``."""

__all__: list[str] = []
