"""Run stage graphs as a pipeline in one process, one worker thread per device.

Each device's worker runs its action list through the one interpreter
(``partitioner.runtime.interpreter``), with futures between threads as the transport
(``partitioner.runtime.thread_transport``). Two ways in:

* :meth:`LocalPipeline.step` runs a training step in the plan's schedule, any registered
  one (GPipe, 1F1B, interleaved 1F1B over ``v`` virtual stages per device, zero-bubble),
  the loss computed per micro-batch on the last stage;
* calling the pipeline (``pm(x)``) runs the forward actions of the fill-drain order over
  the virtual stages (:func:`fill_drain`), and the backward (when autograd reaches the
  pipeline's output) runs its backward actions (:func:`split_phases`). The pipeline enters
  autograd as one ``torch.autograd.Function`` whose backward drives the stages' backwards
  on their own workers, so the backward overlaps across devices too (autograd alone would
  run every CPU backward on one thread).

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.errors import BackwardError, ChunksError, ScheduleError, StrategyError
from partitioner.runtime.checkpointing import checkpoint_stop
from partitioner.runtime.fused_linear import accumulate_concurrently
from partitioner.runtime.interpreter import Interpreter
from partitioner.runtime.loss_head import (
    LossHead,
    loss_reduction_problem,
    loss_weights,
    split_targets,
    to_device,
)
from partitioner.runtime.microbatch import (
    OutputHint,
    batch_size,
    gather,
    join_rules,
    scatter,
    split_grad,
)
from partitioner.runtime.placement import Placement, looped, stages_on
from partitioner.runtime.precision import check_precision
from partitioner.runtime.rng import current_generator, draw_seed
from partitioner.runtime.schedule import Action, Phase, Schedule, clock_ticks, pipeline_depth
from partitioner.runtime.schedule_registry import GPIPE, Runtime, check_runtime
from partitioner.runtime.stage import StageRunner
from partitioner.runtime.thread_transport import ThreadTransport
from partitioner.runtime.worker import (
    Worker,
    restore_thread_default,
    shared_threads,
    thread_default,
    use_threads,
)

__all__ = ["LocalPipeline", "fill_drain", "split_phases", "thread_plan"]


class LocalPipeline:
    """A pipeline of stage graphs on devices of one process.

    Args:
        stages: one graph per (virtual) stage; stage ``k`` takes what stage ``k - 1``
            returns, stage 0 takes the model's placeholders.
        devices: one device per pipeline stage ``P`` (repeats allowed: each entry gets its
            own worker); with ``virtual`` stages per device, virtual stage ``k`` runs on
            ``devices[placement[k]]``, the schedule's placement (``k % P`` but for
            ``v_shape``; a list of ``P v`` devices must repeat that pattern).
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        schedule: any registered schedule (``partitioner.runtime.schedule_registry``); it
            orders :meth:`step`. ``pm(x)`` then ``loss.backward()`` runs all forwards, then
            all backwards (GPipe's order over the virtual stages), whatever the schedule.
        virtual: virtual stages per device ``v`` (``"interleaved"``: 2 or more).
        threads: intra-op threads of each CPU worker. By default (``None``) the caller's
            intra-op threads divided among the CPU workers (``shared_threads``), fixed for
            the pipeline's life, so stages computing together share the cores instead of
            oversubscribing them; a pipeline on one CPU device then runs its steps and
            forwards on the caller's thread itself (one OpenMP team in the process).
            ``"schedule"``: they follow the schedule instead, an
            action getting the caller's threads divided by the CPU stages busy at its time
            in the schedule's clock ticks (:func:`thread_plan`), so a stage alone in the fill
            or drain uses every thread. That is not the default: a worker thread that once
            ran with several intra-op threads keeps its OpenMP team for its life, and GNU
            OpenMP (torch's CPU wheels) then counts more threads than cores and makes every
            team in the process sleep at its barriers instead of spinning. Every parallel op
            of the process, the caller's optimizer step included, ran up to 2-3x slower on
            the 2-core CI machine while the pipeline lived (``docs/benchmarks.md``, "What one
            process pays"); the lone stage's gain, up to a quarter of a small pipeline's step
            there, is given up for that.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the stages compute under autocast
            to it and :meth:`step` computes the loss in fp32
            (``partitioner.runtime.precision``).
        output_rows: per leaf of the last stage's output, the rows of dim 0 per sample the
            capture found (``0``: no batch dimension; ``None``: unknown): how a call joins
            the micro-batches' outputs (``partitioner.runtime.microbatch.join_rules``:
            batched leaves concatenated, floating-point ones without a batch dimension
            averaged weighted by samples, others refused).
    """

    def __init__(self, stages: Sequence[fx.GraphModule], devices: Sequence[torch.device],
                 chunks: int = 1, checkpoint: str = "never", threads: int | str | None = None,
                 schedule: str = "gpipe", virtual: int = 1, precision: str = "fp32",
                 output_rows: Sequence[OutputHint] | None = None) -> None:
        if threads is not None and threads != "schedule" and not (
                isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
            raise StrategyError(f"threads={threads!r}; pass a positive count, \"schedule\" or "
                             "None (the caller's threads shared among the CPU workers)")
        self.schedule_kind = check_runtime(schedule, Runtime.ONE_PROCESS)
        self.virtual = virtual
        self.devices = _pipeline_devices(len(stages), list(devices), virtual,
                                         self.schedule_kind.placement)
        checkpoint_stop(checkpoint, max(chunks, 1))
        if chunks < 1:
            raise ChunksError(f"chunks={chunks}; pass chunks >= 1")
        problems = self.schedule_kind.problems(len(self.devices), chunks, virtual)
        if problems:
            raise ScheduleError("; ".join(problems))
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.output_rows = None if output_rows is None else list(output_rows)
        p = len(self.devices)
        #: Per virtual stage, the device (index into :attr:`devices`) that runs it.
        self.placement = self.schedule_kind.place(p, virtual)
        self.precision = check_precision(precision, scaled=False)
        self.runners = [StageRunner(k, gm, self.devices[self.placement[k]], precision=precision)
                        for k, gm in enumerate(stages)]
        _mark_shared_parameters(stages)
        self.threads = threads
        self._budget = torch.get_num_threads()
        self._default = thread_default()
        self._plans: dict[tuple[str, int], dict[Action, int]] = {}
        start = shared_threads(self.devices) if not isinstance(threads, int) else threads
        self.workers = [Worker(d, start if d.type == "cpu" else None) for d in self.devices]
        # One CPU device with the caller's threads: steps and forwards run on the caller's
        # thread (nothing to overlap; a worker thread would hold a second OpenMP team).
        self._inline = threads is None and [d.type for d in self.devices] == ["cpu"]
        #: (action, start, end) in seconds since the pipeline was made, for every action the
        #: last forward and backward (or step) ran (what ``viz`` draws as a measured timeline).
        self.timeline: list[tuple[Action, float, float]] = []
        #: Per device, the most micro-batches its stages held activations for at once
        #: during the last :meth:`step`.
        self.peak_in_flight: list[int] = [0] * p
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        # One call at a time (a second caller waits): two threads' actions would mix in the
        # stages' stashes and the tensor-parallel collectives (wrong outputs, or a hang).
        self._call_lock = threading.RLock()
        # Which forward with autograd the stages' stashes belong to, and whether its backward
        # ran: only the latest such forward can be back-propagated, once.
        self._generation = 0
        self._consumed = False

    @property
    def n_stages(self) -> int:
        """Virtual stages in all: ``P v``."""
        return len(self.runners)

    @property
    def origin(self) -> float:
        """The ``time.perf_counter()`` the :attr:`timeline`'s times count from (several
        pipelines' timelines, the replicas', are put on one clock with it)."""
        return self._origin

    def _record(self, action: Action, start: float, end: float) -> None:
        with self._lock:
            self.timeline.append((action, start - self._origin, end - self._origin))

    def schedule(self, n_microbatches: int) -> tuple[Schedule, Schedule]:
        """The forward and backward action lists ``pm(x)`` and its backward run."""
        return split_phases(fill_drain(len(self.devices), n_microbatches, self.virtual,
                                       self.placement))

    def step_schedule(self, n_microbatches: int) -> Schedule:
        """The plan's schedule for ``n_microbatches``: what :meth:`step` runs."""
        return self.schedule_kind.build(len(self.devices), n_microbatches, self.virtual)

    def _threads_for(self, key: str, schedule: Schedule) -> dict[Action, int]:
        """Intra-op threads per action (empty: fixed per worker)."""
        if self.threads != "schedule":
            return {}
        n = 1 + max(a.microbatch for actions in schedule for a in actions)
        if (key, n) not in self._plans:
            self._plans[(key, n)] = thread_plan(
                schedule, [d.type == "cpu" for d in self.devices], self._budget)
        return self._plans[(key, n)]

    def _execute(self, schedule: Schedule, transport: ThreadTransport, threads: dict[Action, int],
                 *, head: LossHead | None, training: bool, replay_below: int,
                 inline: bool = False) -> None:
        """Every device runs its list through the interpreter on its worker (``inline``: the
        one device's on the caller's thread); then the threads' default is put back."""
        def device_loop(j: int) -> bool:
            changed = False

            def on_action(action: Action) -> None:
                nonlocal changed
                if action in threads:
                    changed |= use_threads(threads[action])

            mine = {k: self.runners[k] for k in stages_on(self.placement, j)}
            interpreter = Interpreter(mine, self.n_stages, transport, head=head,
                                      training=training, replay_below=replay_below,
                                      on_action=on_action, record=self._record)
            interpreter.run(schedule[j])
            self.peak_in_flight[j] = interpreter.peak_in_flight
            return changed

        if inline:
            changed = [device_loop(0)]
        else:
            done = [w.submit(device_loop, j) for j, w in enumerate(self.workers)]
            changed = [future.result() for future in done]
        if any(changed):
            restore_thread_default(self._default)

    def _reset(self, grad: bool) -> None:
        # From the generator the caller's thread installed (a data-parallel replica's, seeded
        # per call), else torch's global one: replicas drawing from the global generator at
        # once got their seeds in thread order, and a run did not repeat under manual_seed.
        installed = current_generator()
        seed = draw_seed(installed)
        for k, runner in enumerate(self.runners):
            if grad:
                runner.reset(seed + k)
            else:
                runner.reseed(seed + k)  # a pending backward keeps its stash
        if grad:
            self._generation += 1
            self._consumed = False

    def run(self, values: list[Any]) -> Any:
        """Run one mini-batch; ``values`` has one entry per placeholder of stage 0.

        Calls from several threads run one after another (as :meth:`step` and the
        backward of an output do)."""
        with self._call_lock:
            return self._run(values)

    def _run(self, values: list[Any]) -> Any:
        micro = scatter(values, self.chunks)
        leaves = pytree.tree_leaves(values)
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for r in self.runners for p in r.graph_module.parameters())
            or any(isinstance(v, torch.Tensor) and v.requires_grad for v in leaves))
        if not grad:
            return gather(self._forward(micro, grad=False), _sizes(micro), self.output_rows)
        tensor_positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box: dict[str, Any] = {}
        phony = torch.empty(0, requires_grad=True)
        outputs = _PipelineFunction.apply(self, micro, box, phony,
                                          *[leaves[k] for k in tensor_positions])
        out_leaves = list(box["leaves"])
        for position, tensor in zip(box["tensor_positions"], outputs):
            out_leaves[position] = tensor
        return pytree.tree_unflatten(out_leaves, box["spec"])

    def step(self, values: list[Any], targets: Any, loss_fn: Callable[[Any, Any], Any], *,
             loss_reduction: str = "mean",
             restructure: Callable[[Any], Any] = lambda out: out,
             grad_scale: float = 1.0) -> float:
        """One forward and backward of the mini-batch in the plan's schedule; the loss.

        The loss is computed per micro-batch on the last stage (``loss_fn(output_i,
        target_i)``) and its backward starts right there, so 1F1B, interleaved and
        zero-bubble schedules run as planned. Gradients accumulate into ``.grad``.

        Args:
            values: one entry per placeholder of stage 0, for the whole mini-batch.
            targets: what ``loss_fn`` compares with, split into micro-batches as the
                inputs are (``None``: ``loss_fn`` gets ``None``).
            loss_fn: ``loss_fn(output, target)`` returning a scalar tensor.
            loss_reduction: ``"mean"`` (``loss_fn`` averages over its samples: micro-batch
                losses are weighted by their share of the batch) or ``"sum"``.
            restructure: turns the last stage's output into what the model returns.
            grad_scale: a factor on the gradients, not on the loss returned (a loss scale).

        Returns:
            The mini-batch's loss, as ``loss_fn`` over the whole batch would give it.

        Raises:
            StrategyError: If ``loss_reduction`` is not ``"mean"`` or ``"sum"``.
            StageExecutionError: If a stage or ``loss_fn`` raised, naming where.
        """
        problem = loss_reduction_problem(loss_reduction)
        if problem is not None:
            raise StrategyError(problem)
        with self._call_lock:
            return self._step(values, targets, loss_fn, loss_reduction, restructure,
                              grad_scale)

    def _step(self, values: list[Any], targets: Any, loss_fn: Callable[[Any, Any], Any],
              loss_reduction: str, restructure: Callable[[Any], Any],
              grad_scale: float) -> float:
        micro = scatter(values, self.chunks)
        m = len(micro)
        heads_device = self.runners[-1].device
        head = LossHead(loss_fn, [to_device(t, heads_device)
                                  for t in split_targets(targets, m, batch_size(values))],
                        loss_weights(micro, values, loss_reduction), restructure,
                        grad_scale=grad_scale, upcast=self.precision != "fp32")
        self._reset(grad=True)
        self._consumed = True  # no pm(x) output may back-propagate into this step's stashes
        self.timeline = []
        schedule = self.step_schedule(m)
        transport = ThreadTransport(micro, self._stage_devices(), training=True)
        self._execute(schedule, transport, self._threads_for("step", schedule), head=head,
                      training=True, replay_below=checkpoint_stop(self.checkpoint, m),
                      inline=self._inline)
        transport.raise_first()
        return head.loss

    def _stage_devices(self) -> list[torch.device]:
        return [r.device for r in self.runners]

    def _forward(self, micro: list[list[Any]], *, grad: bool) -> list[Any]:
        n = len(micro)
        forward, _ = self.schedule(n)
        self._reset(grad)
        self.timeline = []
        transport = ThreadTransport(micro, self._stage_devices(), training=grad)
        full = fill_drain(len(self.devices), n, self.virtual, self.placement)
        # Its backward runs on the worker: autograd's engine calls it (runtime/module.py).
        self._execute(forward, transport, self._threads_for("fill-drain", full), head=None,
                      training=grad, replay_below=checkpoint_stop(self.checkpoint, n),
                      inline=self._inline)
        return transport.outputs()

    def _backward(self, n: int, grads_last: list[list[Any]]) -> list[list[Any]]:
        _, backward = self.schedule(n)
        micro: list[list[Any]] = [[] for _ in range(n)]
        transport = ThreadTransport(micro, self._stage_devices(), training=False,
                                    last_grads=grads_last)
        full = fill_drain(len(self.devices), n, self.virtual, self.placement)
        self._execute(backward, transport, self._threads_for("fill-drain", full), head=None,
                      training=True, replay_below=checkpoint_stop(self.checkpoint, n))
        return transport.input_grads()

    def close(self) -> None:
        """Stop the workers."""
        for worker in self.workers:
            worker.close()


