"""The command-line options the Snakemake rules pass to `ctseg <step>`, built from the config.

Each serves one rule. They live here rather than in the rule files because `snakemake --lint`
refuses functions beside rules, and here unit tests reach them (tests/test_rule_args.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Host memory a training job asks the scheduler for: the main process plus each loader
# worker (a worker holds its prefetched batches and the memmapped patches it touches).
MAIN_PROCESS_MB = 4000
WORKER_MB = 1500
# Host memory of one scoring process at 320^3 (ctseg.evaluation.metrics.WORKER_MEMORY_GB), and
# the job's own margin.
SCORING_PROCESS_MB = 2000
SCORING_MARGIN_MB = 1000


class Untracked:
    """A rule param that Snakemake does not compare between runs, written into the command as
    its value. Snakemake records a job's params to rerun it when one changes, and records only
    values of the builtin types (snakemake.persistence skips any other as unrepresentable):
    this wrapper is such an other."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)


def shape_arg(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


# ----------------------------------------------------------------------------- preprocessing
def shards_arg(shards: Sequence[int] | None) -> str:
    return f"--shards {shape_arg(shards)}" if shards else ""


def codec_arg(codec: Mapping[str, Any]) -> str:
    """The codec as `ctseg convert --codec` takes it: NAME,KEY=VALUE,..."""
    rest = dict(codec)
    name = rest.pop("name")
    return ",".join([name, *(f"{k}={v}" for k, v in sorted(rest.items()))])


# ----------------------------------------------------------------------------- training
def fold_arg(fold: int | None) -> str:
    return f"--fold {fold}" if fold is not None else ""


def launcher(gpus: int) -> str:
    """How a training job starts ctseg: as one process, or as `gpus` DDP processes."""
    if gpus == 1:
        return "ctseg"
    return f"torchrun --standalone --nproc_per_node {gpus} -m ctseg.cli"


def phase_threads(gpus: int, workers: int) -> int:
    """Cores of a training job: per GPU, its process and its loader workers."""
    return gpus * (max(1, workers) + 1)


def phase_mem_mb(gpus: int, workers: int) -> int:
    return gpus * (MAIN_PROCESS_MB + WORKER_MB * workers)


def scratch_args(
    stage: str, *, manifest_dir: str | None, node_scratch: str, experiment: str, source: str
) -> str:
    """--scratch, plus --stage-from when the job stages its own copy (`stage: per_job`; kept
    unexpanded: $TMPDIR must be the one on the node that runs the job)."""
    if stage == "per_job":
        return f"--scratch '{node_scratch}/{experiment}' --stage-from '{source}'"
    return f"--scratch '{manifest_dir}'"


# Shell run as `{params.keep_log} {log:q} && <command> > {log:q} 2>&1`, so that every attempt of
# a resubmitted job keeps its log. Snakemake deletes a rule's log before each attempt (a stop
# ahead of the time limit, a preemption, a retry), which would lose the one before. This creates
# the log and a hard link to it, `<log>.attempts/<UTC time>-<SLURM job id or local>-<pid>.log`:
# the deletion removes only the log's own name, and each attempt's text stays under its link.
KEEP_ATTEMPT_LOG = (
    'keep_log() { mkdir -p "$1.attempts" && : > "$1" && '
    'ln -f "$1" "$1.attempts/$(date -u +%Y%m%dT%H%M%SZ)-${SLURM_JOB_ID:-local}-$$.log"; }; '
    "keep_log"
)


# Shell run as `{params.record_trials} <record> <trial summaries...> && <command>`: the train job
# writes which trials it waits on to <record> (train/trials.txt), one path a line, and removes
# it when it waits on none. Snakemake reruns a job whose set of inputs changed; this record, kept
# beside the last.pt the job writes, is how the next plan declares the same set whatever the
# phase (`ctseg.runs.Runs.training_plan`). Written before the command: a job that fails leaves
# no last.pt, so a record always belongs to the last.pt beside it.
RECORD_TRIALS = (
    'record_trials() { record="$1"; shift; rm -f "$record" && '
    '{ [ $# -eq 0 ] || printf "%s\\n" "$@" > "$record"; }; }; '
    "record_trials"
)


def init_arg(init: Sequence[str]) -> str:
    return f"--init-from '{init[0]}'" if init else ""


# ----------------------------------------------------------------------------- ensembles
def ensemble_weight_args(
    tuned: bool, weights_file: str, members: Sequence[str], weights: Sequence[float]
) -> str:
    """A tuned ensemble's weights.json and member names, or the weights themselves."""
    if tuned:
        return f"--weights-file '{weights_file}' --names {' '.join(members)}"
    return "--weights " + " ".join(str(w) for w in weights)


def ensemble_member_args(probabilities: Mapping[str, Sequence[str]]) -> str:
    """`--member NAME ZARR...` per member, as ctseg tune-ensemble takes them."""
    return " ".join(
        f"--member {member} " + " ".join(f"'{p}'" for p in paths)
        for member, paths in probabilities.items()
    )


# ----------------------------------------------------------------------------- evaluation
def provenance_args(provenance: Mapping[str, str]) -> str:
    return " ".join(f"--provenance {k}={v}" for k, v in provenance.items())


def scoring_mem_mb(threads: int, volumes: int) -> int:
    """Host memory of a scoring job: one process per volume, up to its threads."""
    return SCORING_MARGIN_MB + SCORING_PROCESS_MB * max(1, min(threads, volumes))


def tune_args(tune: Mapping[str, Any]) -> str:
    """The search space of `ctseg tune-postprocess`, from config infer.tune."""

    def values(option: str, items: Sequence[Any]) -> str:
        return " ".join([option, *(str(v) for v in items)])

    options = [
        values("--thresholds", tune["thresholds"]),
        f"--refine-step {tune['refine_step']}",
        values("--hysteresis-offsets", tune["hysteresis_offsets"]),
        values("--min-component-voxels", tune["min_component_voxels"]),
        "" if tune["fill_holes"] else "--no-fill-holes",
        values("--hysteresis-pairs", [f"{lo},{hi}" for lo, hi in tune["hysteresis_pairs"]]),
        values("--hysteresis-modes", tune["hysteresis_modes"]),
        values("--plug-holes-max-area", tune["plug_holes_max_area"]),
        values("--patch-holes-max-area", tune["patch_holes_max_area"]),
        values("--closing-radii", tune["closing_radii"]),
    ]
    return " ".join(o for o in options if o)


def postprocess_args(infer: Mapping[str, Any], settings: str | None) -> str:
    """`ctseg postprocess` options: the tuned file, or the fixed values of config infer."""
    if infer["postprocess"] == "tuned":
        return f"--settings '{settings}'"
    high = infer["hysteresis_high"]
    options = [
        f"--threshold {infer['threshold']}",
        f"--hysteresis-high {high}" if high is not None else "",
        f"--min-component-voxels {infer['min_component_voxels']}",
        "--fill-holes" if infer["fill_holes"] else "",
        # The later steps only when on: an unchanged config gives the unchanged command line.
        (
            f"--hysteresis-mode {infer['hysteresis_mode']}"
            if infer["hysteresis_mode"] != "3d"
            else ""
        ),
        *[
            f"--{key.replace('_', '-')} {infer[key]}"
            for key in ("plug_holes_max_area", "patch_holes_max_area", "closing_radius")
            if infer[key]
        ],
    ]
    return " ".join(o for o in options if o)


def post_waits_on(
    scroll: str, rounds: Sequence[tuple[str, str]], parts: int, wildcards: Mapping[str, str]
) -> list[str]:
    """What rule scroll_post's job waits on (its `wildcards`: ``round``, ``which`` a range or
    ``merge``, ``n`` the parts), or with no round the finish (`parts` then): a merge its round's
    every range; a range job the round before's merge (a component round) or its every range,
    before the first round every part; the finish the last round's every range (every part
    where there is no round). `scroll`: the folder of the scroll's summaries."""
    round_name, which = wildcards.get("round"), wildcards.get("which")
    parts = int(wildcards.get("n", parts))
    if which == "merge":
        return [f"{scroll}/post-{round_name}-{k}-of-{parts}.json" for k in range(parts)]
    names = [name for name, _ in rounds]
    at = names.index(round_name) if round_name is not None else len(names)
    if at == 0:
        return [f"{scroll}/part-{k}-of-{parts}.json" for k in range(parts)]
    before, kind = rounds[at - 1]
    if kind == "components":
        return [f"{scroll}/post-{before}-merge-of-{parts}.json"]
    return [f"{scroll}/post-{before}-{k}-of-{parts}.json" for k in range(parts)]


# ----------------------------------------------------------------------------- report
def overlay_args(ids: Sequence[str], image_store: str, label_store: str) -> str:
    """--overlay ID IMAGE LABEL for each volume (`image_store`, `label_store`: patterns with
    {id}); each run's prediction is results/<run>/predictions/<id>.tif."""
    return " ".join(
        f"--overlay {i} '{image_store.format(id=i)}' '{label_store.format(id=i)}'" for i in ids
    )
