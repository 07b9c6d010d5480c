"""Declarative tensor-parallel rules, and the per-parameter shard spec they resolve to.

Rules are glob patterns over layer (module) names, each with a kind; the first matching rule
wins, and layers no rule names get the automatic choice (``passes/tensor_parallel/match.py``)::

    tensor_parallel={"blocks.*.mlp.fc1": "colwise",
                     "blocks.*.mlp.fc2": "rowwise",
                     "head": "replicate"}

=============  ==========================================================================
kind           meaning
=============  ==========================================================================
``colwise``    split a Linear's output features (an Embedding's embedding dimension)
``rowwise``    split a Linear's input features; its output is summed over ranks
``vocab``      split an Embedding's rows (``rowwise`` on an Embedding means the same)
``heads``      split an ``nn.MultiheadAttention`` by heads (q, k, v rows of each rank's
               heads, ``out_proj`` row-parallel: one all-reduce)
``replicate``  keep the layer whole on every rank
=============  ==========================================================================

A layer is named by the module that runs it (``transformer.h.0.mlp.c_fc``); the flattened
spelling of ``flatten_sequential`` (``0_1`` for ``0.1``) matches too.

:func:`resolve_shardings` applies the rules and the automatic choice to a captured model and
returns a :class:`ShardPlan`: the sharding of every parameter under the model's own names,
as ``{name: {"kind", "dim", "tp"}}`` (plus ``"blocks"`` for fused projections).

Example:
    >>> import torch
    >>> from partitioner.passes.shape_prop import propagate_shapes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> gm = torch.fx.symbolic_trace(model)
    >>> _ = propagate_shapes(gm, (torch.randn(3, 4),))
    >>> plan = resolve_shardings(gm, model, 2, TensorParallelRules.parse({"2": "replicate"}))
    >>> plan.spec()["0.weight"], plan.spec()["2.weight"]
    ({'kind': 'colwise', 'dim': 0, 'tp': 2}, {'kind': 'replicate', 'dim': None, 'tp': 2})
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch.fx as fx
from torch import nn

from partitioner.errors import TensorParallelRuleError
from partitioner.passes.tensor_parallel.match import SITE_KINDS, SITE_WHAT
from partitioner.passes.tensor_parallel.shard_graph import TensorParallelChoice, choose_shardings
from partitioner.passes.tensor_parallel.sites import Site, attr_tensor, find_sites
from partitioner.runtime.tensor_parallel.sharding import HEADS, REPLICATE, SPLIT_KINDS, Sharding

__all__ = ["TensorParallelRules", "TensorParallelRuleError", "ShardPlan", "resolve_shardings",
           "RULE_KINDS"]

#: The kinds a rule may give.
RULE_KINDS = (*SPLIT_KINDS, HEADS, REPLICATE)


@dataclass(frozen=True)
class TensorParallelRules:
    """Glob pattern -> kind, in order (the first match wins).

    Attributes:
        rules: ``(pattern, kind)`` pairs.
    """

    rules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        problems = []
        for pattern, kind in self.rules:
            if not isinstance(pattern, str) or not pattern:
                problems.append(f"pattern {pattern!r}: give a module-name glob such as "
                                "'blocks.*.mlp.fc1'")
            if kind not in RULE_KINDS:
                problems.append(f"{pattern!r}: kind {kind!r}; use one of {', '.join(RULE_KINDS)}")
        if problems:
            raise TensorParallelRuleError("invalid tensor_parallel rules:\n  "
                                          + "\n  ".join(problems))

    @classmethod
    def parse(cls, value: Mapping[str, str] | None) -> TensorParallelRules:
        """Rules from a mapping (``None``: no rules).

        Raises:
            TensorParallelRuleError: naming every malformed entry.
        """
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise TensorParallelRuleError(
                f"tensor_parallel rules must map module globs to kinds, got "
                f"{type(value).__name__}; pass e.g. {{'blocks.*.mlp.fc1': 'colwise'}}")
        return cls(tuple((pattern, kind) for pattern, kind in value.items()))

    def match(self, name: str) -> tuple[str, str] | None:
        """The first ``(pattern, kind)`` naming layer ``name``, if any."""
        for pattern, kind in self.rules:
            if any(fnmatchcase(spelling, pattern) for spelling in (name, name.replace(".", "_"))):
                return pattern, kind
        return None

    def to_dict(self) -> dict[str, str]:
        return dict(self.rules)


@dataclass(frozen=True)
class ShardPlan:
    """How every parameter of a model is split over the tensor-parallel ranks.

    Attributes:
        tp: the degree.
        shardings: by the model's parameter names (every alias of a tied weight), every
            parameter; unsplit ones are ``replicate``.
        layers: by layer name, the kind it runs as.
        pairs: Megatron regions found, ``(column layers, row layers)``.
        forward_collectives: collectives one forward runs (``{"all_reduce": n, ...}``).
        choice: the pass's result, by graph attribute (what the rewrite needs).
        rules: the rules it was resolved from.
    """

    tp: int
    shardings: dict[str, Sharding]
    layers: dict[str, str]
    pairs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    forward_collectives: dict[str, int] = field(default_factory=dict)
    choice: TensorParallelChoice | None = field(default=None, repr=False, compare=False)
    rules: TensorParallelRules = field(default_factory=TensorParallelRules)

    def spec(self) -> dict[str, dict[str, Any]]:
        """``{parameter: {"kind", "dim", "tp"}}`` (``"blocks"`` too for fused parts)."""
        return {name: s.to_dict() for name, s in self.shardings.items()}

    def split(self) -> dict[str, Sharding]:
        """Only the parameters that are actually split."""
        return {name: s for name, s in self.shardings.items() if s.is_split}

    def notes(self) -> tuple[str, ...]:
        """One line per decision, for a plan's notes."""
        lines = [f"tensor parallel tp={self.tp}: {len(self.split())} of "
                 f"{len(self.shardings)} parameters split; forward collectives "
                 f"{self.forward_collectives or 'none'}"]
        for cols, rows in self.pairs:
            lines.append(f"megatron pair: {', '.join(cols)} colwise -> {', '.join(rows)} "
                         "rowwise")
        paired = {n for cols, rows in self.pairs for n in (*cols, *rows)}
        for name, kind in self.layers.items():
            if name not in paired and kind != "replicate":
                lines.append(f"{name}: {kind}")
        return tuple(lines)


