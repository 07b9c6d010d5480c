"""Manual partitions: ``balance=`` (torchgpipe's) and ``split_points=``.

Both turn into stage boundaries over the model's layers: ``balance=[3, 2, 2]`` gives the
first 3 layers to stage 0, the next 2 to stage 1, and so on; ``split_points=["layer2",
"head"]`` starts a new stage at the first layer of each named module (qualified name, or the
flattened spelling ``0_1`` of ``0.1``).

Example:
    >>> boundaries_from_balance([2, 1], 3)
    (0, 2, 3)
    >>> boundaries_from_split_points(["b"], ["a", "b.0", "b.1"])
    (0, 1, 3)
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from partitioner.errors import BalanceError

__all__ = ["boundaries_from_balance", "boundaries_from_split_points"]


def boundaries_from_balance(balance: Sequence[int], n_layers: int,
                            n_devices: int | None = None) -> tuple[int, ...]:
    """Stage boundaries from layers per stage.

    Raises:
        BalanceError: wrong length, non-positive entries, or a sum other than ``n_layers``.
    """
    entries = list(balance)
    problems = []
    if n_devices is not None and len(entries) != n_devices:
        problems.append(f"balance has {len(entries)} entries but there are {n_devices} "
                        f"devices; pass one entry per device")
    bad = [b for b in entries if not isinstance(b, int) or isinstance(b, bool) or b < 1]
    if bad:
        problems.append(f"balance entries must be positive integers, got {bad} in "
                        f"balance={entries}; pass a layer count >= 1 per stage")
    if not bad and sum(entries) != n_layers:
        problems.append(f"balance sums to {sum(entries)} but the model has {n_layers} layers; "
                        f"pass balance summing to {n_layers} or omit it")
    if not entries:
        problems.append("balance is empty; pass one positive entry per device")
    if problems:
        raise BalanceError("; ".join(problems))
    cuts = [0]
    for b in entries:
        cuts.append(cuts[-1] + b)
    return tuple(cuts)


def _names_no_layer(point: str, layers: Sequence[str]) -> str:
    """The problem with a split point that matches nothing: the names it may have meant (a
    layer or a module holding layers), else the layers there are."""
    modules = dict.fromkeys(".".join(layer.split(".")[:k]) for layer in layers
                            for k in range(1, layer.count(".") + 2))
    close = difflib.get_close_matches(point, list(modules), n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + " or ".join(repr(name) for name in close) + "?"
    else:
        shown = ", ".join(layers[:6]) + (f", ... ({len(layers)} in all)" if len(layers) > 6
                                          else "")
        hint = f"the layers are {shown}"
    return (f"split point {point!r} names no layer or module of the model; {hint}; pass "
            "module names from plan.layers")


def _matches(point: str, layer: str) -> bool:
    flat = layer.replace(".", "_")
    return layer == point or flat == point or layer.startswith(point + ".") \
        or flat.startswith(point + "_")


def boundaries_from_split_points(split_points: Sequence[str],
                                 layers: Sequence[str]) -> tuple[int, ...]:
    """Stage boundaries where each named module's first layer begins a stage.

    Raises:
        BalanceError: an unknown name, a name that is the first layer, or names out of order.
    """
    problems, cuts = [], [0]
    for point in split_points:
        starts = [k for k, layer in enumerate(layers) if _matches(point, layer)]
        if not starts:
            problems.append(_names_no_layer(point, layers))
        elif starts[0] == 0:
            problems.append(f"split point {point!r} is the first layer; a stage begins there "
                            "already, drop it")
        elif starts[0] <= cuts[-1]:
            problems.append(f"split point {point!r} (layer {starts[0]}) is not after the "
                            "previous split point; list split points in model order")
        else:
            cuts.append(starts[0])
    if problems:
        raise BalanceError("; ".join(problems))
    return (*cuts, len(layers))
