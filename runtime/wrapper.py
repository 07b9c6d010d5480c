"""The base of every module the user holds in place of the model: :class:`ModelWrapper`.

Four runtimes hand the user a module that stands in for the model: the one-process pipeline
(``partitioner.runtime.module.PartitionedModule``), one-process tensor parallelism
(``partitioner.runtime.tensor_parallel.module.TensorParallelModule``), one tensor-parallel rank
per process (``partitioner.runtime.tensor_parallel.multiprocess.DistributedTensorParallel``)
and one pipeline stage per process (``partitioner.runtime.distributed.model.DistributedModel``).
What makes each a stand-in lives here, once:

- ``plan``: what was decided (kept for the user; the runtime never reads it);
- the train/eval mode of the model at construction: a wrapper of a model in eval mode starts
  in eval mode (it must not run dropout because nobody called ``eval()`` on it);
- the original model's state-dict keys: the entries of the child named by :attr:`inner` lose
  its prefix on the way out and get it back on the way in, and a rank's tensor-parallel
  slices are gathered whole (a collective across processes) and cut again on load;
- ``clip_grad_norm_`` by the original model's gradient norm: every gradient counts once
  (subclasses say which they hold), and the partial norms of the processes holding the rest
  of the model are combined by a :class:`NormCombiner` (:func:`local_norms` or
  :class:`GroupNorms`);
- ``close()``: idempotent, also called on leaving a ``with`` block and on collection; a
  closed wrapper refuses to run (:class:`~partitioner.errors.ClosedError`), because a
  runtime whose hooks are gone would train silently wrong.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Holder(ModelWrapper):
    ...     inner = "module"
    ...     def __init__(self, module: nn.Module) -> None:
    ...         super().__init__(plan=None, training=module.training)
    ...         self.module = module
    >>> with Holder(nn.Linear(2, 2).eval()) as held:
    ...     print(sorted(held.state_dict()), held.training)
    ['bias', 'weight'] False
    >>> held.closed
    True
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import ClosedError, StrategyError
from partitioner.runtime.loss_head import check_loss, check_loss_fn, loss_reduction_problem
from partitioner.runtime.tensor_parallel.shard_state import ShardState

__all__ = ["ModelWrapper", "NormCombiner", "local_norms", "GroupNorms", "BUILD_LOCK"]

#: Held while a wrapper builds what a mode needs on its first call (a pipeline): two threads
#: calling a fresh wrapper at once must get one pipeline, whose own lock then orders them.
BUILD_LOCK = threading.RLock()

#: Combines this process's partial gradient norm with its peers': given the partial value
#: (float64: a sum of p-th powers, or a largest absolute value) and ``"sum"`` or ``"max"``,
#: the value of the whole model.
NormCombiner = Callable[[torch.Tensor, str], torch.Tensor]


def check_loss_reduction(loss_reduction: object) -> None:
    """Raises a :class:`StrategyError` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    problem = loss_reduction_problem(loss_reduction)
    if problem is not None:
        raise StrategyError(problem)


def local_norms(partial: torch.Tensor, op: str) -> torch.Tensor:
    """The :data:`NormCombiner` of a wrapper that holds every gradient of the model."""
    return partial


class GroupNorms:
    """A :data:`NormCombiner` that all-reduces the partial norms over a process group.

    Args:
        group: the processes holding the rest of the model (``None``: the whole world).
        copies: how many of them hold each gradient (data-parallel replicas hold the same
            averaged gradients): sums are divided by it so each gradient counts once.
        device: where the collective runs (a CUDA device under NCCL); default: the partial
            value's.
    """

    def __init__(self, group: Any = None, copies: int = 1,
                 device: torch.device | None = None) -> None:
        self.group = group
        self.copies = copies
        self.device = device

    def __call__(self, partial: torch.Tensor, op: str) -> torch.Tensor:
        total = partial.to(self.device or partial.device, copy=True)
        reduce = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(total, op=reduce, group=self.group)
        return total if op == "max" else total / self.copies


