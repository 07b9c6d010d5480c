"""Measured tuning: time a plan's best-ranked candidates of each mesh and keep the fastest.

The cost model ranks the configurations; on a real machine the first few are often within
its error of each other (thread hand-offs, allocator behaviour and cores shared by several
``"cpu"`` devices are hard to predict to a few percent). ``partition(..., tune=True)`` then
builds :data:`DEFAULT_CANDIDATES` candidates (or ``tune=n``; the best-ranked of each mesh
first, :func:`tuned_order`), times a few
training steps of each on the example batch (forward, backward in the plan's schedule, an
Adam step: what the prediction covers) and keeps the measured fastest. The plan records
the predicted and measured step time of every candidate timed (``Plan.candidates``:
``measured_step_time``; ``tune_error`` for one that could not run, which is skipped and
never loses the plan), and ``Plan.explain()`` prints both.

This module holds what does not depend on how a candidate is built: the validation of
``tune=``, the timing of a module's training steps, and the bookkeeping of the records.
The fronts (``partitioner.api``, ``partitioner.distributed``) pass a function that builds
a candidate's module.

Example:
    >>> tune_count(True), tune_count(2), tune_count(False)
    (4, 2, 0)
    >>> records = [{"label": "a", "rank": 1, "chosen": True, "step_time": 1.0},
    ...            {"label": "b", "rank": 2, "chosen": False, "step_time": 1.1}]
    >>> tuned = tuned_records(records, [Trial(0, 0.30), Trial(1, 0.20)])
    >>> [(r["label"], r["chosen"], r["measured_step_time"]) for r in tuned]
    [('a', False, 0.3), ('b', True, 0.2)]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner.errors import TuneError
from partitioner.planning.records import built_first
from partitioner.runtime.originals import guarding

__all__ = ["DEFAULT_CANDIDATES", "TIMED_STEPS", "WARMUP_STEPS", "ROUNDS", "RETIME_WITHIN",
           "KEEP_WITHIN", "SETTLE_TRIALS", "CONFIRM_TRIALS", "REFINE", "REFINE_WITHIN",
           "REFINE_TRIALS",
           "MIN_TIMED_SECONDS", "MAX_TIMED_STEPS",
           "TuneError", "Trial", "tune_count", "contenders", "synthetic_loss",
           "time_training_steps", "run_trials", "tuned_order", "refinement", "tuned_records",
           "chosen_first", "snapshot_state", "restore_state"]

DEFAULT_CANDIDATES = 4
"""Candidates ``tune=True`` builds and times."""
WARMUP_STEPS = 1
"""Untimed steps per candidate (threads, allocator and caches warm up)."""
TIMED_STEPS = 3
"""Timed steps per candidate and round; the median counts."""
MIN_TIMED_SECONDS = 0.3
"""In one process, each candidate's timed steps of a round last at least this long in all."""
MAX_TIMED_STEPS = 30
"""The most timed steps per candidate and round."""
ROUNDS = 3
"""Rounds of timing (:func:`run_trials`): every candidate in the first two, in opposite
orders; those close to the fastest in the third. A candidate's time is the median of its
rounds."""
KEEP_WITHIN = 0.03
"""A better-ranked candidate measured within this share of the fastest is kept
(:func:`tuned_records`). It was 10% while tuning's timing in the planning process read
candidates 4-10% apart in either order of what each measured apart in processes of their
own (``benchmarks/regret.py``, 2026-12-04 13:20 UTC: four of six overrulings within 10% made
the plan 12-41% slower, docs/benchmarks.md "Timed in bursts"). Two causes of that are gone:
a slow moment over a candidate's rounds (a lead is confirmed head to head first,
:data:`CONFIRM_TRIALS`) and glibc's allocator, whose thresholds followed what each process
had run before (fixed since for CPU devices: ``partitioner.runtime.host_memory``); at 10%,
``tune=True`` kept plans 6-9% slower than the fastest it had timed (2026-12-05 13:07 UTC,
docs/benchmarks.md "One process: the allocator's history")."""
SETTLE_TRIALS = 1
"""Across processes, the best-ranked candidate's trials before the rounds, whose times are
thrown away: the first candidate timed after rank 0's search (its peers waiting in a
collective meanwhile) measured 33-75% slower than in its later rounds in 4 of the 5 worlds
of ``benchmarks/regret_distributed.py --cases wide --ranks 4`` whose rounds were all logged
(docs/benchmarks.md, "Across processes: the first candidate timed"), and the candidate
timed first is the cost model's pick, whose regret that benchmark reports."""
CONFIRM_TRIALS = 3
"""Trials more of each of the two, alternating, before the measured fastest overrules the
best-ranked candidate (:func:`run_trials`' ``confirm``), which then decide alone (the median
of three outlasts one slow moment): a slow moment of the machine that lasts over two of a
candidate's timings is not a lead. In the planning process on the
2-core VM, ``tune=True`` for the demo's MLP on two devices timed auto's ``1f1b`` at 5.76 ms
where every other run of it read 3.55-4.75 (``benchmarks/regret.py``, 2026-12-05 10:02 UTC,
docs/benchmarks.md "One process: a pick that screened slower timed head to head"), and
overruled it for a plan 10% slower."""
REFINE_WITHIN = 0.10
"""After the rounds, the best-ranked candidate not yet timed of the mesh measured fastest
(another schedule, micro-batch count or checkpointing of the same ``dp x tp x pp``) is timed
head to head with that mesh's fastest when the cost model predicted it within this share
of it (:func:`refinement`; the fronts ask for one, :data:`REFINE`). Tuning times one
candidate per mesh first (:func:`tuned_order`), so a near-tie of schedules on the fastest
mesh was left to the prediction: on 4 gloo ranks ``wide``'s ``tp=2 pp=2`` ``1f1b`` ran
56.3 ms (predicted 54.0) where the ``zero_bubble`` tuning kept, ranked above it, ran 60.3
(``benchmarks/regret_distributed.py``, 2026-12-05 13:48 UTC, docs/benchmarks.md "One
process: the allocator's history")."""
REFINE = 1
"""Variants of the measured fastest mesh ``partition(tune=)`` and ``partition_distributed``
time after the rounds (:data:`REFINE_WITHIN`), beyond the ``tune=`` count."""
REFINE_TRIALS = 2
"""Head-to-head trials of each, the variant and its mesh's fastest, alternating."""
RETIME_WITHIN = 0.25
"""Candidates measured within this share of the fastest after two rounds are timed a third
time: on a machine whose speed drifts by 10-25% over seconds (measured on the 2-core VM,
docs/benchmarks.md "auto's regret"), two rounds do not rank them the same way twice."""