def _pipeline_devices(n_stages: int, devices: list[torch.device], virtual: int,
                      placement: Callable[[int, int], Placement] = looped
                      ) -> list[torch.device]:
    """The ``P`` devices of ``n_stages = P v`` virtual stages.

    Raises:
        ScheduleError: If the counts do not match, naming them and the fix.
    """
    p = pipeline_depth(n_stages, virtual)
    if len(devices) == p:
        return devices
    where = placement(p, virtual)
    if len(devices) == n_stages and all(devices[k] == devices[where[k]] for k in range(n_stages)):
        return devices[:p]
    raise ScheduleError(f"{n_stages} stages with virtual={virtual} need {p} devices (virtual "
                        f"stage k on device {where}[k]), got {len(devices)}; pass {p} devices")


def fill_drain(n_stages: int, n_microbatches: int, virtual: int = 1,
               placement: Placement | None = None) -> Schedule:
    """GPipe's order over ``v`` virtual stages per device: every forward, chunk by chunk,
    then every backward, last chunk and last micro-batch first; device ``j`` runs the
    stages ``placement`` puts on it (default: looped, ``k`` on ``k % P``).

    Example:
        >>> [" ".join(map(str, a)) for a in fill_drain(2, 1, 2)]
        ['0F0 2F0 2B0 0B0', '1F0 3F0 3B0 1B0']
    """
    p, m, v = n_stages, n_microbatches, virtual
    where = looped(p, v) if placement is None else placement
    return tuple(
        tuple(Action(k, Phase.FORWARD, i) for k in stages_on(where, j) for i in range(m))
        + tuple(Action(k, Phase.BACKWARD, i)
                for k in reversed(stages_on(where, j)) for i in reversed(range(m)))
        for j in range(p))


