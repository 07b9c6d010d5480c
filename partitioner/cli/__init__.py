r"""The ``partitioner`` command: plan a model, show a plan, draw it, simulate it, run a job.

::

    partitioner plan gpt --devices 4 --chunks 8 -o plan.json
    partitioner show plan.json
    partitioner viz plan.json --model gpt -o graph.svg --timeline timeline.png
    partitioner simulate plan.json
    partitioner run --nproc-per-node 2 train.py --steps 100
    partitioner calibrate --measure

A model is a bundled example name (``partitioner plan --list``) or ``module:factory``, a
function returning a model, or ``(model, example_inputs)``; ``--input 64x32`` (``:int64``
for token ids) gives example inputs otherwise. Every command has ``--help`` with examples.

A mistake (a missing file, a bad option, a model that does not fit) is one line on stderr
and exit status 1 (2 for arguments argparse refuses); ``--debug`` or ``PARTITIONER_DEBUG=1``
shows the traceback instead. Parsing the arguments imports nothing heavy: torch is loaded
only by the command that needs it, so ``--help`` answers at once.

Example:
    >>> one_line("spec does not fit the model:\n  - a: no layer\n  - b: no layer")
    'spec does not fit the model: a: no layer; b: no layer'
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

from partitioner.cli.models import BUNDLED, load_model
from partitioner.errors import PartitionError

__all__ = ["main", "BUNDLED", "load_model", "one_line"]

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
    "calibrate": """examples:
  partitioner calibrate                # the cache file, its runs and the spec they give
  partitioner calibrate --measure      # measure the CPU now (kept if the machine was quiet)
  partitioner calibrate --clear --measure   # start the cache afresh

Plans for "cpu" devices use the median of the quiet calibration runs kept in
$PARTITIONER_CACHE_DIR (else ~/.cache/partitioner). A run taken while other processes kept
more than 15% of the cores busy is measured again, and never kept.""",
}


class _Command(NamedTuple):
    about: str
    handler: str  # a function of partitioner.cli.commands, imported after parsing


_COMMANDS = {
    "plan": _Command("plan a model over devices and write the plan file", "plan_command"),
    "show": _Command("print a plan file as a table", "show_command"),
    "viz": _Command("draw a plan's graph, timeline or HTML report", "viz_command"),
    "simulate": _Command("lay out a plan's pipeline schedule in time", "simulate_command"),
    "run": _Command("launch a training script with torchrun", "run_command"),
    "calibrate": _Command("show this machine's CPU calibration, or measure it again",
                          "calibrate_command"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    A :class:`~partitioner.errors.PartitionError` (a user's mistake) is printed as one line;
    with ``--debug`` or ``PARTITIONER_DEBUG=1`` it is raised, traceback and all. Other
    exceptions are bugs and always raise.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("PARTITIONER_DEBUG", "") not in ("", "0")
    from partitioner.cli import commands

    try:
        if not debug and args.command != "run":
            commands.quiet_torch_logs()
        return int(getattr(commands, _COMMANDS[args.command].handler)(args) or 0)
    except PartitionError as error:
        if debug:
            raise
        print(f"partitioner {args.command}: error: {one_line(str(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"partitioner {args.command}: interrupted", file=sys.stderr)
        return 130


def one_line(message: str, limit: int = 8) -> str:
    """An error message on one line: an indented list under a heading joined by ``; ``
    (at most ``limit`` items), the sentences after it kept.

    torch.fx appends "While executing <node>" and a traceback to the errors it passes on; the
    partitioner's message names the node already, so that part is dropped.
    """
    text = message.split("\n\nWhile executing ")[0]
    lines = text.splitlines()
    head = lines[0].strip() if lines else ""
    items: list[str] = []
    tail: list[str] = []
    for line in lines[1:]:
        stripped = line.strip().removeprefix("- ")
        if not stripped.strip("^ "):
            continue  # a caret under a quoted line (YAML's errors) means nothing joined up
        (items if line[:1].isspace() and not tail else tail).append(stripped)
    if len(items) > limit:
        items = [*items[:limit], f"and {len(items) - limit} more (--debug shows them all)"]
    if items:
        head = f"{head} {'; '.join(items)}" if head.endswith(":") else "; ".join([head, *items])
    return "; ".join([head, *tail])


class _Parser(argparse.ArgumentParser):
    """argparse, with its refusals on one line that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="partitioner", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(_EXAMPLES[k] for k in ("plan", "viz")))
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (or set PARTITIONER_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in _COMMANDS.items():
        p = sub.add_parser(name, help=command.about, description=command.about,
                           epilog=_EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        # SUPPRESS: given before the command, --debug is not reset by the subparser.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
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
    run.add_argument("script", nargs="?", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    calibrate = sub.choices["calibrate"]
    calibrate.add_argument("--measure", action="store_true",
                           help="measure the CPU now and keep the run if it was quiet")
    calibrate.add_argument("--clear", action="store_true",
                           help="delete the cache file (before --measure, if both)")
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
