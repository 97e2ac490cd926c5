"""Shared by bench/gpu_check.py and bench/quality.py: the pipeline's own steps, run through the
`ctseg` CLI with the arguments the rules in workflow/rules/*.smk pass, in the rules' order.

Every step runs as a child process whose output goes to ``<workdir>/logs/<step>[_<what>].log``;
a step that fails raises `StepFailed`, which names the step and carries the tail of its log.
The settings the rules take from config/config.yaml (convert, targets, infer) are read from
that file here too, so a bench runs what `snakemake` would run.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 40
EVALUATE_WORKERS = min(8, os.cpu_count() or 1)  # the evaluate rule's threads: 8


class StepFailed(RuntimeError):
    """A pipeline step exited non-zero; the message names it and shows its log's tail."""

    def __init__(self, step: str, log: Path, status: int) -> None:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        tail = "\n".join("    " + line for line in lines[-LOG_TAIL_LINES:])
        super().__init__(
            f"step {step} failed with exit status {status}; last {min(len(lines), LOG_TAIL_LINES)}"
            f" lines of {log}:\n{tail}"
        )
        self.step = step
        self.log = log


def ctseg_command() -> list[str]:
    """How to start `ctseg`: the venv's entry point beside this Python, one on PATH, or (a bare
    GPU image with the package only on PYTHONPATH) the same CLI as `python -m ctseg.cli`."""
    beside = Path(sys.executable).with_name("ctseg")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ctseg")
    if found:
        return [found]
    return [sys.executable, "-m", "ctseg.cli"]


