"""`ctseg predict`: a run's masks of a folder of new volumes, byte for byte the masks the
workflow's own steps make of the same volumes with the same run.

The reference is the workflow's rules run by hand on each volume, with the command lines the
rules build from the shipped config (`ctseg convert` as rule convert_image, `ctseg infer` as rule
infer, `ctseg ensemble` as rule ensemble for a cross-validation, `ctseg postprocess` as rule
postprocess), not a whole `snakemake` run (which would train the run first). The runs are tiny
trained runs built as tests/test_infer.py builds weights (`save_checkpoint` of a random U-Net).
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
import yaml
from conftest import REPO, TINY_CONFIG, TINY_EXPERIMENT, run_snakemake

from ctseg import rule_args
from ctseg.cli import main
from ctseg.config import load_config
from ctseg.inference.outputs import read_record
from ctseg.network.model import build_model
from ctseg.training.checkpoint import save_checkpoint, stored_digest

MODEL = {"filters": [4, 8]}
PATCH = [16, 16, 16]
SHIPPED = load_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
TUNED = {"threshold": 0.45, "hysteresis_high": None, "min_component_voxels": 3, "fill_holes": True}
# Each run's members and their weights, as the workflow's rules infer and ensemble take them.
MEMBERS = {
    "tiny": {"tiny": 1.0},
    "tiny_cv.cv": {"tiny_cv.fold0": 1.0, "tiny_cv.fold1": 1.0},  # a new volume: every fold
    "ens": {"tiny": 2.0, "tiny_cv.fold0": 1.0},  # config/ensembles/ens.yaml's weights
}


@pytest.fixture(autouse=True)
def _quiet_tifffile():
    logging.getLogger("tifffile").setLevel(logging.ERROR)


def save_run(run_dir: Path, seed: int) -> Path:
    """last.pt of a random U-Net whose logits are spread about 0, so the masks are not trivial."""
    torch.manual_seed(seed)
    model = build_model(MODEL).eval()
    with torch.no_grad():
        model.heads[0].weight.mul_(8)
        model.heads[0].bias.zero_()
        model.heads[0].bias.sub_(model(torch.rand(1, 1, *PATCH)).median())
    payload = {"model": model.state_dict(), "model_config": MODEL, "patch_size": PATCH}
    save_checkpoint(run_dir / "last.pt", {**payload, "fingerprint": "0123456789abcdef", "step": 1})
    return run_dir


def volume(shape, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    zz = np.arange(shape[0])[:, None, None]
    return np.clip(
        rng.integers(0, 256, size=shape) * 0.5 + 90 * np.sin(zz / 4) + 60, 0, 255
    ).astype(np.uint8)


def write_volume(path: Path, data: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(path, data, photometric="minisblack")
    return path


def write_slices(folder: Path, data: np.ndarray) -> Path:
    folder.mkdir(parents=True)
    for z, plane in enumerate(data):
        tifffile.imwrite(folder / f"slice_{z:03d}.tif", plane)
    return folder


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """results/tiny (tuned), results/tiny_cv.fold{0,1} and the experiment files beside them."""
    save_run(tmp_path / "results" / "tiny", seed=0)
    tuned = tmp_path / "results" / "tiny" / "postprocess" / "tuned.json"
    tuned.parent.mkdir(parents=True)
    tuned.write_text(json.dumps({"settings": TUNED, "score": 0.5}))
    for fold in (0, 1):
        save_run(tmp_path / "results" / f"tiny_cv.fold{fold}", seed=1 + fold)
    experiments = tmp_path / "config" / "experiments"
    experiments.mkdir(parents=True)
    for name, folds in (("tiny", None), ("tiny_cv", 2)):
        exp = copy.deepcopy(TINY_EXPERIMENT)
        exp["name"], exp["split"]["folds"] = name, folds
        (experiments / f"{name}.yaml").write_text(yaml.safe_dump(exp))
    ensembles = tmp_path / "config" / "ensembles"
    ensembles.mkdir()
    spec = {"name": "ens", "members": list(MEMBERS["ens"]), "weights": [2, 1]}
    (ensembles / "ens.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


def ctseg(*args: object) -> None:
    assert main([str(a) for a in args]) == 0


def workflow_mask(project: Path, run: str, source: Path, rid: str, work: Path) -> np.ndarray:
    """The mask the workflow's rules make of `source` with `run`, their commands by hand."""
    infer = SHIPPED["infer"]
    image = work / "zarr" / f"{rid}.zarr"
    # rule convert_image, with the test workflow's chunks (the masks do not depend on them)
    ctseg("convert", source, image, "--kind", "image", "--chunks",
          rule_args.shape_arg(TINY_CONFIG["convert"]["chunks"]), "--codec",
          rule_args.codec_arg(SHIPPED["convert"]["codec"]), "--memory-budget-mb",
          SHIPPED["convert"]["memory_budget_mb"])  # fmt: skip
    probs = []
    for member in MEMBERS[run]:  # rule infer
        probs.append(work / member / f"{rid}.zarr")
        ctseg("infer", project / "results" / member / "last.pt", image, "--probabilities",
              probs[-1], "--overlap", infer["overlap"], "--batch-size", infer["batch_size"],
              "--memory-budget-mb", infer["memory_budget_mb"], "--device-budget-mb",
              infer["device_budget_mb"], "--device", "cpu")  # fmt: skip
    if run != "tiny":  # rule ensemble
        probs.append(work / run / f"{rid}.zarr")
        ctseg("ensemble", "--members", *probs[:-1], "--weights", *MEMBERS[run].values(),
              "--out", probs[-1], "--memory-budget-mb", infer["memory_budget_mb"])  # fmt: skip
    # rule postprocess: tuned.json for a run that has one, else the config's fixed values
    tuned = project / "results" / run / "postprocess" / "tuned.json"
    settings = rule_args.postprocess_args(
        {**infer, "postprocess": "tuned" if tuned.exists() else "fixed"}, str(tuned)
    )
    mask = work / f"{rid}.tif"
    ctseg("postprocess", probs[-1], mask, *[a.strip("'") for a in settings.split()])
    return tifffile.imread(mask)


