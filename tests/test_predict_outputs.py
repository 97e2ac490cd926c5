"""Nothing of the user's is overwritten by a predict in place (`ctseg.inference.outputs`): an
output equal to, inside or holding the input, a foreign store or file at the output or its work
folder, and a ctseg output without --overwrite are refused before the input is read, and leave
every byte as it was; the outputs record how they were made; a disk that fills while a part
writes is one line, and the same command then goes on."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr
from test_predict_scroll import ctseg, save_run, volume, zarr_volume

from ctseg.inference.outputs import (
    LABEL_MAP,
    MASK,
    PROBABILITIES,
    check_output_paths,
    read_record,
    written_kind,
)
from ctseg.io import CtsegError


def tree_digest(path: Path) -> str:
    """One digest of every file's name and bytes under `path` (or of the file)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(path.parent)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [done.stderr.strip().splitlines()[-1]], done.stderr[-2000:]
    assert errors[0].startswith("ctseg predict: error: ")
    return errors[0]


@pytest.fixture(scope="module")
def run_and_volume(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("outputs")
    return save_run(root / "results" / "tiny"), zarr_volume(root / "v.zarr", volume((20, 24, 20)))


def test_an_output_that_is_inside_or_holds_the_input_is_refused_and_the_input_kept(
    tmp_path, run_and_volume
):
    run, source = run_and_volume
    store = tmp_path / "v.zarr"
    shutil.copytree(source, store)
    before = tree_digest(store)
    nested = tmp_path / "outer.zarr" / "inner.zarr"
    shutil.copytree(source, nested)
    for output, how, given in (
        (store, "-o is the input", store),
        (store / "mask.zarr", "-o lies inside the input", store),
        (tmp_path / "outer.zarr", "-o holds the input", nested),
    ):
        done = ctseg("predict", "--run", run, "-i", given, "-o", output, check=False)
        assert how in one_error_line(done)
    assert tree_digest(store) == before
    assert not (store / "mask.zarr").exists() and not (tmp_path / ".v.zarr.predict").exists()
    done = ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr",
                 "--probabilities", store / "p.zarr", check=False)  # fmt: skip
    assert "--probabilities lies inside the input" in one_error_line(done)
    assert tree_digest(store) == before


def test_a_foreign_store_or_file_at_the_output_is_refused_and_left_as_it_was(
    tmp_path, run_and_volume
):
    run, store = run_and_volume
    theirs = tmp_path / "theirs.zarr"
    zarr.create_array(str(theirs), shape=(4, 4), dtype="u1")[...] = 7
    notes = tmp_path / "notes.zarr"
    notes.mkdir()
    (notes / "README.txt").write_text("my notes, not a store")
    image = tmp_path / "scan.tif"
    tifffile.imwrite(image, np.arange(64, dtype=np.uint8).reshape(4, 4, 4))
    for path in (theirs, notes, image):
        before = tree_digest(path)
        done = ctseg("predict", "--run", run, "-i", store, "-o", path, check=False)
        line = one_error_line(done)
        assert f"{path}: -o exists and is not an output of ctseg; it is left as it is" in line
        assert tree_digest(path) == before
        # --overwrite replaces ctseg's own outputs only.
        done = ctseg("predict", "--run", run, "-i", store, "-o", path, "--overwrite", check=False)
        assert "not an output of ctseg" in one_error_line(done) and tree_digest(path) == before


def test_a_ctseg_output_is_replaced_only_with_overwrite_and_records_how_it_was_made(
    tmp_path, run_and_volume
):
    run, store = run_and_volume
    mask, probs = tmp_path / "m.zarr", tmp_path / "p.zarr"
    args = ["predict", "--run", run, "-i", store, "-o", mask, "--probabilities", probs,
            "--memory-budget-mb", "4", "--tta-flips"]  # fmt: skip
    ctseg(*args)
    record = read_record(mask)
    assert record is not None and written_kind(probs) == PROBABILITIES
    assert record["output"] == MASK and record["run"] == "tiny"
    assert record["inference"]["tta_flips"] is True and record["inference"]["window"] == [16] * 3
    assert record["postprocess"]["threshold"] == 0.5 and record["labels"]["labels"]
    assert record["input"]["url"] == str(store) and len(record["input"]["intensity_range"]) == 2
    assert record["weights_sha256"][0] and record["version"]
    assert json.dumps(record)  # plain JSON
    before = tree_digest(mask)
    line = one_error_line(ctseg(*args, check=False))
    assert "a ctseg output is there already; rerun with --overwrite to replace it: ctseg " in line
    assert line.endswith("--tta-flips --overwrite") and tree_digest(mask) == before
    ctseg(*args[:-1], "--overwrite")  # without flips: a new mask, recorded as such
    assert read_record(mask)["inference"]["tta_flips"] is False
    # A TIFF output records the same, in its description.
    tif = tmp_path / "m.tif"
    ctseg("predict", "--run", run, "-i", store, "-o", tif, "--memory-budget-mb", "4")
    assert written_kind(tif) == MASK and tifffile.imread(tif).shape == (20, 24, 20)
    # ctseg's mask is not its probabilities: a store of another kind is refused, not replaced.
    line = one_error_line(ctseg("predict", "--run", run, "-i", store, "-o", probs,
                                "--overwrite", check=False))  # fmt: skip
    assert "ctseg's probabilities, not a mask" in line


