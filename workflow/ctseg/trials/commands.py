"""`ctseg trial` and `ctseg train`: a phase's measured trial, and the training it chooses.

`train` is here, not in `training`, because `--phase auto` picks the phase from the trials
(`ctseg.trials.trials.choose_phase`), which `training` may not import.

`ctseg train` and `ctseg trial` run as one process, or as `gpus` processes under
`torchrun --standalone --nproc_per_node <gpus> -m ctseg.cli ...` (DDP, see ctseg.training.train):
each process joins the process group for the whole command, and only rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ctseg.cli_types import (
    AddParser,
    _experiment,
    _fold_arg,
    _phases,
    dataset_of,
    plan_arg,
)
from ctseg.io import strict_json

if TYPE_CHECKING:
    from ctseg.training.distributed import Ranks


def _split_ids(split_csv: str) -> tuple[list[str], list[str]]:
    import pandas as pd

    table = pd.read_csv(split_csv, dtype={"id": str})
    return (
        table.loc[table["split"] == "train", "id"].tolist(),
        table.loc[table["split"] == "val", "id"].tolist(),
    )


def _phase_settings(phases: dict, phase: str) -> tuple[int, dict]:
    from ctseg.config import select_phase

    return select_phase(phases, phase, "--phases")


def _scratch(args: argparse.Namespace, ranks: Ranks) -> Path:
    """The scratch copy to train from; with --stage-from, staged here first (per_job): by rank
    0 under torchrun, while the others wait."""
    from ctseg.preprocess.stage import check_staged, expand_scratch, stage_records

    scratch = expand_scratch(args.scratch)
    if args.stage_from:
        if ranks.main:
            train_ids, val_ids = _split_ids(args.split)
            summary = stage_records(
                args.stage_from,
                train_ids + val_ids,
                scratch,
                fmt=args.experiment["scratch_format"],
            )
            print(strict_json({"staged": summary}, default=str))
        ranks.barrier()
    # A file deleted or cut short since staging would fail deep inside the loader workers.
    check_staged(scratch, [i for ids in _split_ids(args.split) for i in ids])
    return scratch


def cmd_trial(args: argparse.Namespace) -> None:
    from ctseg.training.distributed import ddp_phase, pick_device, process_group, torchrun_ranks
    from ctseg.trials.trials import run_trial, summary_json

    device = pick_device(args.device)
    phase_id, phase = _phase_settings(args.phases, args.phase)
    phase = ddp_phase(args.experiment, phase, torchrun_ranks().world)
    train_ids, _ = _split_ids(args.split)
    with process_group(device) as ranks:
        scratch = _scratch(args, ranks)
        # Every rank runs the same trial (its runs are collective); rank 0 alone writes.
        summary = run_trial(
            args.experiment,
            phase_id,
            phase,
            scratch=scratch,
            train_ids=train_ids,
            out_dir=Path(args.out),
            previous=Path(args.previous) if args.previous else None,
            device=str(device),
            ranks=ranks,
            labels=dataset_of(args).labels,
        )
    if ranks.main:
        print(summary_json(summary))
    elif summary.error:  # rank 0 records the failure; this rank only says so in the log
        print(f"rank {ranks.rank}: trial run failed: {summary.error}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    from ctseg.training.distributed import ddp_phase, pick_device, process_group, torchrun_ranks
    from ctseg.training.preempt import RESUMABLE_EXIT, stop_on_signals
    from ctseg.training.train import train
    from ctseg.trials.trials import choose_phase

    device = pick_device(args.device)
    first = torchrun_ranks().main
    phase = args.phase
    if phase == "auto":
        phase = str(choose_phase([Path(p) for p in args.trials]))
        if first:
            print(f"phase auto: chose phase {phase}")
    phase_id, settings = _phase_settings(args.phases, phase)
    settings = ddp_phase(args.experiment, settings, torchrun_ranks().world)
    train_ids, val_ids = _split_ids(args.split)
    with process_group(device) as ranks:
        scratch = _scratch(args, ranks)  # staging still stops at once on SIGTERM
        # From here SIGTERM, SIGUSR1 and SIGURG ask the loop to checkpoint after its current step.
        with stop_on_signals() as stop:
            summary = train(
                args.experiment,
                settings,
                scratch=scratch,
                train_ids=train_ids,
                val_ids=val_ids,
                out_dir=Path(args.out),
                state_dir=Path(args.state_dir),
                final_weights=Path(args.weights),
                init_from=Path(args.init_from) if args.init_from else None,
                device=str(device),
                stop=stop,
                phase_id=phase_id,
                phase_auto=args.phase == "auto",
                labels=dataset_of(args).labels,
            )
    if first:
        print(strict_json({"phase": phase_id, **summary}, indent=1, default=str))
    if summary.get("stopped"):
        raise SystemExit(RESUMABLE_EXIT)  # "stopped with a checkpoint: run me again"


def _training_args(p: argparse.ArgumentParser) -> None:
    """What `trial` and `train` share: the settings files, the data and the device."""
    p.add_argument(
        "--experiment",
        type=_experiment,
        default=None,
        help="config/experiments/<name>.yaml (or --plan)",
    )
    _fold_arg(p)
    plan_arg(p)
    p.add_argument("--phases", type=_phases, required=True, help="config/phases.yaml")
    p.add_argument("--scratch", required=True, help="staged scratch directory ($VARS)")
    p.add_argument("--stage-from", default=None, help="stage the split's records from here first")
    p.add_argument("--split", required=True, help="split.csv (id, scroll_id, split)")
    p.add_argument("--out", required=True, help="directory for steps.csv etc.")
    p.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:1, cpu; default: cuda if any (under torchrun: cuda:LOCAL_RANK)",
    )


def _trial_parser(add_parser: AddParser) -> None:
    p = add_parser("trial", help="a short measured run of one loader phase")
    _training_args(p)
    p.add_argument("--phase", required=True, help="the phase of --phases to run")
    p.add_argument("--previous", default=None, help="the previous phase's summary.json")
    p.set_defaults(func=cmd_trial)


def _train_parser(add_parser: AddParser) -> None:
    p = add_parser("train", help="train the experiment under a phase (or auto)")
    _training_args(p)
    p.add_argument("--phase", required=True, help="a phase number or auto")
    p.add_argument("--trials", nargs="*", default=[], help="trial summaries, for auto")
    p.add_argument("--state-dir", required=True, help="resumable checkpoint directory")
    p.add_argument("--weights", required=True, help="final weights (last.pt)")
    p.add_argument(
        "--init-from",
        default=None,
        help="a fine-tune's starting weights: results/<init_from>/last.pt of the experiment's "
        "init_from run (required when it has one)",
    )
    p.set_defaults(func=cmd_train)


# Each subcommand's name and the builder that adds its parser.
PARSERS: dict[str, Callable[[AddParser], None]] = {
    "trial": _trial_parser,
    "train": _train_parser,
}


def add_commands(add_parser: AddParser, names: Iterable[str] = PARSERS) -> None:
    """Adds the subcommands `names` (by default all of this stage's) with `add_parser`."""
    for name in names:
        PARSERS[name](add_parser)
