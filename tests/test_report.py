"""The HTML report: self-contained, numbers traced to files, missing inputs reported, verdicts.

The inputs are small fake results with the exact columns that phases.py, train.py, metrics.py
and Snakemake's benchmark: directive write.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import tifffile
from browser_check import INSTALL_HINT, check_page, find_chromium, image_counts
from matplotlib import image as mpimg

from ctseg.io import CtsegError
from ctseg.report import IMAGE_CHECK_SCRIPT, build_report, loss_terms, verdict
from ctseg.store import create_volume

EXP = "exp001"
SETTINGS = {
    "workers": 1,
    "batch_size": 1,
    "prefetch_factor": 1,
    "persistent_workers": False,
    "pin_memory": False,
    "mp_context": "fork",
    "drop_last": True,
    "device_prefetch": False,
    "precision": "fp32",
    "channels_last": False,
    "compile": False,
}


def summary(phase: int, status: str = "ok", **overrides) -> dict:
    """A phase summary.json as phases.run_trial writes it."""
    settings = {**SETTINGS, **overrides.pop("settings", {})}
    out = {
        "phase": phase,
        "settings": settings,
        "maths": {
            "batch_size": settings["batch_size"],
            "accumulate": settings.get("accumulate", 1),
            "precision": settings["precision"],
        },
        "effective_batch": settings["batch_size"] * settings.get("accumulate", 1),
        "trial_steps": 20,
        "status": status,
    }
    if status in ("oom", "failed"):
        out["error"] = overrides.pop("error", "OutOfMemoryError: CUDA out of memory.")
        out["traceback"] = "Traceback ..."
        return out
    out.update(
        device="cuda:0",
        median_step_s=0.5,
        samples_per_s=2.0,
        data_wait_fraction=0.05,
        h2d_fraction=0.02,
        ceiling_samples_per_s=2.1,
        feed_efficiency=0.95,
        gpu_util_mean=80.0,
        peak_vram_gb=20.0,
        peak_host_rss_gb=6.0,
        vram_limit_gb=80.0,
        host_ram_limit_gb=150.0,
        checks={"vram_ok": True, "host_ram_ok": True},
    )
    out.update(overrides)
    return out


PHASES = [
    summary(
        0,
        median_step_s=2.4375,
        samples_per_s=0.41026,
        data_wait_fraction=0.6234,
        h2d_fraction=0.031,
        feed_efficiency=0.4127,
        gpu_util_mean=17.0,
        peak_vram_gb=9.8765,
        peak_host_rss_gb=3.2109,
    ),
    summary(
        1,
        settings={"workers": 4, "batch_size": 2, "prefetch_factor": 2},
        median_step_s=0.8,
        samples_per_s=2.5,
        data_wait_fraction=0.04,
        feed_efficiency=0.97,
        peak_vram_gb=19.5,
        checks={
            "vram_ok": True,
            "host_ram_ok": True,
            "previous_phase": 0,
            "step_time_vs_previous": 0.328,
            "speedup_vs_previous": 6.0937,
        },
    ),
    summary(2, "oom", settings={"workers": 4, "batch_size": 8}),
    summary(
        3,
        "over_memory",
        settings={"workers": 6, "batch_size": 4, "prefetch_factor": 4},
        peak_host_rss_gb=170.0,
        checks={"vram_ok": True, "host_ram_ok": False},
    ),
]
STEP_COLUMNS = "epoch,step,data_wait_s,h2d_s,compute_s,step_s,samples_per_s,"
TERMS = ("bce", "dice", "cldice")
TAIL_COLUMNS = "grad_norm,lr,gpu_util,vram_peak_mb,host_rss_mb"
SCORES = (
    "id,score,surface_dice,voi_score,voi_split,voi_merge,voi_total,topo_score,topo_f1_0,"
    "topo_f1_1,topo_f1_2,topo_method,dice,cldice\n"
    "1004283650,0.61234,0.7,0.55,0.4,0.6,1.0,0.58,0.9,,0.3,betti_counts,0.81,0.77\n"
    "7,0.4321,0.5,0.45,0.9,0.8,1.7,0.33,0.6,0.1,,betti_counts,0.64,0.52\n"
)


def write_steps(
    path: Path, rows: int, terms: tuple[str, ...] = TERMS, epoch_len: int = 0, seed: int = 0
) -> None:
    rng = np.random.default_rng(seed)
    header = STEP_COLUMNS + ",".join(("loss", *terms)) + "," + TAIL_COLUMNS
    lines = [header]
    for i in range(rows):
        wait, h2d, compute = 0.2 * rng.random() / (1 + seed), 0.01, 0.3 / (1 + seed)
        step = wait + h2d + compute
        loss_terms = [0.9 * np.exp(-i / 20) + 0.05 * rng.random() for _ in terms]
        values = [i // epoch_len if epoch_len else 0, i + 1, wait, h2d, compute, step, 1 / step]
        values += [sum(loss_terms), *loss_terms, 2.0 / (i + 1), 1e-3, float("nan"), 900.0 + i]
        values.append(2000.0 + i)
        lines.append(",".join(f"{v:.6g}" for v in values))
    path.write_text("\n".join(lines) + "\n")


def make_results(root: Path) -> dict:
    """Fake results/ for EXP: 4 phase trials, training logs, scores, 2 volumes, benchmarks."""
    results = root / "results"
    exp = results / EXP
    phase_paths = []
    for item in PHASES:
        folder = exp / "phases" / f"phase{item['phase']}"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(item, indent=1))
        if item["status"] == "oom":
            (folder / "steps.csv").write_text("step\n")  # what run_trial leaves on failure
        else:
            write_steps(folder / "steps.csv", 12, terms=("bce", "dice"), seed=item["phase"])
        phase_paths.append(folder / "summary.json")
    train = exp / "train"
    train.mkdir(parents=True)
    write_steps(train / "steps.csv", 60, epoch_len=20)
    (train / "epochs.csv").write_text(
        "epoch,step,train_loss,samples_per_s,data_wait_fraction,val_loss,val_dice\n"
        "0,20,0.81,2.1,0.31,0.85,0.41\n1,40,0.52,2.2,0.30,0.6,0.58\n2,60,0.44,2.2,0.29,0.5,0.66\n"
    )
    evaluation = exp / "evaluation"
    evaluation.mkdir()
    (evaluation / "scores.csv").write_text(SCORES)
    means = {"score": 0.52222, "surface_dice": 0.6, "dice": 0.725, "n_volumes": 2}
    (evaluation / "summary.json").write_text(json.dumps({**means, "topo_method": "betti_counts"}))
    overlays = [make_volume(results, "1004283650", seed=1), make_volume(results, "7", seed=2)]
    bench = results / "benchmarks"
    for rule, job, seconds, rss in (
        ("convert", "image_1004283650", 3.25, 120.5),
        ("convert", "label_1004283650", 1.75, 80.0),
        ("train", EXP, 412.5, 6500.25),
    ):
        (bench / rule).mkdir(parents=True, exist_ok=True)
        (bench / rule / f"{job}.tsv").write_text(
            "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
            f"{seconds}\t0:00:03\t{rss}\t500.0\t100.0\t110.0\t0.1\t0.2\t95.0\t{seconds * 0.9}\n"
        )
    return {
        "root": root,
        "phase_summaries": phase_paths,
        "train_dir": train,
        "evaluation_dir": evaluation,
        "overlays": overlays,
        "benchmarks_dir": bench,
    }


def make_volume(results: Path, name: str, seed: int) -> tuple[str, Path, Path, Path]:
    """A 12x48x48 volume with a sheet (label 1), an ignore slab (2) and a shifted prediction."""
    rng = np.random.default_rng(seed)
    shape = (12, 48, 48)
    label = np.zeros(shape, np.uint8)
    label[:, 18:26, :] = 1
    label[:, :, 40:] = 2
    image = rng.integers(0, 60, shape, dtype=np.uint8)
    image[label == 1] += 150
    pred = np.zeros(shape, np.uint8)
    pred[:, 20:28, 4:44] = 1
    image_path = results / "zarr" / "images" / f"{name}.zarr"
    label_path = results / "zarr" / "labels" / f"{name}.zarr"
    attrs = {"p0_5": 1.0, "p99_5": 205.0}
    create_volume(image_path, shape, np.uint8, (16, 16, 16), attributes=attrs)[:] = image
    create_volume(label_path, shape, np.uint8, (16, 16, 16))[:] = label
    pred_path = results / EXP / "predictions" / f"{name}.tif"
    pred_path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(pred_path, pred, photometric="minisblack")
    return name, image_path, label_path, pred_path


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str, dict]:
    root = tmp_path_factory.mktemp("report")
    inputs = make_results(root)
    out = root / "results" / "report.html"
    build_report(out, experiment=EXP, cpu_count=8, **inputs)
    return out, out.read_text(), inputs


def table_rows(html: str) -> list[list[str]]:
    """Each table row's cell texts (tags stripped, entities left as they are)."""
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", html, re.S)
    return [
        [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r)]
        for r in rows
    ]