def test_a_foreign_work_folder_is_refused(tmp_path, run_and_volume):
    run, store = run_and_volume
    work = tmp_path / ".m.zarr.predict"
    work.mkdir()
    (work / "thesis.tex").write_text("\\begin{document}")
    line = one_error_line(ctseg("predict", "--run", run, "-i", store, "-o", tmp_path / "m.zarr",
                                check=False))  # fmt: skip
    assert "the work folder of" in line and "is not a predict's" in line
    assert (work / "thesis.tex").read_text() == "\\begin{document}"


@pytest.mark.parametrize(
    "outputs, message",
    [
        ({"-o": ("same.zarr", MASK), "--probabilities": ("same.zarr", PROBABILITIES)},
         "-o and --probabilities: the same path"),
        ({"-o": ("in.zarr/x.zarr", LABEL_MAP)}, "-o lies inside the input"),
    ],
)  # fmt: skip
def test_check_output_paths_refuses_before_anything_exists(tmp_path, outputs, message):
    given = {k: (tmp_path / p, kind) for k, (p, kind) in outputs.items()}
    for url in (str(tmp_path / "in.zarr"), f"file://{tmp_path / 'in.zarr'}"):
        with pytest.raises(CtsegError, match=message):
            check_output_paths(url, given, tmp_path / ".work", False, None)
    # A remote input shares no path with a local output.
    if "inside" in message:
        check_output_paths("s3://bucket/in.zarr", given, tmp_path / ".work", False, None)


def test_a_disk_that_fills_under_a_parts_spill_is_one_line_and_the_part_goes_on(tmp_path):
    """A real full disk (a 16 MB tmpfs, all but 64 KB taken by a ballast file): the part stops
    with one line when it writes a seam's spill; with the space back, the same command goes
    on, and the parts' mask is the one predicted on a roomy disk."""
    from test_faults import mount_tmpfs

    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "16m"):
        pytest.skip("cannot mount a tmpfs here (needs root): run the tests as root, as CI does")
    try:
        run = save_run(tmp_path / "results" / "tiny")
        store = zarr_volume(tmp_path / "v.zarr", volume((48, 60, 52), seed=4))
        options = ["--memory-budget-mb", "4", "--parts", "2"]
        reference = tmp_path / "reference.tif"
        for step in (["--part", "0"], ["--part", "1"], ["--finish"]):
            ctseg("predict", "--run", run, "-i", store, "-o", reference, *options, *step)
        stats = os.statvfs(disk)
        (disk / "ballast").write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - 64 * 1024))
        out = disk / "m.tif"
        part0 = ["predict", "--run", run, "-i", store, "-o", out, *options, "--part", "0"]
        line = one_error_line(ctseg(*part0, check=False))
        assert line.startswith(
            f"ctseg predict: error: {disk}/.m.tif.predict: no space left on the device while "
            f"part 1 of 2 (--part 0) wrote its tiles ({os.strerror(errno.ENOSPC)}; "
        ) and line.endswith(
            " bytes free now); the tiles it finished are kept: free some space there and rerun "
            "the same command to go on"
        )
        assert not list(disk.rglob("*.tmp-*"))  # no partial file left under any name
        (disk / "ballast").unlink()
        ctseg(*part0)
        for step in (["--part", "1"], ["--finish"]):
            ctseg("predict", "--run", run, "-i", store, "-o", out, *options, *step)
        np.testing.assert_array_equal(tifffile.imread(out), tifffile.imread(reference))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_outputs_a_viewer_reads_right_with_the_datasets_spacing_and_provenance(tmp_path):
    """A binary run's mask and probabilities, and a multi-class run's label map and channel
    probabilities, each pass ome-zarr-models' validation as the image kind it is, carry the
    dataset plan's spacing 2.5 x 1 x 1 (a plain Zarr input records none) with a pyramid toward
    isotropic voxels, and record how they were made."""
    from ome_zarr_models.v05 import Image, ImageLabel
    from test_multiclass_inference import SPEC
    from test_multiclass_inference import save_run as save_multiclass_run
    from test_ome_zarr import validate

    from ctseg.labels import LabelSpec
    from ctseg.ome_zarr import check_image
    from ctseg.plan import DatasetPlan, write_dataset_plan

    spacing = (2.5, 1.0, 1.0)
    write_dataset_plan(tmp_path / "results" / "plans" / "dataset.json",
                       DatasetPlan(LabelSpec({"background": 0, "papyrus": 1}), spacing,
                                   "dataset.yaml"))  # fmt: skip
    binary = save_run(tmp_path / "results" / "tiny")
    multi = tmp_path / "results" / "mc"
    save_multiclass_run(multi, SPEC)
    store = zarr_volume(tmp_path / "v.zarr", volume((40, 96, 80), seed=3), chunks=(16, 32, 32))
    for run, name in ((binary, "bin"), (multi, "mc")):
        out, probs = tmp_path / f"{name}.zarr", tmp_path / f"{name}_p.zarr"
        ctseg("predict", "--run", run, "-i", store, "-o", out, "--probabilities", probs,
              "--memory-budget-mb", "24")  # fmt: skip
    for name, kind, channels in (("bin", ImageLabel, None), ("bin_p", Image, None),
                                 ("mc", ImageLabel, None), ("mc_p", Image, 4)):  # fmt: skip
        path = tmp_path / f"{name}.zarr"
        validate(path, kind)
        image = check_image(path)
        assert image["scales"][0][-3:] == list(spacing), image["scales"]
        # Level 1 halves y and x only (2.5 x 2 x 2), level 2 all three (5 x 4 x 4).
        assert image["levels"][1][-3:] == (40, 48, 40) and image["levels"][2][-3:] == (20, 24, 20)
        assert (channels is None) == (image["channels"] is None)
        record = image["attributes"]["ctseg"]
        assert record["input"]["spacing"] == list(spacing)
        assert record["input"]["spacing_from"] == "the run's dataset plan"
        assert record["run"] in ("tiny", "mc") and record["weights_sha256"][0]
    labels = check_image(tmp_path / "mc.zarr")["label_values"]
    assert [c.name for c in labels.values()] == ["background", *SPEC.classes]
    assert sorted(labels) == sorted(SPEC.labels.values())
    assert check_image(tmp_path / "mc_p.zarr")["channels"] == ["background", *SPEC.classes]
    assert zarr.open_group(tmp_path / "mc_p.zarr", mode="r")["0"].shape == (4, 40, 96, 80)


