"""Data-parallel replicas in one process: :class:`ReplicatedModule`.

Each replica is a copy of the model on its own group of devices (one captured graph on one
device, or the pipeline / tensor-parallel module a plan's ``pp x tp`` describes). A call
splits the batch along dim 0 into one share per replica, as ``nn.DataParallel`` does (an
uneven batch gives the first replicas one sample more), runs the replicas at the same time,
each on its own worker thread, and joins their outputs on the first device::

    x (B, ...) --split--> replica 0: x[0:B/2]  --> y0 \\
                          replica 1: x[B/2:B]  --> y1 --cat--> y (B, ...) on devices[0]

The replicas enter autograd as one node whose backward runs every replica's backward on its
own worker, then adds the gradients of replicas 1.. into replica 0's ``.grad``: replica 0
is the master, whose parameters are what ``parameters()``, ``state_dict()`` and the
optimizer see. The gradients are those of the unsplit model, whatever loss is computed on
the joined outputs. :meth:`ReplicatedModule.step` computes the loss on each replica's share
instead (no joining), weighting a ``"mean"`` loss by the share's size.

Rules the user can rely on:

- Weights are never stale: before each call, every replica tensor whose values differ
  from the master's takes the master's (an optimizer step, fused or not, ``load_state_dict``,
  a ``.to()``, writes through ``.data``, batch norm statistics), as ``nn.DataParallel``
  broadcasts them on every call (``partitioner.runtime.replica_copy``).
- Dropout: each replica draws its own masks, from a generator seeded per call from torch's
  global generator (plus the replica's index), so runs repeat under ``torch.manual_seed``.
  Replicas that are pipelines seed their stages from that generator too.
- Batch norm: in training mode each replica normalizes with its own share's statistics, and
  the running statistics are replica 0's (the others' updates are overwritten by the next
  copy), as with ``nn.DataParallel``.

Example:
    >>> import torch
    >>> from partitioner.runtime.replica_copy import GraphReplica
    >>> model = torch.nn.Linear(2, 2)
    >>> copy = torch.nn.Linear(2, 2)
    >>> graphs = [torch.fx.symbolic_trace(m) for m in (model, copy)]
    >>> replicas = [GraphReplica(m, lambda training, g=g: g, lambda args, kwargs: list(args),
    ...                          lambda out: out) for m, g in zip((model, copy), graphs)]
    >>> pm = ReplicatedModule(None, replicas, [torch.device("cpu")] * 2)
    >>> x = torch.randn(5, 2)
    >>> torch.allclose(pm(x), model(x))
    True
    >>> pm.close()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.errors import BackwardError, ReplicaError
from partitioner.runtime.loss_head import LOSS_REDUCTIONS, check_loss
from partitioner.runtime.microbatch import OutputHint, batch_size, gather, join_rules, split_grad
from partitioner.runtime.replica_copy import ReplicaTensors
from partitioner.runtime.rng import draw_seed, use_generator
from partitioner.runtime.transfer import move_leaves
from partitioner.runtime.worker import Worker, shared_threads
from partitioner.runtime.wrapper import ModelWrapper

__all__ = ["ReplicatedModule", "split_batch", "join_outputs", "LOSS_REDUCTIONS"]

T = TypeVar("T")


def split_batch(values: Any, parts: int, batch: int) -> tuple[list[Any], list[bool]]:
    """Split every tensor leaf of ``values`` whose dim 0 is ``batch`` into ``parts`` shares
    (``torch.tensor_split``: the first ``batch % parts`` shares get one sample more); other
    leaves go to every share unchanged.

    Returns:
        The shares (pytrees like ``values``) and, per leaf of ``values``, whether it was split.

    Example:
        >>> shares, split = split_batch([torch.arange(5), 7], 2, 5)
        >>> [s[0].tolist() for s in shares], split
        ([[0, 1, 2], [3, 4]], [True, False])
    """
    leaves, spec = pytree.tree_flatten(values)
    split = [isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch
             for leaf in leaves]
    pieces = [list(torch.tensor_split(leaf, parts)) if cut else [leaf] * parts
              for leaf, cut in zip(leaves, split)]
    return [pytree.tree_unflatten([p[r] for p in pieces], spec) for r in range(parts)], split


def join_outputs(outputs: list[Any], device: torch.device, sizes: Sequence[int] | None = None,
                 rows: Sequence[OutputHint] | None = None,
                 rules: Sequence[str] | None = None) -> Any:
    """The replicas' outputs joined on ``device`` as micro-batches' are
    (``partitioner.runtime.microbatch.gather``): batched tensor leaves concatenated along
    dim 0, floating-point leaves without a batch dimension (an ``aux_loss``) averaged
    weighted by the shares' samples, other leaves taken from replica 0.

    Args:
        outputs: one output per replica.
        device: where the joined tensors go.
        sizes: the samples of each replica's share.
        rows: the capture's rows of dim 0 per sample of each output leaf (``0``: none).
        rules: the join rules, if already decided (``join_rules``).

    Raises:
        ReplicaError: the replicas returned different structures.
        OutputError: a leaf without a batch dimension that cannot be averaged.
    """
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    differ = [r for r, (_, s) in enumerate(flat) if s != spec]
    if differ:
        raise ReplicaError(f"replicas {differ} returned another structure than replica 0 "
                           f"({spec}); data-parallel replicas must return the same structure "
                           "for every share of the batch")
    if len(outputs) == 1:
        leaves = [leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf
                  for leaf in flat[0][0]]
        return pytree.tree_unflatten(leaves, spec)
    return gather(outputs, sizes, rows, device=device, rules=rules)


class ReplicatedModule(ModelWrapper):
    """``dp`` replicas of a model in one process (see the module docstring).

    Args:
        plan: the plan it runs (kept as ``.plan``; the runtime does not read it).
        replicas: one module per replica, all built alike; replica 0 is the master (its
            tensors are the model's) and the others are copies. Each takes the model's call
            arguments and returns its outputs.
        devices: per replica, the device its share of the inputs goes to (its first).
        check_call: checks a call's ``(args, kwargs)`` against the model's ``forward``
            (raising its error) before the batch is split.
        output_rows: per output leaf, the rows of dim 0 per sample the capture found
            (``0``: no batch dimension): how the replicas' outputs join
            (:func:`join_outputs`).
    """

    inner = "module"

    def __init__(self, plan: Any, replicas: Sequence[nn.Module],
                 devices: Sequence[torch.device],
                 check_call: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None,
                 output_rows: Sequence[OutputHint] | None = None) -> None:
        if not replicas or len(replicas) != len(devices):
            raise ValueError(f"{len(replicas)} replicas for {len(devices)} devices; pass one "
                             "device per replica (and at least one replica)")
        super().__init__(plan, replicas[0].training)
        self.module = replicas[0]
        # Not registered as children: their tensors are copies, not the model's.
        self._copies = list(replicas[1:])
        self.devices = [torch.device(d) for d in devices]
        threads = shared_threads(self.devices)
        self._workers = [Worker(d, threads if d.type == "cpu" else None)
                         for d in self.devices]
        self._tensors = ReplicaTensors(replicas[0], replicas[1:])
        self._generators = [torch.Generator(device=d) for d in self.devices]
        # The modes some call ran in: a replica builds what a mode needs on its first call
        # (graphs captured again, pipelines), and capturing patches torch globally.
        self._built: set[bool] = set()
        # Checks a call's arguments against the model's forward before the batch is split
        # (a missing or extra argument is named as such, not as a batch problem).
        self._check_call = check_call
        self.output_rows = output_rows
        #: ``(replica, phase, start, end)`` per replica's forward (``"F"``), backward
        #: (``"B"``) or training step (``"S"``) of the last call, in ``time.perf_counter()``
        #: seconds (what ``viz`` draws as a measured timeline).
        self.timeline: list[tuple[int, str, float, float]] = []

    def train(self, mode: bool = True) -> ReplicatedModule:
        """Set train/eval mode on every replica (the copies are not children)."""
        super().train(mode)
        for copy in self._copies:
            copy.train(mode)
        return self

    @property
    def dp(self) -> int:
        """The number of replicas."""
        return len(self.devices)

    @property
    def replicas(self) -> list[nn.Module]:
        """Every replica, the master first."""
        return [self.module, *self._copies]

    # -- running ------------------------------------------------------------------------

    def _shares(self, values: Any) -> tuple[list[Any], list[bool]]:
        """One share of ``values`` per replica.

        Raises:
            ReplicaError: the batch has fewer samples than replicas, or no batch dimension.
        """
        batch = batch_size(values)
        if self.dp == 1:
            return [values], [False] * len(pytree.tree_leaves(values))
        if batch is None:
            raise ReplicaError(f"no input tensor has a batch dimension to split over dp="
                               f"{self.dp} replicas; pass batched inputs (dim 0 is the batch)")
        if batch < self.dp:
            raise ReplicaError(f"the batch has {batch} sample(s) but there are dp={self.dp} "
                               "data-parallel replicas, each needing at least one; pass a "
                               f"batch of at least {self.dp} samples, or partition with at "
                               f"most {batch} replicas")
        return split_batch(values, self.dp, batch)

    def _prepare(self) -> None:
        """Before a call: the copies take the master's mode and values, and every
        replica's generator a fresh seed from torch's global generator."""
        for copy in self._copies:
            if copy.training != self.training:
                copy.train(self.training)
        self._tensors.refresh()
        seed = draw_seed()
        for r, generator in enumerate(self._generators):
            generator.manual_seed(seed + r)

    def _call(self, r: int, share: Any, grad: bool) -> tuple[list[Any], Any]:
        """Replica ``r`` on its share (on its worker): the moved input leaves and output."""
        leaves, spec = pytree.tree_flatten(share)
        moved = move_leaves(leaves, self.devices[r], grad=grad)
        args, kwargs = pytree.tree_unflatten(moved, spec)
        with torch.set_grad_enabled(grad), use_generator(self._generators[r]):
            out = self.replicas[r](*args, **kwargs)
        return moved, out

    def _run(self, fn: Callable[[int, Any], T], items: Sequence[Any], phase: str = "F"
             ) -> list[T]:
        """``fn(r, items[r])`` on every replica's worker, at once except on the first call in
        a mode (then one replica after another); the first error re-raised, once every
        replica has stopped, with a note naming its replica. Each call's span is recorded in
        :attr:`timeline` as ``phase``."""
        futures: list[Future[T]] = []

        def timed(r: int, item: Any) -> T:
            start = time.perf_counter()
            try:
                return fn(r, item)
            finally:
                self.timeline.append((r, phase, start, time.perf_counter()))

        for r, (worker, item) in enumerate(zip(self._workers, items)):
            futures.append(worker.submit(timed, r, item))
            if self.training not in self._built:
                futures[-1].exception()  # wait
        self._built.add(self.training)
        errors = [(r, e) for r, f in enumerate(futures) if (e := f.exception()) is not None]
        if errors:
            r, error = errors[0]
            error.add_note(f"(in data-parallel replica {r} of {self.dp}, on "
                           f"{self.devices[r]})")
            raise error
        return [f.result() for f in futures]

    def _needs_grad(self, values: Any) -> bool:
        return torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or any(isinstance(v, torch.Tensor) and v.requires_grad
                   for v in pytree.tree_leaves(values)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_open("run the replicas")
        if self._check_call is not None:
            self._check_call(args, kwargs)
        values = [args, kwargs]
        shares, split = self._shares(values)
        self._prepare()
        self.timeline = []
        if not self._needs_grad(values):
            results = self._run(lambda r, share: self._call(r, share, False), shares)
            return join_outputs([out for _, out in results], self.devices[0],
                                _share_sizes(shares), self.output_rows)
        leaves = pytree.tree_leaves(values)
        tensors = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box: dict[str, Any] = {"split": [split[k] for k in tensors], "leaf_index": tensors}
        phony = torch.empty(0, requires_grad=True)
        outputs = _Replicated.apply(self, shares, box, phony, *[leaves[k] for k in tensors])
        out_leaves = list(box["leaves"])
        for position, tensor in zip(box["positions"], outputs):
            out_leaves[position] = tensor
        return pytree.tree_unflatten(out_leaves, box["spec"])

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             loss_reduction: str = "mean", *, kwargs: dict[str, Any] | None = None) -> float:
        """One training step's forward and backward; returns the loss of the whole batch.

        Each replica computes ``loss_fn`` on its own share of the outputs and targets and
        back-propagates it; the gradients are summed into the master's ``.grad`` (call the
        optimizer's ``step()`` next). With ``"mean"`` each share's loss is weighted by its
        share of the batch, so the gradients and the loss are the full batch's mean.

        Args:
            inputs: the model's positional input (a tensor) or a tuple of them.
            targets: what ``loss_fn`` compares with (split like the inputs: every tensor
                leaf whose dim 0 is the batch size).
            loss_fn: ``loss_fn(outputs, targets) -> scalar``, run once per replica.
            loss_reduction: how ``loss_fn`` reduces over samples, ``"mean"`` or ``"sum"``.
            kwargs: keyword inputs of the model.

        Raises:
            ReplicaError: an unknown ``loss_reduction``, targets without the batch's size, a
                batch smaller than the replicas.
            LossError: ``loss_fn`` did not return a scalar tensor, or one without grad.
        """
        self._ensure_open("train")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ReplicaError(f"loss_reduction={loss_reduction!r}; use one of "
                               f"{LOSS_REDUCTIONS}")
        values = [inputs if isinstance(inputs, tuple) else (inputs,), dict(kwargs or {})]
        shares, _ = self._shares(values)
        batch = batch_size(values) or 1
        target_shares, cut = split_batch(targets, self.dp, batch)
        if self.dp > 1 and not any(cut):
            raise ReplicaError(f"targets have no tensor of {batch} samples along dim 0 to "
                               f"split like the inputs over dp={self.dp} replicas; pass "
                               "targets with the batch's size")
        sizes = [batch_size(share) or batch for share in shares]
        weights = [s / batch if loss_reduction == "mean" else 1.0 for s in sizes]
        self._prepare()

        def train(r: int, share_and_target: tuple[Any, Any]) -> float:
            share, target = share_and_target
            replica = self.replicas[r]
            if isinstance(replica, ModelWrapper):
                # A pipeline replica runs its plan's schedule, its loss per micro-batch.
                def scaled(out: Any, part: Any) -> Any:
                    return loss_fn(out, part) * weights[r]

                args, kwargs = share
                with use_generator(self._generators[r]):
                    return replica.step(tuple(args), target, scaled,
                                        loss_reduction=loss_reduction, kwargs=kwargs)
            _, out = self._call(r, share, True)
            device = next((t.device for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor)), self.devices[r])
            target = pytree.tree_unflatten(
                *_moved(pytree.tree_flatten(target), device))
            with torch.enable_grad():
                loss = loss_fn(out, target)
                check_loss(loss, where="the share")
                weighted = loss.reshape(()) * weights[r]
                weighted.backward()
            return float(weighted.detach().double().item())

        self.timeline = []
        losses = self._run(train, list(zip(shares, target_shares)), "S")
        self._tensors.sum_grads()
        return sum(losses)

    # -- the rest of the wrapper ------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """The master's ``clip_grad_norm_`` (it holds the summed gradients; see
        :meth:`ModelWrapper.clip_grad_norm_`)."""
        if isinstance(self.module, ModelWrapper):
            return self.module.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def _release(self) -> None:
        """Stop the workers and close every replica."""
        for worker in self._workers:
            worker.close()
        for replica in self.replicas:
            if isinstance(replica, ModelWrapper):
                replica.close()


def _share_sizes(shares: list[Any]) -> list[int]:
    """The samples of each replica's share (1 for one without a batch dimension)."""
    return [batch_size(share) or 1 for share in shares]


