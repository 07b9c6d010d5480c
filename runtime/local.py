"""Run stage graphs as a pipeline in one process, one worker thread per device.

The forward of a mini-batch runs the forward actions of a fill-drain schedule (GPipe, the one
``partitioner.runtime.schedule_registry`` says this runtime executes), the backward (when
autograd reaches the pipeline's output) runs its backward actions (:func:`split_phases`).
The pipeline enters autograd as one ``torch.autograd.Function`` whose backward drives the
stages' backwards on their own workers, so the backward overlaps across devices too
(autograd alone would run every CPU backward on one thread).

Checkpoint modes follow torchgpipe (``partitioner.runtime.checkpointing``): ``always``
replays every micro-batch's forward in the backward, ``except_last`` all but the last
micro-batch, ``never`` none.

::

    stage 0 | 0F0 0F1 0F2 .   .   .   0B2 0B1 0B0
    stage 1 | .   1F0 1F1 1F2 1B2 1B1 1B0 .   .

Example:
    >>> import torch
    >>> class Stage(torch.nn.Module):  # a stage returns the next stage's inputs, as a tuple
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.linear = torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return (self.linear(x),)
    >>> stages = [torch.fx.symbolic_trace(Stage()) for _ in range(2)]
    >>> pipe = LocalPipeline(stages, [torch.device("cpu")] * 2, chunks=2)
    >>> (y,) = pipe.run([torch.randn(4, 2)])
    >>> y.shape
    torch.Size([4, 2])
    >>> pipe.close()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.errors import BackwardError, ChunksError, ScheduleError, StageExecutionError
from partitioner.runtime.checkpointing import checkpoint_stop
from partitioner.runtime.microbatch import gather, scatter
from partitioner.runtime.schedule import Action, Phase, Schedule, clock_ticks
from partitioner.runtime.schedule_registry import GPIPE, Runtime, check_runtime
from partitioner.runtime.stage import StageRunner
from partitioner.runtime.transfer import Handoff, move_leaves, receive, send
from partitioner.runtime.worker import (
    Worker,
    restore_thread_default,
    shared_threads,
    thread_default,
    use_threads,
)

__all__ = ["LocalPipeline", "split_phases", "thread_plan"]


class LocalPipeline:
    """A pipeline of stage graphs on devices of one process.

    Args:
        stages: one graph per stage; stage ``j`` takes what stage ``j - 1`` returns, stage 0
            takes the model's placeholders.
        devices: one device per stage (repeats allowed: each entry gets its own worker).
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        schedule: a schedule this runtime executes (``Runtime.ONE_PROCESS`` in
            ``partitioner.runtime.schedule_registry``); it must split into a forward pass
            and a backward pass.
        threads: intra-op threads of each CPU worker. By default they follow the schedule:
            an action gets the caller's intra-op threads divided by the number of CPU stages
            busy at its time in the schedule's clock ticks (:func:`thread_plan`), so a stage
            alone in the fill or drain uses every thread and stages computing together
            share them instead of oversubscribing the cores.
    """

    def __init__(self, stages: Sequence[fx.GraphModule], devices: Sequence[torch.device],
                 chunks: int = 1, checkpoint: str = "never", threads: int | None = None,
                 schedule: str = "gpipe") -> None:
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages for {len(devices)} devices")
        checkpoint_stop(checkpoint, max(chunks, 1))
        self.schedule_kind = check_runtime(schedule, Runtime.ONE_PROCESS)
        if chunks < 1:
            raise ChunksError(f"chunks={chunks}; pass chunks >= 1")
        self.devices = list(devices)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.runners = [StageRunner(j, gm, d) for j, (gm, d) in enumerate(zip(stages, devices))]
        self.threads = threads
        self._budget = torch.get_num_threads()
        self._default = thread_default()
        self._plans: dict[int, dict[Action, int]] = {}
        start = shared_threads(self.devices) if threads is None else threads
        self.workers = [Worker(d, start if d.type == "cpu" else None) for d in self.devices]
        #: (action, start, end) in seconds since the pipeline was made, for every action the
        #: last forward and backward ran (what ``viz`` draws as a measured timeline).
        self.timeline: list[tuple[Action, float, float]] = []
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        # Which forward with autograd the stages' stashes belong to, and whether its backward
        # ran: only the latest such forward can be back-propagated, once.
        self._generation = 0
        self._consumed = False

    def _record(self, action: Action, start: float) -> None:
        with self._lock:
            self.timeline.append((action, start - self._origin,
                                  time.perf_counter() - self._origin))

    def schedule(self, n_microbatches: int) -> tuple[Schedule, Schedule]:
        """The forward and backward action lists used for ``n_microbatches``."""
        return split_phases(self.schedule_kind.build(len(self.runners), n_microbatches))

    def _threads_for(self, n_microbatches: int) -> dict[Action, int]:
        """Intra-op threads per action (empty: fixed per worker)."""
        if self.threads is not None:
            return {}
        if n_microbatches not in self._plans:
            self._plans[n_microbatches] = thread_plan(
                self.schedule_kind.build(len(self.runners), n_microbatches),
                [d.type == "cpu" for d in self.devices], self._budget)
        return self._plans[n_microbatches]

    def _run_phase(self, loop: Any, schedule: Schedule) -> None:
        """``loop(j, actions)`` on every worker; then the threads' default is put back."""
        done = [w.submit(loop, j, schedule[j]) for j, w in enumerate(self.workers)]
        changed = [future.result() for future in done]
        if any(changed):
            restore_thread_default(self._default)

    def run(self, values: list[Any]) -> Any:
        """Run one mini-batch; ``values`` has one entry per placeholder of stage 0."""
        micro = scatter(values, self.chunks)
        leaves = pytree.tree_leaves(values)
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for r in self.runners for p in r.graph_module.parameters())
            or any(isinstance(v, torch.Tensor) and v.requires_grad for v in leaves))
        if not grad:
            return gather(self._forward(micro, grad=False))
        tensor_positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box: dict[str, Any] = {}
        phony = torch.empty(0, requires_grad=True)
        outputs = _PipelineFunction.apply(self, micro, box, phony,
                                          *[leaves[k] for k in tensor_positions])
        out_leaves = list(box["leaves"])
        for position, tensor in zip(box["tensor_positions"], outputs):
            out_leaves[position] = tensor
        return pytree.tree_unflatten(out_leaves, box["spec"])

    def _forward(self, micro: list[list[Any]], *, grad: bool) -> list[Any]:
        n = len(micro)
        forward, _ = self.schedule(n)
        stop = checkpoint_stop(self.checkpoint, n)
        self.timeline = []
        seed = int(torch.randint(0, 2**62, (1,)).item())
        for j, runner in enumerate(self.runners):
            if grad:
                runner.reset(seed + j)
            else:
                runner.reseed(seed + j)  # a pending backward keeps its stash
        if grad:
            self._generation += 1
            self._consumed = False
        slots: list[list[Future[Handoff]]] = [[Future() for _ in range(n)] for _ in self.runners]
        threads = self._threads_for(n)

        def stage_loop(j: int, actions: tuple[Action, ...]) -> bool:
            runner = self.runners[j]
            changed = False
            for action in actions:
                i = action.microbatch
                try:
                    if action in threads:
                        changed |= use_threads(threads[action])
                    if j == 0:
                        inputs = pytree.tree_unflatten(
                            *_as_leaves(micro[i], runner.device, grad))
                    else:
                        leaves, spec = receive(slots[j - 1][i].result(), runner.device, grad=grad)
                        inputs = pytree.tree_unflatten(leaves, spec)
                    start = time.perf_counter()  # after the inputs arrived: busy time only
                    out = runner.forward(i, list(inputs), grad=grad, checkpoint=i < stop)
                    slots[j][i].set_result(send(out, runner.device))
                    self._record(action, start)
                except BaseException as error:
                    slots[j][i].set_exception(error)
            return changed

        self._run_phase(stage_loop, forward)
        last = slots[-1]
        errors = [e for row in slots for s in row if (e := s.exception()) is not None]
        if errors:
            raise _first_stage_error(errors)
        return [pytree.tree_unflatten(h.leaves, h.spec) for h in (f.result() for f in last)]

    def _backward(self, n: int, grads_last: list[list[Any]]) -> list[list[Any]]:
        _, backward = self.schedule(n)
        slots: list[list[Future[Handoff]]] = [[Future() for _ in range(n)] for _ in self.runners]
        last = len(self.runners) - 1
        threads = self._threads_for(n)

        def stage_loop(j: int, actions: tuple[Action, ...]) -> bool:
            runner = self.runners[j]
            changed = False
            for action in actions:
                i = action.microbatch
                try:
                    if action in threads:
                        changed |= use_threads(threads[action])
                    if j == last:
                        incoming = move_leaves(grads_last[i], runner.device, grad=False)
                    else:
                        incoming, _ = receive(slots[j + 1][i].result(), runner.device,
                                              grad=False)
                    start = time.perf_counter()
                    slots[j][i].set_result(send(runner.backward(i, incoming), runner.device))
                    self._record(action, start)
                except BaseException as error:
                    slots[j][i].set_exception(error)
            return changed

        self._run_phase(stage_loop, backward)
        errors = [e for row in slots for s in row if (e := s.exception()) is not None]
        if errors:
            raise _first_stage_error(errors)
        return [f.result().leaves for f in slots[0]]

    def close(self) -> None:
        """Stop the workers."""
        for worker in self.workers:
            worker.close()


