"""The models the command plans: bundled examples by name, or ``module:factory``.

A factory is any function that takes no arguments and returns a model, or a pair
``(model, example_inputs)``; ``--input 64x32`` (``:int64`` for token ids) gives example
inputs otherwise. torch is imported only when a model is built, so that parsing the command
line (``--help``) stays fast.

Example:
    >>> sorted(BUNDLED)
    ['gpt', 'gpt2-xl', 'mlp', 'resnet']
    >>> parse_shape("64x32:int64")
    ((64, 32), 'int64')
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from partitioner.errors import CommandError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Bundled", "BUNDLED", "load_model", "parse_input", "parse_shape"]


@dataclass(frozen=True)
class Bundled:
    """A bundled example: a factory in :mod:`partitioner.cli.zoo`, its arguments and an input.

    ``input_dtype`` names a torch dtype (``"float32"``, ``"int64"``), so that this table is
    read without importing torch.
    """

    factory: str
    kwargs: dict[str, Any]
    input_shape: tuple[int, ...]
    input_dtype: str = "float32"
    meta: bool = False  # build on the meta device (too big to allocate)
    about: str = field(default="", compare=False)


BUNDLED = {
    "mlp": Bundled("mlp", {"widths": [64, 512, 512, 512, 512, 512, 10]}, (64, 64),
                   about="6 Linear layers with ReLUs, batch 64"),
    "resnet": Bundled("ResNetish", {}, (32, 3, 32, 32),
                      about="small ResNet (GroupNorm), 32x32 images, batch 32"),
    "gpt": Bundled("gpt", {"n_layer": 8, "n_embd": 128, "n_head": 4, "vocab": 1024, "seq": 64},
                   (16, 64), "int64", about="8-block nanoGPT, 128 wide, batch 16 x 64"),
    "gpt2-xl": Bundled("gpt", {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab": 50257,
                               "seq": 1024}, (8, 1024), "int64", meta=True,
                       about="GPT-2 XL shapes (1.5B parameters), on the meta device"),
}

_FACTORY_HELP = ("a factory takes no arguments and returns a torch.nn.Module or "
                 "(module, example_inputs)")


def load_model(name: str, inputs: list[str] | None = None) -> tuple[nn.Module, Any]:
    """A bundled model by name, or ``module:factory``, with example inputs.

    Args:
        name: a key of :data:`BUNDLED` or ``"package.module:function"``.
        inputs: ``--input`` texts (``"64x32"``, ``"16x64:int64"``); they replace the bundled
            or factory-supplied example inputs.

    Returns:
        The model and its example inputs (a tuple, or ``None`` when there are none).

    Raises:
        CommandError: an unknown name, a factory that cannot be imported or called, one that
            returns no model, or bad ``inputs``.
    """
    given = tuple(parse_input(text) for text in inputs or ()) or None
    if name in BUNDLED:
        return _bundled(BUNDLED[name], given)
    module_name, colon, attr = name.partition(":")
    if not colon or not module_name or not attr:
        raise CommandError(f"model {name!r} is neither bundled ({', '.join(BUNDLED)}) nor "
                           "module:factory; e.g. mypackage.models:build")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise CommandError(f"cannot load {name!r}: {error}; make the module importable "
                           "(run from its folder or pip install it)") from error
    return _checked(name, _call(name, factory), given)


def _call(name: str, factory: Any) -> Any:
    if not callable(factory):
        raise CommandError(f"{name} is a {type(factory).__name__}, not a function; "
                           f"{_FACTORY_HELP}")
    try:
        return factory()
    except Exception as error:
        # The factory is the user's code: its failure is theirs to read, in one line here and
        # with the traceback under --debug.
        raise CommandError(f"calling {name}() failed: {type(error).__name__}: {error}; "
                           f"{_FACTORY_HELP} (rerun with --debug for the traceback)") from error


def _checked(name: str, made: Any, given: tuple[Any, ...] | None) -> tuple[nn.Module, Any]:
    """The model and inputs a factory returned, refused unless it is a module."""
    import torch
    from torch import nn

    model, supplied = made, None
    if isinstance(made, tuple) and made:
        model = made[0]
        if len(made) > 1 and made[1] is not None:
            # One tensor is one input; iterating it would split the batch into rows.
            supplied = (made[1],) if isinstance(made[1], torch.Tensor) else tuple(made[1])
    if not isinstance(model, nn.Module):
        raise CommandError(f"{name}() returned a {type(model).__name__}, not a "
                           f"torch.nn.Module; {_FACTORY_HELP}")
    return model, given or supplied


def _bundled(entry: Bundled, given: tuple[Any, ...] | None) -> tuple[nn.Module, Any]:
    import torch

    from partitioner.cli import zoo

    factory = getattr(zoo, entry.factory)
    device = torch.device("meta" if entry.meta else "cpu")
    with device:
        model = factory(**entry.kwargs)
    example = _example(entry.input_shape, getattr(torch, entry.input_dtype), device)
    return model, given or (example,)


def _example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    import torch

    if dtype.is_floating_point:
        return torch.randn(shape, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def parse_shape(text: str) -> tuple[tuple[int, ...], str]:
    """``"64x32:int64"`` as a shape and a dtype name (``float32`` when none is given).

    Raises:
        CommandError: not a shape of positive sizes.
    """
    shape_text, _, dtype = text.partition(":")
    try:
        shape = tuple(int(d) for d in shape_text.lower().split("x"))
    except ValueError as error:
        raise CommandError(f"--input {text!r}: write a shape like 64x32, optionally :int64 "
                           f"({error})") from error
    if any(d < 1 for d in shape):
        raise CommandError(f"--input {text!r}: every size must be positive, got {shape}; "
                           "write a shape like 64x32")
    return shape, dtype or "float32"


def parse_input(text: str) -> torch.Tensor:
    """An example input tensor from ``--input`` text (``"64x32"``, ``"16x64:int64"``).

    Raises:
        CommandError: a malformed shape or an unknown dtype.
    """
    import torch

    shape, dtype_name = parse_shape(text)
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise CommandError(f"--input {text!r}: {dtype_name!r} is not a torch dtype; use e.g. "
                           "float32, float16 or int64")
    return _example(shape, dtype, torch.device("cpu"))