def has_row(html: str, *start: str) -> bool:
    return any(row[: len(start)] == list(start) for row in table_rows(html))


def section(page: str, anchor: str) -> str:
    start = page.index(f'id="{anchor}"')
    end = page.find("<h2", start)
    return page[start : end if end > 0 else len(page)]


# --------------------------------------------------------------------------- the page
def test_one_self_contained_file(report):
    out, page, _ = report
    assert sorted(p.name for p in out.parent.iterdir() if p.is_file()) == ["report.html"]
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page  # inline CSS only


def test_every_image_is_an_embedded_valid_png(report):
    _, page, _ = report
    sources = re.findall(r"<img[^>]*\ssrc=\"([^\"]*)\"", page)
    assert len(sources) == page.count("<img") >= 6  # phases x2, loss, throughput, overlays x2
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = mpimg.imread(io.BytesIO(data), format="png")
        assert pixels.ndim == 3 and min(pixels.shape[:2]) > 50 and pixels.std() > 0.01


def test_phase_table_shows_the_summaries_numbers(report):
    _, page, _ = report
    phases = section(page, "phases")
    assert has_row(phases, "0", "1", "1", "1", "no", "fp32", "ok", "2.44", "0.410", "62%", "3%")
    for text in (
        "2.44",  # phase 0 median step s (2.4375)
        "0.410",  # phase 0 samples/s (0.41026)
        "62%",  # data wait
        "0.41",  # feed efficiency
        "9.88 (80.0)",  # peak VRAM (limit)
        "3.21 (150)",  # peak RSS (limit)
        "6.09× (vs 0)",  # checks.speedup_vs_previous
        "6.09×",  # phase 1 vs phase 0: 2.5 / 0.41026
        "2×1=2 fp32 (≠ 0)",  # maths beside the result: batch×accumulate=effective, precision
        "results/exp001/phases/phase0/summary.json",
        "results/exp001/phases/phase1/steps.csv",
        "oom",
        "over_memory",
    ):
        assert text in phases, text
    # Settings that never vary are summarised once instead of taking columns.
    assert re.search(r"Same in every phase: [^<]*mp_context = fork", phases)
    assert "data wait 62% of step time, feed efficiency 0.41" in phases