def tune_count(tune: object) -> int:
    """How many candidates ``tune=`` asks to time: ``True`` the default 4, an int that
    many, ``False``/``None`` none.

    Raises:
        TuneError: ``tune`` is neither a bool nor a positive int.
    """
    if tune is None or tune is False:
        return 0
    if tune is True:
        return DEFAULT_CANDIDATES
    if isinstance(tune, int) and tune >= 1:
        return tune
    raise TuneError(f"tune={tune!r}; pass True (time {DEFAULT_CANDIDATES} of the best-ranked "
                    "candidates), a positive int (time that many) or False")


def synthetic_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """A loss touching every floating-point output: the sum of their means (``targets``
    unused). What tuning trains with: the step's cost hardly depends on the loss."""
    leaves = [leaf for leaf in pytree.tree_leaves(outputs)
              if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
              and leaf.requires_grad]
    if not leaves:
        raise TuneError("the model returns no floating-point tensor that requires grad, so "
                        "no training step can be timed; pass tune=False")
    total = leaves[0].float().mean()
    for leaf in leaves[1:]:
        total = total + leaf.float().mean()
    return total


def time_training_steps(module: nn.Module, inputs: tuple[Any, ...],
                        kwargs: dict[str, Any] | None, batch: int, *,
                        steps: int = TIMED_STEPS, warmup: int = WARMUP_STEPS,
                        min_seconds: float = 0.0,
                        agree: Callable[[float], float] | None = None) -> float:
    """The median seconds of ``steps`` training steps of ``module`` on one batch, or of as
    many more (up to :data:`MAX_TIMED_STEPS`) as take ``min_seconds`` in all: three steps of
    10 ms are a few scheduler slices, which on a shared VM ranked candidates 10-60% apart
    differently from run to run (docs/benchmarks.md, "What one process pays"). Every rank
    of a world must time the same number of steps (each is collective): ranks pass
    ``agree``, which turns this rank's first timed step into the one every rank counts
    with (the slowest rank's, an all-reduce), so all take the same count.

    A step is what a plan's predicted step time covers: ``zero_grad``, forward and backward
    (``module.step`` in a partitioned module's schedule; ``loss.backward()`` for a plain
    module) and an Adam step over the trainable parameters. The caller restores the weights
    afterwards (:func:`snapshot_state`).
    """
    optimizer = _adam(module)
    targets = torch.zeros(batch)
    step = getattr(module, "step", None)
    if not callable(step) or isinstance(module, torch.optim.Optimizer) \
            or not hasattr(module, "plan"):
        step = None

    def one_step() -> float:
        start = time.perf_counter()
        (optimizer or module).zero_grad(set_to_none=True)
        if step is not None:
            step(inputs, targets, synthetic_loss, kwargs=kwargs)
        else:
            synthetic_loss(module(*inputs, **dict(kwargs or {})), targets).backward()
        if optimizer is not None:
            optimizer.step()
        return time.perf_counter() - start
    for _ in range(warmup):
        one_step()
    times = [one_step()]
    if min_seconds > 0:
        first = agree(times[0]) if agree is not None else times[0]
        wanted = math.ceil(min_seconds / max(first, 1e-6))
        steps = max(steps, min(wanted, MAX_TIMED_STEPS))
    times += [one_step() for _ in range(steps - 1)]
    (optimizer or module).zero_grad(set_to_none=True)
    return statistics.median(times)