def _moved(flat: tuple[list[Any], Any], device: torch.device) -> tuple[list[Any], Any]:
    leaves, spec = flat
    return move_leaves(leaves, device, grad=False), spec


class _Replicated(torch.autograd.Function):
    """Every replica's forward as one autograd node; its backward runs theirs at once."""

    @staticmethod
    def forward(ctx: Any, owner: ReplicatedModule, shares: list[Any], box: dict[str, Any],
                phony: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = owner._run(lambda r, share: owner._call(r, share, True), shares)
        outs = [out for _, out in results]
        sizes = _share_sizes(shares)
        rules = join_rules(outs, sizes, owner.output_rows)
        joined = join_outputs(outs, owner.devices[0], sizes, rules=rules)
        leaves, spec = pytree.tree_flatten(joined)
        positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box.update(leaves=leaves, spec=spec, positions=positions)
        ctx.owner = owner
        ctx.moved = [moved for moved, _ in results]
        ctx.outs = [[pytree.tree_leaves(out)[k] for k in positions] for out in outs]
        ctx.rules = [rules[k] for k in positions]
        ctx.sizes = sizes
        ctx.split = box["split"]
        ctx.leaf_index = box["leaf_index"]
        ctx.devices = [x.device for x in inputs]
        outputs = tuple(leaves[k] for k in positions)
        ctx.mark_non_differentiable(*[o for o in outputs
                                      if not (o.is_floating_point() or o.is_complex())])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.outs is None:
            raise BackwardError("cannot back-propagate these replicated outputs twice: the "
                                "replicas' activations were freed by the first backward; "
                                "run a forward before each backward")
        outs, ctx.outs = ctx.outs, None
        parts = [split_grad(g, rule, [o[k].shape[0] if o[k].dim() else 1 for o in outs],
                            ctx.sizes) if g is not None else None
                 for k, (g, rule) in enumerate(zip(grads, ctx.rules))]

        def back(r: int, moved: list[Any]) -> list[Any]:
            pairs = [(out, cut[r].to(out.device)) for out, cut in zip(outs[r], parts)
                     if out.requires_grad and cut is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return [leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad
                    else None for leaf in moved]

        per_replica = ctx.owner._run(back, ctx.moved, "B")
        ctx.owner._tensors.sum_grads()
        result = [_input_grad([g[index] for g in per_replica], cut, device)
                  for index, cut, device in zip(ctx.leaf_index, ctx.split, ctx.devices)]
        return (None, None, None, None, *result)


def _input_grad(grads: list[torch.Tensor | None], split: bool,
                device: torch.device) -> torch.Tensor | None:
    """An input's gradient from its shares': joined if it was split, else summed."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if split:
        if len(present) != len(grads):
            raise BackwardError("some replicas computed a gradient for a split input and "
                                "others did not; the replicas must treat their shares alike")
        return torch.cat([g.to(device) for g in present])
    total = present[0].to(device)
    for g in present[1:]:
        total = total + g.to(device)
    return total
