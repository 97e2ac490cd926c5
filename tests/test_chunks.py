"""ctseg.chunks and the readers of ctseg.store: a store that lost a chunk file is an error naming
the store and the chunk, never zeros; a chunk left out on purpose (all fill value) still reads;
a chunk whose bytes are not those written at its position (flipped, damaged, swapped with
another) is an error naming the store and the chunk, never data."""

from __future__ import annotations

import json
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import tifffile
import zarr

from ctseg.chunks import (
    ABSENT_DIGEST,
    RECORD,
    chunk_key,
    missing_chunks,
    record_for,
    record_stores,
    sizes_digest,
)
from ctseg.io import CtsegError, atomic_path
from ctseg.preprocess.convert import convert_volume
from ctseg.preprocess.targets import compute_targets
from ctseg.store import create_volume, open_targets, open_volume

SHAPE = (20, 24, 28)
CHUNKS = (8, 8, 8)  # a 3 x 3 x 4 grid, edge chunks on every axis


def metadata(path: Path) -> dict:
    return json.loads((path / "zarr.json").read_text())


def written(path: Path, values: np.ndarray, **kwargs) -> Path:
    with atomic_path(path) as tmp:
        create_volume(tmp, values.shape, values.dtype, CHUNKS, **kwargs)[...] = values
    return path


def test_a_finished_store_records_its_chunks_and_a_lost_one_is_named(tmp_path):
    values = np.random.default_rng(0).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values)
    record = metadata(store)["attributes"][RECORD]
    # The chunk files in C order, the order of the record's digests.
    grid = [(z, y, x) for z in range(3) for y in range(3) for x in range(4)]
    files = [store / "c" / str(z) / str(y) / str(x) for z, y, x in grid]
    sizes = {p.relative_to(store).as_posix(): p.stat().st_size for p in files}
    assert record == {
        "grid": [3, 3, 4],
        "written": 36,
        "absent": [],
        "bytes": sum(sizes.values()),
        "sizes": sizes_digest(sizes),
        "crc32c": "".join(f"{google_crc32c.value(p.read_bytes()):08x}" for p in files),
    }
    np.testing.assert_array_equal(open_volume(store)[...], values)

    (store / "c" / "2" / "1" / "3").unlink()
    (store / "c" / "0" / "0" / "1").unlink()

    with pytest.raises(CtsegError) as info:
        open_volume(store)
    assert str(info.value) == (
        f"{store}: chunk c/0/0/1 is missing (and 1 more): 2 of the 36 chunks written to this "
        "store are gone (a partial copy or sync?), and zarr would read them as zeros; copy the "
        "store again, or rerun the step that writes it"
    )


@pytest.mark.parametrize("keep", [40, 0])
def test_a_chunk_file_cut_short_is_named_not_read_as_garbage(tmp_path, keep):
    """A partial copy can leave a chunk file cut short (or empty): blosc decodes a truncated
    buffer into garbage without an error, so its size against the record is what finds it."""
    values = np.random.default_rng(1).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values)
    chunk = store / "c" / "1" / "1" / "1"
    data = chunk.read_bytes()
    written_bytes = metadata(store)["attributes"][RECORD]["bytes"]
    chunk.write_bytes(data[:keep])
    with pytest.raises(CtsegError) as info:
        open_volume(store)
    assert str(info.value) == (
        f"{store}: its chunk files hold {written_bytes - len(data) + keep} bytes where "
        f"{written_bytes} were written: a chunk file was cut short or replaced (a partial copy "
        "or sync?), and zarr would read it as garbage; copy the store again, or rerun the step "
        "that writes it"
    )
    chunk.write_bytes(data)  # the whole file back: it reads again
    np.testing.assert_array_equal(open_volume(store)[...], values)
    # A file that is not a chunk (Snakemake marks a directory output with one) is no change.
    (store / ".snakemake_timestamp").write_bytes(b"")
    np.testing.assert_array_equal(open_volume(store)[...], values)