def _adam(module: nn.Module) -> torch.optim.Optimizer | None:
    """The Adam a timed step runs: the module's own sharded one when its plan shards the
    optimizer state; ``None`` when this module (a pipeline stage of activations only, such
    as a lone ReLU) has no trainable parameter, where the step has nothing to update."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return None
    make_optimizer = getattr(module, "make_optimizer", None)
    if getattr(getattr(module, "plan", None), "optimizer_sharding", False) \
            and callable(make_optimizer):
        return make_optimizer(torch.optim.Adam, lr=1e-6)  # ZeRO-1: its own
    return torch.optim.Adam(params, lr=1e-6)


@dataclass(frozen=True)
class Trial:
    """One candidate's timing.

    Attributes:
        index: the candidate's position in the records.
        measured: its step time in seconds, the median of its rounds' medians (``None``: it
            could not run).
        error: why it could not run.
        rounds: how many rounds timed it.
    """

    index: int
    measured: float | None
    error: str = ""
    rounds: int = 1


def run_trials(records: Sequence[dict[str, Any]], count: int,
               measure: Callable[[dict[str, Any]], float], *,
               rounds: int = ROUNDS, settle: int = 0, confirm: int = 0,
               refine: int = 0) -> list[Trial]:
    """Time ``count`` candidates with ``measure(record)``: those :func:`tuned_order` picks.

    ``settle`` untimed trials of the first of them come before the rounds (their times are
    discarded; :data:`SETTLE_TRIALS` across processes). After the rounds, where the
    measured fastest would overrule the best-ranked candidate that ran
    (:func:`tuned_records`), both are timed ``confirm`` more times, alternating which goes
    first (:data:`CONFIRM_TRIALS` in ``partition`` and ``partition_distributed``), and the
    two are then measured by those head-to-head trials alone.

    The first two rounds time every candidate, in rank order and then in the reverse order
    (a machine whose speed drifts over the seconds tuning takes favours none of them); each
    further round times again, in rank order, the candidates within
    :data:`RETIME_WITHIN` of the fastest so far. A candidate's measured time is the median
    of its rounds: one round that met a slow moment of the machine (they read a plan up to
    1.5x apart on the 2-core VM) does not decide, as it did when only the candidates close
    after the first round were timed again.

    Then, ``refine`` times over, the next variant of the mesh measured fastest
    (:func:`refinement`) is timed :data:`REFINE_TRIALS` times head to head with it, and
    joins the candidates timed.

    A candidate that fails to build or run is skipped with its error (the first line of
    it): tuning never loses the plan.
    """
    order = tuned_order(records, count)
    samples: dict[int, list[float]] = {}
    errors: dict[int, str] = {}

    def attempt(i: int) -> None:
        try:
            samples.setdefault(i, []).append(measure(records[i]))
        except Exception as error:  # any failure skips the candidate, never the plan
            text = str(error).strip().splitlines()
            errors[i] = f"{type(error).__name__}: {text[0] if text else ''}"[:300]

    for _ in range(settle if order else 0):
        attempt(order[0])
        samples.pop(order[0], None)
    for i in order:
        if i not in errors:
            attempt(i)
    for k in range(1, rounds):
        ok = [i for i in order if i not in errors]
        timed = contenders({i: statistics.median(samples[i]) for i in ok}) if k > 1 else ok
        if len(timed) < 2:
            break
        for i in sorted(timed, key=order.index, reverse=k % 2 == 1):
            attempt(i)
    for _ in range(refine):
        ok = [i for i in order if i not in errors]
        medians = {i: statistics.median(samples[i]) for i in ok}
        extra = refinement(records, order, medians)
        if extra is None:
            break
        lead = min(ok, key=lambda i: (medians[i], _rank(records, i)))
        order.append(extra)
        for k in range(REFINE_TRIALS):
            for i in (extra, lead) if k % 2 == 0 else (lead, extra):
                if i not in errors:
                    attempt(i)
    ok = [i for i in order if i not in errors]
    decisive: dict[int, list[float]] = {}
    if confirm and len(ok) >= 2:
        first = min(ok, key=lambda i: _rank(records, i))
        kept = _kept(records, {i: statistics.median(samples[i]) for i in ok})
        if kept != first:
            before = {i: len(samples[i]) for i in (first, kept)}
            for k in range(confirm):
                for i in (first, kept) if k % 2 == 0 else (kept, first):
                    if i not in errors:
                        attempt(i)
            # The two are measured by their head-to-head trials alone: a slow moment over
            # the rounds before would otherwise still weigh in the median.
            decisive = {i: samples[i][before[i]:] for i in (first, kept)}
    return [Trial(i, None, errors[i]) if i in errors else
            Trial(i, statistics.median(decisive.get(i) or samples[i]), rounds=len(samples[i]))
            for i in order]


def tuned_order(records: Sequence[dict[str, Any]], count: int) -> list[int]:
    """The positions of the ``count`` candidates tuning times, in rank order: the
    best-ranked candidate of each mesh (``dp x tp x pp``) first, then the best-ranked of
    the rest. The cost model's errors are largest between kinds of plan (replicas against
    a pipeline, measured 1.2 against 1.9 times their predictions on the 2-core VM), so the
    ``count`` best-ranked alone were often variants of one mesh (its schedules and
    checkpoint modes) and the fastest kind was never timed.

    Example:
        >>> def rec(rank, dp, pp, ckpt):
        ...     return {"rank": rank, "config": {"dp": dp, "tp": 1, "pp": pp, "checkpoint": ckpt}}
        >>> records = [rec(1, 2, 2, "never"), rec(2, 2, 2, "always"), rec(3, 1, 4, "never")]
        >>> tuned_order(records, 2), tuned_order(records, 3)
        ([0, 2], [0, 1, 2])
    """
    ranked = sorted(range(len(records)), key=lambda i: records[i].get("rank", i + 1))
    picked: list[int] = []
    meshes: set[Any] = set()
    for i in ranked:
        mesh = _mesh(records, i) or i
        if mesh not in meshes:
            meshes.add(mesh)
            picked.append(i)
    picked = picked[:count]
    picked += [i for i in ranked if i not in picked][:count - len(picked)]
    return sorted(picked, key=ranked.index)


def _mesh(records: Sequence[dict[str, Any]], i: int) -> tuple[int, ...] | None:
    config = records[i].get("config")
    return tuple(config.get(k, 1) for k in ("dp", "tp", "pp")) if config else None


def refinement(records: Sequence[dict[str, Any]], timed: Sequence[int],
               measured: dict[int, float], within: float = REFINE_WITHIN) -> int | None:
    """The candidate to time next: the best-ranked one not in ``timed`` of the mesh whose
    candidate ``measured`` fastest, if the cost model predicted it (``step_time``) within
    ``within`` of that one; ``None`` when there is none.

    Example:
        >>> def rec(rank, pp, schedule, step):
        ...     return {"rank": rank, "step_time": step,
        ...             "config": {"dp": 1, "tp": 1, "pp": pp, "schedule": schedule}}
        >>> records = [rec(1, 2, "zero_bubble", 1.00), rec(2, 4, "1f1b", 1.01),
        ...            rec(3, 2, "1f1b", 1.05), rec(4, 4, "gpipe", 1.30)]
        >>> refinement(records, [0, 1], {0: 0.9, 1: 1.2})  # pp=2's 1f1b: predicted +5%
        2
        >>> refinement(records, [0, 1], {0: 1.3, 1: 1.2})  # pp=4's next: predicted +29%
    """
    if not measured:
        return None
    lead = min(measured, key=lambda i: (measured[i], _rank(records, i)))
    mesh, limit = _mesh(records, lead), records[lead].get("step_time")
    if mesh is None or limit is None:
        return None
    for i in sorted(range(len(records)), key=lambda i: _rank(records, i)):
        if i in timed or _mesh(records, i) != mesh:
            continue
        predicted = records[i].get("step_time")
        return i if predicted is not None and predicted <= limit * (1 + within) else None
    return None


def contenders(measured: dict[int, float], within: float = RETIME_WITHIN) -> list[int]:
    """The candidates measured within ``within`` (a share) of the fastest.

    Example:
        >>> contenders({0: 1.0, 1: 1.2, 2: 1.5}), contenders({0: 1.0, 1: 1.2}, within=0.03)
        ([0, 1], [0])
    """
    if not measured:
        return []
    best = min(measured.values())
    return [i for i, t in measured.items() if t <= best * (1 + within)]


def tuned_records(records: Sequence[dict[str, Any]], trials: Sequence[Trial]
                  ) -> tuple[dict[str, Any], ...]:
    """The records with each trial's measured time (or error), the measured fastest chosen
    (the predicted best stays chosen when no candidate ran).

    Candidates measured within :data:`KEEP_WITHIN` of the fastest are a tie the timing
    cannot break (one plan's steps measure 10-30% apart from one run to the next on the
    2-core VM): of those the best-ranked is chosen, so tuning costs at most that share
    where the measurement is not decisive and overrules the cost model where it is.

    Example:
        >>> records = [{"label": "a", "rank": 1}, {"label": "b", "rank": 2}]
        >>> [r["chosen"] for r in tuned_records(records, [Trial(0, 1.00), Trial(1, 0.98)])]
        [True, False]
        >>> [r["chosen"] for r in tuned_records(records, [Trial(0, 1.00), Trial(1, 0.90)])]
        [False, True]
    """
    out = [dict(r) for r in records]
    for trial in trials:
        out[trial.index]["measured_step_time"] = trial.measured
        if trial.measured is not None:
            out[trial.index]["measured_rounds"] = trial.rounds
        if trial.error:
            out[trial.index]["tune_error"] = trial.error
    measured = {t.index: t.measured for t in trials if t.measured is not None}
    if measured:
        best = _kept(records, measured)
        for i, r in enumerate(out):
            r["chosen"] = i == best
    return tuple(out)


TUNING_KEYS = ("rank", "chosen", "measured_step_time", "measured_rounds", "tune_error")
"""What tuning writes into a candidate's record (:func:`tuned_records`)."""


