"""The short names of floating-point dtypes that device specs key their peak FLOP/s by.

Example:
    >>> import torch
    >>> dtype_name(torch.bfloat16), dtype_name(torch.int64)
    ('bf16', 'fp32')
"""

from __future__ import annotations

import torch

__all__ = ["dtype_name"]

_DTYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16",
           torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name peak FLOP/s are keyed by: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``
    (``"fp32"`` for any other dtype).

    Example:
        >>> dtype_name(torch.bfloat16)
        'bf16'
    """
    return _DTYPES.get(dtype, "fp32")