def test_a_record_without_digests_is_refused_with_the_command_that_writes_it_again(tmp_path):
    """A store ctseg wrote before it recorded each chunk's crc32c (no ``crc32c``, and older ones
    no ``bytes``/``sizes`` either) cannot have its chunks checked as they are read: refused,
    naming the store and the command that writes it again; a lost chunk is still named first."""
    values = np.random.default_rng(2).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values)
    meta = metadata(store)
    del meta["attributes"][RECORD]["crc32c"]
    (store / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(CtsegError) as info:
        open_volume(store)
    assert str(info.value) == (
        f"{store}: written by an older ctseg that recorded no digest of each chunk ('crc32c' "
        "in 'chunks_written'), so a damaged or misplaced chunk could not be found as it is "
        f"read; re-create the store: snakemake --force {store} (or rerun the ctseg step that "
        "wrote it)"
    )
    del meta["attributes"][RECORD]["bytes"], meta["attributes"][RECORD]["sizes"]
    (store / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(CtsegError, match="written by an older ctseg"):
        open_volume(store)
    (store / "c" / "0" / "0" / "0").unlink()
    with pytest.raises(CtsegError, match="chunk c/0/0/0 is missing"):
        open_volume(store)


def flip(path: Path, start: int, count: int = 16) -> None:
    """Invert `count` bytes of a file in place: same size, other content."""
    data = bytearray(path.read_bytes())
    data[start : start + count] = bytes(255 - b for b in data[start : start + count])
    path.write_bytes(bytes(data))


def damaged_line(store: Path, key: str) -> str:
    got = f"{google_crc32c.value((store / key).read_bytes()):08x}"
    recorded = metadata(store)["attributes"][RECORD]["crc32c"]
    index = int(key.split("/")[1]) * 12 + int(key.split("/")[2]) * 4 + int(key.split("/")[3])
    return (
        f"{store}: chunk {key} does not hold the bytes written there (crc32c {got}, "
        f"{recorded[8 * index : 8 * index + 8]} recorded): damaged, or another chunk's file in "
        f"its place; re-create the store: snakemake --force {store} (or rerun the ctseg step "
        "that wrote it)"
    )


def test_bytes_flipped_in_place_are_refused_naming_the_store_and_the_chunk(tmp_path):
    """Uncompressed, flipped bytes decode without an error into other values, and the file
    keeps its size: only the chunk's digest tells."""
    values = np.random.default_rng(4).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values, codec={"name": "none"})
    flip(store / "c" / "1" / "2" / "3", start=100)
    # Unchecked, zarr reads other values and no error.
    plain = zarr.open_array(str(store), mode="r")[8:16, 16:24, 24:28]
    assert not np.array_equal(plain, values[8:16, 16:24, 24:28])
    with pytest.raises(CtsegError) as info:
        open_volume(store)[8:16, 16:24, 24:28]
    assert str(info.value) == damaged_line(store, "c/1/2/3")
    # The chunks around it still read.
    np.testing.assert_array_equal(open_volume(store)[:8], values[:8])


def test_two_chunks_of_one_size_swapped_are_refused(tmp_path):
    """Data that does not compress gives every chunk file one size: a swap passes the size
    check, and each file is a valid chunk, but not the one written at its position."""
    values = np.random.default_rng(5).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values, codec={"name": "none"})
    a, b = store / "c" / "0" / "0" / "1", store / "c" / "2" / "1" / "0"
    assert a.stat().st_size == b.stat().st_size
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b), b.write_bytes(data_a)
    array = open_volume(store)  # the listing and the sizes agree with the record
    with pytest.raises(CtsegError) as info:
        array[0:8, 0:8, 8:16]
    assert str(info.value) == damaged_line(store, "c/0/0/1")
    with pytest.raises(CtsegError, match=r"a.zarr: chunk c/2/1/0 does not hold the bytes"):
        array[16:20, 8:16, 0:8]


def test_a_damaged_compressed_chunk_gets_the_same_line_not_blosc_s_traceback(tmp_path):
    values = np.random.default_rng(6).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values)  # blosc lz4, the default codec
    chunk = store / "c" / "0" / "1" / "2"
    flip(chunk, start=0, count=chunk.stat().st_size)
    with pytest.raises(RuntimeError, match="blosc"):  # what zarr alone gives
        zarr.open_array(str(store), mode="r")[0:8, 8:16, 16:24]
    with pytest.raises(CtsegError) as info:
        open_volume(store)[...]
    assert str(info.value) == damaged_line(store, "c/0/1/2")


def test_a_chunk_lost_after_opening_or_put_where_none_was_written_is_refused(tmp_path):
    values = np.random.default_rng(7).integers(1, 255, SHAPE, dtype=np.uint8)
    values[:8] = 0  # one chunk row of zeros: zarr writes no file for it
    store = written(tmp_path / "a.zarr", values, write_empty_chunks=False)
    assert metadata(store)["attributes"][RECORD]["crc32c"].startswith(ABSENT_DIGEST * 12)
    array = open_volume(store)
    (store / "c" / "1" / "0" / "0").unlink()
    with pytest.raises(CtsegError, match=r"chunk c/1/0/0 is missing \(zarr would read it as"):
        array[8:16, 0:8, 0:8]
    (store / "c" / "0" / "0" / "0").parent.mkdir(parents=True)
    (store / "c" / "2" / "0" / "0").rename(store / "c" / "0" / "0" / "0")
    with pytest.raises(CtsegError, match=r"chunk c/0/0/0 holds data where its writer wrote none"):
        array[0:8, 0:8, 0:8]