def chosen_first(tuned: Sequence[dict[str, Any]], own: dict[str, Any]
                 ) -> tuple[dict[str, Any], ...]:
    """``tuned`` records as a plan keeps them: the chosen one first, holding ``own`` (the
    record of the plan that runs, built for that candidate: its prediction, stage costs and
    cluster) with the rank and measurements tuning gave it (and ``ranked_step_time``, the
    step time the search ranked it by, where the plan built for it predicts another); the
    search's summary stays on the first record and the other records keep no stage costs.

    A plan's first candidate is the one its step is simulated from, explained and drawn
    (``Plan.candidates``); when tuning chose another, that must be the plan that runs.

    Example:
        >>> tuned = [{"label": "a", "rank": 1, "chosen": False, "stages": [1], "search": {}},
        ...          {"label": "b", "rank": 2, "chosen": True, "measured_step_time": 0.2}]
        >>> own = {"label": "b", "rank": 1, "step_time": 0.3, "stages": [2], "search": {"n": 1}}
        >>> [(r["label"], r["rank"], r.get("stages"), r.get("search")) for r in
        ...  chosen_first(tuned, own)]
        [('b', 2, [2], {}), ('a', 1, None, None)]
    """
    index = next((i for i, r in enumerate(tuned) if r.get("chosen")), 0)
    if index == 0:
        return tuple(tuned)
    return built_first(tuned, index, own, TUNING_KEYS)