def predict(project: Path, run: str, folder: Path, out: Path, *extra: object) -> dict:
    ctseg("predict", "--run", project / "results" / run, "-i", folder, "-o", out,
          "--experiments-dir", project / "config" / "experiments", "--ensembles-dir",
          project / "config" / "ensembles", "--device", "cpu", *extra)  # fmt: skip
    return {p.name: p for p in sorted(out.glob("*.tif"))}


@pytest.mark.parametrize("run", list(MEMBERS))
def test_predict_gives_the_workflows_masks_voxel_for_voxel(project, tmp_path, run, capsys):
    volumes = tmp_path / "new_volumes"
    sources = {
        "vol_a": write_volume(volumes / "vol_a.tif", volume((20, 24, 28), seed=5)),
        "vol_b": write_volume(volumes / "vol_b.tiff", volume((36, 18, 22), seed=6)),
    }
    slices = tmp_path / "slice_volumes"
    sources["vol_c"] = write_slices(slices / "vol_c", volume((18, 26, 20), seed=7))

    capsys.readouterr()
    masks = predict(project, run, volumes, tmp_path / "masks", "--probabilities", tmp_path / "p")
    log = capsys.readouterr()
    masks |= predict(project, run, slices, tmp_path / "masks_c")
    assert sorted(masks) == ["vol_a.tif", "vol_b.tif", "vol_c.tif"]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["vol_a.zarr", "vol_b.zarr"]

    for rid, source in sources.items():
        expected = workflow_mask(project, run, source, rid, tmp_path / "workflow")
        mask = tifffile.imread(masks[f"{rid}.tif"])
        assert mask.dtype == expected.dtype == np.uint8 and 0.02 < mask.mean() < 0.98, rid
        np.testing.assert_array_equal(mask, expected)  # voxel for voxel
        # ... and the predict's mask records what made it (its TIFF description).
        record = read_record(masks[f"{rid}.tif"])
        assert record["run"] == run and record["weights"] == pytest.approx(
            [w / sum(MEMBERS[run].values()) for w in MEMBERS[run].values()]
        )

    # The console ends with one line; the figures are in the folder's predict.json.
    summary_file = tmp_path / "masks" / "predict.json"
    label = "t>0.45 min 3 fill" if run == "tiny" else "t>0.5"
    assert log.out.splitlines() == [
        f"ctseg predict: wrote 2 mask(s) to {tmp_path / 'masks'} by {run}, post-processing "
        f"{label} (figures: {summary_file})"
    ]
    rows = json.loads(summary_file.read_text())["volumes"]
    assert list(rows) == ["vol_a", "vol_b"]
    assert rows["vol_b"]["shape"] == [36, 18, 22]
    assert rows["vol_a"]["mask"] == str(tmp_path / "masks" / "vol_a.tif")
    tuned = project / "results" / "tiny" / "postprocess" / "tuned.json"
    if run == "tiny":
        assert rows["vol_a"]["postprocess"]["from"] == str(tuned)
        assert rows["vol_a"]["postprocess"]["min_component_voxels"] == 3
        assert f"post-processing t>0.45 min 3 fill: {tuned}" in log.err
    else:
        assert rows["vol_a"]["members"] == list(MEMBERS[run])
        assert rows["vol_a"]["postprocess"]["from"].startswith("the fixed defaults (")
        assert "tuned.json does not exist" in log.err


