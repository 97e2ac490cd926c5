"""One report for many runs: the comparison table's numbers are the runs' files' numbers, every
run's loss curves and the same slice of every run are shown, each score says which volumes it
comes from and whether anything was fitted on them, and each run keeps its own sections.

Three fake runs with the files their writers write (columns: ctseg.summaries, train.py,
metrics.evaluate_pairs, tuning's tuned.json, records.write_split, Snakemake's benchmark TSVs,
the JSON `ctseg train` prints into its log): exp001 (trained, scored on test, tuned on val),
exp001_full (trained, tuned on the very volumes it is scored on) and ens1 (an ensemble: no
phases/ or train/, one scored volume).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
from browser_check import INSTALL_HINT, WIDTHS, check_page, find_chromium
from matplotlib import image as mpimg

from ctseg.cli import main
from ctseg.formatting import fmt
from ctseg.io import CtsegError
from ctseg.report import build_runs_report
from ctseg.report.provenance import Provenance
from ctseg.report.timings import GPU_RULES
from ctseg.run_settings import write_run_settings
from ctseg.store import create_volume
from ctseg.summaries import TrialSummary, step_columns

REPO = Path(__file__).resolve().parents[1]
SHAPE = (10, 40, 40)
SCORE_HEADER = (
    "id,score,surface_dice,voi_score,voi_split,voi_merge,voi_total,topo_score,topo_f1_0,"
    "topo_f1_1,topo_f1_2,topo_method,dice,cldice"
)
BENCH_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time"


def write_scores(folder: Path, rows: dict[str, tuple[float, float, float]], provenance: dict):
    """scores.csv and summary.json as metrics.evaluate_pairs writes them (+ provenance)."""
    folder.mkdir(parents=True)
    lines = [SCORE_HEADER]
    table = []
    for record_id, (sd, voi, topo) in rows.items():
        score = 0.35 * sd + 0.35 * voi + 0.30 * topo
        table.append({"score": score, "surface_dice": sd, "voi_score": voi, "topo_score": topo})
        lines.append(
            f"{record_id},{score},{sd},{voi},0.5,0.5,1.0,{topo},0.9,0.5,0.4,betti_matching,0.8,0.7"
        )
    (folder / "scores.csv").write_text("\n".join(lines) + "\n")
    means = pd.DataFrame(table).mean()
    summary = {"volumes": len(rows), "topo_method": "betti_matching"}
    summary |= {f"mean_{k}": float(v) for k, v in means.items()}
    (folder / "summary.json").write_text(json.dumps({**summary, "provenance": provenance}))


def write_train(folder: Path, rows: int, rate: float, val_dice: list[float]) -> None:
    """train/steps.csv (the training loop's columns) and epochs.csv, one epoch per 10 steps."""
    folder.mkdir(parents=True)
    terms = ("bce", "dice")
    lines = [",".join(step_columns(terms))]
    for i in range(rows):
        step_s = 2 / rate
        loss = [0.8 * np.exp(-i / (rows / 3)) + 0.01 * (i % 3), 0.5 * np.exp(-i / rows)]
        values = [i // 10, i + 1, 0.1, 0.01, step_s - 0.11, step_s, rate + 0.1 * (i % 2)]
        values += [sum(loss), *loss, 1.0, 1e-3, 50.0, 900.0, 2000.0]
        lines.append(",".join(f"{v:.6g}" for v in values))
    (folder / "steps.csv").write_text("\n".join(lines) + "\n")
    epochs = ["epoch,step,train_loss,samples_per_s,data_wait_fraction,val_loss,val_dice"]
    epochs += [
        f"{e},{10 * (e + 1)},0.5,{rate},0.05,{0.9 - 0.1 * e},{d}" for e, d in enumerate(val_dice)
    ]
    (folder / "epochs.csv").write_text("\n".join(epochs) + "\n")


def write_bench(run: Path, jobs: dict[str, float]) -> None:
    for name, seconds in jobs.items():
        path = run / "benchmarks" / f"{name}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{BENCH_HEADER}\n{seconds}\t0:00:01\t300.0\t1\t1\t1\t0\t0\t90\t1.0\n")


def write_prediction(run: Path, record_id: str, shift: int) -> None:
    pred = np.zeros(SHAPE, np.uint8)
    pred[:, 14 + shift : 22 + shift, 4:36] = 1
    path = run / "predictions" / f"{record_id}.tif"
    path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(path, pred, photometric="minisblack")


def write_volume(results: Path, record_id: str, seed: int) -> tuple[str, str, str]:
    rng = np.random.default_rng(seed)
    label = np.zeros(SHAPE, np.uint8)
    label[:, 15:23, :] = 1
    label[:, :, 34:] = 2
    image = rng.integers(0, 60, SHAPE, dtype=np.uint8)
    image[label == 1] += 150
    image_path = results / "preprocessed/demo/zarr/images" / f"{record_id}.zarr"
    label_path = results / "preprocessed/demo/zarr/labels" / f"{record_id}.zarr"
    create_volume(image_path, SHAPE, np.uint8, (16, 16, 16), attributes={"p0_5": 1.0})[:] = image
    create_volume(label_path, SHAPE, np.uint8, (16, 16, 16))[:] = label
    return (
        record_id,
        str(image_path.relative_to(results.parent)),
        str(label_path.relative_to(results.parent)),
    )


def trial(phase: int, rate: float) -> TrialSummary:
    return TrialSummary(
        phase=phase,
        status="ok",
        settings={"workers": phase + 1, "batch_size": 2},
        samples_per_s=rate,
        median_step_s=2 / rate,
        verdict="compute-bound",
        verdict_reason="recorded",
        next_knob="none",
        version=2,
    )


def make_runs(root: Path) -> dict:
    results = root / "results"
    exp = results / "exp001"
    for phase, rate in ((0, 3.0), (1, 5.0)):
        (exp / "phases" / f"phase{phase}").mkdir(parents=True)
        trial(phase, rate).write(exp / "phases" / f"phase{phase}" / "summary.json")
    write_train(exp / "train", 40, rate=5.0, val_dice=[0.31, 0.52, 0.61, 0.655])
    write_scores(
        exp / "evaluation",
        {"v1": (0.9, 0.4, 0.6), "v2": (0.7, 0.3, 0.5)},
        {"scored_split": "test", "tuned_on": "val"},
    )
    (exp / "postprocess").mkdir()
    (exp / "postprocess" / "tuned.json").write_text(
        json.dumps({"label": "t>0.4", "score": 0.6, "volumes": ["v3"], "settings": {}})
    )
    (exp / "split.csv").write_text(
        "id,scroll_id,split\nv4,1,train\nv5,1,train\nv3,2,val\nv1,3,test\nv2,3,test\n"
    )
    write_bench(exp, {"train": 3600, "train_trial/phase0": 1800, "infer/v1": 360, "evaluate": 720})
    log = results / "logs" / "train" / "exp001.log"
    log.parent.mkdir(parents=True)
    printed = {"phase": 1, "steps": 40, "world_size": 2, "device": "cuda:0"}
    log.write_text(
        "phase auto: chose phase 1\ntrain: 100%|####| 40/40\r\n"
        + json.dumps(printed, indent=1)
        + "\n"
    )
    for record_id, shift in (("v1", 0), ("v2", 1)):
        write_prediction(exp, record_id, shift)
    base = {
        "name": "exp001",
        "init_from": None,
        "model": {"filters": [8, 16], "block": "plain", "blocks_per_stage": None},
        "train": {"lr": 0.002, "ema": {"decay": 0.999, "start_step": 1000}},
        "data": {"patch_size": [32, 48, 48]},
    }
    phase = {"batch_size": 2, "workers": 2}
    write_run_settings(
        exp / "train",
        base,
        phase,
        phase_id=1,
        phase_auto=True,
        weights="ema",
        source_weights=None,
        run_identity="aaaa",
    )

    full = results / "exp001_full"
    write_train(full / "train", 60, rate=8.0, val_dice=[0.4, 0.7])
    fine_tune = {
        **base,
        "name": "exp001_full",
        "init_from": "exp001",
        "model": {**base["model"], "block": "residual", "blocks_per_stage": [1, 2]},
        "train": {"lr": 0.001, "ema": None},
        "data": {"patch_size": [48, 64, 64]},
    }
    write_run_settings(
        full / "train",
        fine_tune,
        phase,
        phase_id=4,
        phase_auto=False,
        weights="trained",
        source_weights="d1g3",
        run_identity="b",
    )
    write_scores(
        full / "evaluation",
        {"v3": (0.95, 0.5, 0.7), "v6": (0.85, 0.45, 0.65), "v7": (0.6, 0.2, 0.3)},
        # The keys the workflow's evaluate rule records (provenance_args in common.smk).
        {"run": "exp001_full", "kind": "trained", "scored_on": "val", "fitted_on_scored": "yes"},
    )
    (full / "postprocess").mkdir()
    (full / "postprocess" / "tuned.json").write_text(
        json.dumps({"label": "t>0.3", "volumes": ["v3", "v6", "v7"], "settings": {}})
    )
    write_bench(full, {"train": 7200, "infer/v1": 180})
    write_prediction(full, "v1", 3)  # v2 has no prediction from this run

    ens = results / "ens1"
    write_scores(
        ens / "evaluation",
        {"v1": (0.92, 0.42, 0.62)},
        # members and weights: as the evaluate rule records them for an ensemble (ctseg.runs)
        {
            "scored_split": "test",
            "weights_tuned_on": "val",
            "kind": "ensemble",
            "members": "exp001,exp001_full",
            "weights": "2,1",
        },
    )
    write_bench(ens, {"ensemble/v1": 30, "evaluate": 60})
    for record_id, shift in (("v1", -1), ("v2", 2)):
        write_prediction(ens, record_id, shift)
    volumes = [write_volume(results, "v1", 1), write_volume(results, "v2", 2)]
    return {"results": results, "volumes": volumes}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, str, dict]:
    root = tmp_path_factory.mktemp("compare")
    made = make_runs(root)
    cwd = os.getcwd()
    os.chdir(root)  # the workflow runs `ctseg report` from its root, paths relative to it
    try:
        args = ["report", "--out", "results/report.html"]
        args += [
            a for run in ("exp001", "exp001_full", "ens1") for a in ("--run", f"results/{run}")
        ]
        for volume in made["volumes"]:
            args += ["--overlay", *volume]
        assert main([*args, "--benchmarks-dir", "results/benchmarks"]) == 0
    finally:
        os.chdir(cwd)
    out = root / "results" / "report.html"
    return out, out.read_text(), made