def test_training_evaluation_overlays_and_timings(report):
    _, page, _ = report
    training = section(page, "training")
    assert "results/exp001/train/steps.csv" in training
    assert "results/exp001/train/epochs.csv" in training
    assert has_row(training, "optimizer steps", "60")
    assert has_row(training, "1", "40", "0.520", "2.20", "30%", "0.600", "0.580")  # epochs.csv
    evaluation = section(page, "evaluation")
    assert "betti_counts" in evaluation and "upper bound" in evaluation
    assert has_row(evaluation, "1004283650", "0.6123", "0.7000")
    assert has_row(evaluation, "7", "0.4321")  # an id that looks like a number stays an id
    assert has_row(evaluation, "score", "0.5222")  # the mean, from summary.json
    overlays = section(page, "overlays")
    assert (
        "results/zarr/labels/7.zarr" in overlays and "results/exp001/predictions/7.tif" in overlays
    )
    assert "slice 6 of 12" in overlays
    timings = section(page, "timings")
    assert has_row(timings, "train", "exp001", "412", "6500", "371", "1")
    assert "results/benchmarks/convert/label_1004283650.tsv" in timings
    files = section(page, "sources")
    assert files.count("<li>") == 4 * 2 - 1 + 2 + 2 + 2 * 3 + 3  # oom steps.csv has no rows


