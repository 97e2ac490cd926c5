"""The pieces of bench/gpu_check.py and bench/quality.py that can be checked in seconds: the
step runner's error, the arguments it builds for `ctseg`, and the threshold baseline; and
bench/mfu.py's sweep, planned in full and run end to end at toy size (--cpu-smoke)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import mfu  # noqa: E402
import pipeline  # noqa: E402
import quality  # noqa: E402


def test_failed_step_names_the_step_and_shows_its_log(tmp_path: Path) -> None:
    runner = pipeline.Runner(tmp_path)
    missing = tmp_path / "nowhere.tif"
    with pytest.raises(pipeline.StepFailed) as info:
        runner.run("convert_image", ["convert", str(missing), str(tmp_path / "x.zarr")], "r1")
    message = str(info.value)
    assert message.startswith("step convert_image r1 failed with exit status 2")
    # The tail of the log carries ctseg's own one-line error, which names the file.
    assert f"ctseg convert: error: {missing}" in message
    assert info.value.log == tmp_path / "logs/convert_image_r1.log"
    assert not (tmp_path / "x.zarr").exists()


def test_experiment_args_carry_the_modified_experiment(tmp_path: Path) -> None:
    exp = pipeline.load_experiment("exp001")
    pipeline.set_training_budget(exp, steps=40, val_batches=3)
    phases = pipeline.load_phases()
    args = pipeline.experiment_args("train", exp, phases, tmp_path)
    assert args[0] == "--experiment" and args[2] == "--phases"
    passed = yaml.safe_load(Path(args[1]).read_text())
    passed_phases = yaml.safe_load(Path(args[3]).read_text())["phases"]
    assert Path(args[1]).stem == "exp001"  # ctseg checks the name against the file name
    assert passed["train"]["steps_per_epoch"] == 40 and passed["train"]["epochs"] == 1
    assert passed["train"]["warmup_steps"] == 4 and passed["train"]["val_batches"] == 3
    assert {int(k) for k in passed_phases} == set(phases)
    # ctseg's own loaders accept both files (the schema, the name and every phase).
    from ctseg.config import load_experiment, load_phases

    assert load_experiment(args[1]).name == "exp001"
    assert set(load_phases(args[3])) == set(phases)
    assert pipeline.experiment_args("split", exp, None, tmp_path) == ["--experiment", args[1]]


def test_codec_arg_matches_what_convert_accepts() -> None:
    codec = {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}
    assert pipeline.codec_arg(codec) == "blosc,clevel=5,cname=lz4,shuffle=shuffle"


def test_threshold_masks_keep_the_brightest_voxels(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(20, 24, 28), dtype=np.uint8)
    tifffile.imwrite(tmp_path / "a.tif", image)
    (mask_path,) = quality.threshold_masks({"a": tmp_path / "a.tif"}, 90.0, tmp_path / "m", "_p90")
    mask = tifffile.imread(mask_path)
    assert mask_path.name == "a_p90.tif" and mask.dtype == np.uint8
    assert set(np.unique(mask)) <= {0, 1}
    # About the top 10% of the voxels (ties at the threshold go to background).
    assert 0.07 < mask.mean() <= 0.10
    assert image[mask == 1].min() > image[mask == 0].max()


def test_gpu_check_cpu_smoke_runs_the_pipeline_end_to_end(tmp_path: Path) -> None:
    """bench/gpu_check.py --cpu-smoke at its smallest (one phase, 2+1 volumes of 32^3): every
    step through the real `ctseg` CLI, so a change of the CLI's arguments shows up here (about
    30 s on 2 cores)."""
    import subprocess

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/gpu_check.py"),
            "--cpu-smoke",
            "--phases",
            "0",
            "--records",
            "2",
            "--size",
            "32",
            "--train-steps",
            "4",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT gpu_check auto_phase=0 "), proc.stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["auto_phase"] == 0 and record["phases"]["0"]["status"] == "ok"
    assert record["phases"]["0"]["samples_per_s"] > 0
    assert record["evaluation"]["volumes"] == 1 and 0 <= record["evaluation"]["mean_score"] <= 1
    assert (tmp_path / "work/results/report.html").stat().st_size > 0
    for step in ("demo_data", "convert_image", "targets", "split", "stage", "train_trial"):
        assert step in record["step_seconds"]
    # The trial's efficiency and kernel profile reach the record and the RESULT lines.
    phase0 = record["phases"]["0"]
    assert phase0["mfu"] > 0 and phase0["tflops"] > 0 and phase0["peak"]["source"] == "measured"
    assert phase0["profile"]["largest"] in phase0["profile"]["fractions"]
    lines = proc.stdout.splitlines()
    for prefix in (
        "RESULT gpu_check_phase phase=0 status=ok ",
        "RESULT gpu_check_path path=pinned_unpack status=not_run ",
        "RESULT gpu_check_phase7_vs_6 status=not_run ",
        "RESULT gpu_check_infer status=skipped ",
        "RESULT gpu_check_path path=ema status=",
        "RESULT gpu_check_path path=fine_tune status=",
    ):
        assert any(line.startswith(prefix) for line in lines), prefix


def _phase(status: str, sps: float | None, device: str = "cuda:0", pinned: bool = True) -> dict:
    maths = {"batch_size": 4, "accumulate": 1, "precision": "bf16", "gpus": 1}
    return {
        "status": status,
        "device": device,
        "samples_per_s": sps,
        "maths": maths,
        "pinned_unpack": pinned,
        "h2d_fraction": 0.01,
        "mfu": None if sps is None else sps / 400,
    }


def test_gpu_only_path_lines_judge_the_trials_that_ran_them():
    record = {
        "phases": {5: _phase("ok", 24.0), 6: _phase("ok", 45.0), 7: _phase("ok", 56.0)},
        "infer_compare": {"status": "ok", "ratio": 1.31},
        "optional_paths": {"ema": {"status": "skipped", "reason": "none yet"}},
    }
    lines = gpu_check.path_lines(record)
    assert lines[0].startswith("RESULT gpu_check_path path=pinned_unpack status=ok phases=5,6,7 ")
    assert "RESULT gpu_check_phase7_vs_6 status=ok ratio=1.24 same_maths=yes" in lines
    assert any(
        line.startswith("RESULT gpu_check_infer status=ok ctseg_vs_monai=1.31 ") for line in lines
    )
    assert lines[-1] == 'RESULT gpu_check_path path=ema status=skipped reason="none yet"'
    # A failed trial of a phase with the pinned path fails that path's line; on a CPU the path
    # is the CPU one, which is not the GPU path this line is about.
    record["phases"][6] = _phase("failed", None)
    assert "path=pinned_unpack status=failed" in gpu_check.path_lines(record)[0]
    record["phases"] = {5: _phase("ok", 2.0, device="cpu")}
    assert "path=pinned_unpack status=cpu_path" in gpu_check.path_lines(record)[0]
    assert "RESULT gpu_check_phase7_vs_6 status=not_run" in gpu_check.path_lines(record)[1]


def test_trial_steps_by_phase():
    exp = pipeline.load_experiment("exp001")
    plain = gpu_check.trial_experiment(exp, {"compile": False}, None)["trial"]
    compiled = gpu_check.trial_experiment(exp, {"compile": True}, None)["trial"]
    assert plain["steps"] == gpu_check.TRIAL_STEPS < compiled["steps"]
    assert compiled["warmup_steps"] == compiled["steps"] // 4
    assert gpu_check.trial_experiment(exp, {"compile": True}, 7)["trial"]["steps"] == 7
    assert exp["trial"]["steps"] != 7  # the experiment itself is left as it was


def test_metrics_bench_prints_pruned_and_unpruned_searches_that_agree() -> None:
    """bench/metrics.py at 40^3: the score against the previous implementation, the
    20-candidate search pruned and unpruned, which must choose the same, and the default search
    with its masks shared and built whole, which must too. At 40^3 a score takes milliseconds:
    every time in the RESULT line is a measured, positive, finite figure (printed to significant
    digits, not rounded to 0)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/metrics.py"), "--sizes", "40", "--threads", "1"]
        + ["--unpruned", "--whole-masks"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT metrics ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    fields = dict(item.split("=") for item in lines[0].split()[2:])
    assert fields["counts_identical_40"] == "True"
    assert float(fields["max_term_diff_40"]) <= 1e-12
    assert fields["pruned_same_choice_40"] == "True"
    assert fields["shared_masks_same_choice_40"] == "True"
    assert 0 <= int(fields["tune_pruned_40"]) <= 20
    assert 0 <= int(fields["tune32_pruned_40"]) <= 32
    # One score is timed after its first call (which may load or compile kernels), apart.
    timed = ["warmup_s", "peak_rss_gb"] + [
        f"{name}_40"
        for name in ("first_score_s", "score_s", "reference_score_s", "sd_s")
        + ("score_speedup", "sd_speedup")
        + tuple(
            f"{search}_{figure}"
            for search in ("tune", "tune32", "tune_unpruned", "tune32_whole_masks")
            for figure in ("s_per_volume", "over_score")
        )
    ]
    for key in timed:
        value = float(fields[key])
        assert math.isfinite(value) and value > 0, (key, lines[0])
    # Each ratio is its two times divided, to the three digits printed.
    ratio = float(fields["tune_s_per_volume_40"]) / float(fields["score_s_40"])
    assert float(fields["tune_over_score_40"]) == pytest.approx(ratio, rel=0.01)


def test_mfu_sweep_runs_the_shipped_compiled_phases_first_as_shipped():
    """Phase 6 (the baseline) first, then phase 6 and phase 8 on the unpadded experiment and
    phase 7, each exactly as config/phases.yaml ships it; then one change to phase 8 at a time."""
    specs = mfu.plan(mfu.parse_args([]))
    names = [s["name"] for s in specs]
    assert names[:4] == ["phase6", "phase6/unpadded", "phase8", "phase7"] == list(mfu.SHIPPED)
    assert len(set(names)) == len(names)
    shipped = yaml.safe_load((REPO / "config/phases.yaml").read_text())["phases"]
    for spec in specs[:4]:
        exp, phase = mfu.variant_settings(spec, cpu_smoke=False)
        assert phase == {**mfu.shipped_phase(spec["phase"])}
        assert {k: phase[k] for k in shipped[spec["phase"]]} == shipped[spec["phase"]]
        assert exp["model"]["norm"] == "instance_layout"  # the shipped default
    exp6, phase6 = mfu.variant_settings(specs[0], cpu_smoke=False)
    assert mfu.variant_settings(specs[1], cpu_smoke=False)[0]["data"]["patch_size"] == [
        80,
        144,
        144,
    ]
    exp8, phase8 = mfu.variant_settings(specs[2], cpu_smoke=False)
    assert exp6["data"]["patch_size"] == [72, 136, 136] and phase6["batch_size"] == 4
    assert exp8["data"]["patch_size"] == [80, 144, 144] and phase8["batch_size"] == 16
    graphs = next(s for s in specs if s["name"] == "phase8+cudagraphs")
    assert mfu.variant_settings(graphs, False)[1]["compile_mode"] == "reduce-overhead"
    torch_norm = next(s for s in specs if s["name"] == "phase8/norm=instance")
    assert mfu.variant_settings(torch_norm, False)[0]["model"]["norm"] == "instance"


def test_mfu_cpu_smoke_counts_no_layout_copy_and_no_host_sync_in_the_shipped_phases(
    tmp_path: Path,
) -> None:
    """bench/mfu.py --cpu-smoke over the shipped phases and torch's instance norm: each trains
    through the package's own setup and step, is profiled, and lands in the figures file; the
    best variant and the best shipped phase change no tensor's layout and read nothing back
    to the host between logged steps, while nn.InstanceNorm3d's copies are counted."""
    out = tmp_path / "mfu.json"
    variants = ["phase6", "phase8", "phase7", "phase8/norm=instance"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/mfu.py"), "--cpu-smoke", "--variants", *variants]
        + ["--steps", "1", "--profile-steps", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT mfu best="), proc.stdout[-2000:]
    fields = dict(item.split("=", 1) for item in last.split()[2:])
    assert fields["variants_ok"] == "4/4" and float(fields["useful_voxels_per_s"]) > 0
    record = json.loads(out.read_text())
    assert record["result"] == last and len(record["variants"]) == 4
    by_name = {r["name"]: r for r in record["variants"]}
    shipped = [by_name[n] for n in mfu.SHIPPED if n in by_name]
    assert len(shipped) == 3
    assert fields["best_shipped"] == max(shipped, key=lambda r: r["useful_voxels_per_s"])["name"]
    assert int(fields["best_shipped_layout_copies"]) <= 1
    assert float(fields["best_shipped_host_syncs"]) == 0
    for r in shipped:
        assert r["layout_copies"] <= 1 and r["host_syncs"] == 0, r
    assert by_name["phase8/norm=instance"]["layout_copies"] > 1  # the counter sees copies
    best = max(record["variants"], key=lambda r: r["useful_voxels_per_s"])
    assert fields["best"] == best["name"]
    assert int(fields["layout_copies"]) == best["layout_copies"]
    for r in record["variants"]:
        assert r["status"] == "ok", r
        assert r["samples_per_s"] > 0 and r["tflops"] > 0 and r["peak"]["source"] == "measured"
        assert len(r["top_kernel_classes"]) == 5 and r["profile_error"] is None
        assert 0 <= r["idle"] <= 1 and 0 <= r["copies"] <= 1
        padded = r["patch"] == [12, 24, 24]
        assert r["computed_patch"] == [16, 32, 32]
        assert (r["padding_share"] > 0) == padded
        useful = r["samples_per_s"] * math.prod(r["patch"])
        assert r["useful_voxels_per_s"] == pytest.approx(useful)
        assert r["useful_mfu"] == pytest.approx(r["mfu"] * (1 - r["padding_share"]))


def test_mfu_result_line_names_the_best_the_best_shipped_and_the_baseline():
    def ok(name: str, voxels: float, copies: int) -> dict:
        return {
            "name": name,
            "status": "ok",
            "useful_voxels_per_s": voxels,
            "useful_mfu": 0.1,
            "samples_per_s": 4.0,
            "layout_copies": copies,
            "host_syncs": 0.0,
            "idle": 0.05,
            "copies": 0.02,
        }

    results = [
        ok("phase6", 2e6, 0),
        ok("phase8", 3e6, 1),
        ok("phase8/norm=instance", 4e6, 22),
        {"name": "phase7", "status": "skipped", "reason": "time budget 280 s"},
    ]
    line = mfu.result_line(results, 12.0)
    assert line.startswith("RESULT mfu best=phase8/norm=instance useful_voxels_per_s=4e+06 ")
    assert " layout_copies=22 host_syncs=0 idle=0.050 copies=0.020 best_shipped=phase8 " in line
    assert "best_shipped_useful_voxels_per_s=3e+06 best_shipped_layout_copies=1 " in line
    assert "baseline_useful_voxels_per_s=2e+06 speedup_vs_baseline=2.000 variants_ok=3/4" in line
    args = mfu.parse_args([])
    assert mfu.run_one(mfu.VARIANTS[0], torch.device("cpu"), args, 1e9)["status"] == "skipped"