def table_rows(html: str) -> list[list[str]]:
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", html, re.S)
    return [
        [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r)]
        for r in rows
    ]


def block(page: str, anchor: str, until: str = "<h2") -> str:
    start = page.index(f'id="{anchor}"')
    end = page.find(until, start + 1)
    return page[start : end if end > 0 else len(page)]


def comparison(page: str) -> dict[str, dict[str, str]]:
    rows = table_rows(block(page, "comparison"))
    header = rows[0]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows[1:]}


def mean_std(cell: str) -> tuple[float, float | None]:
    parts = [float(p) for p in re.findall(r"[\d.]+", cell)]
    return parts[0], (parts[1] if len(parts) > 1 else None)


# --------------------------------------------------------------------------- comparison table
def test_comparison_table_is_the_files_numbers(rendered):
    _, page, made = rendered
    table = comparison(page)
    assert list(table) == ["exp001", "exp001_full", "ens1"]
    results = made["results"]
    for run in table:
        scores = pd.read_csv(results / run / "evaluation" / "scores.csv")
        assert table[run]["scored split (n volumes)"].endswith(f" ({len(scores)})")
        for column, header in (
            ("score", "score"),
            ("surface_dice", "SurfaceDice"),
            ("voi_score", "VOI score"),
            ("topo_score", "TopoScore"),
        ):
            cell = table[run][f"{header} (mean ± std)"]
            mean, std = mean_std(cell)
            assert mean == pytest.approx(scores[column].mean(), abs=5e-5), (run, column)
            if len(scores) > 1:
                assert std == pytest.approx(scores[column].std(ddof=1), abs=5e-5), (run, column)
                assert cell == f"{fmt(scores[column].mean(), 4)} ± {fmt(scores[column].std(), 4)}"
            else:
                assert std is None  # one volume: no spread to show
    exp = table["exp001"]
    steps = pd.read_csv(results / "exp001/train/steps.csv")
    assert exp["steps"] == "40" == str(len(steps))
    assert exp["val Dice (patches, last epoch)"] == "0.655"
    assert exp["samples/s (mean)"] == fmt(steps["samples_per_s"].mean())  # 5.05
    assert exp["phase, train device"] == "1 (auto), cuda:0"  # as printed
    # Job hours: 3600 + 1800 + 360 + 720 s. GPU-hours: train x 2 GPUs (world_size in its log)
    # + train_trial + infer; evaluate holds no GPU.
    assert exp["job hours (with members)"] == "1.80"
    hours = "GPU- or CPU-hours (with members)"
    assert exp[hours] == f"{fmt((2 * 3600 + 1800 + 360) / 3600)} GPU-hours"  # cuda:0
    full = table["exp001_full"]
    assert full["steps"] == "60" and full["val Dice (patches, last epoch)"] == "0.700"
    # The phase is settings.json's id, whatever a log says or lacks (exp001_full has no log).
    assert full["phase, train device"] == "4, device not recorded"
    assert full[hours] == f"{fmt((7200 + 180) / 3600)} device hours (device not recorded)"
    # The ensemble's row counts its members' training: its own 90 s, then theirs.
    ens = table["ens1"]
    trained = "2 members trained"
    assert ens["steps"] == trained
    assert ens["phase, train device"] == ens["val Dice (patches, last epoch)"] == "n/a"
    job_s = 90 + (3600 + 1800 + 360 + 720) + (7200 + 180)
    gpu_s = (2 * 3600 + 1800 + 360) + (7200 + 180)
    assert ens["job hours (with members)"] == (
        f"{fmt(job_s / 3600)} (own {fmt(90 / 3600)} + 2 members)"
    )
    # Its members trained on cuda:0 and on a device not recorded: GPU-hours.
    assert ens[hours] == f"{fmt(gpu_s / 3600)} GPU-hours (own 0 + 2 members)"


