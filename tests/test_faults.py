"""Faults end in a one-line message and leave nothing behind (docs/bad-inputs.md).

Killed and out-of-space runs of the steps that write large outputs, a damaged scratch copy,
and inputs that used to pass the up-front checks and fail late (or with a traceback).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
import yaml
import zarr.storage
from conftest import BIN, TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake, settings_args
from training_setup import EXPERIMENT, PHASE, TRAIN_IDS, VAL_IDS, build_scratch

from ctseg.cli import main as cli_main
from ctseg.inference.ensemble import ensemble_volume
from ctseg.io import CtsegError, atomic_path
from ctseg.preprocess.convert import convert_volume
from ctseg.preprocess.stage import stage_records
from ctseg.preprocess.targets import compute_targets
from ctseg.store import create_volume, open_volume

# Big enough that the temporary store exists for a while, small enough to convert in a second.
KILL_SHAPE = (96, 256, 256)


def volume(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def write_tiff(path: Path, data: np.ndarray) -> Path:
    tifffile.imwrite(path, data, photometric="minisblack")
    return path


def stale_temporaries(dest: Path) -> list[Path]:
    """Temporary stores atomic_path made for `dest`: ".<name>.tmp-<pid>-<8 hex>"."""
    if not dest.parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(dest.name)}\.tmp-\d+-[0-9a-f]{{8}}$")
    return [p for p in dest.parent.iterdir() if pattern.match(p.name)]


def beside(dest: Path) -> list[str]:
    """Everything a run left next to `dest`: temporaries and lock files."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}"))


def fake_stale_temporary(dest: Path) -> Path:
    """What a run killed mid-write leaves: a partial store under atomic_path's temporary name."""
    stale = dest.with_name(f".{dest.name}.tmp-4242-{uuid.uuid4().hex[:8]}")
    (stale / "c" / "0").mkdir(parents=True)
    (stale / "c" / "0" / "0").write_bytes(b"\0" * 4096)
    return stale


def no_space_after(calls: int):
    """A zarr store write that fails like a full disk after `calls` writes went through."""
    real = zarr.storage.LocalStore.set
    count = {"n": 0}

    async def set_or_fail(self, key, value):
        count["n"] += 1
        if count["n"] > calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        await real(self, key, value)

    return set_or_fail


