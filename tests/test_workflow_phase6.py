"""`snakemake train --config phase=6` on the demo: bf16 autocast, channels_last, the real
default torch.compile (inductor, which needs the machine's C compiler) and device prefetch,
end to end through the rules on 2 CPU cores, then inference from the weights it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch
import yaml
from conftest import REPO, TINY_CONFIG, copy_workflow, run_snakemake

PHASE6 = yaml.safe_load((REPO / "config" / "phases.yaml").read_text())["phases"][6]


def test_phase6_as_shipped_trains_through_snakemake(tmp_path: Path) -> None:
    assert PHASE6["compile"] and PHASE6["channels_last"] and PHASE6["precision"] == "bf16"
    work = copy_workflow(tmp_path, TINY_CONFIG)
    run_snakemake(work, "--cores", "2", "stage", "--config", "experiment=tiny")
    proc = run_snakemake(work, "--cores", "2", "train", "--config", "experiment=tiny", "phase=6")
    assert "rule train:" in proc.stderr

    run = work / "results" / "tiny"
    log = (work / "results" / "logs" / "train" / "tiny.log").read_text()
    summary = json.loads(log[log.index('{\n "phase"') :])
    assert summary["phase"] == 6 and summary["resume"] == "fresh"
    exp = yaml.safe_load((work / "config" / "experiments" / "tiny.yaml").read_text())
    total = exp["train"]["epochs"] * exp["train"]["steps_per_epoch"]
    steps = pd.read_csv(run / "train" / "steps.csv")
    assert list(steps["step"]) == list(range(1, total + 1))
    assert steps["loss"].notna().all()
    weights = torch.load(run / "last.pt", weights_only=True)
    assert weights["step"] == total
    assert all(t.is_contiguous() for t in weights["model"].values())

    # The weights of a channels_last, compiled run predict like any others.
    run_snakemake(work, "--cores", "2", "predict", "--config", "experiment=tiny", "phase=6")
    assert list((run / "predictions").glob("*.tif"))