def test_each_row_names_its_files(rendered):
    _, page, _ = rendered
    sources = block(page, "comparison")
    items = dict(re.findall(r"<li><b>([^<]+)</b>: (.*?)</li>", sources))
    for name in (
        "results/exp001/evaluation/scores.csv",
        "results/exp001/train/steps.csv",
        "results/exp001/train/epochs.csv",
        "results/logs/train/exp001.log",
        "results/exp001/benchmarks/train.tsv",
        "results/exp001/benchmarks/train_trial/phase0.tsv",
        "results/exp001/postprocess/tuned.json",
        "results/exp001/split.csv",
    ):
        assert name in items["exp001"], name
    assert "results/ens1/benchmarks/ensemble/v1.tsv" in items["ens1"]
    # Besides its own files, the ensemble's row reads its members' timings (and nothing else).
    others = re.findall(r"<code>([^<]+)</code>", items["ens1"].replace("results/ens1/", "ENS/"))
    member_files = [f for f in others if not f.startswith("ENS/")]
    assert "results/exp001_full/benchmarks/train.tsv" in member_files
    assert all(
        f.startswith(("results/exp001/benchmarks/", "results/exp001_full/benchmarks/"))
        or f == "results/logs/train/exp001.log"
        for f in member_files
    ), member_files
    files = block(page, "sources")
    assert "results/exp001_full/evaluation/summary.json" in files
    assert "results/logs/train/exp001.log" in files