class ModelWrapper(nn.Module):
    """Base of the modules that stand in for a partitioned model (see the module docstring).

    Subclasses set :attr:`inner` when one child holds the model's tensors under the model's
    own names, override :meth:`_norm_grads` when some gradients they hold are copies, and
    :meth:`_release` to free threads or hooks; those whose state dict needs more than a
    prefix (tensor-parallel models holding every rank) override :meth:`_state_to_original`
    and :meth:`_state_from_original`.

    Args:
        plan: what was decided (kept as ``.plan``; the runtime does not read it).
        training: the model's mode when it was partitioned (``model.training``); only this
            module's own flag is set, the model's modules keep theirs.
        shards: for a process holding one tensor-parallel rank's slices of the entries it
            names, how to gather them whole and cut them again.
        combine_norms: how partial gradient norms combine with other processes'.
    """

    #: The child whose state-dict keys, without its prefix, are the original model's.
    inner: ClassVar[str | None] = None

    def __init__(self, plan: Any, training: bool, *, shards: ShardState | None = None,
                 combine_norms: NormCombiner = local_norms) -> None:
        super().__init__()
        self.plan = plan
        self.training = training
        self._shards = shards
        self._combine_norms = combine_norms
        self._closed = False
        self.register_state_dict_post_hook(_to_original)
        self.register_load_state_dict_pre_hook(_from_original)

    # -- closing ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Release the worker threads and hooks; calling it again does nothing.

        Afterwards the wrapper refuses to run; ``state_dict()`` still works.
        """
        if self._closed:
            return
        self._release()
        self._closed = True

    def _release(self) -> None:
        """Free what the runtime holds (threads, hooks); called once, by :meth:`close`."""

    def _ensure_open(self, action: str) -> None:
        """Raise if closed, naming what was attempted.

        Raises:
            ClosedError: after :meth:`close`.
        """
        if self._closed:
            raise ClosedError(f"cannot {action}: this {type(self).__name__} was closed, which "
                              "released its threads and hooks; partition the model again, "
                              "and close it (or leave its `with` block) only when done")

    def __enter__(self) -> ModelWrapper:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # half-built, or the interpreter is shutting down: nothing left to free

    # -- state dict ---------------------------------------------------------------------

    def _state_to_original(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Turn this module's state-dict entries into the original model's, in place."""
        if self.inner is not None:
            _strip(state_dict, prefix, self.inner)
        if self._shards is not None:
            _convert_shards(self._whole_shards, self._shards, state_dict, prefix)

    def _state_from_original(self, state_dict: dict[str, Any], prefix: str,
                             missing_keys: list[str]) -> None:
        """Turn the original model's entries into this module's, in place (before loading)."""
        if self._shards is not None:
            _convert_shards(self._cut_shards, self._shards, state_dict, prefix)
        if self.inner is not None:
            _add(state_dict, prefix, self.inner)

    def _whole_shards(self, entries: dict[str, Any]) -> dict[str, Any]:
        """This process's split entries whole (a collective over the tensor-parallel group);
        a subclass holding them cut again (FSDP) overrides it with its own layout."""
        assert self._shards is not None
        return self._shards.gather(entries)

    def _cut_shards(self, entries: dict[str, Any]) -> dict[str, Any]:
        """The split entries (whole tensors) cut to what this process holds."""
        assert self._shards is not None
        return self._shards.split(entries)

    # -- names --------------------------------------------------------------------------

    def _inner_module(self) -> nn.Module | None:
        """The child holding the model's tensors under the model's own names, if any."""
        if self.inner is None or self._shards is not None:
            return None
        return self._modules.get(self.inner)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters under the original model's names (as ``state_dict()`` keys), so
        ``dict(pm.named_parameters())`` and ``dict(model.named_parameters())`` agree."""
        yield from self._named(super().named_parameters, "named_parameters", prefix, recurse,
                               remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers under the original model's names, as :meth:`named_parameters`."""
        yield from self._named(super().named_buffers, "named_buffers", prefix, recurse,
                               remove_duplicate)

    def _named(self, own: Callable[..., Iterator[tuple[str, Any]]], method: str, prefix: str,
               recurse: bool, remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        inner = self._inner_module()
        if inner is None or not recurse:
            yield from own(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
            return
        seen = set()
        for name, tensor in getattr(inner, method)(prefix=prefix, recurse=True,
                                                   remove_duplicate=remove_duplicate):
            seen.add(id(tensor))
            yield name, tensor
        # Held beside the model (none today): the wrapper's own and its other children's,
        # without walking the model's tree a second time (replicas read these names on
        # every step: two walks of a transformers model's modules cost milliseconds).
        beside = [own(prefix=prefix, recurse=False, remove_duplicate=remove_duplicate)]
        for child_name, child in self._modules.items():  # every name, as torch walks them
            if child is not None and child is not inner:
                beside.append(getattr(child, method)(
                    prefix=f"{prefix}.{child_name}" if prefix else child_name, recurse=True,
                    remove_duplicate=remove_duplicate))
        for named in beside:
            for name, tensor in named:
                if id(tensor) not in seen:
                    if remove_duplicate:  # one tensor under two children: its first name
                        seen.add(id(tensor))
                    yield name, tensor

    # -- gradient clipping --------------------------------------------------------------

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Any], *,
             loss_reduction: str = "mean", kwargs: dict[str, Any] | None = None) -> float:
        """One training step's forward and backward; returns the batch's loss.

        Gradients accumulate into ``.grad``; then call your optimizer's ``step()``. This
        base runs ``loss_fn(self(*inputs), targets).backward()``; pipelines override it to
        compute the loss per micro-batch on the last stage, in their schedule's order.

        Args:
            inputs: the model's positional input (a tensor) or a tuple of them.
            targets: what ``loss_fn`` compares with.
            loss_fn: ``loss_fn(outputs, targets)`` returning a scalar tensor.
            loss_reduction: how ``loss_fn`` reduces over samples, ``"mean"`` or ``"sum"``
                (pipelines weight micro-batch losses by it).
            kwargs: keyword inputs of the model.

        Raises:
            StrategyError: If ``loss_reduction`` is neither ``"mean"`` nor ``"sum"``.
            LossError: If ``loss_fn`` does not return a one-element tensor, or returns one
                that does not require grad.
        """
        check_loss_reduction(loss_reduction)
        check_loss_fn(loss_fn)
        self._ensure_open("train")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        loss = loss_fn(self(*args, **dict(kwargs or {})), targets)
        check_loss(loss, training=torch.is_grad_enabled())
        loss.backward()
        return float(loss.detach().double().item())

    def _pipeline_step(self, pipeline: Any, bind: Callable[..., list[Any]],
                       restructure: Callable[[Any], Any], inputs: Any, targets: Any,
                       loss_fn: Callable[[Any, Any], Any], loss_reduction: str,
                       kwargs: dict[str, Any] | None, *, grad_scale: float = 1.0) -> float:
        """:meth:`step` through a one-process pipeline's own ``step`` (its schedule);
        ``grad_scale`` multiplies the gradients only (fp16 loss scaling)."""
        check_loss_reduction(loss_reduction)
        check_loss_fn(loss_fn)
        self._ensure_open("train")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        values = bind(args, dict(kwargs or {}))
        return float(pipeline.step(values, targets, loss_fn, loss_reduction=loss_reduction,
                                   restructure=restructure, grad_scale=grad_scale))

    def _norm_grads(self) -> list[torch.Tensor]:
        """The gradients that count towards the model's norm, each once."""
        return [p.grad.detach() for p in self.parameters() if p.grad is not None]

    def _grads_to_scale(self) -> list[torch.Tensor]:
        """The gradients clipping scales (a sharded optimizer's slices, where it has one)."""
        return [p.grad for p in self.parameters() if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` by the unpartitioned model's gradient norm.

        ``clip_grad_norm_(wrapper.parameters())`` would count a gradient once per copy (a
        replicated parameter on every tensor-parallel rank) and, across processes, only this
        process's share; here each gradient of the model counts once, and every process
        scales its own gradients by the same factor. When the model spans processes this is
        a collective: call it on every rank after the backward and before
        ``optimizer.step()``.

        Returns:
            The total norm of the gradients before clipping, in the gradients' dtype (as
            torch's), the same on every rank.

        Raises:
            RuntimeError: with ``error_if_nonfinite``, if the norm is nan or infinite.
        """
        norm_type = float(norm_type)
        infinite = norm_type == math.inf
        partial = _partial_norm(self._norm_grads(), norm_type)
        total = self._combine_norms(partial, "max" if infinite else "sum")
        if not infinite:
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"{float(total)}; pass error_if_nonfinite=False to scale anyway")
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = self._grads_to_scale()
        for g in grads:
            g.detach().mul_(factor.to(g.device, g.dtype))
        return total.to(grads[0].dtype if grads else torch.float32)


def _partial_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This process's share of the norm (float64): the largest absolute value, or the sum of
    p-th powers, on the first gradient's device."""
    device = grads[0].device if grads else torch.device("cpu")
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == math.inf:
        return torch.stack([g.abs().max().double().to(device) for g in grads]).max()
    return torch.stack([g.double().norm(norm_type).to(device) ** norm_type
                        for g in grads]).sum()


def _to_original(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: Any) -> None:
    if isinstance(module, ModelWrapper):
        module._state_to_original(state_dict, prefix)


def _from_original(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   local_metadata: Any, strict: bool, missing_keys: list[str],
                   unexpected_keys: list[str], error_msgs: list[str]) -> None:
    if isinstance(module, ModelWrapper):
        module._state_from_original(state_dict, prefix, missing_keys)


def _strip(state_dict: dict[str, Any], prefix: str, inner: str) -> None:
    """``prefix + inner + ".k"`` becomes ``prefix + "k"``, in the entries and the metadata
    (whose versions the original model's modules read when loading)."""
    for key in list(state_dict):
        if key.startswith(f"{prefix}{inner}."):
            state_dict[prefix + key[len(prefix) + len(inner) + 1:]] = state_dict.pop(key)
    metadata: dict[str, Any] = getattr(state_dict, "_metadata", None) or {}
    own = prefix.removesuffix(".")
    for key in list(metadata):
        if key == own + ("." if own else "") + inner:
            metadata[own] = metadata.pop(key)
        elif key.startswith(f"{prefix}{inner}."):
            metadata[prefix + key[len(prefix) + len(inner) + 1:]] = metadata.pop(key)


def _add(state_dict: dict[str, Any], prefix: str, inner: str) -> None:
    """The reverse of :func:`_strip`, for the entries."""
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(f"{prefix}{inner}."):
            state_dict[f"{prefix}{inner}.{key[len(prefix):]}"] = state_dict.pop(key)


def _convert_shards(convert: Callable[[dict[str, Any]], dict[str, Any]], shards: ShardState,
                    state_dict: dict[str, Any], prefix: str) -> None:
    """Make the split entries of ``state_dict`` whole (a collective) or this rank's slices."""
    entries = {k: state_dict[prefix + k] for k in shards.shardings if prefix + k in state_dict}
    converted = convert(entries)
    for key, value in converted.items():
        state_dict[prefix + key] = value