def test_a_staged_copy_names_staging_as_its_fix(tmp_path):
    values = np.random.default_rng(8).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "scratch" / "exp" / "v1" / "image.zarr", values)
    flip(store / "c" / "0" / "0" / "0", start=0, count=64)
    with pytest.raises(CtsegError) as info:
        open_volume(store)[:8, :8, :8]
    assert str(info.value).startswith(f"{store}: chunk c/0/0/0 does not hold the bytes ")
    assert str(info.value).endswith(
        "; stage the records again (snakemake -R stage; with stage: per_job, rerun the "
        "training job)"
    )


def test_chunks_left_out_on_purpose_still_read_as_the_fill_value(tmp_path):
    values = np.random.default_rng(1).integers(1, 255, SHAPE, dtype=np.uint8)
    values[:16] = 0  # two chunk rows of zeros: zarr writes no file for them
    store = written(tmp_path / "sparse.zarr", values, write_empty_chunks=False)
    record = metadata(store)["attributes"][RECORD]
    assert {k: record[k] for k in ("grid", "written", "absent")} == {
        "grid": [3, 3, 4],
        "written": 12,
        "absent": [[0, 24]],
    }
    np.testing.assert_array_equal(open_volume(store)[...], values)

    (store / "c" / "2" / "0" / "0").unlink()
    with pytest.raises(CtsegError, match=r"sparse.zarr: chunk c/2/0/0 is missing: 1 of the 12"):
        open_volume(store)


def test_a_store_without_a_record_reads_only_when_every_chunk_is_there(tmp_path):
    values = np.random.default_rng(2).integers(1, 255, SHAPE, dtype=np.uint8)
    store = tmp_path / "old.zarr"
    create_volume(store, SHAPE, np.uint8, CHUNKS)[...] = values  # no atomic_path: no record
    assert RECORD not in metadata(store)["attributes"]
    np.testing.assert_array_equal(open_volume(store)[...], values)

    (store / "c" / "1" / "1" / "1").unlink()
    with pytest.raises(CtsegError) as info:
        open_volume(store)
    assert str(info.value).startswith(
        f"{store}: chunk c/1/1/1 is missing, and the store has no record of the chunks written "
        "to it ('chunks_written' in its attributes), so a lost chunk cannot be told from an empty "
        "one; write the store again"
    )


def test_a_record_of_another_grid_is_not_trusted(tmp_path):
    # Attributes copied from a store of another shape carry that store's record.
    values = np.ones(SHAPE, np.uint8)
    store = written(tmp_path / "a.zarr", values)
    meta = metadata(store)
    meta["attributes"][RECORD] = {"grid": [1, 1, 1], "written": 0, "absent": [[0, 1]]}
    (store / "zarr.json").write_text(json.dumps(meta))
    (store / "c" / "0" / "0" / "0").unlink()
    with pytest.raises(CtsegError, match=r"a.zarr: chunk c/0/0/0 is missing, and .* no record"):
        open_volume(store)


def test_a_byte_for_byte_copy_keeps_the_zarr_json_it_was_given(tmp_path):
    values = np.zeros(SHAPE, np.uint8)
    with atomic_path(tmp_path / "copy", record_chunks=False) as tmp:
        create_volume(tmp / "a.zarr", SHAPE, np.uint8, CHUNKS)[...] = values
        before = (tmp / "a.zarr" / "zarr.json").read_bytes()
    assert (tmp_path / "copy" / "a.zarr" / "zarr.json").read_bytes() == before


def test_keys_and_records_follow_the_metadata():
    meta = {"shape": [5, 0], "chunk_grid": {"configuration": {"chunk_shape": [2, 2]}}}
    assert record_for(meta, {}, {}) == {
        "grid": [3, 0],
        "written": 0,
        "absent": [],
        "bytes": 0,
        "sizes": sizes_digest({}),
        "crc32c": "",
    }
    v2 = {
        "shape": [4, 4],
        "chunk_grid": {"configuration": {"chunk_shape": [2, 2]}},
        "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
    }
    assert chunk_key(v2, (1, 0)) == "1.0"
    assert missing_chunks(v2, {"0.0", "0.1", "1.1"}) == (["1.0"], False)
    scalar = {"shape": [], "chunk_grid": {"configuration": {"chunk_shape": []}}}
    assert missing_chunks(scalar, set()) == (["c"], False)
    assert missing_chunks(scalar, {"c"}) == ([], False)


