"""Plain example models, for the examples, benchmarks and tests.

They live in the package (``partitioner.cli.zoo``), where the ``partitioner`` command's bundled
models come from, so an installed package has them too; this file keeps the examples'
``from examples.models import ...`` working.

Example:
    >>> import torch
    >>> mlp([8, 16, 2])(torch.randn(5, 8)).shape
    torch.Size([5, 2])
"""

from __future__ import annotations

from partitioner.cli.zoo import GPT, ResNetish, classifier, gpt, mlp

__all__ = ["mlp", "classifier", "ResNetish", "GPT", "gpt"]
