"""`ctseg <step>`: one subcommand per pipeline step. The Snakemake rules call these.

Each stage's subcommands live in its `commands` module (`ctseg.preprocess.commands`, ...), which
adds their parsers and holds the function each calls. This module only puts them together and
dispatches: it runs the subcommand's function and turns a `CtsegError` into a one-line message
and exit status 2, so the rule's log names the file and the problem instead of ending in a
traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from ctseg import __version__
from ctseg.cli_types import from_plan
from ctseg.evaluation import commands as evaluation
from ctseg.inference import commands as inference
from ctseg.io import CtsegError, disk_full, os_error_line
from ctseg.network import commands as network
from ctseg.planning import commands as planning
from ctseg.postprocess import commands as postprocess
from ctseg.preprocess import commands as preprocess
from ctseg.report import commands as report
from ctseg.trials import commands as trials

# Every subcommand, each once, in the order `ctseg --help` lists them: the pipeline's.
COMMANDS = (
    (preprocess, ("demo-data", "convert", "targets")),
    (planning, ("plan-dataset", "plan")),
    (preprocess, ("split", "stage")),
    (trials, ("trial", "train")),
    (inference, ("infer", "predict")),
    (postprocess, ("tune-postprocess", "postprocess")),
    (evaluation, ("score", "evaluate", "baseline")),
    (report, ("report",)),
    (network, ("model-summary",)),
    (inference, ("ensemble", "tune-ensemble")),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctseg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ctseg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, help="the step to run")
    for stage, names in COMMANDS:
        stage.add_commands(sub.add_parser, names)
    return parser


def _terminated(signum: int, frame: object) -> None:
    # SIGTERM (Snakemake stopping a job, a scheduler's preemption) unwinds like an error, so
    # each step's temporary output is removed on the way out instead of being left behind.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except CtsegError as exc:  # a file an option names (an experiment, a plan) is refused
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        print(f"ctseg {words[0] if words else ''}: error: {exc.line()}", file=sys.stderr)
        return 2
    # The command line as given, for a refusal whose fix is the same command with an option.
    args.argv = ["ctseg", *(sys.argv[1:] if argv is None else argv)]
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main_thread else None
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        if hasattr(args, "plan"):
            from_plan(args)
        if getattr(args, "fold", None) is not None:
            from ctseg.config import with_fold

            args.experiment = with_fold(args.experiment, args.fold)
        func(args)
    except CtsegError as exc:
        print(f"ctseg {args.command}: error: {exc.line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Each step's temporary output was removed on the way out (`io.atomic_path`).
        print(f"ctseg {args.command}: interrupted; nothing partial was kept", file=sys.stderr)
        return 130
    except Exception as exc:
        # A folder that cannot be written, a full disk, a file where a folder should be: the
        # user's to fix, so one line naming the path rather than a traceback. Anything else
        # is ctseg's own error and keeps its traceback.
        line = os_error_line(disk_full(exc) or exc)  # a full disk, however deep it was raised
        if line is None:
            raise
        print(f"ctseg {args.command}: error: {line}", file=sys.stderr)
        return 2
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