def resolve_shardings(gm: fx.GraphModule, model: nn.Module, tp: int,
                      rules: TensorParallelRules | None = None) -> ShardPlan:
    """Apply ``rules`` and the automatic choice to ``model`` captured as ``gm``.

    Args:
        gm: the captured graph with shapes (``partitioner.passes.shape_prop``).
        model: the user's model (names layers and parameters).
        tp: the tensor-parallel degree.
        rules: overrides of the automatic choice.

    Returns:
        A :class:`ShardPlan`.

    Raises:
        TensorParallelRuleError: a pattern naming no layer, or a kind a layer cannot take
            (every problem at once).
        ShardSizeError: layers whose split dimension does not divide by ``tp``.
    """
    rules = rules or TensorParallelRules()
    sites = find_sites(gm, model)
    fixed = _fixed_kinds(rules, sites)
    choice = choose_shardings(gm, tp, root=model, fixed=fixed, sites=sites)
    names = _model_names(model)
    shardings: dict[str, Sharding] = {name: Sharding("replicate", None, tp)
                                      for name, _ in model.named_parameters(
                                          remove_duplicate=False)}
    for attr, sharding in choice.shardings.items():
        for name in names.get(id(attr_tensor(gm, attr)), []):
            if name in shardings:
                shardings[name] = sharding
    return ShardPlan(tp, shardings, dict(choice.kinds), choice.pairs,
                     choice.forward_collectives, choice, rules)


def _fixed_kinds(rules: TensorParallelRules, sites: list[Site]) -> dict[str, str]:
    fixed: dict[str, str] = {}
    used: set[str] = set()
    problems = []
    for site in sites:
        found = rules.match(site.name)
        if found is None:
            continue
        pattern, kind = found
        used.add(pattern)
        if kind not in SITE_KINDS[site.op]:
            problems.append(f"{pattern!r}: {site.name} is {SITE_WHAT[site.op]}, which cannot "
                            f"be split {kind!r}; use one of {', '.join(SITE_KINDS[site.op])}")
            continue
        fixed[site.node] = "vocab" if site.op == "embedding" and kind == "rowwise" else kind
    layer_names = list(dict.fromkeys(s.name for s in sites))
    for pattern, _ in rules.rules:
        if pattern not in used:
            near = difflib.get_close_matches(pattern, layer_names, n=3, cutoff=0.5)
            problems.append(f"{pattern!r} names no Linear, Embedding or attention layer; "
                            + (f"did you mean {', '.join(near)}? " if near else "")
                            + f"the layers are {_summary(layer_names)}")
    if problems:
        raise TensorParallelRuleError("tensor_parallel rules do not fit the model:\n  "
                                      + "\n  ".join(problems))
    return fixed


def _summary(names: list[str], limit: int = 10) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit // 2]) + ", ..., " + ", ".join(names[-limit // 2:])


def _model_names(model: nn.Module) -> dict[int, list[str]]:
    """Every state-dict name of every tensor of ``model`` (tied tensors have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return names
