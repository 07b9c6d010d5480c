"""What each subcommand of ``partitioner`` does, once its arguments are parsed.

Each ``*_command`` takes the parsed arguments and returns the exit code; user mistakes raise
:class:`~partitioner.errors.CommandError` (or another ``PartitionError``), which
``partitioner.cli.main`` prints as one line. Files are written through :func:`writing`, so an
unwritable path is such a mistake too, not a traceback.

Example:
    >>> from partitioner.runtime.schedule import Action
    >>> from partitioner.viz.timeline import Timeline
    >>> ascii_timeline(Timeline.of([(Action.parse("0F0"), 0.0, 1.0)]), width=4)
    '  stage 0  |FFFF|'
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.cli.calibrate import calibrate_command
from partitioner.cli.models import BUNDLED, load_model
from partitioner.cli.progress import Progress
from partitioner.errors import CommandError, PlanFormatError

if TYPE_CHECKING:
    from partitioner.viz.timeline import Timeline

__all__ = ["plan_command", "show_command", "viz_command", "simulate_command", "run_command",
           "calibrate_command", "quiet_torch_logs", "writing", "ascii_timeline", "parameter_facts"]

_PLAN_FILES = (".json", ".yaml", ".yml")


def quiet_torch_logs() -> None:
    """Keep torch's own error logs (a failed fake-tensor kernel logs its traceback before
    raising) off stderr: the command reports the error it raises, in one line. ``TORCH_LOGS``
    still turns them on."""
    import torch  # noqa: F401  (torch resets its loggers' levels when imported)

    if not os.environ.get("TORCH_LOGS"):
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


@contextmanager
def writing(path: str | Path) -> Iterator[Path]:
    """``path`` to write, its folder made if missing; an ``OSError`` becomes a
    :class:`CommandError` that names the path."""
    path = Path(path)
    blocked = next((folder for folder in path.parents if folder.is_file()), None)
    if blocked is not None:
        raise CommandError(f"cannot write {path}: {blocked} is a file, not a folder; pass a "
                           "path in a folder you can write to")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
    except OSError as error:
        # Plan.save's PlanWriteError is an OSError wrapping the system's.
        cause = error.__cause__ if isinstance(error.__cause__, OSError) else error
        raise CommandError(f"cannot write {path}: {cause.strerror or cause}; pass a path in "
                           "a folder you can write to") from error


# -- plan, show -----------------------------------------------------------------------------

def plan_command(args: argparse.Namespace) -> int:
    """``partitioner plan``: plan a model, print the table, write the plan file."""
    if args.list:
        for name, entry in BUNDLED.items():
            print(f"{name:10s} {entry.about}")
        return 0
    if not args.target:
        raise CommandError("name a model: a bundled one (partitioner plan --list) or "
                           "module:factory")
    plan, _, _ = _make_plan(args, args.target)
    with writing(args.out) as out:
        plan.save(out)
    print(plan.table())
    print(f"\nplan written to {args.out}")
    return 0


def _make_plan(args: argparse.Namespace, target: str) -> tuple[Any, Any, Any]:
    """Build the model and plan it, with a progress bar over the steps; returns the plan,
    the model and its example inputs."""
    from partitioner.cost.devices import parse_devices
    from partitioner.cost.machine import spec_for

    steps = Progress(["building the model", "calibrating devices",
                      "capturing, analysing and planning"])
    try:
        model, example = load_model(target, args.input)
        steps.advance()
        devices = _devices(args.devices)
        if devices is None and args.spec is None:
            raise CommandError("pass --devices (a list such as cpu,cpu or a count), or --spec")
        for device in parse_devices(devices if devices is not None else ["cpu"]):
            if device.type != "meta":
                spec_for(device)
        steps.advance()
        plan = _build_plan(args, model, example, devices)
        steps.advance()
    finally:
        steps.close()
    return plan, model, example


def _build_plan(args: argparse.Namespace, model: Any, example: Any, devices: Any) -> Any:
    """Plan ``model``; ``--spec`` may name a spec to compile or a saved plan to check."""
    from partitioner.api import make_plan
    from partitioner.apply import load_plan, resolve_plan
    from partitioner.plans.plan import Plan
    from partitioner.request import PlanRequest

    source = load_plan(args.spec) if args.spec else None
    if isinstance(source, Plan):
        return resolve_plan(model, source, PlanRequest(example_inputs=example))[1]
    return make_plan(model, devices, args.strategy, example_inputs=example, chunks=args.chunks,
                     checkpoint=args.checkpoint, balance=_ints(args.balance),
                     split_points=_names(args.split_points), memory_limit=args.memory_limit,
                     plan=source)


def show_command(args: argparse.Namespace) -> int:
    """``partitioner show``: a plan file as a table and facts, or its JSON."""
    from partitioner.plans.plan import Plan

    if Path(args.plan).suffix.lower() in (".yaml", ".yml"):
        raise CommandError(f"{args.plan} is a spec, not a plan; compile it for a model first: "
                           f"partitioner plan MODEL --spec {args.plan} -o plan.json")
    try:
        plan = Plan.load(args.plan)
    except PlanFormatError as error:
        if args.plan in str(error):
            raise
        raise CommandError(f"{args.plan} is not a plan file: {error}; write one with "
                           "partitioner plan") from error
    if args.json:
        print(plan.to_json(), end="")
        return 0
    print(plan.table())
    print()
    for line in _facts(plan):
        print(line)
    return 0


def _facts(plan: Any) -> list[str]:
    lines = []
    if plan.mesh is not None:
        lines.append(f"mesh: dp={plan.mesh.dp} pp={plan.mesh.pp} tp={plan.mesh.tp}")
    lines.append(f"tensor-parallel shard specs: {len(plan.shard_specs)}")
    if plan.planner is not None:
        p = plan.planner
        lines.append(f"planner: strategy={p.strategy}"
                     + (f", balance={list(p.balance)}" if p.balance else "")
                     + (f", split_points={list(p.split_points)}" if p.split_points else "")
                     + (f", costed on {', '.join(p.example_inputs)}" if p.example_inputs
                        else ""))
    if plan.fingerprint is not None:
        f = plan.fingerprint
        lines.append(f"model: {f.model}, {parameter_facts(f.parameters)}, {f.digest[:23]}...")
    lines += [f"note: {note}" for note in plan.notes]
    return lines


def parameter_facts(entries: Any) -> str:
    """``"1,234 parameters in 4 tensors"``: the elements of a fingerprint's parameter entries
    (tied ones counted once) and how many tensors hold them."""
    count = 0
    for entry in entries:
        elements = 1
        for size in entry.shape:
            elements *= size
        count += elements
    tensors = len(entries)
    return f"{count:,} parameters in {tensors} tensor{'s' if tensors != 1 else ''}"


# -- viz, simulate --------------------------------------------------------------------------

def viz_command(args: argparse.Namespace) -> int:
    """``partitioner viz``: draw a plan's graph, timeline and/or HTML report."""
    from partitioner.viz import check_output, write_graph, write_report, write_timeline
    from partitioner.viz.timeline import predicted_timeline

    if not (args.out or args.timeline or args.report):
        raise CommandError("say what to draw: -o graph.svg, --timeline t.png or --report r.html")
    if args.out and Path(args.out).suffix.lower() == ".html":
        args.report, args.out = args.out, None
    if args.measure and Path(args.target).suffix.lower() in _PLAN_FILES and not args.model:
        raise CommandError(f"--measure runs the model, and {args.target} is a file; pass "
                           "--model NAME (bundled or module:factory) with it")
    # Refuse a wrong suffix, or an image without Graphviz, before the slow planning.
    for given, kind in ((args.out, "graph"), (args.timeline, "timeline"),
                        (args.report, "report")):
        if given:
            check_output(given, kind)
    plan, analysis, built = _plan_and_analysis(args, need_analysis=True)
    timeline = _measure(args, plan, built) if args.measure else predicted_timeline(plan)
    if args.out:
        with writing(args.out) as out:
            write_graph(out, plan, analysis, args.detail)
        print(f"graph written to {args.out}")
    if args.timeline:
        with writing(args.timeline) as out:
            write_timeline(out, timeline, plan)
        print(f"timeline written to {args.timeline}")
    if args.report:
        with writing(args.report) as out:
            write_report(out, plan, analysis, timeline, args.detail)
        print(f"report written to {args.report}")
    return 0