def test_loss_terms_are_the_columns_beyond_the_fixed_ones():
    header = (STEP_COLUMNS + "loss,bce,skel_recall," + TAIL_COLUMNS).split(",")
    assert loss_terms(header) == ["bce", "skel_recall"]  # not grad_norm, not lr


def test_missing_inputs_are_reported_not_fatal(tmp_path):
    out = tmp_path / "report.html"
    build_report(
        out,
        experiment=EXP,
        phase_summaries=[tmp_path / "results/exp001/phases/phase0/summary.json"],
        train_dir=tmp_path / "results/exp001/train",
        evaluation_dir=None,
        overlays=[("a", tmp_path / "results/zarr/images/a.zarr", None, None)],
        benchmarks_dir=tmp_path / "results/benchmarks",
        root=tmp_path,
    )
    page = out.read_text()
    assert "Phase summaries: not found (<code>results/exp001/phases/phase0/summary.json" in page
    assert "Training steps: not found (<code>results/exp001/train/steps.csv" in page
    assert "Evaluation: no input given" in page
    assert "Overlay a: image: not found" in page
    assert "Stage timings (benchmark TSVs): not found" in page
    assert "<img" not in page


def test_partial_overlay_and_evaluation_say_what_is_missing(tmp_path):
    name, image, label, _ = make_volume(tmp_path / "results", "v1", seed=0)
    evaluation = tmp_path / "results" / EXP / "evaluation"
    evaluation.mkdir(parents=True)
    (evaluation / "scores.csv").write_text(SCORES)
    out = tmp_path / "report.html"
    build_report(
        out,
        experiment=EXP,
        phase_summaries=[],
        train_dir=None,
        evaluation_dir=evaluation,
        overlays=[(name, image, label, tmp_path / "results" / EXP / "predictions" / "gone.tif")],
        benchmarks_dir=None,
        root=tmp_path,
    )
    page = out.read_text()
    assert "Overlay v1: prediction: not found (<code>results/exp001/predictions/gone.tif" in page
    assert "Evaluation means: not found" in page and "0.4321" in page
    assert page.count("<img") == 1


def test_corrupt_input_is_an_error_naming_the_file(tmp_path):
    bad = tmp_path / "phase0" / "summary.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    out = tmp_path / "report.html"
    with pytest.raises(CtsegError, match="phase0/summary.json"):
        build_report(
            out,
            experiment=EXP,
            phase_summaries=[bad],
            train_dir=None,
            evaluation_dir=None,
            overlays=[],
            benchmarks_dir=None,
        )
    assert list(tmp_path.iterdir()) == [bad.parent]  # nothing partial left behind


# --------------------------------------------------------------------------- verdicts
def test_verdict_data_bound_with_free_cores_suggests_more_workers():
    label, text = verdict(PHASES[0], cpu_count=8)
    assert label == "data-bound"
    assert "data wait 62% of step time, feed efficiency 0.41" in text
    assert "next knob: more workers (1 → 2; 8 CPU cores, 6 free)" in text


def test_verdict_data_bound_without_free_cores_suggests_raw_scratch():
    item = summary(5, settings={"workers": 3}, data_wait_fraction=0.02, feed_efficiency=0.85)
    label, text = verdict(item, cpu_count=4)
    assert label == "data-bound"
    assert "data wait 2% of step time, feed efficiency 0.85" in text
    assert "next knob: raw scratch format" in text
    assert "no free CPU core for more workers (4 cores, 3 workers)" in text