def thread_plan(schedule: Schedule, on_cpu: Sequence[bool], budget: int
                ) -> dict[Action, int]:
    """Intra-op threads for each action of ``schedule``: ``budget`` shared by the CPU stages
    busy alongside it in the schedule's clock ticks (the most at any of its ticks).

    Example:
        >>> from partitioner.runtime.schedule_generators import gpipe
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
        >>> from partitioner.runtime.schedule_generators import gpipe
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


class _PipelineFunction(torch.autograd.Function):
    """The whole pipeline as one autograd node (its backward runs the backward schedule)."""

    @staticmethod
    def forward(ctx: Any, pipe: LocalPipeline, micro: list[list[Any]], box: dict[str, Any],
                phony: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        per_micro = pipe._forward(micro, grad=True)
        ctx.generation = pipe._generation
        flat = [pytree.tree_flatten(out) for out in per_micro]
        sizes = _sizes(micro)
        rules = join_rules(per_micro, sizes, pipe.output_rows)
        gathered = gather(per_micro, sizes, rules=rules)
        leaves, spec = pytree.tree_flatten(gathered)
        positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        box.update(leaves=leaves, spec=spec, tensor_positions=positions)
        ctx.pipe = pipe
        ctx.positions = positions
        ctx.samples = sizes
        ctx.rules = [rules[k] for k in positions]
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
        with ctx.pipe._call_lock:
            return _PipelineFunction._backward(ctx, grad_outputs)

    @staticmethod
    def _backward(ctx: Any, grad_outputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
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
            lengths = [s[position_index] for s in ctx.sizes]
            parts = split_grad(g, ctx.rules[position_index], lengths, ctx.samples)
            for i in range(n):
                per_micro[i][k] = parts[i]
        input_grads = ctx.pipe._backward(n, per_micro)
        result: list[Any] = []
        for split in ctx.input_split:
            result.append(_join_input_grad([g[split[0]] for g in input_grads], split[1]))
        return (None, None, None, None, *result)


def _sizes(micro: list[list[Any]]) -> list[int]:
    """The samples of each micro-batch (1 for one without a batch dimension)."""
    return [batch_size(mb) or 1 for mb in micro]


def _mark_shared_parameters(stages: Sequence[fx.GraphModule]) -> None:
    """A parameter held by two stages (tied weights, a module called from both) gets
    gradients from two worker threads at once: leave its accumulation to autograd's lock
    (``partitioner.runtime.fused_linear.accumulate_concurrently``)."""
    seen: set[int] = set()
    for gm in stages:
        for param in gm.parameters():
            if id(param) in seen:
                accumulate_concurrently(param)
            seen.add(id(param))


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