def test_a_folder_predict_replaces_only_its_own_masks_and_only_with_overwrite(tmp_path, capsys):
    """The masks of a folder of volumes: a foreign <id>.tif or summary file in -o is refused and
    kept byte for byte; a mask of an earlier predict is replaced only with --overwrite (the
    refusal gives the command); each mask records how it was made, in its TIFF description."""
    from ctseg.cli import main

    run = save_run(tmp_path / "results" / "tiny")
    (tmp_path / "in").mkdir()
    tifffile.imwrite(tmp_path / "in" / "a.tif", volume((20, 24, 20)), photometric="minisblack")
    out = tmp_path / "masks"
    out.mkdir()
    theirs = np.arange(64, dtype=np.uint8).reshape(4, 4, 4)
    tifffile.imwrite(out / "a.tif", theirs)
    args = ["predict", "--run", str(run), "-i", str(tmp_path / "in"), "-o", str(out),
            "--device", "cpu"]  # fmt: skip

    def refusal(*extra: str) -> str:
        capsys.readouterr()
        assert main([*args, *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert refusal().endswith(f"{out / 'a.tif'}: exists and is not an output of ctseg; it is "
                              "left as it is: give another output folder, or move it aside "
                              "yourself")  # fmt: skip
    assert "not an output of ctseg" in refusal("--overwrite")
    np.testing.assert_array_equal(tifffile.imread(out / "a.tif"), theirs)
    (out / "a.tif").unlink()
    (out / "predict.json").write_text("my notes")
    assert "predict.json: exists and is not a summary of ctseg predict" in refusal()
    assert (out / "predict.json").read_text() == "my notes"
    (out / "predict.json").unlink()
    assert main(args) == 0
    record = read_record(out / "a.tif")
    assert record["output"] == MASK and record["run"] == "tiny"
    assert record["input"]["url"] == str(tmp_path / "in" / "a.tif")
    assert len(record["input"]["intensity_range"]) == 2
    before = tree_digest(out / "a.tif")
    line = refusal("--threshold", "0.7")
    assert line.endswith(f"rerun with --overwrite to replace them: ctseg {' '.join(args)} "
                         "--threshold 0.7 --overwrite")  # fmt: skip
    assert tree_digest(out / "a.tif") == before
    assert main([*args, "--threshold", "0.7", "--overwrite"]) == 0
    assert read_record(out / "a.tif")["postprocess"]["threshold"] == 0.7