# --------------------------------------------------------------------------- provenance
def test_provenance_says_which_volumes_and_what_was_fitted(rendered):
    _, page, _ = rendered
    table = comparison(page)
    assert table["exp001"]["scored split (n volumes)"] == "test (2)"
    assert table["exp001"]["fitted on them"] == "no"
    assert table["exp001_full"]["scored split (n volumes)"] == "val (3)"
    assert table["exp001_full"]["fitted on them"] == "yes"
    assert table["ens1"]["fitted on them"] == "no"
    exp = block(page, "exp001-provenance", "<h3")
    assert "Scored on <b>2</b> volume(s) of split <b>test</b>: v1, v2." in exp
    assert "tuning (1 volume(s) in tuned.json): none of them scored" in exp
    assert "training (2 train ids in split.csv): none" in exp
    assert "tuned_on = val, not the scored split" in exp
    assert ["tuned_on", "val"] in table_rows(exp)
    full = block(page, "exp001_full-provenance", "<h3")
    assert "post-processing tuned on 3 of the scored volumes" in full
    assert "fitted_on_scored = yes, as the workflow recorded it" in full
    assert "optimistic" in full
    ens = block(page, "ens1-provenance", "<h3")
    assert "post-processing fixed" in ens and "weights_tuned_on = val" in ens