def one_line_error(capsys, command: str) -> str:
    # tqdm redraws its bar with carriage returns: those end a line too.
    lines = [line for line in re.split(r"[\r\n]+", capsys.readouterr().err) if line.strip()]
    errors = [line for line in lines if line.startswith(f"ctseg {command}: error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


# --------------------------------------------------------------------------- convert


def run_and_signal(source: Path, dest: Path, signum: int) -> subprocess.CompletedProcess:
    """Run a real `ctseg convert` and send it `signum` while its temporary store exists."""
    command = [str(BIN / "ctseg"), "convert", str(source), str(dest)]
    command += ["--chunks", "16", "--memory-budget-mb", "1"]
    return signal_while_writing(command, dest, signum)


def signal_while_writing(
    command: list[str], dest: Path, signum: int
) -> subprocess.CompletedProcess:
    """Run `command` and send it `signum` while its temporary of `dest` exists."""
    for _ in range(5):
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while child.poll() is None and not stale_temporaries(dest):
                time.sleep(0.001)
            if child.poll() is None:
                os.kill(child.pid, signum)
            _, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if signum == signal.SIGKILL and child.returncode == -signal.SIGKILL:
            if stale_temporaries(dest):
                return subprocess.CompletedProcess(command, child.returncode, "", err.decode())
            # The kill landed after the run had already removed its temporary (it was on its
            # way out): that is not the moment this test is about, so try again.
            continue
        if child.returncode != 0:
            return subprocess.CompletedProcess(command, child.returncode, "", err.decode())
        shutil.rmtree(dest)  # it finished before the signal: try again
    pytest.fail(f"ctseg {command[1]} always finished before it could be signalled")


def test_convert_killed_with_sigkill_leaves_a_temporary_that_the_rerun_removes(tmp_path):
    data = volume(KILL_SHAPE)
    source = write_tiff(tmp_path / "vol.tif", data)
    dest = tmp_path / "zarr" / "vol.zarr"

    killed = run_and_signal(source, dest, signal.SIGKILL)

    assert killed.returncode == -signal.SIGKILL
    assert not dest.exists()
    leaked = stale_temporaries(dest)
    assert leaked, "the kill should have landed while the temporary store existed"

    rerun = subprocess.run(
        [str(BIN / "ctseg"), "convert", str(source), str(dest), "--chunks", "16"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert beside(dest) == []  # neither the killed run's store nor a lock file
    np.testing.assert_array_equal(open_volume(dest)[:], data)


def test_convert_stopped_with_sigterm_removes_its_temporary_at_once(tmp_path):
    source = write_tiff(tmp_path / "vol.tif", volume(KILL_SHAPE))
    dest = tmp_path / "zarr" / "vol.zarr"

    stopped = run_and_signal(source, dest, signal.SIGTERM)

    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert not dest.exists()
    assert beside(dest) == []


def test_convert_removes_stale_temporaries_before_checking_free_space(tmp_path, monkeypatch):
    source = write_tiff(tmp_path / "vol.tif", volume((16, 32, 32)))
    dest = tmp_path / "zarr" / "vol.zarr"
    dest.parent.mkdir()
    stale = fake_stale_temporary(dest)
    monkeypatch.setattr("ctseg.io.free_bytes", lambda path: 1000)

    with pytest.raises(CtsegError) as info:
        convert_volume(source, dest, kind="image", chunks=(16, 16, 16))

    message = str(info.value)
    assert str(dest) in message and "not enough free space to convert vol.tif" in message
    assert "bytes needed, 1000 bytes free" in message
    assert not stale.exists() and not dest.exists() and beside(dest) == []


def test_convert_running_out_of_space_is_one_line_and_keeps_the_old_output(
    tmp_path, monkeypatch, capsys
):
    old = volume((32, 32, 32), seed=1)
    source = write_tiff(tmp_path / "vol.tif", volume((32, 32, 32), seed=2))
    dest = tmp_path / "vol.zarr"
    convert_volume(write_tiff(tmp_path / "old.tif", old), dest, kind="image", chunks=(16,) * 3)
    monkeypatch.setattr(zarr.storage.LocalStore, "set", no_space_after(3))

    status = cli_main(["convert", str(source), str(dest), "--chunks", "16"])

    assert status == 2
    line = one_line_error(capsys, "convert")
    assert str(dest) in line and "no space left on the device" in line and "rerun" in line
    assert beside(dest) == []
    monkeypatch.undo()
    np.testing.assert_array_equal(open_volume(dest)[:], old)


def test_a_second_convert_into_the_same_output_is_refused(tmp_path):
    source = write_tiff(tmp_path / "vol.tif", volume((16, 32, 32)))
    dest = tmp_path / "vol.zarr"
    held = dest.with_name(".vol.zarr.lock")
    fd = os.open(held, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(CtsegError, match="another run is writing this output"):
            convert_volume(source, dest, kind="image")
    finally:
        os.close(fd)
    assert not dest.exists()


def mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def test_a_real_full_disk(tmp_path, monkeypatch):
    """The same, on a real 1 MiB filesystem, where one is allowed to mount one (root)."""
    disk = tmp_path / "disk"
    if shutil.which("mount") is None or not mount_tmpfs(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        source = write_tiff(tmp_path / "vol.tif", volume((48, 128, 128)))  # 768 KiB
        dest = disk / "vol.zarr"
        # 16^3 chunks take two 4 KiB pages each (data plus header): up front, that is too much.
        with pytest.raises(CtsegError, match="not enough free space"):
            convert_volume(source, dest, kind="image", chunks=(16, 16, 16))
        assert list(disk.iterdir()) == []
        # Past the check, the disk really fills: the same message, and nothing left.
        monkeypatch.setattr("ctseg.io.check_free_space", lambda *args, **kwargs: None)
        with pytest.raises(CtsegError, match="no space left on the device"):
            convert_volume(source, dest, kind="image", chunks=(16, 16, 16))
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# --------------------------------------------------------------------------- targets


def label_store(path: Path) -> Path:
    labels = np.zeros((16, 32, 32), np.uint8)
    labels[:, 10:13] = 1
    labels[:4] = 2
    create_volume(path, labels.shape, np.uint8, (16, 16, 16))[:] = labels
    return path


def test_targets_remove_stale_temporaries_and_check_free_space(tmp_path, monkeypatch):
    label = label_store(tmp_path / "lab.zarr")
    dest = tmp_path / "targets" / "lab.zarr"
    dest.parent.mkdir()
    stale = fake_stale_temporary(dest)
    monkeypatch.setattr("ctseg.io.free_bytes", lambda path: 1000)

    with pytest.raises(CtsegError, match=r"not enough free space to write the targets of lab"):
        compute_targets(label, dest, clip_distance=2, block_shape=(16, 16, 16))

    assert not stale.exists() and not dest.exists() and beside(dest) == []
    monkeypatch.undo()
    compute_targets(label, dest, clip_distance=2, block_shape=(16, 16, 16))
    assert beside(dest) == [] and (dest / "zarr.json").exists()


def test_targets_running_out_of_space_is_an_error_naming_the_output(tmp_path, monkeypatch):
    label = label_store(tmp_path / "lab.zarr")
    dest = tmp_path / "targets" / "lab.zarr"
    monkeypatch.setattr(zarr.storage.LocalStore, "set", no_space_after(4))

    with pytest.raises(CtsegError, match=rf"{dest}: no space left on the device"):
        compute_targets(label, dest, clip_distance=2, block_shape=(16, 16, 16))

    assert not dest.exists() and beside(dest) == []


# --------------------------------------------------------------------------- stage and scratch


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """A preprocessed store (root/store) and its staged raw copy (root/scratch)."""
    root = tmp_path_factory.mktemp("staged")
    build_scratch(root)
    return root


def test_stage_running_out_of_space_is_one_line_and_leaves_no_partial_record(
    staged, tmp_path, monkeypatch, capsys
):
    from ctseg.preprocess import stage

    real = stage._HashingWriter.write

    def write_or_fail(self, data):
        # The disk fills while the second record is written (workers=1 stages them in order).
        if f".{TRAIN_IDS[1]}.tmp-" in self._handle.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, data)

    monkeypatch.setattr(stage._HashingWriter, "write", write_or_fail)
    split = tmp_path / "split.csv"
    pd.DataFrame({"id": TRAIN_IDS + VAL_IDS, "scroll_id": 1, "split": "train"}).to_csv(split)
    dest = tmp_path / "scratch"

    status = cli_main(["stage", str(staged / "store"), str(split), str(dest), "--workers", "1"])

    assert status == 2
    line = one_line_error(capsys, "stage")
    assert str(dest) in line and "no space left on the device while staging" in line
    # The record finished before the disk filled is kept (a rerun skips it); no temporaries.
    assert sorted(p.name for p in dest.iterdir()) == [TRAIN_IDS[0]]
    assert not (dest / "manifest.json").exists()
    monkeypatch.undo()
    summary = stage_records(str(staged / "store"), TRAIN_IDS + VAL_IDS, dest)
    assert summary["records_skipped"] == 1 and summary["stale_temps_removed"] == 0


def training_command(command: str, scratch: Path, tmp_path: Path) -> list[str]:
    split = tmp_path / "split.csv"
    pd.DataFrame(
        {
            "id": TRAIN_IDS + VAL_IDS,
            "scroll_id": 1,
            "split": ["train"] * len(TRAIN_IDS) + ["val"] * len(VAL_IDS),
        }
    ).to_csv(split, index=False)
    # A loader worker, as in the issue: there the damage surfaced as a DataLoader traceback.
    phases = {0: {**PHASE, "workers": 1}}
    args = [command, *settings_args(tmp_path / "settings", EXPERIMENT, phases)]
    args += ["--phase", "0", "--scratch", str(scratch)]
    args += ["--split", str(split), "--out", str(tmp_path / "out"), "--device", "cpu"]
    if command == "train":
        args += ["--state-dir", str(tmp_path / "state"), "--weights", str(tmp_path / "last.pt")]
    return args


@pytest.mark.parametrize("command", ["train", "trial"])
def test_a_damaged_scratch_copy_stops_training_with_the_file_and_the_fix(
    staged, tmp_path, capsys, command
):
    scratch = tmp_path / "scratch"
    shutil.copytree(staged / "scratch", scratch)
    (scratch / TRAIN_IDS[1] / "sdt.npy").unlink()

    status = cli_main(training_command(command, scratch, tmp_path))

    assert status == 2
    line = one_line_error(capsys, command)
    assert f"{scratch / TRAIN_IDS[1] / 'sdt.npy'}" in line and "is missing" in line
    assert "snakemake -R stage" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "last.pt").exists()


def test_restaging_repairs_what_the_scratch_check_found(staged, tmp_path, capsys):
    scratch = tmp_path / "scratch"
    shutil.copytree(staged / "scratch", scratch)
    os.truncate(scratch / TRAIN_IDS[0] / "image.npy", 64)
    assert cli_main(training_command("trial", scratch, tmp_path)) == 2
    assert "has 64 bytes" in one_line_error(capsys, "trial")

    stage_records(str(staged / "store"), TRAIN_IDS + VAL_IDS, scratch)

    from ctseg.preprocess.stage import check_staged

    check_staged(scratch, TRAIN_IDS + VAL_IDS)


# --------------------------------------------------------------------------- infer and ensemble

# What ctseg.inference.run.infer_volume records, as ensemble checks it.
INFER_ATTRS = {"window": [8, 16, 16], "overlap": 0.5, "tta_flips": False, "blending": "gaussian"}


def probability_store(path: Path, values: np.ndarray) -> Path:
    """A probability store written as infer writes one: atomically, so with its chunk record."""
    with atomic_path(path) as tmp:
        create_volume(tmp, values.shape, np.float16, (16, 64, 64), attributes=INFER_ATTRS)[...] = (
            values.astype(np.float16)
        )
    return path


def test_ensemble_killed_with_sigkill_leaves_a_temporary_that_the_rerun_removes(tmp_path):
    rng = np.random.default_rng(3)
    members = [probability_store(tmp_path / m / "v.zarr", rng.random(KILL_SHAPE)) for m in "ab"]
    dest = tmp_path / "ens" / "v.zarr"
    command = [str(BIN / "ctseg"), "ensemble", "--members", *map(str, members)]
    command += ["--weights", "1", "1", "--out", str(dest), "--memory-budget-mb", "1"]

    killed = signal_while_writing(command, dest, signal.SIGKILL)

    assert killed.returncode == -signal.SIGKILL
    leaked = stale_temporaries(dest)
    assert leaked and not dest.exists()
    assert f".{dest.name}.lock" in beside(dest)  # the killed run held the output's lock

    rerun = subprocess.run(command, capture_output=True, text=True, check=False)

    assert rerun.returncode == 0, rerun.stderr
    assert beside(dest) == []  # neither the killed run's store nor its lock file
    want = (open_volume(members[0])[...].astype(np.float32) + open_volume(members[1])[...]) / 2
    np.testing.assert_allclose(open_volume(dest)[...], want, atol=2**-11)


HOLD_OUTPUT = """
import sys, time
from ctseg.io import atomic_path
from ctseg.store import create_volume
with atomic_path(sys.argv[1]) as tmp:
    create_volume(tmp, (8, 8, 8), "float16", (8, 8, 8))[...] = 1
    print("writing", flush=True)
    time.sleep(60)
"""


def hold_output(dest: Path) -> subprocess.Popen:
    """A process in the middle of writing `dest` through atomic_path, as every step writes."""
    child = subprocess.Popen(
        [str(BIN / "python"), "-c", HOLD_OUTPUT, str(dest)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "writing\n"
    return child


def test_the_next_write_of_an_output_removes_a_killed_writers_temporary(tmp_path):
    # infer writes its probability store as ensemble does, through atomic_path.
    dest = tmp_path / "probabilities" / "v.zarr"
    child = hold_output(dest)
    child.kill()
    child.wait()
    (leaked,) = stale_temporaries(dest)
    assert (leaked / "zarr.json").exists()

    probability_store(dest, np.zeros((8, 8, 8)))

    assert beside(dest) == [] and open_volume(dest).shape == (8, 8, 8)


def test_a_living_writers_temporary_is_never_removed(tmp_path):
    dest = tmp_path / "probabilities" / "v.zarr"
    child = hold_output(dest)
    try:
        (theirs,) = stale_temporaries(dest)
        with pytest.raises(CtsegError, match=r"v.zarr: another run is writing this output now"):
            probability_store(dest, np.zeros((8, 8, 8)))
        assert theirs.exists() and not dest.exists()
    finally:
        child.kill()
        child.wait()


def test_an_ensemble_member_missing_a_chunk_is_an_error_naming_it(tmp_path):
    # A member's store lost one chunk file (a partial copy): zarr would read zeros there, and
    # the ensemble would be half the other member's probability.
    rng = np.random.default_rng(4)
    a, b = (probability_store(tmp_path / m / "v.zarr", rng.random((32, 64, 64))) for m in "ab")
    (b / "c" / "1" / "0" / "0").unlink()
    out = tmp_path / "ens" / "v.zarr"

    with pytest.raises(CtsegError) as info:
        ensemble_volume([a, b], [1, 1], out)

    message = str(info.value)
    assert f"{b}: chunk c/1/0/0 is missing: 1 of the 2 chunks written" in message
    assert "\n" not in message and not out.parent.exists()  # refused before anything is written


@pytest.mark.parametrize("threshold", ["2", "1", "-0.1", "nan"])
def test_infer_refuses_a_bad_threshold_before_inference(tmp_path, capsys, threshold):
    probabilities = tmp_path / "probabilities.zarr"
    status = cli_main(
        [
            "infer",
            str(tmp_path / "weights-never-read.pt"),
            str(tmp_path / "image-never-read.zarr"),
            "--mask",
            str(tmp_path / "mask.tif"),
            "--probabilities",
            str(probabilities),
            "--threshold",
            threshold,
        ]
    )
    assert status == 2
    assert "--threshold" in one_line_error(capsys, "infer")
    assert not probabilities.exists() and not (tmp_path / "mask.tif").exists()


# --------------------------------------------------------------------------- the workflow


def dataset(workdir: Path, name: str, rows: list[tuple[str, str]]) -> Path:
    """resources/<name>/ in the Kaggle layout; the volumes only need to exist for a dry run."""
    root = workdir / "resources" / name
    for folder in ("train_images", "train_labels"):
        (root / folder).mkdir(parents=True)
        for record_id, _ in rows:
            write_tiff(root / folder / f"{record_id}.tif", np.zeros((4, 8, 8), np.uint8))
    (root / "train.csv").write_text("id,scroll_id\n" + "".join(f"{i},{s}\n" for i, s in rows))
    return root


def dry_run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_snakemake(workdir, "-n", *args, check=False)


@pytest.fixture
def workdir(tmp_path) -> Path:
    return copy_workflow(tmp_path, {**TINY_CONFIG, "experiment": "tiny"})


@pytest.mark.slow
def test_bad_datasets_stop_the_workflow_before_any_job(workdir):
    cases = {
        "one": ([("a", "1")], "no record to evaluate", "label at least 2 records"),
        "header": ([], "train.csv: no records, only a header", None),
        "noscroll": ([("a", "1"), ("b", ""), ("c", "2")], "empty scroll_id in row(s) [3]", None),
    }
    for name, (rows, expected, fix) in cases.items():
        dataset(workdir, name, rows)
        proc = dry_run(workdir, "--config", f"dataset={name}")
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, name
        assert expected in output and f"'{name}'" in output, output
        assert fix is None or fix in output, output
        assert "KeyError" not in output and "TypeError" not in output, output
    # Two labelled records make a train and a val record, and the workflow can be planned.
    dataset(workdir, "two", [("a", "1"), ("b", "1")])
    assert dry_run(workdir, "--config", "dataset=two").returncode == 0


def test_a_trial_phase_missing_from_phases_yaml_is_named(workdir):
    experiment = {**TINY_EXPERIMENT, "trial": {**TINY_EXPERIMENT["trial"], "phases": [0, 42]}}
    (workdir / "config" / "experiments" / "tiny.yaml").write_text(yaml.safe_dump(experiment))

    proc = dry_run(workdir)

    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "trial.phases names phase(s) [42]" in output and "config/phases.yaml" in output
    assert "KeyError" not in output


@pytest.mark.slow
def test_each_dataset_has_its_own_preprocessed_stores(workdir):
    for name in ("first", "second"):
        dataset(workdir, name, [("a", "1"), ("b", "2")])
    plans = {
        name: dry_run(workdir, "precompute_targets", "--config", f"dataset={name}")
        for name in ("first", "second")
    }
    for name, proc in plans.items():
        other = "second" if name == "first" else "first"
        assert proc.returncode == 0, proc.stderr
        for path in ("zarr/images/a.zarr", "zarr/labels/a.zarr", "targets/a.zarr"):
            assert f"results/preprocessed/{name}/{path}" in proc.stdout, proc.stdout
        assert f"results/preprocessed/{other}/" not in proc.stdout


@pytest.mark.parametrize(
    ("raised", "line"),
    [
        (
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out/a.tif"),
            f"ctseg postprocess: error: /data/out/a.tif: {os.strerror(errno.ENOSPC)}; free some "
            "space there and rerun",
        ),
        (
            PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/ro"),
            f"ctseg postprocess: error: /data/ro: {os.strerror(errno.EACCES)}; choose a path "
            "this user may write to, or change the folder's permissions",
        ),
        (
            RuntimeError("zarr: the write failed"),  # no OS error behind it: ctseg's own, raised
            None,
        ),
    ],
    ids=["disk-full", "permission", "ctseg-own"],
)
def test_an_os_error_is_one_line_naming_the_path_and_an_interrupt_says_so(
    tmp_path, monkeypatch, capsys, raised, line
):
    """What the user must fix (a full disk, a folder they may not write) is one line with the
    path; a KeyboardInterrupt is one line too; anything else keeps its traceback."""
    from ctseg.postprocess import write

    def fails(*args, **kwargs):
        if line is None:
            raise raised
        raise RuntimeError("wrapped") from raised  # as zarr and pools re-raise an OS error

    monkeypatch.setattr(write, "write_mask", fails)
    args = ["postprocess", str(tmp_path / "p.zarr"), str(tmp_path / "m.tif")]
    if line is None:
        with pytest.raises(RuntimeError, match="the write failed"):
            cli_main(args)
        return
    assert cli_main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(write, "write_mask", interrupted)
    assert cli_main(args) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "ctseg postprocess: interrupted; nothing partial was kept"
    ]


def test_a_full_disk_raised_deep_in_a_library_is_still_one_line(tmp_path, monkeypatch, capsys):
    """zarr's async writers raise the OS error while handling another (its context, not its
    cause): a full disk found anywhere in the chain is still the one line."""
    from ctseg.postprocess import write

    def fails(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/scratch/p.zarr/c/0/0/0")
        except OSError:
            raise RuntimeError("task failed")  # noqa: B904 - as the library does

    monkeypatch.setattr(write, "write_mask", fails)
    assert cli_main(["postprocess", str(tmp_path / "p.zarr"), str(tmp_path / "m.tif")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"ctseg postprocess: error: /scratch/p.zarr/c/0/0/0: {os.strerror(errno.ENOSPC)}; free "
        "some space there and rerun"
    ]


# --------------------------------------------------------------------------- a full disk, named
def test_infer_on_a_full_disk_is_one_line_naming_the_probability_store(
    tmp_path, monkeypatch, capsys
):
    """zarr's write error names no file: the line names the store being written."""
    import torch

    from ctseg.network.model import build_model
    from ctseg.training.checkpoint import save_checkpoint

    torch.manual_seed(0)
    weights = tmp_path / "last.pt"
    payload = {"model_config": {"filters": [4, 8]}, "patch_size": [12, 12, 12]}
    save_checkpoint(
        weights, {**payload, "model": build_model(payload["model_config"]).state_dict()}
    )
    image = tmp_path / "img.zarr"
    attributes = {"p0_5": 0.0, "p99_5": 255.0}
    create_volume(image, (16, 16, 16), np.uint8, (16, 16, 16), attributes=attributes)[...] = volume(
        (16, 16, 16)
    )
    probabilities = tmp_path / "probabilities" / "img.zarr"
    monkeypatch.setattr(zarr.storage.LocalStore, "set", no_space_after(1))  # after zarr.json

    args = ["infer", str(weights), str(image), "--probabilities", str(probabilities)]
    assert cli_main([*args, "--device", "cpu"]) == 2

    line = one_line_error(capsys, "infer")
    assert re.fullmatch(
        rf"ctseg infer: error: {re.escape(str(probabilities))}: no space left on the device "
        r"while trying to write the probabilities of img\.zarr \(No space left on device; \d+ "
        r"bytes free now\); the partial output was removed: free some space and rerun",
        line,
    ), line
    assert not probabilities.exists() and beside(probabilities) == []


@pytest.mark.parametrize(
    ("raised", "problem"),
    [
        pytest.param(
            lambda: OSError("110592 requested and 40704 written"),
            f"{os.strerror(errno.ENOSPC)} (a write of 110592 bytes stopped after 40704: the disk "
            "or the quota is full)",
            id="short-write",
        ),
        pytest.param(
            lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
            os.strerror(errno.ENOSPC),
            id="enospc",
        ),
    ],
)
def test_a_mask_written_on_a_full_disk_is_one_line_naming_it(
    tmp_path, monkeypatch, capsys, raised, problem
):
    """tifffile (numpy's tofile) reports a full disk as a short write with no errno and no file,
    zarr and the OS with no file: either way the line names the mask, and none is left."""
    from ctseg.postprocess import write

    probabilities = tmp_path / "p.zarr"
    create_volume(probabilities, (8, 16, 16), np.float16, (8, 16, 16))[...] = 0.75
    mask = tmp_path / "masks" / "a.tif"

    def imwrite_then_fill(path, *args, **kwargs):
        Path(path).write_bytes(bytes(40704))
        raise raised()

    monkeypatch.setattr(write.tifffile, "imwrite", imwrite_then_fill)
    assert cli_main(["postprocess", str(probabilities), str(mask)]) == 2
    assert one_line_error(capsys, "postprocess") == (
        f"ctseg postprocess: error: {mask}: {problem}; free some space there and rerun"
    )
    assert not mask.exists() and beside(mask) == []


def test_the_innermost_output_is_named_and_an_os_error_s_own_file_comes_first(tmp_path):
    from ctseg.io import os_error_line

    outer, inner = tmp_path / "run", tmp_path / "run" / "a.json"
    with pytest.raises(OSError) as info, atomic_path(outer), atomic_path(inner):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert os_error_line(info.value) == (
        f"{inner}: {os.strerror(errno.EDQUOT)}; free some space there and rerun"
    )
    with pytest.raises(OSError) as info, atomic_path(inner):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/ro")
    assert os_error_line(info.value).startswith(f"/data/ro: {os.strerror(errno.EACCES)}; ")
