"""The report's stage timings: every Snakemake `benchmark:` TSV under results/benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ctseg.formatting import fmt, num
from ctseg.io import CtsegError
from ctseg.report.markup import Sources, esc, missing, png, read_table, table


def _read_benchmarks(benchmarks_dir: Path, src: Sources) -> pd.DataFrame:
    rows = []
    for path in sorted(benchmarks_dir.rglob("*.tsv")):
        frame = read_table(path, sep="\t", na_values=["NA", "-"])
        if "s" not in frame.columns or frame.empty:
            raise CtsegError(f"{path}: not a Snakemake benchmark TSV (no 's' column or no rows)")
        parts = path.relative_to(benchmarks_dir).with_suffix("").parts
        rule, job = (parts[0], "/".join(parts[1:])) if len(parts) > 1 else (parts[0], "")
        rows.append(
            {
                "rule": rule,
                "job": job,
                # A benchmark with repeat(...) has one row per repeat: report their mean.
                "repeats": len(frame),
                "s": float(frame["s"].mean()),
                "max_rss_mb": num(frame["max_rss"].max()) if "max_rss" in frame else None,
                "cpu_time": num(frame["cpu_time"].mean()) if "cpu_time" in frame else None,
                "file": src.use(path),
            }
        )
    return pd.DataFrame(rows)


def _timing_figure(totals: pd.Series) -> Figure:
    fig = Figure(figsize=(9, 0.45 * len(totals) + 1.2), layout="constrained")
    ax = fig.subplots()
    ax.barh(totals.index, totals.values, color="#4c72b0")
    ax.invert_yaxis()
    ax.set(title="total seconds per rule (sum over jobs)", xlabel="seconds")
    return fig


def timing_section(benchmarks_dir: Path | None, src: Sources, title: str = "Stage timings") -> str:
    out = [f'<h2 id="timings">{esc(title)}</h2>']
    if benchmarks_dir is None:
        return "\n".join([*out, missing("Stage timings")])
    benchmarks_dir = Path(benchmarks_dir)
    jobs = _read_benchmarks(benchmarks_dir, src) if benchmarks_dir.is_dir() else pd.DataFrame()
    if jobs.empty:
        where = src.rel(benchmarks_dir) + "/<rule>/*.tsv"
        return "\n".join([*out, missing("Stage timings (benchmark TSVs)", [where])])
    rows = [
        [
            r.rule,
            r.job,
            fmt(r.s),
            fmt(r.max_rss_mb),
            fmt(r.cpu_time),
            fmt(r.repeats),
            r.file,
        ]
        for r in jobs.itertuples()
    ]
    header = ["rule", "job", "seconds", "max RSS MB", "CPU s", "repeats", "file"]
    out.append(table(header, rows))
    totals = jobs.groupby("rule")["s"].sum().sort_values(ascending=False)
    out.append(png(_timing_figure(totals), "total seconds per rule"))
    out.append(
        f"<p class='source'>Read from the Snakemake <code>benchmark:</code> files under "
        f"<code>{esc(src.rel(benchmarks_dir))}</code> (listed per row).</p>"
    )
    return "\n".join(out)


# The rules whose jobs hold a GPU (`resources: gpu=` in workflow/rules/*.smk; a test keeps
# the two in step). Their wall time is the run's GPU time.
GPU_RULES: tuple[str, ...] = ("infer", "predict", "scroll", "train", "train_trial")


@dataclass(frozen=True)
class RunHours:
    """A run's job time from its benchmark TSVs: every job, and the GPU rules' jobs."""

    job_s: float | None
    gpu_s: float | None
    jobs: int
    files: tuple[str, ...]


def run_hours(benchmarks_dir: Path | None, src: Sources, train_gpus: int = 1) -> RunHours:
    """Sum of wall seconds over the run's jobs, and over its GPU-rule jobs times their GPUs.

    Only the train job's GPU count is recorded anywhere (`world_size` in its log, passed as
    `train_gpus`); every other GPU-rule job counts one GPU.
    """
    if benchmarks_dir is None or not Path(benchmarks_dir).is_dir():
        return RunHours(None, None, 0, ())
    jobs = _read_benchmarks(Path(benchmarks_dir), src)
    if jobs.empty:
        return RunHours(None, None, 0, ())
    gpu = jobs[jobs["rule"].isin(GPU_RULES)]
    gpus = np.where(gpu["rule"] == "train", train_gpus, 1)
    return RunHours(
        job_s=float(jobs["s"].sum()),
        gpu_s=float((gpu["s"] * gpus).sum()),
        jobs=len(jobs),
        files=tuple(jobs["file"]),
    )