# --------------------------------------------------------------------------- curves, overlays
def images(html: str) -> dict[str, str]:
    return dict((alt, src) for src, alt in re.findall(r'<img src="([^"]+)" alt="([^"]+)">', html))


def test_loss_curves_of_every_run_and_each_runs_own_sections(rendered):
    _, page, _ = rendered
    assert "loss curves of every run" in images(block(page, "comparison"))
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # several runs' sections, no clashing anchors
    for run in ("exp001", "exp001_full"):
        own = block(page, f"run-{run}")
        assert f'id="{run}-training"' in own and f'id="{run}-evaluation"' in own
        assert "training and validation loss curves" in images(own)
        assert f"results/{run}/train/steps.csv" in own
    assert "phase trial figures" in images(block(page, "run-exp001"))
    ens = block(page, "run-ens1")
    assert "trained nothing of its own" in ens and 'id="ens1-training"' not in ens
    assert 'id="ens1-evaluation"' in ens and 'id="ens1-timings"' in ens


def test_overlays_show_the_same_slice_of_every_run(rendered):
    _, page, _ = rendered
    overlays = block(page, "overlays")
    assert set(images(overlays)) == {"overlay v1, every run", "overlay v2, every run"}
    assert overlays.count("slice 5 of 10, every run") == 2
    for run in ("exp001", "exp001_full", "ens1"):
        assert f"results/{run}/predictions/v1.tif" in overlays
    assert (
        "Overlay v2: prediction of exp001_full: not found "
        "(<code>results/exp001_full/predictions/v2.tif</code>)" in overlays
    )


def test_every_image_is_an_embedded_png(rendered):
    _, page, _ = rendered
    sources = re.findall(r"<img[^>]*\ssrc=\"([^\"]*)\"", page)
    assert len(sources) == page.count("<img") >= 8
    for src in sources:
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        pixels = mpimg.imread(io.BytesIO(data), format="png")
        assert pixels.ndim == 3 and pixels.std() > 0.01


