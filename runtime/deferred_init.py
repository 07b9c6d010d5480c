"""A meta-built stage's initialization put off until its tensors are first used:
:class:`DeferredInit`.

``partition_distributed`` gives each rank's stage of a meta-built model real tensors on the
rank's device. Filling them (``init_fn`` or ``reset_parameters()`` on every module: seconds
to minutes of random draws at LLM sizes) is work thrown away when the next call is
``dpm.load(path)``, which overwrites every parameter and persistent buffer from a file. So
the stage is built with its tensors allocated and set to NaN (a read before initialization
shows as NaN, never as plausible numbers), and initialized when first used:

- ``dpm.load(...)`` or ``load_state_dict`` filled the state dict: only the non-persistent
  buffers (rotary ``inv_freq``: no file holds them) are initialized;
- otherwise, at the first ``step``, ``evaluate``, ``save``, ``state_dict`` or
  ``dpm.initialize()``, every tensor is filled, with exactly the values an eager build gives
  (the same per-module seeds, :mod:`~partitioner.runtime.materialize`).

``parameters()`` does not initialize: an optimizer is built over the placeholders before
``dpm.load(path, optimizer)`` resumes a run, and holds the very tensors the load fills.

A stage split over ``tp`` ranks is put off alike: each rank's slice is a placeholder of the
slice's shape (:meth:`DeferredInit.derived`, computed from the meta original, so no whole
tensor is allocated at build), filled by the same slicing of the whole initialized value
when it runs. Stages sharded by FSDP or with a sharded optimizer are initialized at build:
their tensors are copied into shards or flat buffers there.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from partitioner.runtime.materialize import Materializer, materialize_module
    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(4, 4))
    >>> later = DeferredInit(Materializer(model, torch.device("cpu"), seed=3))
    >>> stage = nn.Sequential(model[0])
    >>> materialize_module(stage, later)
    >>> bool(stage[0].weight.isnan().all()), later.pending
    (True, 2)
    >>> later.run(loaded=False)
    >>> bool(stage[0].weight.isnan().any()), later.pending
    (False, 0)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from partitioner.runtime.materialize import Materializer

__all__ = ["DeferredInit", "Derive"]

Derive = Callable[[torch.Tensor], torch.Tensor]
"""How a rank's tensor is made from a whole one (its tensor-parallel slice, or a copy)."""


class DeferredInit:
    """Placeholders for a meta model's tensors now; their initialized values on
    :meth:`run`.

    Args:
        materializer: what computes the initialized values (and owns the seeds).
    """

    def __init__(self, materializer: Materializer) -> None:
        self._materializer = materializer
        # By id of the meta original (kept alive, so that its id names no other): the
        # original and its placeholder. One placeholder per original, so stages of one rank
        # that share a tensor share its placeholder.
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Placeholders of values made from an original (a tensor-parallel rank's slice):
        # the original, the placeholder and how the value is made from the whole one.
        self._derived: list[tuple[torch.Tensor, torch.Tensor, Derive]] = []

    @property
    def pending(self) -> int:
        """How many tensors still wait for their values."""
        return len(self._pending) + len(self._derived)

    def derived(self, original: torch.Tensor, make: Derive) -> torch.Tensor:
        """A placeholder on the device for ``make(whole)``, where ``whole`` is
        ``original``'s initialized value (a tensor-parallel rank's slice of it), filled in
        place by :meth:`run`; its shape comes from ``make(original)`` on the meta device.
        ``make(original)`` itself if ``original`` is real.

        Raises:
            InitError: if ``original`` is not one of the model's tensors.
        """
        if not original.is_meta:
            return make(original)
        self._materializer.persistent(original)  # refuses a tensor no module owns, now
        shape = make(original)
        value = self._blank(shape.shape, shape.dtype)
        if value.numel():
            self._derived.append((original, value, make))
        return value

    def _blank(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        device = self._materializer.device
        if dtype.is_floating_point or dtype.is_complex:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def tensor(self, original: torch.Tensor) -> torch.Tensor:
        """A placeholder on the device for ``original`` (NaN if floating, else zeros), filled
        in place by :meth:`run`; ``original`` itself if it is real.

        Raises:
            InitError: if ``original`` is not one of the model's tensors.
        """
        if not original.is_meta:
            return original
        known = self._pending.get(id(original))
        if known is not None:
            return known[1]
        self._materializer.persistent(original)  # refuses a tensor no module owns, now
        value = self._blank(original.shape, original.dtype)
        if value.numel():
            self._pending[id(original)] = (original, value)
        return value

    def release(self) -> None:
        """Nothing is kept per module until :meth:`run`."""

    def run(self, *, loaded: bool) -> None:
        """Fill the placeholders in place: all of them, or (``loaded``: the state dict came
        from a file) only the non-persistent buffers, which no file holds."""
        try:
            with torch.no_grad():
                for key, (original, value) in list(self._pending.items()):
                    if loaded and self._materializer.persistent(original):
                        continue
                    value.copy_(self._materializer.tensor(original))
                    del self._pending[key]
                for original, value, make in self._derived:
                    if not (loaded and self._materializer.persistent(original)):
                        value.copy_(make(self._materializer.tensor(original)))
        finally:
            self._materializer.release()
        self._pending.clear()  # loaded: the rest came from the file
        self._derived.clear()