def _rank(records: Sequence[dict[str, Any]], i: int) -> tuple[int, int]:
    return records[i].get("rank", i + 1), i


def _kept(records: Sequence[dict[str, Any]], measured: dict[int, float]) -> int:
    """The candidate tuning keeps: the best-ranked of those measured within
    :data:`KEEP_WITHIN` of the fastest."""
    return min(contenders(measured, within=KEEP_WITHIN), key=lambda i: _rank(records, i))


def snapshot_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s parameters and buffers (those not on the meta device), which
    :func:`restore_state` puts back after tuning trained candidates on them.

    Raises:
        TuneError: a live tensor-parallel module of ``model`` guards its weights (it
            refuses optimizers over them and any write to them).
    """
    owner = guarding(model.parameters())
    if owner is not None:
        raise TuneError(f"tune=True trains this model's own weights to time the candidates, "
                        f"but a live {owner} partitioned from it guards them (it refuses "
                        f"optimizers over them and writes to them); close() that {owner} "
                        "first, or pass tune=False")
    return {name: t.detach().clone() for name, t in
            [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
            if t.device.type != "meta"}


@torch.no_grad()
def restore_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`snapshot_state` copied and clear the gradients."""
    tensors = dict([*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)])
    for name, saved in state.items():
        tensors[name].copy_(saved)
    for p in model.parameters():
        p.grad = None
