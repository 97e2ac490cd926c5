"""ctseg.preprocess.stage: choosing the subset, and copying it to scratch verified, atomic and
resumable."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import s3_options, upload

from ctseg.chunks import RECORD, record_stores
from ctseg.io import CtsegError, sha256_file
from ctseg.preprocess.stage import check_staged, expand_scratch, stage_records
from ctseg.store import (
    MASK_BITS,
    create_in_group,
    create_volume,
    open_targets,
    open_volume,
    unpack_mask,
)

SHAPE = (20, 24, 28)
CHUNKS = (8, 8, 8)
IDS = ["r0", "r1", "r2"]
ARRAYS = ("image", "ignore", "foreground", "skeleton", "tube", "sdt", "fg_locations")


# --------------------------------------------------------------------------- helpers


def make_record(
    source: Path, record_id: str, seed: int, shape=SHAPE, chunks=CHUNKS, n_locations=37
) -> dict:
    """One record of a preprocessed store, as convert and precompute_targets would leave it
    (with the record of the chunks written, which they write through ctseg.io.atomic_path)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, shape, dtype=np.uint8)
    image[:8] = 0  # whole chunks at the fill value are never written: raw must still fill them
    foreground = (rng.random(shape) < 0.3).astype(np.uint8)
    arrays = {
        "image": image,
        "ignore": (rng.random(shape) < 0.1).astype(np.uint8),
        "foreground": foreground,
        "skeleton": foreground & (rng.random(shape) < 0.3),
        "tube": foreground | (rng.random(shape) < 0.05),
        "sdt": rng.normal(0, 4, shape).astype(np.float16),
        "fg_locations": rng.integers(0, min(shape), (n_locations, 3)).astype(np.int32),
    }
    attrs = {
        "source": f"train_images/{record_id}.tif",
        "source_sha256": "0" * 64,
        "shape": list(shape),
        "dtype": "uint8",
        "mean": float(image.mean()),
        "std": float(image.std()),
        "p0_5": 0.0,
        "p99_5": 254.0,
    }
    create_volume(
        source / f"zarr/images/{record_id}.zarr", shape, "uint8", chunks, attributes=attrs
    )[:] = image
    group = zarr.open_group(str(source / f"targets/{record_id}.zarr"), mode="w", zarr_format=3)
    target_attrs = {"clip_distance": 4, "skeleton_method": "medial_surface", "tube_dilations": 2}
    group.attrs.update(target_attrs)
    for name in ARRAYS[1:6]:
        create_in_group(group, name, shape, arrays[name].dtype, chunks)[:] = arrays[name]
    locations = create_in_group(group, "fg_locations", (n_locations, 3), np.int32, (16, 3))
    if n_locations:
        locations[:] = arrays["fg_locations"]
    record_stores(source / f"zarr/images/{record_id}.zarr")
    record_stores(source / f"targets/{record_id}.zarr")
    return {**arrays, "attrs": attrs, "target_attrs": target_attrs}


def make_store(source: Path, ids: list[str], chunks=CHUNKS) -> dict:
    # The last record has no foreground samples: an N=0 array must survive both formats.
    return {
        rid: make_record(source, rid, seed, chunks=chunks, n_locations=0 if rid == "r2" else 37)
        for seed, rid in enumerate(ids)
    }


@pytest.fixture(scope="module")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    # zarr writes cost ~2 ms a chunk; build once per module.
    source = tmp_path_factory.mktemp("template") / "store"
    return source, make_store(source, IDS)


@pytest.fixture
def store(store_template) -> tuple[Path, dict]:
    """The shared preprocessed store with IDS (never modify it), and each record's arrays."""
    source, expected = store_template
    return source, copy.deepcopy(expected)