# --------------------------------------------------------------------------- one run, errors
def test_one_run_is_a_one_row_comparison(tmp_path):
    results = make_runs(tmp_path)["results"]
    out = tmp_path / "one.html"
    build_runs_report(out, [results / "ens1"], root=tmp_path)
    page = out.read_text()
    assert list(comparison(page)) == ["ens1"]
    assert comparison(page)["ens1"]["score (mean ± std)"] == fmt(
        0.35 * 0.92 + 0.35 * 0.42 + 0.3 * 0.62, 4
    )
    assert "Runs <b>ens1</b>" in page and 'id="ens1-timings"' in page
    assert "Slice overlays (--overlay ID IMAGE LABEL): no input given" in page
    assert "Shared timings (jobs of no run: preprocessing)</h2>" in page


def test_bad_runs_are_errors_naming_the_file(tmp_path):
    results = make_runs(tmp_path)["results"]
    out = tmp_path / "report.html"
    with pytest.raises(CtsegError, match="results/nope: no such run directory"):
        build_runs_report(out, [results / "exp001", results / "nope"])
    (results / "exp001_full/evaluation/scores.csv").write_text("id,score\nv3,0.5\n")
    with pytest.raises(CtsegError, match="exp001_full/evaluation/scores.csv: not an evaluation"):
        build_runs_report(out, [results / "exp001", results / "exp001_full"])
    (results / "ens1/evaluation/summary.json").write_text('{"provenance": ["test"]}')
    with pytest.raises(CtsegError, match="ens1/evaluation/summary.json: 'provenance'"):
        build_runs_report(out, [results / "ens1"])
    assert not out.exists()
    assert (
        main(
            [
                "report",
                "--out",
                str(out),
                "--run",
                str(results / "exp001"),
                "--overlay",
                "v1",
                "a.zarr",
                "b.zarr",
                "c.tif",
            ]
        )
        == 2
    )


def test_gpu_rules_are_the_workflows_gpu_jobs():
    """GPU-hours count the benchmark folders of exactly the rules that request a GPU."""
    found = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for rule in re.split(r"\n(?=rule \w+:)", smk.read_text()):
            bench = re.search(r'bench\("\{exp\}", "([^"/]+)', rule)
            if re.search(r"^\s+gpu=", rule, re.M):
                assert bench, f"{smk.name}: a GPU rule without a per-run benchmark"
                found.add(bench.group(1))
    assert found == set(GPU_RULES)


# --------------------------------------------------------------------------- real browser
@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is not None:
        return found
    message = f"chromium is not on PATH; install it (as root) with: {INSTALL_HINT}"
    if os.environ.get("CI") or os.geteuid() == 0:  # as in test_report: `make test` installs it
        pytest.fail(message)
    pytest.skip(f"{message}; then run `make test`")


def test_several_run_report_renders_in_headless_chromium(rendered, chromium, tmp_path):
    out, page, _ = rendered
    result = check_page(out, tmp_path / "compare_screenshot.png")
    for width in WIDTHS:  # check_page raises on a table too wide or a word broken
        assert result[width]["images_ok"] == result[width]["images_total"] == page.count("<img")


def test_fitted_is_yes_only_on_evidence_and_no_only_when_checked():
    scored = ["a", "b"]
    assert Provenance(scored=scored, tuned=["b", "c"]).fitted()[0] == "yes"
    assert Provenance(scored=scored, train_ids=["a"]).fitted()[0] == "yes"
    assert Provenance(scored=scored, tuned=["c"], train_ids=["d"]).fitted()[0] == "no"
    recorded = {"scored_split": "val", "weights_tuned_on": "val"}
    assert Provenance(scored=scored, recorded=recorded).fitted()[0] == "yes"
    # A fitted-on split with no scored split to compare it with decides nothing.
    assert Provenance(scored=scored, recorded={"tuned_on": "val"}).fitted()[0] == "not recorded"
    assert Provenance(scored=None, tuned=["a"]).fitted()[0] == "not recorded"
    # The scored split's own key is no fitting; the workflow's recorded answer counts.
    recorded = {"scored_on": "demo_test_volumes", "fitted_on_scored": "no"}
    assert Provenance(scored=scored, recorded=recorded).fitted()[0] == "no"
    assert Provenance(scored=scored, recorded=recorded).scored_split == "demo_test_volumes"
    recorded = {"scored_on": "val", "fitted_on_scored": "yes"}
    assert Provenance(scored=scored, recorded=recorded).fitted()[0] == "yes"
    # A fact beats a recorded "no": tuning saw a scored volume.
    recorded = {"scored_on": "val", "fitted_on_scored": "no"}
    assert Provenance(scored=scored, recorded=recorded, tuned=["a"]).fitted()[0] == "yes"


