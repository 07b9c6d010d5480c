"""Real tensors for a model built on the meta device, one module at a time.

A model too big for one device is built with ``torch.device("meta")`` (shapes, no data); each
device then materializes only the tensors its stage (or tensor-parallel shard) uses.
Initialization is deterministic and independent of the layout: module ``name``'s tensors are
filled in a forked random generator seeded from ``(seed, name)``, by the module's own
``reset_parameters()`` or by the user's ``init_fn(module)``. So a parameter gets the same
value whether the model runs on one device, on a pipeline of two, or split over tensor-parallel
ranks, and whatever ran before.

``reset_parameters()`` fills a module's *own* tensors (as ``torch.nn`` layers do; FSDP's
meta-device initialization relies on the same contract): a parent's ``reset_parameters`` that
re-initializes its children's weights is not seen by the children, which are filled by
their own. Pass ``init_fn`` for such schemes; it is called once per module that holds
tensors directly, with only that module's own tensors real.

Memory: :meth:`Materializer.tensor` builds the whole owning module (one layer) on the device
and keeps the last one, so a tensor-parallel rank holds one whole layer transiently while
it cuts its slice (:class:`partitioner.runtime.tensor_parallel.module.ShardStore`); no rank
ever holds more than its stage plus one layer.

Example:
    >>> import torch
    >>> from torch import nn
    >>> with torch.device("meta"):
    ...     model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> stage = nn.Sequential(model[1])
    >>> materialize_module(stage, Materializer(model, torch.device("cpu"), seed=3))
    >>> stage[0].weight.device.type, model[0].weight.device.type
    ('cpu', 'meta')
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from partitioner.errors import InitError
from partitioner.runtime.device import fork_rng

__all__ = ["InitFn", "Materializer", "TensorSource", "MaterializerFactory", "materializer_for",
           "materialize_module", "check_initializable", "on_meta", "module_seed"]

InitFn = Callable[[nn.Module], None]
"""Fills one module's own parameters and buffers in place (``init_fn(module)``)."""