def _measure(args: argparse.Namespace, plan: Any, built: Any | None) -> Any:
    """Apply ``plan`` to the model (``built``: the model and inputs the plan was made from,
    if any) and time two training steps (the second is drawn)."""
    import torch
    import torch.utils._pytree as pytree

    from partitioner.api import partition
    from partitioner.viz.measured import measured_timeline

    model_name = args.model or args.target
    model, example = built if built is not None else load_model(model_name, args.input)
    if example is None or any(p.is_meta for p in model.parameters()):
        raise CommandError(f"--measure needs a real model with example inputs; {model_name} "
                           "is on the meta device or has none (give --input)")
    pm = partition(model, None, plan=plan, example_inputs=example)
    try:
        for _ in range(2):
            out = pm(*example)
            leaves = [t for t in pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            sum(t.float().mean() for t in leaves).backward()  # type: ignore[union-attr]
        return measured_timeline(pm)
    finally:
        pm.close()


def _plan_and_analysis(args: argparse.Namespace, need_analysis: bool = False
                       ) -> tuple[Any, Any | None, Any | None]:
    """The plan (loaded, or made from a model) and, when a model is at hand,
    ``(model, example_inputs)`` and (if ``need_analysis``) its analysis."""
    from partitioner.analysis import analyze

    target = args.target
    if Path(target).suffix.lower() in _PLAN_FILES:
        model_name = getattr(args, "model", None)
        if model_name is None:
            from partitioner.apply import load_plan
            from partitioner.plans.plan import Plan
            given = load_plan(target)
            if not isinstance(given, Plan):
                raise CommandError(f"{target} is a spec; pass --model to compile it for a model")
            return given, None, None
        args.spec = target
        target = model_name
    elif Path(target).exists():
        raise CommandError(f"{target} is neither a plan or spec file (.json, .yaml) nor a "
                           f"model; name a bundled model ({', '.join(BUNDLED)}) or "
                           "module:factory")
    plan, model, example = _make_plan(args, target)
    analysis = analyze(model, example, need_costs=False) if need_analysis else None
    return plan, analysis, (model, example)


def simulate_command(args: argparse.Namespace) -> int:
    """``partitioner simulate``: the plan's step laid out in time, as text (and a picture)."""
    from partitioner.planning.simulate import simulate
    from partitioner.viz import check_output, write_timeline
    from partitioner.viz.timeline import (
        per_device,
        plan_placement,
        predicted_timeline,
        simulated_timeline,
    )

    cluster = _cluster(args.cluster)
    if args.out:
        check_output(args.out, "timeline")
    plan, _, _ = _plan_and_analysis(args)
    if plan.candidates:
        # The predictor the plan's own step time came from: on its cluster they agree.
        result = simulate(plan, cluster)
        timeline = per_device(simulated_timeline(result, len(plan.devices),
                                                 placement=plan_placement(plan)), plan)
        how = f"simulated on {args.cluster or 'the cluster it was planned for'}"
        step = f"  step {result.step_time * 1e3:.2f} ms, bubble {result.bubble:.0%}"
    else:
        timeline = predicted_timeline(plan)
        how = "clock ticks (the plan has no cost records to simulate)"
        step = f"  step {timeline.makespan:g} ticks, bubble {timeline.bubble:.0%}"
    print(plan.table())
    print(f"\n{how}:")
    print(step)
    print(ascii_timeline(timeline))
    if args.out:
        with writing(args.out) as out:
            write_timeline(out, timeline, plan)
        print(f"timeline written to {args.out}")
    return 0


def ascii_timeline(timeline: Timeline, width: int = 72) -> str:
    """One text row per stage (per device, ``dev``, when the timeline's rows are devices):
    ``F`` forward, ``B`` backward (either half of a split one), ``#`` other work (the
    gradient all-reduce, the optimizer step), ``.`` idle."""
    scale = width / timeline.makespan
    rows = []
    for j in timeline.stages:
        line = ["."] * width
        for b in (b for b in timeline.bars if b.stage == j):
            lo = round(b.start * scale)
            hi = max(round(b.end * scale), lo + 1)
            for k in range(lo, min(hi, width)):
                line[k] = "F" if b.phase == "F" else "B" if b.phase in "BIW" else "#"
        name = "dev" if timeline.row_names else "stage"
        rows.append(f"  {name} {j:<2d} |{''.join(line)}|")
    return "\n".join(rows)


# -- run ------------------------------------------------------------------------------------

def run_command(args: argparse.Namespace) -> int:
    """``partitioner run``: check the options, then hand the script to torchrun."""
    _check_run(args)
    command = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        command.append(f"--rdzv-endpoint={args.rdzv_endpoint}")
    command += [args.script, *args.script_args]
    print("+ " + " ".join(command), file=sys.stderr)
    return subprocess.call(command)


def _check_run(args: argparse.Namespace) -> None:
    """Refuse what torchrun would answer with a traceback (or a failure per process)."""
    if not args.script:
        raise CommandError("name the training script: partitioner run [options] train.py "
                           "[its arguments]")
    if not Path(args.script).is_file():
        raise CommandError(f"script {args.script!r} does not exist (or is not a file); pass "
                           "the path of a Python training script")
    nproc = args.nproc_per_node
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("auto", "cpu", "gpu", "xpu"):
        raise CommandError(f"--nproc-per-node {nproc!r}: pass a positive number of processes "
                           "per node, or auto, cpu, gpu or xpu")
    low, colon, high = args.nnodes.partition(":")
    counts = [low, high] if colon else [low]
    if not all(c.isdigit() and int(c) > 0 for c in counts) or int(counts[0]) > int(counts[-1]):
        raise CommandError(f"--nnodes {args.nnodes!r}: pass a positive number of nodes, or "
                           "MIN:MAX with 0 < MIN <= MAX (e.g. 2 or 1:4)")


# -- small parsers --------------------------------------------------------------------------

def _cluster(text: str | None) -> Any:
    """``--cluster PRESET[:NODES]`` as a Cluster (8 devices a node)."""
    if text is None:
        return None
    from partitioner.cost.device_names import preset_key
    from partitioner.cost.devices import DEVICES, Cluster

    name, _, nodes = text.partition(":")
    preset = preset_key(name)
    if preset is None or (nodes and not (nodes.isdigit() and int(nodes) > 0)):
        raise CommandError(f"--cluster {text!r}: pass PRESET[:NODES] with PRESET one of "
                           f"{sorted(DEVICES)} and NODES a positive number, e.g. "
                           "--cluster A100-80GB:2")
    return Cluster.preset(preset, nodes=int(nodes or 1))


def _devices(text: str | None) -> Any:
    if text is None:
        return None
    if text.isdigit():
        from partitioner.runtime import device as accelerators

        return ["cpu"] * int(text) if not accelerators.available() else int(text)
    return [d.strip() for d in text.split(",") if d.strip()]


def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",")]
    except ValueError as error:
        raise CommandError(f"--balance {text!r}: write integers such as 3,2,2") from error


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [v.strip() for v in text.split(",") if v.strip()]
