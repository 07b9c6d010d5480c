"""The ``partitioner`` command: plan a model, show a plan, draw it, simulate it, run a job.

::

    partitioner plan gpt --devices 4 --chunks 8 -o plan.json
    partitioner show plan.json
    partitioner viz plan.json --model gpt -o graph.svg --timeline timeline.png
    partitioner simulate plan.json
    partitioner run --nproc-per-node 2 train.py --steps 100

A model is a bundled example name (``partitioner plan --list``) or ``module:factory``, a
function returning a model, or ``(model, example_inputs)``; ``--input 64x32`` (``:int64``
for token ids) gives example inputs otherwise. Every command has ``--help`` with examples.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner.errors import CommandError, PartitionError

__all__ = ["main", "BUNDLED", "load_model"]


@dataclass(frozen=True)
class Bundled:
    """A bundled example: a factory in ``examples/models.py``, its arguments and an input."""

    factory: str
    kwargs: dict[str, Any]
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype = torch.float32
    meta: bool = False  # build on the meta device (too big to allocate)
    about: str = field(default="", compare=False)


BUNDLED = {
    "mlp": Bundled("mlp", {"widths": [64, 512, 512, 512, 512, 512, 10]}, (64, 64),
                   about="6 Linear layers with ReLUs, batch 64"),
    "resnet": Bundled("ResNetish", {}, (32, 3, 32, 32),
                      about="small ResNet (GroupNorm), 32x32 images, batch 32"),
    "gpt": Bundled("gpt", {"n_layer": 8, "n_embd": 128, "n_head": 4, "vocab": 1024, "seq": 64},
                   (16, 64), torch.int64, about="8-block nanoGPT, 128 wide, batch 16 x 64"),
    "gpt2-xl": Bundled("gpt", {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab": 50257,
                               "seq": 1024}, (8, 1024), torch.int64, meta=True,
                       about="GPT-2 XL shapes (1.5B parameters), on the meta device"),
}

_EXAMPLES = {
    "plan": """examples:
  partitioner plan gpt --devices 4 --chunks 8 -o plan.json
  partitioner plan gpt2-xl --devices 8 --chunks 8 -o xl.json     # 1.5B params, meta device
  partitioner plan mymodels:build --input 32x128 --devices cpu,cpu --balance 3,4
  partitioner plan gpt --devices 2 --spec spec.yaml -o plan.json  # a hand-written spec
  partitioner plan --list                                        # the bundled models""",
    "show": """examples:
  partitioner show plan.json
  partitioner show plan.json --json          # the file, validated and reformatted""",
    "viz": """examples:
  partitioner viz plan.json -o plan.svg                     # from the plan alone (layers)
  partitioner viz plan.json --model gpt -o graph.png        # the model's graph, by stage
  partitioner viz gpt --devices 4 -o graph.svg --timeline timeline.png
  partitioner viz plan.json --model gpt --report report.html  # table + graph + timeline
  partitioner viz gpt --devices 4 --chunks 8 --measure --timeline measured.png""",
    "simulate": """examples:
  partitioner simulate plan.json
  partitioner simulate gpt --devices 4 --chunks 8 -o timeline.svg
  partitioner simulate plan.json --cluster A100-80GB:2

The discrete-event simulator (partitioner.planning.simulate) replays the plan's schedule
with its recorded stage costs; --cluster PRESET[:NODES] (8 devices a node) decides which
devices share a host and the links between them. A plan without cost records (written by
hand, or made without example inputs) is drawn by clock ticks instead.""",
    "run": """examples:
  partitioner run --nproc-per-node 2 train.py --steps 100
  partitioner run --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host:29500 train.py

Everything after the script is passed to it; this only calls torch.distributed.run
(torchrun) with the options given.""",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except PartitionError as error:
        print(f"partitioner {args.command}: error: {error}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partitioner", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(_EXAMPLES[k] for k in ("plan", "viz")))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
        "plan": ("plan a model over devices and write the plan file", _cmd_plan),
        "show": ("print a plan file as a table", _cmd_show),
        "viz": ("draw a plan's graph, timeline or HTML report", _cmd_viz),
        "simulate": ("lay out a plan's pipeline schedule in time", _cmd_simulate),
        "run": ("launch a training script with torchrun", _cmd_run),
    }
    for name, (about, handler) in commands.items():
        p = sub.add_parser(name, help=about, description=about, epilog=_EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(handler=handler)
        if name in ("plan", "viz", "simulate"):
            _planning_options(p, positional=name == "plan")
    show = sub.choices["show"]
    show.add_argument("plan", help="a plan file (.json)")
    show.add_argument("--json", action="store_true", help="print the file's JSON instead")
    plan = sub.choices["plan"]
    plan.add_argument("-o", "--out", default="plan.json", help="plan file to write")
    plan.add_argument("--list", action="store_true", help="list the bundled models and exit")
    viz = sub.choices["viz"]
    viz.add_argument("-o", "--out", help="graph file: .dot, .svg, .png, .pdf or .html")
    viz.add_argument("--timeline", help="timeline file: .dot, .svg, .png or .pdf")
    viz.add_argument("--report", help="self-contained HTML report (table, graph, timeline)")
    viz.add_argument("--measure", action="store_true",
                     help="run two training steps of the model on its example inputs and "
                          "draw the measured timeline (default: predicted from the plan)")
    viz.add_argument("--detail", default="auto", choices=["auto", "nodes", "layers", "blocks"],
                     help="graph detail (auto: every node for small models, else layers)")
    simulate = sub.choices["simulate"]
    simulate.add_argument("--cluster", help="a preset cluster, PRESET[:NODES] (e.g. A100-80GB:2)")
    simulate.add_argument("-o", "--out", help="draw the timeline to this file")
    run = sub.choices["run"]
    run.add_argument("--nproc-per-node", default="1", help="processes per node")
    run.add_argument("--nnodes", default="1", help="nodes (or MIN:MAX)")
    run.add_argument("--rdzv-endpoint", help="rendezvous host:port for several nodes")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _planning_options(p: argparse.ArgumentParser, positional: bool) -> None:
    help_target = ("bundled model name or module:factory" if positional else
                   "a plan or spec file (.json/.yaml), or a model to plan")
    p.add_argument("target", nargs="?" if positional else None, help=help_target)
    if not positional:
        p.add_argument("--model", help="the model a plan file is for (to draw its graph)")
    p.add_argument("--devices", help="device list (cpu,cpu,cuda:0) or a count")
    p.add_argument("--strategy", default="auto", choices=["auto", "pipeline"])
    p.add_argument("--chunks", type=int, default=1, help="micro-batches per batch")
    p.add_argument("--checkpoint", default="except_last",
                   choices=["always", "except_last", "never"])
    p.add_argument("--balance", help="layers per stage, e.g. 3,2,2")
    p.add_argument("--split-points", help="module names that begin a stage, e.g. h.4,h.8")
    p.add_argument("--memory-limit", type=float, help="bytes per device")
    p.add_argument("--spec", help="a hand-written spec (.yaml/.json) to compile")
    p.add_argument("--input", action="append", default=[], metavar="SHAPE[:DTYPE]",
                   help="an example input, e.g. 64x32 or 8x1024:int64 (repeat for more)")


# -- models ---------------------------------------------------------------------------------

def load_model(name: str, inputs: Sequence[str] = ()) -> tuple[nn.Module, tuple[Any, ...] | None]:
    """Build a model from a bundled name or ``module:factory``, with example inputs.

    Raises:
        CommandError: an unknown name, a factory that cannot be imported, or bad ``inputs``.
    """
    given = tuple(_parse_input(text) for text in inputs) or None
    if name in BUNDLED:
        entry = BUNDLED[name]
        factory = getattr(_examples(), entry.factory)
        device = torch.device("meta" if entry.meta else "cpu")
        with device:
            model = factory(**entry.kwargs)
        example = _example(entry.input_shape, entry.input_dtype, device)
        return model, given or (example,)
    if ":" not in name:
        raise CommandError(f"model {name!r} is neither bundled ({', '.join(BUNDLED)}) nor "
                           "module:factory; e.g. mypackage.models:build")
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise CommandError(f"cannot load {name!r}: {error}; make the module importable "
                           "(run from its folder or pip install it)") from error
    made = factory()
    if isinstance(made, tuple):
        supplied = tuple(made[1]) if len(made) > 1 else None
        return made[0], given or supplied
    return made, given


def _examples() -> Any:
    path = Path(__file__).resolve().parents[1] / "examples" / "models.py"
    if not path.exists():
        raise CommandError(f"the bundled models live in {path}, which is missing (the package "
                           "was installed without its examples); clone the repository and "
                           "pip install -e ., or name a model as module:factory")
    spec = importlib.util.spec_from_file_location("partitioner_bundled_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _parse_input(text: str) -> torch.Tensor:
    shape_text, _, dtype_text = text.partition(":")
    try:
        shape = tuple(int(d) for d in shape_text.lower().split("x"))
        dtype = getattr(torch, dtype_text or "float32")
    except (ValueError, AttributeError) as error:
        raise CommandError(f"--input {text!r}: write a shape like 64x32, optionally :int64 "
                           f"({error})") from error
    if not isinstance(dtype, torch.dtype):
        raise CommandError(f"--input {text!r}: {dtype_text!r} is not a torch dtype")
    return _example(shape, dtype, torch.device("cpu"))


# -- commands -------------------------------------------------------------------------------

def _cmd_plan(args: argparse.Namespace) -> int:
    if args.list:
        for name, entry in BUNDLED.items():
            print(f"{name:10s} {entry.about}")
        return 0
    if not args.target:
        raise CommandError("name a model: a bundled one (partitioner plan --list) or "
                           "module:factory")
    plan = _make_plan(args, args.target)
    plan.save(_ready(args.out))
    print(plan.table())
    print(f"\nplan written to {args.out}")
    return 0


def _make_plan(args: argparse.Namespace, target: str) -> Any:
    """Build the model and plan it, with a progress bar over the steps."""
    from partitioner.cost.devices import parse_devices
    from partitioner.cost.machine import spec_for

    steps = _Progress(["building the model", "calibrating devices",
                       "capturing, analysing and planning"])
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
    steps.close()
    return plan


def _build_plan(args: argparse.Namespace, model: nn.Module, example: Any, devices: Any) -> Any:
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


def _cmd_show(args: argparse.Namespace) -> int:
    from partitioner.plans.plan import Plan
    plan = Plan.load(args.plan)
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
        lines.append(f"model: {f.model}, {len(f.parameters)} parameters, {f.digest[:23]}...")
    lines += [f"note: {note}" for note in plan.notes]
    return lines


def _cmd_viz(args: argparse.Namespace) -> int:
    from partitioner.viz import render, to_dot, visualize_timeline
    from partitioner.viz.graph import diagram
    from partitioner.viz.report import report_html
    from partitioner.viz.timeline import predicted_timeline

    if not (args.out or args.timeline or args.report):
        raise CommandError("say what to draw: -o graph.svg, --timeline t.png or --report r.html")
    plan, analysis = _plan_and_analysis(args)
    timeline = _measure(args, plan) if args.measure else predicted_timeline(plan)
    if args.out and Path(args.out).suffix.lower() == ".html":
        args.report, args.out = args.out, None
    for given in (args.out, args.timeline, args.report):
        if given:
            _ready(given)
    if args.out:
        out = Path(args.out)
        dot = to_dot(diagram(analysis, plan, args.detail))
        if out.suffix.lower() == ".dot":
            out.write_text(dot)
        else:
            out.write_bytes(render(dot, out.suffix.lower().lstrip(".") or "svg"))
        print(f"graph written to {out}")
    if args.timeline:
        visualize_timeline(plan, args.timeline, timeline=timeline)
        print(f"timeline written to {args.timeline}")
    if args.report:
        Path(args.report).write_text(report_html(plan, analysis, timeline, args.detail))
        print(f"report written to {args.report}")
    return 0


def _measure(args: argparse.Namespace, plan: Any) -> Any:
    """Apply ``plan`` to the model and time two training steps (the second is drawn)."""
    import torch.utils._pytree as pytree

    from partitioner.api import partition
    from partitioner.viz.timeline import measured_timeline

    model_name = getattr(args, "model", None) or args.target
    model, example = load_model(model_name, args.input)
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


def _plan_and_analysis(args: argparse.Namespace) -> tuple[Any, Any | None]:
    """The plan (loaded, or made from a model) and, when a model is at hand, its analysis."""
    from partitioner.analysis import analyze
    target = args.target
    if Path(target).suffix.lower() in (".json", ".yaml", ".yml"):
        model_name = getattr(args, "model", None)
        if model_name is None:
            from partitioner.apply import load_plan
            from partitioner.plans.plan import Plan
            given = load_plan(target)
            if not isinstance(given, Plan):
                raise CommandError(f"{target} is a spec; pass --model to compile it for a model")
            return given, None
        args.spec = target
        target = model_name
    model, example = load_model(target, args.input)
    plan = _build_plan(args, model, example, _devices(args.devices))
    return plan, analyze(model, example, need_costs=False)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from partitioner.planning.simulate import simulate
    from partitioner.viz import visualize_timeline
    from partitioner.viz.timeline import Timeline, predicted_timeline

    cluster = _cluster(args.cluster)
    plan, _ = _plan_and_analysis(args)
    if plan.candidates:
        timeline = Timeline.of(simulate(plan, cluster), "s", "simulated")
        how = f"simulated on {args.cluster or 'the cluster it was planned for'}"
    else:
        timeline = predicted_timeline(plan)
        how = "clock ticks (the plan has no cost records to simulate)"
    print(plan.table())
    print(f"\n{how}:")
    print(f"  step {timeline.makespan * 1e3:.2f} ms, bubble {timeline.bubble:.0%}"
          if timeline.unit == "s" else
          f"  step {timeline.makespan:g} ticks, bubble {timeline.bubble:.0%}")
    print(_ascii(timeline))
    if args.out:
        visualize_timeline(plan, _ready(args.out), timeline=timeline)
        print(f"timeline written to {args.out}")
    return 0


def _ascii(timeline: Any, width: int = 72) -> str:
    scale = width / timeline.makespan
    rows = []
    for j in timeline.stages:
        line = ["."] * width
        for b in (b for b in timeline.bars if b.stage == j):
            lo = round(b.start * scale)
            hi = max(round(b.end * scale), lo + 1)
            for k in range(lo, min(hi, width)):
                line[k] = b.phase if b.phase in "FB" else "#"
        rows.append(f"  stage {j:<2d} |{''.join(line)}|")
    return "\n".join(rows)


def _cmd_run(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        command.append(f"--rdzv-endpoint={args.rdzv_endpoint}")
    command += [args.script, *args.script_args]
    print("+ " + " ".join(command), file=sys.stderr)
    return subprocess.call(command)


def _ready(path: str) -> Path:
    """``path``, its folder made if missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return Path(path)


# -- small parsers --------------------------------------------------------------------------

def _cluster(text: str | None) -> Any:
    """``--cluster PRESET[:NODES]`` as a Cluster (8 devices a node)."""
    if text is None:
        return None
    from partitioner.cost.devices import DEVICES, Cluster

    name, _, nodes = text.partition(":")
    preset = {key.lower(): key for key in DEVICES}.get(name.lower())
    if preset is None or (nodes and not (nodes.isdigit() and int(nodes) > 0)):
        raise CommandError(f"--cluster {text!r}: pass PRESET[:NODES] with PRESET one of "
                           f"{sorted(DEVICES)} and NODES a positive number, e.g. "
                           "--cluster A100-80GB:2")
    return Cluster.preset(preset, nodes=int(nodes or 1))


def _devices(text: str | None) -> Any:
    if text is None:
        return None
    if text.isdigit():
        return ["cpu"] * int(text) if not torch.cuda.is_available() else int(text)
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


class _Progress:
    """A progress bar over named steps (tqdm on a terminal, nothing when piped)."""

    def __init__(self, steps: list[str]) -> None:
        self.steps = steps
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar: Any = None
        else:
            self.bar = tqdm(total=len(steps), desc=steps[0], file=sys.stderr, leave=False,
                            disable=None, bar_format="{desc:36s} {bar} {n}/{total} {elapsed}")

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n < len(self.steps):
                self.bar.set_description(self.steps[self.bar.n])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    sys.exit(main())