def test_fixed_options_and_only(project, tmp_path):
    volumes = tmp_path / "in"
    for i, rid in enumerate(["a", "b"]):
        write_volume(volumes / f"{rid}.tif", volume((20, 20, 20), seed=i))
    out = tmp_path / "out"
    predict(project, "tiny", volumes, out, "--only", "b", "--threshold", "0.7")
    assert sorted(p.name for p in out.iterdir()) == ["b.tif", "predict.json"]
    # A second predict into the folder adds its volume's row to the figures.
    predict(project, "tiny", volumes, out, "--only", "a", "--threshold", "0.6")
    rows = json.loads((out / "predict.json").read_text())["volumes"]
    assert {rid: row["postprocess"]["threshold"] for rid, row in rows.items()} == {
        "a": 0.6,
        "b": 0.7,
    }
    assert main(["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes),
                 "-o", str(out), "--settings", "t.json", "--threshold", "0.7"]) == 2  # fmt: skip


def cli_error(args: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda path: path.write_bytes(b"II*\x00" + bytes(4000)), id="corrupt"),
        pytest.param(
            lambda path: tifffile.imwrite(path, np.zeros((20, 30), np.uint8)), id="2d-image"
        ),
        pytest.param(
            lambda path: tifffile.imwrite(
                path, np.zeros((4, 8, 8), np.float32), photometric="minisblack"
            ),
            id="float-dtype",
        ),
    ],
)
def test_bad_inputs_get_converts_errors_and_nothing_is_written(project, tmp_path, capsys, bad):
    volumes = tmp_path / "in"
    write_volume(volumes / "a_good.tif", volume((20, 20, 20), seed=0))
    bad(volumes / "b_bad.tif")
    convert_error = cli_error(["convert", str(volumes / "b_bad.tif"), str(tmp_path / "x.zarr")],
                              capsys)  # fmt: skip
    args = ["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes), "-o"]
    predict_error = cli_error([*args, str(tmp_path / "out"), "--device", "cpu"], capsys)
    assert convert_error.startswith("ctseg convert: error: ")
    assert predict_error.removeprefix("ctseg predict: error: ") == convert_error.removeprefix(
        "ctseg convert: error: "
    )
    assert not (tmp_path / "out").exists()  # checked before the good volume is predicted


def test_folder_and_run_errors_name_the_path(project, tmp_path, capsys):
    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    (volumes / "notes.txt").write_text("x")
    (volumes / ".DS_Store").write_text("hidden: skipped")
    run = ["predict", "--run", str(project / "results" / "tiny"), "-o", str(tmp_path / "o")]
    assert "notes.txt: not a TIFF volume" in cli_error([*run, "-i", str(volumes)], capsys)
    (volumes / "notes.txt").unlink()
    write_volume(volumes / "a.tiff", volume((20, 20, 20), seed=1))
    assert "two volumes with the id 'a'" in cli_error([*run, "-i", str(volumes)], capsys)
    (volumes / "a.tiff").unlink()
    assert "no such folder of volumes" in cli_error([*run, "-i", str(tmp_path / "x")], capsys)
    # One TIFF is a volume read in place: its mask is one image, not a folder of masks.
    one_file = cli_error([*run, "-i", str(volumes / "a.tif")], capsys)
    assert f"{volumes / 'a.tif'} is one volume, read in place, and its mask one image" in one_file
    assert f"({volumes}) with --only a" in one_file
    missing = [
        "predict",
        "--run",
        str(tmp_path / "results" / "nope"),
        "-i",
        str(volumes),
        "-o",
        "o",
    ]
    assert "no such run folder" in cli_error(missing, capsys)
    (tmp_path / "results" / "empty").mkdir()
    empty = ["predict", "--run", str(tmp_path / "results" / "empty"), "-i", str(volumes), "-o", "o"]
    assert "last.pt: weights file not found" in cli_error(empty, capsys)


def test_the_workflow_route_plans_one_predict_job_per_volume_naming_run_and_folder(
    workflow_dir, tmp_path
):
    folder = tmp_path / "scans"
    write_volume(folder / "a.tif", volume((20, 20, 20), seed=0))
    write_slices(folder / "b", volume((20, 20, 20), seed=1))
    config = f"predict={{input: {folder}, run: tiny}}"
    plan = run_snakemake(workflow_dir, "-n", "-p", "predict_folder", "--config", config).stdout
    for rid in ("a", "b"):
        assert f"results/tiny/predict/scans/{rid}.tif" in plan
        assert f"ctseg predict --run results/tiny -i {folder} --only {rid} " in plan
    assert "rule train_model:" in plan  # the run is made first
    # Without predict.input the target is one line saying what to set.
    refused = run_snakemake(workflow_dir, "-n", "predict_folder", check=False)
    assert refused.returncode != 0
    assert "config predict.input: not set" in refused.stdout + refused.stderr


def test_an_output_inside_the_input_folder_is_refused_and_the_volumes_are_kept(
    project, tmp_path, capsys
):
    """-o the input folder would overwrite each volume with its mask (same name); inside it,
    the masks would be read as volumes next time. Both are refused before anything runs."""
    volumes = tmp_path / "in"
    source = write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    before = source.read_bytes()
    run = ["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes)]
    for option, where in (("-o", volumes), ("-o", volumes / "masks"),
                          ("--probabilities", volumes / "p")):  # fmt: skip
        out = [] if option == "-o" else ["-o", str(tmp_path / "out")]
        line = cli_error([*run, *out, option, str(where), "--device", "cpu"], capsys)
        assert f"{where}: " in line and "is inside the input folder" in line, line
    assert source.read_bytes() == before and sorted(p.name for p in volumes.iterdir()) == ["a.tif"]


def test_a_killed_predicts_work_folder_is_removed_by_the_next_one(project, tmp_path):
    """SIGKILL leaves the work folder (the temporary stores) behind; the next predict into the
    same output removes it, and leaves none of its own. Another output's is left alone."""
    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    other = scratch / "ctseg-predict-0123456789ab"
    other.mkdir(parents=True)
    args = ["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes), "-o",
            str(out), "--scratch", str(scratch), "--device", "cpu"]  # fmt: skip
    # Killed once the volume's probabilities are in the work folder, before its mask is written.
    killer = (
        "import os, signal, sys\n"
        "from ctseg.inference import predict\n"
        "infer = predict.infer_source\n"
        "def infer_then_die(*a, **k):\n"
        "    infer(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "predict.infer_source = infer_then_die\n"
        "from ctseg.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    killed = subprocess.run([sys.executable, "-c", killer, *args], capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    left = [p for p in scratch.iterdir() if p.name.startswith("ctseg-predict-") and p != other]
    assert len(left) == 1 and (left[0] / "a.zarr").is_dir()
    assert [p.name for p in out.iterdir()] == [".a.tif.predict.lock"]  # the killed one's claim
    predict(project, "tiny", volumes, out, "--scratch", scratch)
    assert sorted(p.name for p in scratch.iterdir()) == [other.name]
    assert sorted(p.name for p in out.iterdir()) == ["a.tif", "predict.json"]


def test_a_device_this_machine_lacks_and_an_unwritable_output_are_one_line(
    project, tmp_path, capsys
):
    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    run = ["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes)]
    for device in ("cuda:7", "nonsense"):
        line = cli_error([*run, "-o", str(tmp_path / "o"), "--device", device], capsys)
        assert line.startswith(f"ctseg predict: error: device '{device}': ") and "cpu" in line
    (tmp_path / "afile").write_text("a file where the output folder should be")
    line = cli_error([*run, "-o", str(tmp_path / "afile"), "--device", "cpu"], capsys)
    assert line.startswith(f"ctseg predict: error: {tmp_path / 'afile'}: ") and "folder" in line
    assert (tmp_path / "afile").read_text().startswith("a file")


def test_settings_tuned_for_other_weights_are_refused(project, tmp_path, capsys):
    """tuned.json says which weights its search scored (`made_with`); after a retrain the run's
    last.pt is another file, and predict refuses the stale settings instead of applying them
    to the new model's probabilities. Fixed settings still predict."""
    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    run_dir = project / "results" / "tiny"
    tuned_file = run_dir / "postprocess" / "tuned.json"
    tuned = json.loads(tuned_file.read_text())
    made = {"weights_sha256": [stored_digest(run_dir / "last.pt")], "ensemble_weights": None}
    tuned_file.write_text(json.dumps({**tuned, "made_with": made}))
    predict(project, "tiny", volumes, tmp_path / "ok")  # tuned for these weights: applied
    save_run(run_dir, seed=9)  # retrained: another last.pt, tuned.json left as it was
    args = ["predict", "--run", str(run_dir), "-i", str(volumes), "-o", str(tmp_path / "o"),
            "--experiments-dir", str(project / "config" / "experiments"),
            "--device", "cpu"]  # fmt: skip
    line = cli_error(args, capsys)
    assert line.startswith(f"ctseg predict: error: {tuned_file}: tuned on the probabilities of ")
    assert "its weights files changed" in line and "rerun the search" in line
    assert not (tmp_path / "o").exists()
    predict(project, "tiny", volumes, tmp_path / "fixed", "--threshold", "0.5")


def test_a_second_predict_into_the_same_output_is_refused(project, tmp_path, capsys):
    """While one predict writes a volume into -o (it holds the lock on that mask in -o), another
    predict of it into the same folder is refused with one line naming it, whatever its scratch
    folder (two cluster jobs); a predict of another volume into the folder runs (the workflow's
    one job per volume)."""
    from ctseg.inference.predict import _claimed, _work_folder

    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    write_volume(volumes / "b.tif", volume((20, 20, 20), seed=1))
    out = tmp_path / "masks"
    out.mkdir()
    args = ["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes), "-o",
            str(out), "--scratch", str(tmp_path / "scratch_2"), "--device", "cpu"]  # fmt: skip
    # The first predict, still running, with a scratch folder of its own.
    with _claimed(out, ["a"]), _work_folder(tmp_path / "scratch_1", out, ["a"]) as work:
        (work / "images").mkdir()
        line = cli_error(args, capsys)
        assert line == (
            f"ctseg predict: error: {out}: another ctseg predict is writing a.tif into this "
            "folder now; wait for it to finish, or choose another --output"
        )
        assert (work / "images").is_dir()
        assert not (out / "b.tif").exists()  # refused before anything was written
        assert main([*args, "--only", "b", "--summary", str(tmp_path / "b.json")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["b.tif"]  # the figures where asked
    assert list(json.loads((tmp_path / "b.json").read_text())["volumes"]) == ["b"]


def test_damaged_weights_are_named_before_the_settings_tuned_for_them(project, tmp_path, capsys):
    """A last.pt cut short (a partial copy), with the tuned.json of the whole file beside it:
    the weights file is named as damaged, not taken for retrained weights."""
    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    run_dir = project / "results" / "tiny"
    weights = run_dir / "last.pt"
    tuned_file = run_dir / "postprocess" / "tuned.json"
    made = {"weights_sha256": [stored_digest(weights)], "ensemble_weights": None}
    tuned_file.write_text(json.dumps({**json.loads(tuned_file.read_text()), "made_with": made}))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = ["predict", "--run", str(run_dir), "-i", str(volumes), "-o", str(tmp_path / "o"),
            "--device", "cpu"]  # fmt: skip
    assert cli_error(args, capsys) == (
        f"ctseg predict: error: {weights}: damaged weights file: it has no checksum trailer (cut "
        "short, or not written by ctseg train); copy it again from where the run trained, or "
        "retrain the run"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "raised",
    [
        pytest.param(lambda: OSError("110592 requested and 40704 written"), id="short-write"),
        pytest.param(lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), id="enospc"),
    ],
)
def test_a_disk_that_fills_while_a_mask_is_written_is_one_line_naming_it(
    project, tmp_path, monkeypatch, capsys, raised
):
    """tifffile reports a short write on a full disk without an errno; either way, one line
    naming the mask, and no partial mask left."""
    from ctseg.inference import predict as predict_module
    from ctseg.postprocess import write

    volumes = tmp_path / "in"
    write_volume(volumes / "a.tif", volume((20, 20, 20), seed=0))
    out = tmp_path / "out"

    def imwrite_then_fill(path, *args, **kwargs):
        Path(path).write_bytes(bytes(40704))
        raise raised()

    monkeypatch.setattr(write.tifffile, "imwrite", imwrite_then_fill)
    monkeypatch.setattr(predict_module, "free_bytes", lambda path: 1000)
    args = ["predict", "--run", str(project / "results" / "tiny"), "-i", str(volumes), "-o",
            str(out), "--device", "cpu"]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err  # the progress of the steps before, then one line
    assert "Traceback" not in err and err.count("error") == 1
    line = err.strip().splitlines()[-1]
    assert line == (
        f"ctseg predict: error: {out / 'a.tif'}: no space left on the device while writing this "
        f"mask ({raised()}; 1000 bytes free now, the mask takes 8000); the partial mask was "
        "removed: free some space there and rerun"
    )
    assert sorted(p.name for p in out.iterdir()) == []