def test_the_loss_plot_has_each_trained_runs_curves(tmp_path):
    """One line per trained run in each panel, its points the run's own steps.csv/epochs.csv."""
    from ctseg.report.compare import _loss_figure, read_run
    from ctseg.report.markup import Sources
    from ctseg.report.runs import run_from_dir

    results = make_runs(tmp_path)["results"]
    src = Sources(tmp_path)
    facts = [read_run(run_from_dir(results / r), src) for r in ("exp001", "exp001_full", "ens1")]
    train, val, dice = _loss_figure(facts).axes
    assert [line.get_label() for line in train.get_lines()] == ["exp001", "exp001_full"]
    steps = pd.read_csv(results / "exp001_full/train/steps.csv")
    assert list(train.get_lines()[1].get_xdata()) == list(steps["step"])
    epochs = pd.read_csv(results / "exp001/train/epochs.csv")
    assert list(dice.get_lines()[0].get_ydata()) == list(epochs["val_dice"])
    assert [line.get_label() for line in val.get_lines()] == ["exp001", "exp001_full"]


def test_a_run_without_results_says_what_is_missing(tmp_path):
    (tmp_path / "results" / "bare").mkdir(parents=True)
    out = tmp_path / "bare.html"
    build_runs_report(out, [tmp_path / "results" / "bare"], root=tmp_path)
    page = out.read_text()
    row = comparison(page)["bare"]
    assert row["scored split (n volumes)"] == "not recorded (n/a)"
    assert row["score (mean ± std)"] == row["job hours (with members)"] == "n/a"
    assert row["fitted on them"] == "not recorded"
    assert "Scored volumes: not found (<code>results/bare/evaluation/scores.csv</code>)" in page
    assert "Evaluation means: not found (<code>results/bare/evaluation/summary.json" in page
    assert "Loss curves (train/steps.csv of any run): no input given" in page
    assert "<img" not in page


# --------------------------------------------------------------------------- settings
def test_settings_show_what_differs_between_runs_first(rendered):
    """Every run's train/settings.json side by side: the keys that differ (EMA, init_from, the
    residual blocks, the patch) in the first table, the rest after; an ensemble trained
    nothing of its own."""
    _, page, _ = rendered
    section = block(page, "settings")
    tables = re.findall(r"<table>.*?</table>", section, re.S)
    assert len(tables) == 2
    differ, same = ({r[0]: r[1:] for r in table_rows(t)[1:]} for t in tables)
    assert table_rows(tables[0])[0] == ["setting", "exp001", "exp001_full", "ens1"]
    assert differ["init_from"] == ["null", "exp001", "(no training)"]
    assert differ["train.ema.decay"] == ["0.999", "(not set)", "(no training)"]
    assert differ["train.ema"] == ["(not set)", "null", "(no training)"]
    assert differ["model.block"][:2] == ["plain", "residual"]
    assert differ["model.blocks_per_stage"][:2] == ["null", "[1,2]"]
    assert differ["data.patch_size"][:2] == ["[32,48,48]", "[48,64,64]"]
    assert differ["weights"][:2] == ["ema", "trained"]
    assert differ["source_weights"][:2] == ["null", "d1g3"]
    assert "model.filters" not in differ and same["model.filters"][:2] == ["[8,16]", "[8,16]"]
    assert same["phase.batch_size"][:2] == ["2", "2"]
    assert "results/exp001/train/settings.json" in section
