"""Every benchmark in bench/ at its smallest size (`--smoke`, or the smallest flags it has), end
to end, so a change of the package that breaks one shows here rather than on a GPU machine;
and bench/measure.py's report of a failed child. The figures at these sizes say nothing about
speed: the checks are that each RESULT line is there and each figure is what it claims to be
(finite, positive where it must be, a fraction in [0, 1], two implementations agreeing).

bench/loader.py runs here too (`--smoke`, about 15 s), and bench/scroll.py (`--quick`, about 40 s).
bench/gpu_check.py, bench/mfu.py and bench/metrics.py run in test_bench_smoke.py,
bench/recipe.py in test_bench_recipe.py, bench/postprocess_search.py in test_tuning.py."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import measure  # noqa: E402


def run_bench(script: str, *args: str) -> tuple[str, dict[str, str]]:
    """Run bench/<script> with `args`; its whole stdout and its RESULT line's fields.

    One OpenMP thread per process: at these sizes torch's threads only wait for each other,
    and on a loaded machine their spinning made bench/infer.py's smoke run 3x the CPU time."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = Path(script).stem
    lines = [x for x in proc.stdout.splitlines() if x.startswith(f"RESULT {name} ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    fields = dict(item.split("=", 1) for item in lines[0].split()[2:])
    return proc.stdout, fields


def positive(fields: dict[str, str], *keys: str) -> None:
    for key in keys:
        value = float(fields[key])
        assert math.isfinite(value) and value > 0, (key, fields)


def fraction(fields: dict[str, str], *keys: str) -> None:
    for key in keys:
        assert 0 <= float(fields[key]) <= 1, (key, fields)


def test_a_failed_child_shows_its_own_error() -> None:
    """A measurement's child that fails raises with its own last stderr lines, not only its
    exit status (bench/infer.py's children once failed as "stream child failed with status 1")."""
    script = "import sys; print('noise', file=sys.stderr); sys.exit('settings: bad budget')"
    with pytest.raises(measure.ChildFailed) as info:
        measure.run_child([sys.executable, "-c", script], "stream")
    message = str(info.value)
    assert message.startswith("stream child failed with status 1")
    assert "settings: bad budget" in message and "noise" in message
    # A child that exits 0 without its figures is a failure too, with its stderr.
    with pytest.raises(measure.ChildFailed, match="printed no .* line last") as info:
        measure.run_child([sys.executable, "-c", "import sys; print('x', file=sys.stderr)"], "c")
    assert str(info.value).endswith("  x")
    reported = measure.run_child([sys.executable, "-c", "print('{\"seconds\": 0.25}')"], "ok")
    assert reported["seconds"] == 0.25 and reported["rss_mb"] >= 0


@pytest.mark.slow
def test_ema_bench_at_its_smallest() -> None:
    _, fields = run_bench(
        "ema.py", "--model", '{"filters": [4, 8]}', "--updates", "2", "--repeats", "1"
    )
    assert fields["model"] == "model" and int(fields["tensors"]) > 0
    positive(fields, "params_m", "foreach_ms", "mul_add_ms", "loop_ms", "speedup")
    # The weights stay put, so the average stays equal to them up to rounding.
    assert 0 <= float(fields["drift"]) < 1e-5


@pytest.mark.slow
def test_ensemble_bench_quick() -> None:
    _, fields = run_bench("ensemble.py", "--quick")
    positive(fields, "streamed_peak_growth", "whole_peak_growth", "time_ratio_vs_whole")
    # Both take the same weighted mean; the whole-volume way's memory grows with z (4x), the
    # streamed one's less.
    assert float(fields["max_diff"]) == 0.0
    assert float(fields["whole_peak_growth"]) > 3
    assert float(fields["streamed_peak_growth"]) < float(fields["whole_peak_growth"])
    assert 0 < float(fields["peak_ratio_vs_whole"]) < 1


@pytest.mark.slow
def test_infer_bench_smoke() -> None:
    """One tile, tiles (the RSS rows) and the loop baseline, on a U-Net and a 1x1x1 conv. MONAI
    is a bench-only extra that CI does not install: its comparison is left out, by flag."""
    out, fields = run_bench("infer.py", "--smoke", "--skip-monai")
    positive(fields, "speedup_vs_loop", "rss_growth")
    assert "monai_ratio" not in fields
    # The two ways compute the same probabilities (to float16 storage).
    loop = re.search(r"max \|one tile - loop\| probability: ([0-9.]+)", out)
    assert loop, out[-2000:]
    assert float(loop.group(1)) < 2e-3


@pytest.mark.slow
def test_preprocess_bench_smoke() -> None:
    _, fields = run_bench("preprocess.py", "--smoke", "--workers", "2")
    positive(
        fields,
        "convert_vs_codec",
        "convert_vs_zarr_write",
        "precompute_speedup",
        "precompute_speedup_medial_surface",
        "precompute_rss_ratio",
        "rss_growth",
    )


@pytest.mark.slow
def test_train_bench_smoke() -> None:
    out, fields = run_bench("train.py", "--smoke")
    assert fields["best_phase"] in {"0", "1"}
    assert re.search(r"^phase 0 \[.*samples/s", out, re.MULTILINE)
    assert re.search(r"^phase 1 \[.*samples/s", out, re.MULTILINE)
    positive(fields, "speedup_vs_phase0", "feed_efficiency")
    fraction(fields, "data_wait_fraction")


@pytest.mark.slow
def test_quality_bench_smoke(tmp_path: Path) -> None:
    figures = tmp_path / "quality.json"
    _, fields = run_bench("quality.py", "--smoke", "--json", str(figures))
    fraction(fields, "score", "baseline", "dice")
    positive(fields, "train_s")
    assert fields["steps"] == "2"
    record = json.loads(figures.read_text())
    assert record["volumes"] == {"train": 2, "test": 1, "size": 32}
    assert record["filters"] == [4, 8] and record["patch_size"] == [16, 16, 16]
    assert record["model"]["volumes"] == 1
    assert record["baseline"]["percentile"] in (80.0, 90.0)


@pytest.mark.slow
def test_postprocess_bench_smoke(tmp_path: Path) -> None:
    figures = tmp_path / "postprocess.json"
    _, fields = run_bench(
        "postprocess.py", "--smoke", "--workers", "1", "--workdir", str(tmp_path / "work"),
        "--json", str(figures),
    )  # fmt: skip
    fraction(fields, "tuned", "default", "baseline")
    tuned, default, baseline = (float(fields[k]) for k in ("tuned", "default", "baseline"))
    assert float(fields["tuned_gain"]) == pytest.approx(tuned - default, abs=2e-4)
    assert float(fields["gap"]) == pytest.approx(tuned - baseline, abs=2e-4)
    assert float(fields["ratio"]) == pytest.approx(tuned / default, abs=2e-3)
    record = json.loads(figures.read_text())
    assert record["tuned"]["candidates"] > 1
    assert record["volumes"] == {"train": 2, "test": 1, "size": 32}


@pytest.mark.slow
def test_loader_bench_smoke() -> None:
    """Every loader configuration, the hand-off and the chunk check, at a few samples each."""
    out, fields = run_bench("loader.py", "--smoke")
    positive(
        fields,
        "precomputed_vs_runtime",
        "worker_rss_ratio",
        "raw_vs_zarr",
        "workers_vs_main",
        "workers_vs_main_host_layout",
        "workers_vs_main_cpu_bound",
        "best_samples_per_s",
        "chunk_check_ratio",
    )
    # A hand-off's cost is a difference of two timings: at this size it may come out below 0.
    assert all(
        math.isfinite(float(fields[k])) for k in ("handoff_ms_packed", "handoff_ms_host_layout")
    )
    # The check's own work is a share of the unchecked read, measured apart.
    assert 0 < float(fields["chunk_check_own_share"]) < 1
    for phase in range(6):  # each of phases 0-5 has its row in the phases table
        row = rf"^ +{phase} +\d+ +\d+ +\d+ +(yes|no) +12 "
        assert re.search(row, out, re.MULTILINE), out[-3000:]


def test_blockwise_mask_bench_smoke() -> None:
    """bench/blockwise_mask.py at 24^3: the blockwise mask equals binary_mask's, its figures
    are measured (the ratios are those of the printed peaks and times)."""
    out, fields = run_bench("blockwise_mask.py", "--smoke")
    assert fields["identical"] == "1" and fields["size"] == "24" and fields["block"] == "8"
    positive(fields, "tracemalloc_ratio", "time_ratio", "whole_tracemalloc_mb", "whole_s")
    ratio = float(fields["blockwise_tracemalloc_mb"]) / float(fields["whole_tracemalloc_mb"])
    assert float(fields["tracemalloc_ratio"]) == pytest.approx(ratio, rel=0.02)
    assert "settings: t>0.5 hyst 0.6 min 32 fill close 1" in out


def test_scroll_bench_quick() -> None:
    """bench/scroll.py --quick: the tiled path equals the in-memory one bit for bit, one tile
    and 4x the budget; its rates, ratios and read amplification are measured figures."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scroll.py"), "--quick", "--skip-monai",
         "--parts", "1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {
        line.split()[1]: dict(item.split("=", 1) for item in line.split()[2:])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    }
    fits, budget = results["scroll_fits"], results["scroll_budget"]
    assert fits["identical"] == "1" and budget["identical"] == "1"
    positive(fits, "c_over_b", "memory_voxels_per_s", "tiled_voxels_per_s")
    positive(budget, "tiled_over_memory", "memory_voxels_per_s", "tiled_voxels_per_s")
    ratio = float(budget["tiled_voxels_per_s"]) / float(budget["memory_voxels_per_s"])
    assert float(budget["tiled_over_memory"]) == pytest.approx(ratio, rel=0.01)
    assert float(budget["working_set_over_budget"]) == pytest.approx(4.0, rel=0.01)
    assert int(budget["tiles"]) > 1 and budget["met"] in ("0", "1")
    assert 1.0 <= float(budget["read_amplification"]) <= 1.2
