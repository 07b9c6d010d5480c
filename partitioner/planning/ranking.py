"""The search's kept candidates through the one predictor, within the planning budget:
:func:`rank_within`.

The search (:func:`partitioner.planning.auto.search`) ranks its candidates by closed forms,
then passes the ones it keeps through :func:`partitioner.planning.simulate.predict_step`, the
simulation of each plan's own action lists, so that the step time a plan shows is the one it
was ranked by. The simulation costs about ``P x v x m`` (x3 for a split backward) actions of
some tens of microseconds each: a 32-stage plan of 256 micro-batches and 4 chunks takes 2 s
of one core, and ten such candidates would be 20 s. So under a budget:

- the search stops early enough to simulate its best candidate: :class:`SimulationClock`
  estimates a simulation's seconds from its action count and the seconds per action the
  simulations of this process took (a first guess until one ran);
- the best candidate is always simulated; each next one only if its estimate still fits the
  budget. Candidates left out are dropped, not shown with another predictor's times.

Example:
    >>> from partitioner.cost.devices import Cluster
    >>> from partitioner.planning.predict import Config, predict
    >>> from partitioner.cost.transformer_model import GPTShape, gpt_workload
    >>> cluster = Cluster.preset("A100-80GB")
    >>> w = gpt_workload(GPTShape(4, 256, 4, 128, 1000), 16)
    >>> kept = [predict(w, cluster, Config(dp=4, pp=2, chunks=m)) for m in (4, 2)]
    >>> ranked = rank_within(kept, cluster, deadline=None)
    >>> [p.simulated for p in ranked], ranked[0].step_time <= ranked[1].step_time
    ([True, True], True)
    >>> len(rank_within(kept, cluster, deadline=0.0))  # no time left: the best one only
    1
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from partitioner.cost.devices import Cluster
from partitioner.planning.predict import Config, Prediction
from partitioner.planning.simulate import predict_step
from partitioner.runtime.schedule_registry import nothing_hidden, schedule_kind

__all__ = ["SimulationClock", "CLOCK", "actions", "rank_within"]


def actions(config: Config) -> int:
    """The compute actions one replica's simulation replays: forward and backward (and the
    weight half of a split backward) per micro-batch and virtual stage."""
    split = schedule_kind(config.schedule).hidden is not nothing_hidden
    return config.pp * config.virtual * config.chunks * (3 if split else 2)


class SimulationClock:
    """Seconds a simulation takes here, from the ones this process ran.

    Args:
        rate: the first guess, seconds per action (measured on this 2-core VM: 34 us of
            CPU per action for a 65,536-action plan).
    """

    def __init__(self, rate: float = 35e-6) -> None:
        self.rate = rate

    def estimate(self, config: Config) -> float:
        """The expected seconds to simulate ``config``."""
        return actions(config) * self.rate

    def record(self, config: Config, seconds: float) -> None:
        """One simulation's seconds: the rate follows the latest large ones (small plans
        are dominated by setup and would understate the rate)."""
        count = actions(config)
        if count >= 1000:
            self.rate = 0.5 * self.rate + 0.5 * seconds / count


CLOCK = SimulationClock()
"""The process's clock (simulations are single-threaded Python: the rate is the process's)."""


def rank_within(kept: Sequence[Prediction], cluster: Cluster, deadline: float | None,
                key: Callable[[Prediction], Any] = lambda p: p.step_time,
                clock: SimulationClock = CLOCK) -> tuple[Prediction, ...]:
    """``kept`` (fastest first by the closed forms) through :func:`predict_step`, fastest
    first (``key`` breaks ties): all of them without a ``deadline`` (a
    ``time.perf_counter()`` value), else the first and each next one whose estimated
    simulation still ends before it."""
    out = []
    for k, prediction in enumerate(kept):
        if k and deadline is not None \
                and time.perf_counter() + clock.estimate(prediction.config) > deadline:
            continue
        start = time.perf_counter()
        simulated = predict_step(prediction, cluster)
        if not prediction.simulated:
            clock.record(prediction.config, time.perf_counter() - start)
        out.append(simulated)
    return tuple(sorted(out, key=lambda p: (p.step_time, key(p))))
