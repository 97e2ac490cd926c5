"""ctseg.chunks and the readers of ctseg.store: a store that lost a chunk file is an error naming
the store and the chunk, never zeros; a chunk left out on purpose (all fill value) still reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr

from ctseg.chunks import (
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
    sizes = {f"c/{z}/{y}/{x}": (store / "c" / str(z) / str(y) / str(x)).stat().st_size
             for z in range(3) for y in range(3) for x in range(4)}  # fmt: skip
    assert record == {
        "grid": [3, 3, 4],
        "written": 36,
        "absent": [],
        "bytes": sum(sizes.values()),
        "sizes": sizes_digest(sizes),
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


def test_a_record_without_sizes_is_still_read(tmp_path):
    """A store recorded before sizes were (no ``bytes``/``sizes``) is checked for lost chunks
    only, as before."""
    values = np.random.default_rng(2).integers(1, 255, SHAPE, dtype=np.uint8)
    store = written(tmp_path / "a.zarr", values)
    meta = metadata(store)
    del meta["attributes"][RECORD]["bytes"], meta["attributes"][RECORD]["sizes"]
    (store / "zarr.json").write_text(json.dumps(meta))
    np.testing.assert_array_equal(open_volume(store)[...], values)
    (store / "c" / "0" / "0" / "0").unlink()
    with pytest.raises(CtsegError, match="chunk c/0/0/0 is missing"):
        open_volume(store)


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
    assert record_for(meta, {}) == {
        "grid": [3, 0],
        "written": 0,
        "absent": [],
        "bytes": 0,
        "sizes": sizes_digest({}),
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
    sdt_chunks[0].unlink()
    key = sdt_chunks[0].relative_to(dest).as_posix()
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