def test_verdict_prefers_the_cpu_count_the_trial_recorded():
    _, text = verdict({**PHASES[0], "cpu_count": 2}, cpu_count=64)
    assert "next knob: raw scratch format" in text
    assert "no free CPU core for more workers (2 cores, 1 workers)" in text


def test_verdict_compute_bound_with_vram_headroom():
    label, text = verdict(PHASES[1], cpu_count=8)
    assert label == "compute-bound"
    assert "data wait 4% of step time, feed efficiency 0.97" in text
    assert "next knob: bf16 autocast" in text
    assert "VRAM headroom 4.1x (peak 19.5 of 80.0 GB) > 2x: batch 2 → 4" in text


def test_verdict_compute_bound_with_everything_on():
    on = {"precision": "bf16", "channels_last": True, "compile": True}
    label, text = verdict(summary(6, settings=on, peak_vram_gb=50.0), cpu_count=8)
    assert label == "compute-bound"
    assert "none left on the loader side" in text
    assert "VRAM headroom 1.6x (peak 50.0 of 80.0 GB) ≤ 2x" in text


def test_verdict_h2d_heavy():
    item = summary(4, data_wait_fraction=0.08, h2d_fraction=0.22, feed_efficiency=0.7)
    label, text = verdict(item, cpu_count=8)
    assert label == "h2d-bound"
    assert "data wait 8% of step time, feed efficiency 0.70, host-to-device 22%" in text
    assert "next knob: pin_memory (off now); then device-side prefetch" in text


def test_verdict_oom_and_over_memory_and_failed():
    label, text = verdict(PHASES[2], cpu_count=8)
    assert label == "out of memory"
    assert "batch 8 × accum. 1 = 8, fp32" in text and "CUDA out of memory" in text
    assert "batch 8 → 4 with accumulate ×2 (same effective batch)" in text
    assert "gradient checkpointing" in text
    label, text = verdict(PHASES[3], cpu_count=8)
    assert label == "over memory"
    assert "peak host RSS 170 GB > limit 150 GB" in text
    assert "fewer workers (6 → 3)" in text and "prefetch_factor 4 → 2" in text
    label, text = verdict(summary(8, "oom", settings={"batch_size": 1}), cpu_count=8)
    assert "next knob: gradient checkpointing; then bf16 autocast" in text
    assert text.count("gradient checkpointing") == 1
    label, text = verdict(summary(7, "failed", error="RuntimeError: boom"), cpu_count=8)
    assert (label, "RuntimeError: boom" in text) == ("failed", True)


# --------------------------------------------------------------------------- real browser
@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        # Not a skip: the acceptance needs the real browser check to have run.
        pytest.fail(f"chromium is not on PATH; the test set-up installs it with: {INSTALL_HINT}")
    return found


def test_report_renders_in_headless_chromium(report, chromium, tmp_path):
    """The issue's acceptance: a real headless browser renders every image; a screenshot."""
    out, page, _ = report
    result = check_page(out, tmp_path / "report_screenshot.png")
    assert result["images_ok"] == result["images_total"] == page.count("<img")
    assert result["bytes"] > 10_000 and result["pixel_std"] > 0.01


def test_browser_check_counts_a_broken_image(report, chromium, tmp_path):
    """The in-page check is not vacuous: an image that cannot be decoded is not counted."""
    _, page, _ = report
    good = re.search(r'<img src="data:image/png;base64,[^"]+"[^>]*>', page).group(0)
    broken = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    html = (
        f"<!DOCTYPE html><html><body>{good}<img src='data:image/png;base64,{broken}' alt='x'>"
        f"<script>{IMAGE_CHECK_SCRIPT}</script></body></html>"
    )
    (tmp_path / "broken.html").write_text(html)
    assert image_counts(chromium, tmp_path / "broken.html") == (1, 2)