def child_env() -> dict[str, str]:
    """The environment for every step: the package importable for `python -m ctseg.cli`."""
    env = dict(os.environ)
    paths = [str(REPO / "workflow"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def experiment_args(
    step: str, exp: Mapping[str, Any], phases: Mapping[Any, Any] | None, workdir: Path
) -> list[str]:
    """The experiment (and for trial/train the phase table) as `ctseg <step>` takes them, as
    the rules pass them: file paths. The one place that builds them. The experiment file is
    named for the experiment, as ctseg's config loader requires."""
    config_dir = workdir / "config"
    exp_file = config_dir / "experiments" / f"{exp['name']}.yaml"
    exp_file.parent.mkdir(parents=True, exist_ok=True)
    exp_file.write_text(yaml.safe_dump(dict(exp), sort_keys=False))
    if phases is None:
        return ["--experiment", str(exp_file)]
    phases_file = config_dir / "phases.yaml"
    table = {int(k): dict(v) for k, v in phases.items()}
    phases_file.write_text(yaml.safe_dump({"phases": table}, sort_keys=False))
    return ["--experiment", str(exp_file), "--phases", str(phases_file)]


def codec_arg(codec: Mapping[str, Any]) -> str:
    """config's convert.codec as `ctseg convert --codec` takes it (NAME,KEY=VALUE,...), as the
    rules' codec_arg() writes it."""
    rest = {k: v for k, v in codec.items() if k != "name"}
    return ",".join([str(codec["name"]), *(f"{k}={v}" for k, v in sorted(rest.items()))])


def load_config() -> dict[str, Any]:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def load_experiment(name: str) -> dict[str, Any]:
    """config/experiments/<name>.yaml, checked against the schema when jsonschema is there (a
    bare GPU image may lack it; the shipped files list every key, so it is a check only)."""
    path = REPO / "config/experiments" / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"experiment {name!r}: {path} does not exist")
    exp = yaml.safe_load(path.read_text())
    try:
        import jsonschema
    except ImportError:
        return exp
    schema = yaml.safe_load((REPO / "workflow/schemas/experiment.schema.yaml").read_text())
    jsonschema.validate(exp, schema)
    return exp


def load_phases() -> dict[int, dict[str, Any]]:
    raw = yaml.safe_load((REPO / "config/phases.yaml").read_text()) or {}
    return {int(k): v for k, v in (raw.get("phases") or {}).items()}


def set_training_budget(exp: dict[str, Any], steps: int, val_batches: int) -> None:
    """One epoch of `steps` steps; the warm-up scaled down with the budget (exp001_full's 500
    warm-up steps would be most of a short run)."""
    tcfg = exp["train"]
    tcfg["warmup_steps"] = min(int(tcfg["warmup_steps"]), max(1, steps // 10))
    tcfg.update(epochs=1, steps_per_epoch=steps, val_batches=val_batches)
    tcfg["log_every"] = max(1, min(int(tcfg["log_every"]), steps // 10 or 1))


# --smoke (bench/train.py, quality.py, postprocess.py): a two-level model on 16^3 patches of
# volumes of SMOKE_SIZE^3, so that every step runs in seconds for CI; its figures mean nothing.
SMOKE_SIZE = 32


def shrink_for_smoke(exp: dict[str, Any]) -> None:
    """`exp` with the smoke run's model and patch, in place."""
    exp["model"]["filters"] = [4, 8]
    exp["data"]["patch_size"] = [16, 16, 16]


def shape_arg(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)


@dataclass
class Runner:
    """Runs steps, prints one progress line per step, keeps their wall times."""

    workdir: Path
    jobs: int = 1
    t0: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)

    def run(
        self, step: str, args: Sequence[str], what: str = "", launch: list[str] | None = None
    ) -> None:
        """Run `ctseg <args>` (or `launch <args>`); raise StepFailed on a non-zero exit."""
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / (f"{step}_{what}.log" if what else f"{step}.log")
        start = time.perf_counter()
        with open(log, "w") as handle:
            status = subprocess.run(
                [*(launch or ctseg_command()), *args],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=child_env(),
                check=False,
            ).returncode
        took = time.perf_counter() - start
        self.seconds[step] = self.seconds.get(step, 0.0) + took
        label = f"{step} {what}".strip()
        if status != 0:
            print(f"[{self.elapsed():7.1f} s] {label}: FAILED ({took:.1f} s)", flush=True)
            raise StepFailed(label, log, status)
        print(f"[{self.elapsed():7.1f} s] {label}: ok ({took:.1f} s)", flush=True)

    def run_many(self, step: str, jobs: Sequence[tuple[str, Sequence[str]]]) -> None:
        """Independent per-record jobs, `self.jobs` at a time (Snakemake would run them side by
        side too); the first failure is raised once the running ones have ended."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
            futures = [pool.submit(self.run, step, args, what) for what, args in jobs]
            for future in futures:
                future.result()
        self.seconds[step] = time.perf_counter() - start  # wall time, not the sum of the jobs

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@dataclass
class Prepared:
    """What the preprocessing steps produced."""

    dataset: Path
    results: Path
    store: Path  # the preprocessed stores: zarr/images, zarr/labels, targets
    split_csv: Path
    scratch: Path
    train_ids: list[str]  # the split's train records
    val_ids: list[str]
    labelled_train_ids: list[str]  # every labelled training record (train + val)
    test_ids: list[str]  # the demo's test records; they have labels in test_labels/

    def image(self, record_id: str) -> Path:
        return self.store / "zarr/images" / f"{record_id}.zarr"

    def label_zarr(self, record_id: str) -> Path:
        return self.store / "zarr/labels" / f"{record_id}.zarr"


def _csv_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [row["id"] for row in csv.DictReader(handle)]


def prepare(
    runner: Runner,
    exp: Mapping[str, Any],
    *,
    n_train: int,
    n_test: int,
    shape: Sequence[int],
    seed: int = 0,
    preset: str | None = None,
) -> Prepared:
    """demo_data -> convert_image/convert_label -> targets -> split -> stage, as the rules do."""
    cfg = load_config()
    work = runner.workdir
    dataset, results = work / "resources/demo", work / "results"
    # The rules' layout: each dataset's preprocessed stores under a root of their own.
    store = results / "preprocessed" / "demo"
    demo = [
        "demo-data",
        "--out",
        str(dataset),
        "--n-train",
        str(n_train),
        "--n-test",
        str(n_test),
        "--shape",
        shape_arg(shape),
        "--scroll-ids",
        *(str(s) for s in cfg["demo"]["scroll_ids"]),
        "--seed",
        str(seed),
    ]
    demo += ["--preset", preset or cfg["demo"]["preset"]]
    runner.run("demo_data", demo)
    train_ids, test_ids = _csv_ids(dataset / "train.csv"), _csv_ids(dataset / "test.csv")

    conv = cfg["convert"]
    convert_common = [
        "--chunks",
        shape_arg(conv["chunks"]),
        *(["--shards", shape_arg(conv["shards"])] if conv["shards"] else []),
        "--codec",
        codec_arg(conv["codec"]),
        "--memory-budget-mb",
        str(conv["memory_budget_mb"]),
    ]
    images = {
        **{i: dataset / "train_images" / f"{i}.tif" for i in train_ids},
        **{i: dataset / "test_images" / f"{i}.tif" for i in test_ids},
    }
    labels = {
        **{i: dataset / "train_labels" / f"{i}.tif" for i in train_ids},
        **{i: dataset / "test_labels" / f"{i}.tif" for i in test_ids},
    }
    runner.run_many(
        "convert_image",
        [
            (
                i,
                ["convert", str(src), str(store / f"zarr/images/{i}.zarr"), "--kind", "image"]
                + convert_common,
            )
            for i, src in images.items()
        ],
    )
    runner.run_many(
        "convert_label",
        [
            (
                i,
                [
                    "convert",
                    str(src),
                    str(store / f"zarr/labels/{i}.zarr"),
                    "--kind",
                    "label",
                    "--like",
                    str(store / f"zarr/images/{i}.zarr"),
                    *convert_common,
                ],
            )
            for i, src in labels.items()
            if src.exists()
        ],
    )
    tg = cfg["targets"]
    runner.run_many(
        "targets",
        [
            (
                i,
                [
                    "targets",
                    str(store / f"zarr/labels/{i}.zarr"),
                    str(store / f"targets/{i}.zarr"),
                    "--clip-distance",
                    str(tg["clip_distance"]),
                    "--skeleton-method",
                    tg["skeleton_method"],
                    "--tube-dilations",
                    str(tg["tube_dilations"]),
                    "--block",
                    shape_arg(tg["block"]),
                    "--max-samples",
                    str(tg["max_samples"]),
                    "--seed",
                    str(tg["seed"]),
                    "--codec",
                    codec_arg(conv["codec"]),
                    "--workers",
                    str(tg["workers"]),
                ],
            )
            for i in train_ids
        ],
    )
    split_csv = results / exp["name"] / "split.csv"
    runner.run(
        "split",
        [
            "split",
            str(dataset),
            str(split_csv),
            *experiment_args("split", exp, None, work),
        ],
    )
    scratch = results / "scratch" / exp["name"]
    runner.run(
        "stage",
        [
            "stage",
            str(store),
            str(split_csv),
            str(scratch),
            "--format",
            exp["scratch_format"],
            "--workers",
            "4",
        ],
    )
    with open(split_csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return Prepared(
        dataset=dataset,
        results=results,
        store=store,
        split_csv=split_csv,
        scratch=scratch,
        train_ids=[r["id"] for r in rows if r["split"] == "train"],
        val_ids=[r["id"] for r in rows if r["split"] == "val"],
        labelled_train_ids=train_ids,
        test_ids=test_ids,
    )


def gpus_of(phase: Mapping[str, Any], exp: Mapping[str, Any]) -> int:
    """GPUs a phase trains on: its own `gpus`, else the experiment's (as the rules decide)."""
    return int(phase.get("gpus") or exp["train"].get("gpus") or 1)


def launcher(gpus: int) -> list[str]:
    """`ctseg`, or torchrun over several GPUs, as the rules' launcher() decides."""
    if gpus == 1:
        return ctseg_command()
    return ["torchrun", "--standalone", "--nproc_per_node", str(gpus), "-m", "ctseg.cli"]


def trial(
    runner: Runner,
    data: Prepared,
    exp: Mapping[str, Any],
    phases: Mapping[int, Mapping[str, Any]],
    phase: int,
    previous: Path | None,
    device: str | None,
) -> Path:
    """`ctseg trial` for one phase (rule train_trial); returns its summary.json."""
    out = data.results / exp["name"] / "phases" / f"phase{phase}"
    args = [
        "trial",
        *experiment_args("trial", exp, phases, runner.workdir),
        "--phase",
        str(phase),
        "--scratch",
        str(data.scratch),
        "--split",
        str(data.split_csv),
        "--out",
        str(out),
        *(["--previous", str(previous)] if previous is not None else []),
        *(["--device", device] if device else []),
    ]
    runner.run("train_trial", args, f"phase{phase}", launch=launcher(gpus_of(phases[phase], exp)))
    return out / "summary.json"


def train(
    runner: Runner,
    data: Prepared,
    exp: Mapping[str, Any],
    phases: Mapping[int, Mapping[str, Any]],
    phase: int | str,
    trials: Sequence[Path],
    device: str | None,
    init_from: Path | None = None,
    what: str = "",
) -> Path:
    """`ctseg train` (rule train_model); returns last.pt. Its log says which phase auto chose.
    `init_from`: a fine-tune's starting weights (the experiment names its source run); `what`
    names the log when one bench trains several models."""
    run_dir = data.results / exp["name"]
    weights = run_dir / "last.pt"
    # As the rule: with auto, the launcher fits the largest phase it may choose.
    candidates = [read_json(p)["phase"] for p in trials] if phase == "auto" else [int(phase)]
    launch = launcher(max(gpus_of(phases[int(p)], exp) for p in candidates))
    chosen = [str(p) for p in trials] if phase == "auto" else []
    args = [
        "train",
        *experiment_args("train", exp, phases, runner.workdir),
        "--phase",
        str(phase),
        "--trials",
        *chosen,
        "--scratch",
        str(data.scratch),
        "--split",
        str(data.split_csv),
        "--out",
        str(run_dir / "train"),
        "--state-dir",
        str(run_dir / "checkpoints"),
        "--weights",
        str(weights),
        *(["--init-from", str(init_from)] if init_from is not None else []),
        *(["--device", device] if device else []),
    ]
    step = "train" if init_from is None else "fine_tune"
    runner.run(step, args, what, launch=launch)
    return weights


def infer(
    runner: Runner, data: Prepared, exp: Mapping[str, Any], weights: Path, device: str | None
) -> list[Path]:
    """`ctseg infer` per test volume (rule infer, one GPU job at a time); returns the masks."""
    icfg = load_config()["infer"]
    masks = []
    for record_id in data.test_ids:
        mask = data.results / exp["name"] / "predictions" / f"{record_id}.tif"
        args = [
            "infer",
            str(weights),
            str(data.image(record_id)),
            "--mask",
            str(mask),
            "--probabilities",
            str(data.results / exp["name"] / "probabilities" / f"{record_id}.zarr"),
            "--overlap",
            str(icfg["overlap"]),
            "--batch-size",
            str(icfg["batch_size"]),
            *(["--tta-flips"] if icfg["tta_flips"] else []),
            "--threshold",
            str(icfg["threshold"]),
            "--min-component-voxels",
            str(icfg["min_component_voxels"]),
            *(["--fill-holes"] if icfg["fill_holes"] else []),
            "--memory-budget-mb",
            str(icfg["memory_budget_mb"]),
            "--device-budget-mb",
            str(icfg["device_budget_mb"]),
            *(["--device", device] if device else []),
        ]
        runner.run("infer", args, record_id)
        masks.append(mask)
    return masks


def evaluate(
    runner: Runner, predictions: Sequence[Path], labels: Sequence[Path], out: Path, what: str = ""
) -> dict[str, Any]:
    """`ctseg evaluate` (rule evaluate); returns its summary.json (mean_score, mean_dice, ...)."""
    runner.run(
        "evaluate",
        [
            "evaluate",
            "--predictions",
            *map(str, predictions),
            "--labels",
            *map(str, labels),
            "--out",
            str(out),
            "--workers",
            str(EVALUATE_WORKERS),
        ],
        what,
    )
    return json.loads((out / "summary.json").read_text())


def test_labels(data: Prepared) -> list[Path]:
    return [data.dataset / "test_labels" / f"{i}.tif" for i in data.test_ids]


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def last_epoch(data: Prepared, exp: Mapping[str, Any]) -> dict[str, str]:
    """The last row of train/epochs.csv (train loss, val loss, val Dice)."""
    path = data.results / exp["name"] / "train" / "epochs.csv"
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return rows[-1] if rows else {}


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)
    print(f"figures: {path}")
