"""Each layer's forward and backward, timed in training passes of the whole model.

``calibrate=True`` scales every layer's predicted cost to this machine. Timing a layer on its
own (its stage graph, a backward of its own) charged it a whole autograd run and a cold start
it never pays in training: a deep MLP of 64-wide layers measured 3.4x its training step that
way, while its real layers ran 1.6x the uncalibrated prediction (``docs/benchmarks.md``,
"The model timed before planning"). Here the captured graph runs whole, forward and backward, as one
training step; a copy of it carries a clock:

* before each layer's first node a stamp of the time (the forward of layer ``k`` is the time
  from its stamp to the next one's);
* on each value a layer hands to a later one (or to the output), a gradient hook: the last
  of them to fire is when the backward reaches the layer, and the backward of layer ``k``
  lasts until the backward reaches the next layer below it that has one.

The stamps and hooks are not free (about 40 us a layer in all: most of a 64-wide layer's
time), so :func:`time_layers` scales the layers' times to plain passes of the graph, timed
alternately with the instrumented ones. The copy shares the graph's parameters; gradients
it leaves are the caller's to clear (:func:`partitioner.cost.measure.calibrate` restores
them).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from partitioner.analysis import analyze
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> a = analyze(model, (torch.randn(4, 8),))
    >>> timed = time_layers(a.captured.graph_module, a.layers, a.inputs, repeats=1,
    ...                     optimizer=True)
    >>> len(timed.layers) == len(a.layers) and all(f > 0 and b >= 0 for f, b in timed.layers)
    True
    >>> timed.optimizer > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner.passes.group_layers import Layer

__all__ = ["time_layers", "Timed"]


class _Clock:
    """What one training pass of the instrumented graph recorded."""

    def __init__(self, n_layers: int) -> None:
        self.starts = [0.0] * (n_layers + 1)
        self.reached: list[float | None] = [None] * n_layers

    def stamp(self, k: int) -> None:
        self.starts[k] = time.perf_counter()

    def watch(self, k: int, value: Any) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, k=k: self._reached(k))

    def _reached(self, k: int) -> None:
        now = time.perf_counter()
        seen = self.reached[k]
        self.reached[k] = now if seen is None else max(seen, now)

    def phases(self, end: float) -> list[tuple[float, float]]:
        """Per layer (forward, backward) seconds, ``end`` being when the backward returned."""
        forward = [b - a for a, b in zip(self.starts, self.starts[1:])]
        backward = [0.0] * len(self.reached)
        # The backward of layer k ends where it reaches the nearest layer below with one.
        below = end
        for k, seen in enumerate(self.reached):
            if seen is not None:
                backward[k], below = max(below - seen, 0.0), seen
        return list(zip(forward, backward))


#: The clock of the pass running now (graph code can hold no object; one pass at a time).
_RUNNING: list[_Clock] = []


def _stamp(k: int) -> None:
    _RUNNING[-1].stamp(k)


def _watch(k: int, value: Any) -> None:
    _RUNNING[-1].watch(k, value)


def instrumented(gm: fx.GraphModule, layers: Sequence[Layer]) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters) that stamps the time before each layer
    and hooks the gradients of the values each layer hands on, for the running clock."""
    first = {layer.nodes[0]: k for k, layer in enumerate(layers)}
    layer_of = {name: k for k, layer in enumerate(layers) for name in layer.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            graph.call_function(_stamp, (len(layers),))
            graph.output(pytree.tree_map(
                lambda v: env[v] if isinstance(v, fx.Node) else v, node.args[0]))
            continue
        if node.name in first:
            graph.call_function(_stamp, (first[node.name],))
        env[node] = graph.node_copy(node, lambda n: env[n])
        k = layer_of.get(node.name)
        if k is not None and any(layer_of.get(u.name) != k for u in node.users):
            graph.call_function(_watch, (k, env[node]))
    return fx.GraphModule(gm, graph)


def _loss(out: Any) -> torch.Tensor | None:
    tensors = [t for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not tensors:
        return None
    return sum((t.float().mean() for t in tensors), torch.zeros(()))


def _pass(module: fx.GraphModule, inputs: Sequence[Any], params: Sequence[torch.Tensor]
          ) -> tuple[float, float, float]:
    """One training pass: the times it started, its forward ended and its backward ended."""
    for p in params:
        p.grad = None
    with torch.enable_grad():
        begin = time.perf_counter()
        loss = _loss(module(*inputs))
        middle = time.perf_counter()
        if loss is not None:
            loss.backward()
        return begin, middle, time.perf_counter()


@dataclass(frozen=True)
class Timed:
    """What :func:`time_layers` measured.

    Attributes:
        layers: per layer, its (forward, backward) seconds in context.
        optimizer: seconds of a ``torch.optim.Adam`` step over every trainable parameter,
            right after a backward made their gradients (``None`` when not asked for).
        passes: the timed passes (of each kind: instrumented and plain).
    """

    layers: list[tuple[float, float]]
    optimizer: float | None = None
    passes: int = 0


def time_layers(gm: fx.GraphModule, layers: Sequence[Layer], inputs: Sequence[Any], *,
                repeats: int = 3, warmup: int = 2, optimizer: bool = False,
                min_seconds: float = 0.0, max_repeats: int = 64) -> Timed:
    """Per layer, the median (forward, backward) seconds over ``repeats`` training passes
    of the whole graph on ``inputs`` (one value per placeholder), after ``warmup`` passes;
    more passes (up to ``max_repeats``) until the timed ones last ``min_seconds``: on a
    shared VM a burst of slowness spans a few 10 ms passes, and the median of three of them
    read a small model's step 1.4x apart from one plan to the next.

    Each pass clears the parameters' gradients first (``set_to_none``, as training does
    with ``zero_grad``), so the weight gradients are new tensors each time. A layer with no
    gradient to compute (its outputs need none) has a backward of 0. The instrumented
    passes alternate with passes of ``gm`` itself, whose forward and backward totals the
    layers' times are scaled to: the clock's own cost (tens of microseconds a layer, most of
    a 64-wide layer's) is nobody's. With ``optimizer=True`` each plain pass is followed by
    an Adam step over stand-ins of the parameters (copies given the pass's gradients; the
    state, two tensors the size of each parameter, lives for the timing only): the same
    work as stepping the model's own, which are never written (a live tensor-parallel
    wrapper of the model refuses optimizers over them and watches them for writes,
    ``partitioner.runtime.originals``).
    """
    timed = instrumented(gm, layers)
    params = [p for p in gm.parameters() if p.requires_grad]
    stand_ins = [p.detach().clone() for p in params] if optimizer else []
    adam = torch.optim.Adam(stand_ins, lr=0.0) if stand_ins else None
    runs: list[list[tuple[float, float]]] = []
    plain: list[tuple[float, float]] = []
    steps: list[float] = []
    i, spent = 0, 0.0
    while i < warmup + repeats or (spent < min_seconds and i < warmup + max_repeats):
        clock = _Clock(len(layers))
        _RUNNING.append(clock)
        try:
            start, _, end = _pass(timed, inputs, params)
        finally:
            _RUNNING.pop()
        begin, middle, finish = _pass(gm, inputs, params)
        if adam is not None:
            for stand_in, param in zip(stand_ins, params):
                stand_in.grad = param.grad
            stepping = time.perf_counter()
            adam.step()
            steps.append(time.perf_counter() - stepping)
        if i >= warmup:
            runs.append(clock.phases(end))
            plain.append((middle - begin, finish - middle))
            spent += (end - start) + (finish - begin)
        i += 1
    out = [(statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs))
           for k in range(len(layers))]
    scales = [statistics.median(p[j] for p in plain) / max(sum(o[j] for o in out), 1e-12)
              for j in (0, 1)]
    return Timed([(f * scales[0], b * scales[1]) for f, b in out],
                 statistics.median(steps[warmup:]) if steps[warmup:] else None, len(plain))