def test_a_sharded_store_counts_shards_and_names_a_lost_one(tmp_path):
    values = np.random.default_rng(3).integers(1, 255, (32, 32, 32), dtype=np.uint8)
    source = tmp_path / "vol.tif"
    tifffile.imwrite(source, values, photometric="minisblack")
    store = tmp_path / "vol.zarr"
    convert_volume(source, store, kind="image", chunks=(8, 8, 8), shards=(16, 32, 32))
    assert metadata(store)["attributes"][RECORD]["grid"] == [2, 1, 1]
    np.testing.assert_array_equal(open_volume(store)[...], values)

    # zarr reads a shard in parts (its index, then inner chunks): the whole shard is checked.
    flip(store / "c" / "0" / "0" / "0", start=40)
    with pytest.raises(CtsegError, match=r"vol.zarr: chunk c/0/0/0 does not hold the bytes"):
        open_volume(store)[0:8, 0:8, 0:8]
    np.testing.assert_array_equal(open_volume(store)[16:], values[16:])

    (store / "c" / "1" / "0" / "0").unlink()
    with pytest.raises(CtsegError, match=r"vol.zarr: chunk c/1/0/0 is missing: 1 of the 2 "):
        open_volume(store)


def test_targets_record_each_array_and_a_lost_chunk_is_named_with_its_array(tmp_path):
    labels = np.zeros((16, 32, 32), np.uint8)
    labels[:, 10:13] = 1
    labels[:4] = 2
    label = tmp_path / "lab.zarr"
    create_volume(label, labels.shape, np.uint8, (16, 16, 16))[...] = labels
    dest = tmp_path / "targets" / "lab.zarr"
    compute_targets(label, dest, clip_distance=2, block_shape=(16, 16, 16))
    for name in ("ignore", "foreground", "skeleton", "tube", "sdt", "fg_locations"):
        assert RECORD in metadata(dest / name)["attributes"], name
    open_targets(dest)

    sdt_chunks = sorted(p for p in (dest / "sdt").rglob("*") if p.is_file() and p.suffix != ".json")
    key = sdt_chunks[0].relative_to(dest).as_posix()
    flip(sdt_chunks[0], start=0, count=sdt_chunks[0].stat().st_size)
    with pytest.raises(CtsegError, match=rf"lab.zarr: chunk {key} does not hold the bytes"):
        open_targets(dest)["sdt"][...]
    sdt_chunks[0].unlink()
    with pytest.raises(CtsegError, match=rf"lab.zarr: chunk {key} is missing"):
        open_targets(dest)


def test_record_stores_records_every_array_under_a_directory(tmp_path):
    group = zarr.open_group(str(tmp_path / "t.zarr"), mode="w", zarr_format=3)
    group.create_array("a", shape=(4, 4), chunks=(2, 2), dtype=np.uint8, fill_value=0)[...] = 1
    group.create_array("b", shape=(4,), chunks=(2,), dtype=np.uint8, fill_value=0)
    assert record_stores(tmp_path) == 2
    assert metadata(tmp_path / "t.zarr" / "a")["attributes"][RECORD]["written"] == 4
    assert metadata(tmp_path / "t.zarr" / "b")["attributes"][RECORD]["absent"] == [[0, 2]]
    assert RECORD not in metadata(tmp_path / "t.zarr").get("attributes", {})
    assert open_targets(tmp_path / "t.zarr")["b"][...].tolist() == [0, 0, 0, 0]


def test_the_loaders_zarr_scratch_reads_are_checked(tmp_path):
    """The training loader reads a staged zarr copy (`ctseg.layout.open_record`): a chunk
    damaged there is refused as it is read, naming the copy and staging as the fix."""
    from ctseg.layout import MASK_PLANES, open_record

    record = tmp_path / "scratch" / "exp" / "v1"
    values = np.random.default_rng(9).integers(1, 255, SHAPE, dtype=np.uint8)
    with atomic_path(record / "image.zarr") as tmp:
        attrs = {"p0_5": 1.0, "p99_5": 254.0}
        create_volume(tmp, SHAPE, np.uint8, CHUNKS, attributes=attrs)[...] = values
    with atomic_path(record / "targets.zarr") as tmp:
        group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        group.attrs["clip_distance"] = 4
        for name in (*MASK_PLANES, "sdt"):
            group.create_array(name, shape=SHAPE, chunks=CHUNKS, dtype=np.uint8, fill_value=0)
        group.create_array("fg_locations", shape=(0, 3), chunks=(1, 3), dtype=np.int32)
    scratch = open_record(record, "zarr")
    np.testing.assert_array_equal(scratch.image[:8], values[:8])
    flip(record / "image.zarr" / "c" / "2" / "0" / "0", start=0, count=32)
    with pytest.raises(CtsegError, match=r"image.zarr: chunk c/2/0/0 does not hold the bytes"):
        open_record(record, "zarr").image[16:, :8, :8]