def thread_plan(schedule: Schedule, on_cpu: Sequence[bool], budget: int
                ) -> dict[Action, int]:
    """Intra-op threads for each action of ``schedule``: ``budget`` shared by the CPU stages
    busy alongside it in the schedule's clock ticks (the most at any of its ticks).

    Example:
        >>> from partitioner.runtime.schedules import gpipe
        >>> plan = thread_plan(gpipe(2, 2), [True, True], budget=2)
        >>> {str(a): n for a, n in plan.items()}["0F0"], {str(a): n for a, n in plan.items()}["0F1"]
        (2, 1)
    """
    out: dict[Action, int] = {}
    for tick in clock_ticks(schedule):
        busy = sum(1 for j, a in enumerate(tick) if a is not None and on_cpu[j])
        for j, action in enumerate(tick):
            if action is not None and on_cpu[j]:
                out[action] = min(out.get(action, budget), max(1, budget // max(busy, 1)))
    return out


def split_phases(schedule: Schedule) -> tuple[Schedule, Schedule]:
    """Splits a fill-drain schedule into its forward pass and its backward pass.

    For runtimes that run forward and backward in separate calls (``loss =
    model(x)`` then ``loss.backward()``), which only works if no stage runs a forward
    after any of its backwards.

    Args:
        schedule: Per stage, the ordered actions it runs.

    Returns:
        ``(forwards, backwards)``: per stage, its forward actions and its backward actions,
        each in the schedule's order.

    Raises:
        ScheduleError: Naming every stage that runs a forward after a backward.

    Example:
        >>> from partitioner.runtime.schedules import gpipe
        >>> forwards, backwards = split_phases(gpipe(2, 2))
        >>> [str(a) for a in forwards[0]], [str(a) for a in backwards[0]]
        (['0F0', '0F1'], ['0B1', '0B0'])
    """
    problems = []
    for j, actions in enumerate(schedule):
        first_b = next((a for a in actions if a.phase is Phase.BACKWARD), None)
        if first_b is None:
            continue
        late = [a for a in actions[actions.index(first_b) :] if a.phase is Phase.FORWARD]
        if late:
            problems.append(f"stage {j} runs {late[0]} after {first_b}")
    if problems:
        raise ScheduleError(
            f"cannot split into a forward pass then a backward pass: {'; '.join(problems)}; "
            f"run such schedules action by action, or use a fill-drain schedule such as {GPIPE!r}"
        )
    return _phase_only(schedule, Phase.FORWARD), _phase_only(schedule, Phase.BACKWARD)


def _phase_only(schedule: Schedule, phase: Phase) -> Schedule:
    return tuple(tuple(a for a in actions if a.phase is phase) for actions in schedule)


def _as_leaves(values: list[Any], device: torch.device, grad: bool) -> tuple[list[Any], Any]:
    leaves, spec = pytree.tree_flatten(values)
    return move_leaves(leaves, device, grad=grad), spec


def _first_stage_error(errors: list[BaseException]) -> BaseException:
    """The root cause: a stage's own error rather than a neighbour's echo of it."""
    own = [e for e in errors if isinstance(e, StageExecutionError)]
    own.sort(key=lambda e: (e.microbatch, e.stage))
    return own[0] if own else errors[0]


class _PipelineFunction(torch.autograd.Function):
    """The whole pipeline as one autograd node (its backward runs the backward schedule)."""

    @staticmethod
    def forward(ctx: Any, pipe: LocalPipeline, micro: list[list[Any]], box: dict[str, Any],
                phony: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        per_micro = pipe._forward(micro, grad=True)
        ctx.generation = pipe._generation
        flat = [pytree.tree_flatten(out) for out in per_micro]
        gathered = gather(per_micro)
        leaves, spec = pytree.tree_flatten(gathered)
        positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box.update(leaves=leaves, spec=spec, tensor_positions=positions)
        ctx.pipe = pipe
        ctx.positions = positions
        ctx.sizes = [[leaves_i[k].shape[0] if leaves_i[k].dim() else 1 for k in positions]
                     for leaves_i, _ in flat]
        ctx.n_leaves = len(leaves)
        ctx.input_split = [_split_sizes(x, micro, k) for k, x in enumerate(inputs)]
        outputs = tuple(leaves[k].detach() for k in positions)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()
                                      and not o.is_complex()])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        pipe = ctx.pipe
        if ctx.generation != pipe._generation or pipe._consumed:
            why = ("its backward already ran" if ctx.generation == pipe._generation
                   else "a later forward with autograd replaced its saved activations")
            raise BackwardError(
                f"cannot back-propagate this output of the partitioned model: {why}. The "
                "pipeline keeps the activations of its latest forward only, for one backward; "
                "call backward() after each forward (forward, backward, forward, backward "
                "for gradient accumulation), and not twice (retain_graph=True does not keep "
                "the stages' activations)")
        pipe._consumed = True
        n = len(ctx.sizes)
        per_micro: list[list[Any]] = [[None] * ctx.n_leaves for _ in range(n)]
        for position_index, (k, g) in enumerate(zip(ctx.positions, grad_outputs)):
            sizes = [s[position_index] for s in ctx.sizes]
            parts = torch.split(g, sizes) if n > 1 else (g,)
            for i in range(n):
                per_micro[i][k] = parts[i]
        input_grads = ctx.pipe._backward(n, per_micro)
        result: list[Any] = []
        for split in ctx.input_split:
            result.append(_join_input_grad([g[split[0]] for g in input_grads], split[1]))
        return (None, None, None, None, *result)


def _split_sizes(x: torch.Tensor, micro: list[list[Any]], k: int) -> tuple[int, bool]:
    """(leaf index of tensor input ``k`` among stage-0 leaves, whether it was split)."""
    first_leaves = [v for v in pytree.tree_leaves(micro[0])]
    tensor_leaf_indices = [i for i, v in enumerate(first_leaves) if isinstance(v, torch.Tensor)]
    index = tensor_leaf_indices[k]
    piece = first_leaves[index]
    return index, len(micro) > 1 and piece.shape != x.shape


def _join_input_grad(grads: list[Any], was_split: bool) -> torch.Tensor | None:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if was_split:
        return torch.cat(present)
    total = present[0]
    for g in present[1:]:
        total = total + g
    return total