@pytest.fixture
def private_store(store_template, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the store that a test may change."""
    template, expected = store_template
    source = tmp_path / "store"
    shutil.copytree(template, source)
    return source, copy.deepcopy(expected)


def read_back(dest: Path, record_id: str, fmt: str) -> dict:
    record = dest / record_id
    if fmt == "raw":
        masks = np.load(record / "masks.npy", mmap_mode="r")
        arrays = {name: unpack_mask(masks, name).astype(np.uint8) for name in MASK_BITS}
        for name in ("image", "sdt", "fg_locations"):
            arrays[name] = np.load(record / f"{name}.npy", mmap_mode="r")
        arrays["attrs"] = json.loads((record / "meta.json").read_text())
        arrays["target_attrs"] = arrays["attrs"].pop("targets")
        return arrays
    targets = open_targets(record / "targets.zarr")
    image = open_volume(record / "image.zarr")
    arrays = {name: targets[name][:] for name in ARRAYS[1:]}
    attrs = image.attrs.asdict()
    assert attrs.pop(RECORD)["written"] > 0  # the copy keeps the source's chunk record
    return {"image": image[:], **arrays, "attrs": attrs, "target_attrs": targets.attrs.asdict()}


def assert_same_record(actual: dict, expected: dict) -> None:
    for name in ARRAYS:
        assert actual[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)
    assert actual["attrs"] == expected["attrs"]
    assert actual["target_attrs"] == expected["target_attrs"]


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def data_files(record: Path) -> dict[str, bytes]:
    return {name: data for name, data in tree(record).items() if name != "manifest.json"}


def leftovers(dest: Path) -> list[str]:
    return [p.name for p in dest.iterdir() if p.name.startswith(".")]


def test_expand_scratch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CTSEG_TEST_SCRATCH", str(tmp_path))
    monkeypatch.setenv("HOME", "/home/someone")
    assert expand_scratch("$CTSEG_TEST_SCRATCH/exp") == tmp_path / "exp"
    assert expand_scratch("${CTSEG_TEST_SCRATCH}/exp") == tmp_path / "exp"
    assert expand_scratch("~/scratch") == Path("/home/someone/scratch")
    monkeypatch.delenv("CTSEG_UNSET_VAR", raising=False)
    with pytest.raises(CtsegError, match="CTSEG_UNSET_VAR"):
        expand_scratch("/tmp/$CTSEG_UNSET_VAR/x")


# --------------------------------------------------------------------------- stage_records


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_stage_reproduces_source_arrays(store, tmp_path: Path, fmt: str) -> None:
    source, expected = store
    dest = tmp_path / "scratch"
    summary = stage_records(str(source), IDS, dest, fmt=fmt, workers=2)
    assert summary["records_copied"] == 3 and summary["records_skipped"] == 0
    # The estimate is exact, so the free-space check is neither too strict nor too loose.
    assert summary["bytes_copied"] == summary["bytes_needed"] > 0
    for rid in IDS:
        assert_same_record(read_back(dest, rid, fmt), expected[rid])
    assert leftovers(dest) == []


def test_raw_and_zarr_formats_read_back_identical(store, tmp_path: Path) -> None:
    source, _ = store
    stage_records(str(source), IDS, tmp_path / "raw", fmt="raw")
    stage_records(str(source), IDS, tmp_path / "zarr", fmt="zarr")
    for rid in IDS:
        assert_same_record(
            read_back(tmp_path / "raw", rid, "raw"), read_back(tmp_path / "zarr", rid, "zarr")
        )
        image = np.load(tmp_path / "raw" / rid / "image.npy", mmap_mode="r")
        assert isinstance(image, np.memmap)


def test_raw_slabs_thinner_than_a_chunk_still_assemble_exactly(
    store, tmp_path: Path, monkeypatch
) -> None:
    """Planes wider than the memory budget are read a few rows at a time."""
    source, expected = store
    monkeypatch.setattr("ctseg.preprocess.stage.SLAB_BYTES", 1)
    stage_records(str(source), ["r0"], tmp_path / "scratch", fmt="raw")
    assert_same_record(read_back(tmp_path / "scratch", "r0", "raw"), expected["r0"])


def test_zarr_format_copies_store_files_byte_for_byte(store, tmp_path: Path) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    stage_records(str(source), ["r1"], dest, fmt="zarr")
    assert tree(dest / "r1" / "image.zarr") == tree(source / "zarr/images/r1.zarr")
    assert tree(dest / "r1" / "targets.zarr") == tree(source / "targets/r1.zarr")


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_manifests_list_every_file_with_size_and_sha256(store, tmp_path: Path, fmt: str) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt=fmt, storage_options={"secret_token": "xyz"})
    text = (dest / "manifest.json").read_text()
    assert "xyz" not in text, "storage options may hold credentials; keep them out"
    manifest = json.loads(text)
    assert manifest["format"] == fmt and manifest["source"] == str(source)
    assert manifest["ids"] == IDS
    on_disk = {
        str(p.relative_to(dest))
        for p in dest.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert {f["path"] for f in manifest["files"]} == on_disk
    for entry in manifest["files"]:
        path = dest / entry["path"]
        assert path.stat().st_size == entry["size"]
        assert sha256_file(path) == entry["sha256"]
    record = json.loads((dest / "r0" / "manifest.json").read_text())
    assert (
        record["format"] == fmt
        and record["fingerprint"] == manifest["records"]["r0"]["fingerprint"]
    )
    assert [f"r0/{e['path']}" for e in record["files"]] == [
        f["path"] for f in manifest["files"] if f["path"].startswith("r0/")
    ]


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_second_run_copies_nothing(store, tmp_path: Path, fmt: str) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt=fmt)
    before = tree(dest)
    summary = stage_records(str(source), IDS, dest, fmt=fmt)
    assert summary["bytes_copied"] == 0 and summary["files_copied"] == 0
    assert summary["records_skipped"] == len(IDS) and summary["records_copied"] == 0
    assert tree(dest) == before


@pytest.mark.parametrize("damage", ["delete", "truncate", "drop_manifest"])
@pytest.mark.parametrize("verify", ["size", "sha256"])
def test_damaged_record_is_restaged(store, tmp_path: Path, damage: str, verify: str) -> None:
    source, expected = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt="raw")
    target = dest / "r1" / ("manifest.json" if damage == "drop_manifest" else "sdt.npy")
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    else:
        target.unlink()
    summary = stage_records(str(source), IDS, dest, fmt="raw", verify=verify)
    assert summary["records_copied"] == 1 and summary["records_skipped"] == 2
    assert_same_record(read_back(dest, "r1", "raw"), expected["r1"])


def test_same_size_corruption_needs_sha256_verification(store, tmp_path: Path) -> None:
    source, expected = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt="raw")
    path = dest / "r0" / "image.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    # The cheap check trusts sizes (documented trade-off) ...
    assert stage_records(str(source), IDS, dest, fmt="raw", verify="size")["records_copied"] == 0
    # ... the default rereads and catches it.
    assert stage_records(str(source), IDS, dest, fmt="raw")["records_copied"] == 1
    assert_same_record(read_back(dest, "r0", "raw"), expected["r0"])


def test_format_change_restages_and_replaces(store, tmp_path: Path) -> None:
    source, expected = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt="raw")
    summary = stage_records(str(source), IDS, dest, fmt="zarr")
    assert summary["records_copied"] == 3
    assert sorted(p.name for p in (dest / "r0").iterdir()) == [
        "image.zarr",
        "manifest.json",
        "targets.zarr",
    ]
    assert_same_record(read_back(dest, "r0", "zarr"), expected["r0"])
    assert leftovers(dest) == []


def test_changed_source_restages_only_that_record(private_store, tmp_path: Path) -> None:
    source, expected = private_store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt="raw")
    # Upstream re-ran on r1 with new data: chunk sizes change.
    expected["r1"] = make_record(source, "r1", seed=99)
    # Upstream rewrote only r2's attributes (same chunk files): the metadata text changes.
    image = zarr.open_array(str(source / "zarr/images/r2.zarr"), mode="r+")
    image.attrs["mean"] = 123.0
    expected["r2"]["attrs"]["mean"] = 123.0
    summary = stage_records(str(source), IDS, dest, fmt="raw")
    assert summary["records_copied"] == 2 and summary["records_skipped"] == 1
    for rid in IDS:
        assert_same_record(read_back(dest, rid, "raw"), expected[rid])


def test_not_enough_space_fails_before_writing(store, tmp_path: Path) -> None:
    source, _ = store
    dest = tmp_path / "scratch" / "exp"
    with pytest.raises(CtsegError) as info:
        stage_records(str(source), IDS, dest, reserve_bytes=1 << 62)
    message = str(info.value)
    assert str(dest) in message and "bytes needed" in message and "bytes free" in message
    assert not (tmp_path / "scratch").exists()
    # Once staged, a rerun needs no space at all, so the same reserve passes.
    stage_records(str(source), IDS, dest)
    summary = stage_records(str(source), IDS, dest, reserve_bytes=1 << 62)
    assert summary["records_skipped"] == 3


def test_space_check_counts_only_records_to_copy(store, tmp_path: Path) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    first = stage_records(str(source), IDS[:2], dest)
    summary = stage_records(str(source), IDS, dest)
    assert 0 < summary["bytes_needed"] == summary["bytes_copied"] < first["bytes_needed"]


def test_missing_record_in_source_names_it_and_writes_nothing(
    private_store, tmp_path: Path
) -> None:
    source, _ = private_store
    dest = tmp_path / "scratch"
    with pytest.raises(CtsegError, match="ghost"):
        stage_records(str(source), ["r0", "ghost"], dest)
    assert not dest.exists()
    shutil.rmtree(source / "targets" / "r1.zarr" / "tube")
    with pytest.raises(CtsegError, match="tube"):
        stage_records(str(source), ["r1"], dest)
    assert not dest.exists()


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_a_source_store_missing_a_chunk_is_refused_naming_it(
    private_store, tmp_path: Path, fmt: str
) -> None:
    # A partial copy of the preprocessed store: zarr would read the lost chunk as zeros.
    source, _ = private_store
    (source / "targets" / "r1.zarr" / "sdt" / "c" / "1" / "0" / "2").unlink()
    dest = tmp_path / "scratch"
    with pytest.raises(CtsegError) as info:
        stage_records(str(source), IDS, dest, fmt=fmt)
    assert str(info.value).startswith(
        f"{source}/targets/r1.zarr: chunk sdt/c/1/0/2 is missing: 1 of the 36 chunks written to "
        "this store are gone"
    )
    assert not dest.exists()


def test_a_source_store_without_a_chunk_record_must_hold_every_chunk(
    private_store, tmp_path: Path
) -> None:
    source, expected = private_store
    metadata = source / "zarr" / "images" / "r0.zarr" / "zarr.json"
    meta = json.loads(metadata.read_text())
    del meta["attributes"][RECORD]  # as written before the record, or by another tool
    metadata.write_text(json.dumps(meta))
    stage_records(str(source), ["r0"], tmp_path / "complete")  # every chunk there: staged
    (metadata.parent / "c" / "2" / "2" / "3").unlink()
    with pytest.raises(
        CtsegError, match=r"r0.zarr: chunk c/2/2/3 is missing, and the store has no record"
    ):
        stage_records(str(source), ["r0"], tmp_path / "scratch")


def test_target_shape_mismatch_is_an_error(private_store, tmp_path: Path) -> None:
    source, _ = private_store
    group = zarr.open_group(str(source / "targets" / "r0.zarr"), mode="r+")
    create_in_group(group, "sdt", (4, 4, 4), np.float16, CHUNKS)
    with pytest.raises(CtsegError, match=r"sdt.*differs"):
        stage_records(str(source), ["r0"], tmp_path / "scratch")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"ids": ["../etc"]}, "bad id"),
        ({"ids": ["r0", "r0"]}, "duplicate"),
        ({"fmt": "tiff"}, "scratch_format"),
        ({"verify": "md5"}, "verify"),
    ],
)
def test_bad_arguments(store, tmp_path: Path, kwargs: dict, named: str) -> None:
    source, _ = store
    arguments = {"ids": IDS, **kwargs}
    with pytest.raises(CtsegError, match=named):
        stage_records(str(source), dest=tmp_path / "scratch", **arguments)


def test_failed_verification_leaves_no_record(store, tmp_path: Path, monkeypatch) -> None:
    """Simulates a disk that returns other bytes than were written."""
    source, _ = store
    dest = tmp_path / "scratch"
    monkeypatch.setattr("ctseg.preprocess.stage.sha256_file", lambda path: "0" * 64)
    with pytest.raises(CtsegError, match="verification after copy failed"):
        stage_records(str(source), IDS, dest, workers=1)
    assert sorted(os.listdir(dest)) == []


def test_stale_temporaries_are_removed(store, tmp_path: Path) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    (dest / ".r0.tmp-4242-0123abcd" / "partial").mkdir(parents=True)
    (dest / ".manifest.json.tmp-4242-deadbeef").write_text("{")
    summary = stage_records(str(source), IDS, dest)
    assert summary["stale_temps_removed"] == 2
    assert leftovers(dest) == []


def test_concurrent_run_into_same_dest_is_refused(store, tmp_path: Path) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(CtsegError, match="another staging run"):
            stage_records(str(source), IDS, dest)
    finally:
        os.close(fd)
    assert stage_records(str(source), IDS, dest)["records_copied"] == 3


def test_progress_bar_goes_to_stderr(store, tmp_path: Path, capsys) -> None:
    source, _ = store
    stage_records(str(source), IDS, tmp_path / "scratch")
    captured = capsys.readouterr()
    assert "stage" in captured.err and "records 3/3" in captured.err
    assert captured.out == ""


# --------------------------------------------------------------------------- killed half-way

KILL_RECORDS = 8
CHILD = (
    "import json, sys\n"
    "from ctseg.preprocess.stage import stage_records\n"
    "stage_records(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], fmt=sys.argv[4], workers=1)\n"
)


def staged_and_temporary(dest: Path) -> tuple[list[str], list[str]]:
    try:
        names = os.listdir(dest)
    except FileNotFoundError:
        return [], []
    done = [n for n in names if not n.startswith(".") and n != "manifest.json"]
    return done, [n for n in names if n.startswith(".")]


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_killed_run_resumes_to_a_complete_byte_exact_copy(tmp_path: Path, fmt: str) -> None:
    source = tmp_path / "store"
    expected = make_record(source, "r000", seed=1, shape=(24, 24, 24))
    ids = [f"r{i:03d}" for i in range(KILL_RECORDS)]
    for rid in ids[1:]:
        shutil.copytree(source / "zarr/images/r000.zarr", source / f"zarr/images/{rid}.zarr")
        shutil.copytree(source / "targets/r000.zarr", source / f"targets/{rid}.zarr")
    dest = tmp_path / "scratch"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(source), json.dumps(ids), str(dest), fmt],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        # Kill while a record is mid-copy (its temporary exists) and some are already done.
        while True:
            done, temporary = staged_and_temporary(dest)
            if len(done) >= 2 and temporary:
                break
            assert child.poll() is None, "staging ended before it could be killed"
            assert time.monotonic() < deadline, "staging never got going"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    done, temporary = staged_and_temporary(dest)
    assert temporary and len(done) < KILL_RECORDS
    assert not (dest / "manifest.json").exists(), "an unfinished run must not look finished"

    summary = stage_records(str(source), ids, dest, fmt=fmt)
    assert summary["stale_temps_removed"] >= 1
    assert summary["records_skipped"] >= len(done)
    assert summary["records_copied"] + summary["records_skipped"] == KILL_RECORDS
    assert leftovers(dest) == []
    # Every record is a copy of r000, so one uninterrupted staging of it is the reference.
    reference = tmp_path / "reference"
    stage_records(str(source), ["r000"], reference, fmt=fmt)
    assert_same_record(read_back(reference, "r000", fmt), expected)
    reference_files = data_files(reference / "r000")
    for rid in ids:
        assert data_files(dest / rid) == reference_files, rid


# --------------------------------------------------------------------------- remote source


def test_s3_source_stages_the_same_bytes_as_local(tmp_path: Path, s3_endpoint) -> None:
    # Two records on a 2x2x2 chunk grid: still several chunks per slab, but few requests, as
    # moto spends ~20 ms of CPU on each.
    ids = ["r0", "r2"]
    source = tmp_path / "store"
    expected = make_store(source, ids, chunks=(16, 16, 16))
    upload(s3_endpoint, source, "ctseg-store", "preprocessed/v1")
    url = "s3://ctseg-store/preprocessed/v1"
    options = s3_options(s3_endpoint)
    for fmt in ("raw", "zarr"):
        remote = tmp_path / f"remote-{fmt}"
        local = tmp_path / f"local-{fmt}"
        summary = stage_records(url, ids, remote, fmt=fmt, storage_options=options)
        stage_records(str(source), ids, local, fmt=fmt)
        assert summary["records_copied"] == 2
        for rid in ids:
            assert_same_record(read_back(remote, rid, fmt), expected[rid])
        remote_files = json.loads((remote / "manifest.json").read_text())["files"]
        local_files = json.loads((local / "manifest.json").read_text())["files"]
        assert remote_files == local_files
        again = stage_records(url, ids, remote, fmt=fmt, storage_options=options)
        assert again["bytes_copied"] == 0 and again["records_skipped"] == 2
    with pytest.raises(CtsegError, match="no-such-prefix"):
        stage_records(f"{url}/no-such-prefix", ids, tmp_path / "x", storage_options=options)
    # Same content, other address: the fingerprint ignores the URL, so nothing is copied.
    moved = stage_records(str(source), ids, tmp_path / "remote-zarr", fmt="zarr")
    assert moved["records_skipped"] == 2


def test_an_s3_source_missing_a_chunk_is_refused_naming_it(
    tmp_path: Path, s3_endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An interrupted upload: one chunk of the image never reached the bucket.
    source = tmp_path / "store"
    make_store(source, ["r0"], chunks=(16, 16, 16))
    (source / "zarr" / "images" / "r0.zarr" / "c" / "1" / "0" / "0").unlink()
    upload(s3_endpoint, source, "ctseg-partial", "v1")
    url = "s3://ctseg-partial/v1"
    options = s3_options(s3_endpoint)
    missing = f"{url}/zarr/images/r0.zarr: chunk c/1/0/0 is missing: 1 of the 8 chunks written"
    with pytest.raises(CtsegError) as info:
        stage_records(url, ["r0"], tmp_path / "scratch", fmt="raw", storage_options=options)
    assert str(info.value).startswith(missing)
    assert not (tmp_path / "scratch").exists()
    # Opened straight from the bucket (ctseg.store.open_volume), the same store is refused too.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    with pytest.raises(CtsegError) as info:
        open_volume(f"{url}/zarr/images/r0.zarr")
    assert str(info.value).startswith(missing)


def test_an_s3_source_with_a_chunk_cut_short_is_refused(
    tmp_path: Path, s3_endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An upload cut off inside a chunk file: the object is there, shorter than written.
    source = tmp_path / "store"
    make_store(source, ["r0"], chunks=(16, 16, 16))
    chunk = source / "zarr" / "images" / "r0.zarr" / "c" / "1" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    upload(s3_endpoint, source, "ctseg-cut", "v1")
    url = "s3://ctseg-cut/v1"
    options = s3_options(s3_endpoint)
    cut = f"{url}/zarr/images/r0.zarr: its chunk files hold "
    with pytest.raises(CtsegError) as info:
        stage_records(url, ["r0"], tmp_path / "scratch", fmt="raw", storage_options=options)
    assert str(info.value).startswith(cut) and "cut short or replaced" in str(info.value)
    assert not (tmp_path / "scratch").exists()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    with pytest.raises(CtsegError) as info:
        open_volume(f"{url}/zarr/images/r0.zarr")
    assert str(info.value).startswith(cut)


# --------------------------------------------------------------------------- check_staged


@pytest.mark.parametrize("fmt", ["raw", "zarr"])
def test_check_staged_passes_an_intact_copy(store, tmp_path: Path, fmt: str) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest, fmt=fmt)
    manifest = check_staged(dest, IDS)
    assert manifest["ids"] == IDS
    check_staged(dest, IDS[:1])  # a subset of what is staged


@pytest.mark.parametrize(
    ("damage", "named", "problem"),
    [
        (lambda d: (d / "r1" / "sdt.npy").unlink(), "r1/sdt.npy", "is missing"),
        (lambda d: os.truncate(d / "r2" / "image.npy", 100), "r2/image.npy", "has 100 bytes"),
        (lambda d: (d / "r0" / "meta.json").write_text("{}"), "r0/meta.json", "bytes"),
        (
            lambda d: (d / "r0" / "meta.json").write_bytes(
                (d / "r0" / "meta.json").read_bytes().replace(b"0", b"1")
            ),
            "r0/meta.json",
            "sha256",
        ),
        (lambda d: (d / "r1" / "manifest.json").unlink(), "r1/manifest.json", "missing"),
        (lambda d: (d / "manifest.json").unlink(), "scratch/manifest.json", "nothing is staged"),
    ],
    ids=["deleted", "truncated", "rewritten", "same-size", "record-manifest", "manifest"],
)
def test_check_staged_names_the_damaged_file_and_the_fix(
    store, tmp_path: Path, damage, named: str, problem: str
) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS, dest)
    damage(dest)
    with pytest.raises(CtsegError) as info:
        check_staged(dest, IDS)
    message = str(info.value)
    assert named in message and problem in message, message
    assert "snakemake -R stage" in message and "\n" not in message
    # What the message says repairs it: staging again.
    stage_records(str(source), IDS, dest)
    check_staged(dest, IDS)


def test_check_staged_names_records_that_were_not_staged(store, tmp_path: Path) -> None:
    source, _ = store
    dest = tmp_path / "scratch"
    stage_records(str(source), IDS[:2], dest)
    with pytest.raises(CtsegError, match=r"\['r2'\] are not staged here"):
        check_staged(dest, IDS)