def on_meta(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters or buffers is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def module_seed(seed: int, name: str) -> int:
    """The seed module ``name``'s initialization draws from (63 bits, from ``seed``)."""
    digest = hashlib.sha256(repr((int(seed), name)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for store in (module._parameters, module._buffers):
        for local, tensor in store.items():
            if tensor is not None:
                yield local, tensor


def check_initializable(model: nn.Module, init_fn: InitFn | None) -> None:
    """Refuse a meta model some of whose modules nothing could initialize.

    Raises:
        InitError: naming every module (and its class) that holds meta tensors but has no
            ``reset_parameters()``, when no ``init_fn`` is given; or when ``init_fn`` is not
            callable.
    """
    if init_fn is not None:
        if not callable(init_fn):
            raise InitError(f"init_fn={init_fn!r} is not callable; pass a function "
                            "init_fn(module) that fills the module's own tensors in place")
        return
    lacking = [f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
               if any(t.is_meta for _, t in _own_tensors(m))
               and not callable(getattr(m, "reset_parameters", None))]
    if lacking:
        raise InitError(
            f"the model is on the meta device, but {len(lacking)} modules holding tensors "
            f"have no reset_parameters() to initialize them: {', '.join(lacking[:6])}; pass "
            "init_fn=fn (called as fn(module) on each module holding tensors, filling its "
            "own parameters and buffers), or give those modules a reset_parameters()")


class Materializer:
    """Real, deterministically initialized tensors for ``model``'s meta tensors, on ``device``.

    Args:
        model: the meta-built model (names the modules, and so the seeds).
        device: where the real tensors go.
        seed: the base seed (module ``name`` draws from ``module_seed(seed, name)``).
        init_fn: fills a module's own tensors; default: its ``reset_parameters()``.
    """

    def __init__(self, model: nn.Module, device: torch.device, *, seed: int = 0,
                 init_fn: InitFn | None = None) -> None:
        self.model = model
        self.device = torch.device(device)
        self.seed = seed
        self.init_fn = init_fn
        # By id, the module and attribute naming each tensor (and the tensor, kept alive so
        # that its id names no other).
        self._owner: dict[int, tuple[str, str, torch.Tensor]] = {}
        self._modules: dict[str, nn.Module] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self._modules.setdefault(name, module)
            for local, tensor in _own_tensors(module):
                self._owner.setdefault(id(tensor), (name, local, tensor))
        self._last: tuple[str, nn.Module] | None = None

    def tensor(self, original: torch.Tensor) -> torch.Tensor:
        """``original`` itself if it is real, else its initialized value on the device (a
        plain tensor, not a parameter).

        Raises:
            InitError: if ``original`` is not one of the model's tensors, or its module
                cannot be initialized.
        """
        if not original.is_meta:
            return original
        name, local = self._owned(original)
        twin = self._built(name)
        value: torch.Tensor | None = twin._parameters.get(local)
        if value is None:
            value = twin._buffers[local]
        assert value is not None, "the owner map lists only tensors that are set"
        return value.detach()

    def persistent(self, original: torch.Tensor) -> bool:
        """Whether ``original`` (one of the model's meta tensors) is in a state dict: a
        parameter or a persistent buffer.

        Raises:
            InitError: if ``original`` is not one of the model's tensors.
        """
        name, local = self._owned(original)
        return local not in self._modules[name]._non_persistent_buffers_set

    def _owned(self, original: torch.Tensor) -> tuple[str, str]:
        """The module name and attribute holding ``original``."""
        owner = self._owner.get(id(original))
        if owner is None:
            raise InitError(f"a meta tensor of shape {tuple(original.shape)} is not one of "
                            "the model's parameters or buffers, so nothing can initialize it; "
                            "register it on a module (nn.Parameter or register_buffer)")
        return owner[0], owner[1]

    def release(self) -> None:
        """Forget the last module built (its whole tensors)."""
        self._last = None

    def _built(self, name: str) -> nn.Module:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        self._last = None  # free the previous layer before building the next
        source = self._modules[name]
        twin = copy.copy(source)  # shares children (left on meta): only own tensors are real
        twin._parameters = {k: None if t is None else nn.Parameter(
            torch.empty_like(t, device=self.device), t.requires_grad)
            for k, t in source._parameters.items()}
        twin._buffers = {k: None if t is None else torch.empty_like(t, device=self.device)
                         for k, t in source._buffers.items()}
        with _seeded(module_seed(self.seed, name), self.device), torch.no_grad():
            self._fill(name, twin)
        self._last = (name, twin)
        return twin

    def _fill(self, name: str, twin: nn.Module) -> None:
        if self.init_fn is not None:
            self.init_fn(twin)
            return
        reset = getattr(twin, "reset_parameters", None)
        if not callable(reset):
            raise InitError(f"module {name or '<root>'} ({type(twin).__name__}) is on the "
                            "meta device and has no reset_parameters() to initialize it; "
                            "pass init_fn=fn (called as fn(module), filling the module's own "
                            "tensors) or give it a reset_parameters()")
        reset()


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The global generators of the CPU (and ``device``) seeded, restored afterwards."""
    with fork_rng([device]):
        torch.manual_seed(seed)
        yield


MaterializerFactory = Callable[[torch.device], Materializer]
"""Builds the :class:`Materializer` of one device."""


def materializer_for(model: nn.Module, init_fn: InitFn | None, seed: int
                     ) -> MaterializerFactory | None:
    """For a meta-built model, what builds each device's real tensors (after checking every
    module can be initialized); ``None`` for a model whose tensors are real.

    Raises:
        InitError: a module holding meta tensors has no ``reset_parameters()`` and no
            ``init_fn`` is given, or ``init_fn`` is given for a model that is not on the
            meta device.
    """
    if not on_meta(model):
        if init_fn is not None:
            raise InitError("init_fn= initializes a model built on the meta device, but this "
                            "model's tensors are real; drop init_fn= or build the model "
                            "under torch.device('meta')")
        return None
    check_initializable(model, init_fn)
    return lambda device: Materializer(model, device, seed=seed, init_fn=init_fn)


class TensorSource(Protocol):
    """What :func:`materialize_module` reads real tensors from: a :class:`Materializer`, or
    one that puts initialization off
    (:class:`~partitioner.runtime.deferred_init.DeferredInit`)."""

    def tensor(self, original: torch.Tensor) -> torch.Tensor:
        """The real tensor standing for ``original`` (``original`` itself if real)."""
        ...

    def release(self) -> None:
        """Drop what was kept only to serve the last module."""
        ...


def materialize_module(module: nn.Module, materializer: TensorSource, *,
                       everywhere: tuple[nn.Module, ...] = ()) -> None:
    """Replace every meta parameter and buffer reachable from ``module`` with its real,
    initialized value (one tensor shared by several modules stays shared).

    Args:
        module: a stage (its modules may be the model's own).
        materializer: builds the real tensors.
        everywhere: more modules (the model, its captured graph) in which the same meta
            tensors are replaced too, so that graphs cut from them later share the real ones.
    """
    # By id, the meta tensor (kept alive: a freed one's id may name a new tensor) and its
    # real value.
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for store, local, tensor in _slots(module):
        if tensor.is_meta:
            if id(tensor) not in memo:
                data = materializer.tensor(tensor)
                memo[id(tensor)] = (tensor, nn.Parameter(data, tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else data)
            store[local] = memo[id(tensor)][1]
    materializer.release()
    for root in everywhere:
        for store, local, tensor in _slots(root):
            if id(tensor) in memo and memo[id(tensor)][0] is tensor:
                store[local] = memo[id(tensor)][1]


def _slots(root: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Every (store, name, tensor) of the parameters and buffers under ``root``."""
    stores: list[dict[str, Any]] = [store for sub in root.modules()
                                    for store in (sub._parameters, sub._buffers)]
    return [(store, local, tensor) for store in stores
            for local, tensor in list(store.items()) if tensor is not None]
