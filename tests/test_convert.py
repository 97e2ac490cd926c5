"""Tests for `ctseg.preprocess.convert`: exact round trips, exact statistics, bounded memory, and a
clear
error with nothing left behind for every kind of bad input."""

from __future__ import annotations

import logging
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr.codecs

from ctseg.chunks import RECORD, record_stores
from ctseg.cli import main as cli_main
from ctseg.io import CtsegError, sha256_file, sha256_files
from ctseg.labels import KAGGLE, LabelSpec
from ctseg.preprocess.convert import (
    MIN_PAIR_PIECE,
    Histogram,
    _inspect,
    _open_reader,
    _slab_depth,
    _slab_plan,
    _SlabWriter,
    convert_volume,
    read_header,
)
from ctseg.store import create_volume, open_volume

SHAPE = (40, 50, 60)
CHUNKS = (16, 16, 16)
# A budget of one chunk row (16 x 50 x 60 bytes), so a 40-slice volume takes three slabs.
SMALL_BUDGET_MB = 0.1


@pytest.fixture(autouse=True)
def _quiet_tifffile():
    # tifffile logs what it finds in the damaged files these tests write; pytest shows it anyway.
    logging.getLogger("tifffile").setLevel(logging.ERROR)


def random_volume(shape=SHAPE, dtype=np.uint8, seed=0, high=None) -> np.ndarray:
    info = np.iinfo(dtype)
    high = info.max if high is None else high
    return np.random.default_rng(seed).integers(0, high, shape, dtype=dtype, endpoint=True)


def labels_volume(shape=SHAPE, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).choice(np.uint8([0, 1, 2]), shape, p=[0.37, 0.05, 0.58])


def write_tiff(path: Path, data: np.ndarray, **kwargs) -> Path:
    # Without it tifffile stores a volume of 3 or 4 slices as one planar RGB(A) image.
    kwargs.setdefault("photometric", "minisblack")
    tifffile.imwrite(path, data, **kwargs)
    return path


def write_slices(directory: Path, data: np.ndarray, name: str = "slice_{}.tif") -> list[Path]:
    directory.mkdir()
    paths = [directory / name.format(z) for z in range(len(data))]
    for path, plane in zip(paths, data, strict=True):
        tifffile.imwrite(path, plane)
    return paths


def convert(source: Path, dest: Path, **kwargs) -> dict:
    kwargs.setdefault("kind", "image")
    kwargs.setdefault("chunks", CHUNKS)
    kwargs.setdefault("memory_budget_mb", SMALL_BUDGET_MB)
    return convert_volume(source, dest, **kwargs)


def assert_nothing_left(dest: Path) -> None:
    assert not dest.exists()
    leftovers = [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}")]
    assert leftovers == []


def chunk_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


def kept_voxels(data: np.ndarray) -> np.ndarray:
    """The voxels the statistics are of: not in a slice of one value, not the dtype's maximum;
    every voxel where that leaves none."""
    planes = data.reshape(len(data), -1)
    values = planes[planes.min(axis=1) != planes.max(axis=1)].reshape(-1)
    values = values[values != np.iinfo(data.dtype).max]
    return values if values.size else data.reshape(-1)


def assert_stats_match_numpy(attrs: dict, data: np.ndarray) -> None:
    data = kept_voxels(data)
    assert attrs["stats_voxels"] == data.size
    assert attrs["mean"] == pytest.approx(data.mean(dtype=np.float64), rel=1e-12)
    assert attrs["std"] == pytest.approx(data.std(dtype=np.float64), rel=1e-12)
    assert attrs["p0_5"] == pytest.approx(np.percentile(data, 0.5, method="linear"), rel=1e-12)
    assert attrs["p99_5"] == pytest.approx(np.percentile(data, 99.5, method="linear"), rel=1e-12)


# --- round trips and attributes -----------------------------------------------------------------


def test_uint8_round_trip_is_exact_and_attributes_are_complete(tmp_path):
    data = random_volume()
    source = write_tiff(tmp_path / "vol.tif", data)
    dest = tmp_path / "vol.zarr"

    attrs = convert(source, dest)

    arr = open_volume(dest)
    np.testing.assert_array_equal(arr[:], data)
    assert arr.dtype == np.uint8
    stored = dict(arr.attrs)
    # Beside what convert returns: the record of the chunks written (ctseg.chunks).
    record = stored.pop(RECORD)
    assert {k: record[k] for k in ("grid", "written", "absent")} == {
        "grid": [3, 4, 4],
        "written": 48,
        "absent": [],
    }
    assert record["bytes"] > 0 and len(record["sizes"]) == 32
    assert stored == attrs
    assert attrs["source"] == str(source)
    assert attrs["source_sha256"] == sha256_file(source)
    assert attrs["shape"] == list(SHAPE)
    assert attrs["dtype"] == "uint8"
    assert attrs["kind"] == "image"
    assert "label_counts" not in attrs
    assert_stats_match_numpy(attrs, data)


def test_uint16_round_trip_is_exact(tmp_path):
    data = random_volume(dtype=np.uint16, seed=3)
    data[0, 0, 0], data[-1, -1, -1] = 0, 65535
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr")

    arr = open_volume(tmp_path / "vol.zarr")
    assert arr.dtype == np.uint16
    np.testing.assert_array_equal(arr[:], data)
    assert attrs["dtype"] == "uint16"
    assert_stats_match_numpy(attrs, data)


@pytest.mark.parametrize(
    ("shape", "dtype", "high", "seed"),
    [
        ((3, 7, 11), np.uint8, 255, 0),  # 231 voxels: both percentiles interpolate
        ((5, 9, 13), np.uint8, 3, 1),  # few distinct values: ties around the percentiles
        ((4, 6, 17), np.uint16, 65535, 2),
        ((1, 1, 1), np.uint8, 255, 3),
        ((2, 3, 5), np.uint16, 9, 4),
    ],
)
def test_statistics_equal_numpy_on_the_whole_array(tmp_path, shape, dtype, high, seed):
    data = random_volume(shape, dtype, seed, high)
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr", chunks=(2, 4, 4))

    assert_stats_match_numpy(attrs, data)


def test_statistics_are_exact_when_streamed_over_many_slabs(tmp_path):
    # A skewed histogram, streamed one chunk row at a time, must give numpy's numbers.
    data = (random_volume(seed=5) // 40) ** 2
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr", chunks=(4, 16, 16), memory_budget_mb=0.01)

    assert_stats_match_numpy(attrs, data)


def test_a_last_slab_of_one_slice_round_trips(tmp_path):
    # 33 slices in slabs of 16: the last read is a single page, which tifffile returns as 2D.
    data = random_volume((33, 20, 24), seed=4)
    source = write_tiff(tmp_path / "vol.tif", data)

    convert(source, tmp_path / "vol.zarr", chunks=(16, 8, 8), memory_budget_mb=0.01)

    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)


def test_slice_directory_round_trip_in_natural_order(tmp_path):
    data = random_volume((12, 20, 24))
    slices = write_slices(tmp_path / "slices", data)
    # Beside the slices: a macOS resource fork and a note, both ignored.
    (tmp_path / "slices" / "._slice_3.tif").write_bytes(b"\x00\x05\x16\x07 not a tiff")
    (tmp_path / "slices" / "notes.txt").write_text("scan notes")

    attrs = convert(tmp_path / "slices", tmp_path / "vol.zarr", chunks=(4, 8, 8))

    # slice_10 sorts before slice_2 by plain string order; natural order keeps z.
    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)
    assert attrs["shape"] == [12, 20, 24]
    assert attrs["source_sha256"] == sha256_files(slices)
    assert read_header(tmp_path / "slices") == ((12, 20, 24), np.dtype(np.uint8))
    assert_stats_match_numpy(attrs, data)


def test_labels_are_counted(tmp_path):
    labels = labels_volume()
    source = write_tiff(tmp_path / "lab.tif", labels)

    attrs = convert(source, tmp_path / "lab.zarr", kind="label", expect_shape=SHAPE)

    np.testing.assert_array_equal(open_volume(tmp_path / "lab.zarr")[:], labels)
    assert attrs["kind"] == "label"
    assert attrs["label_counts"] == {str(v): int((labels == v).sum()) for v in (0, 1, 2)}
    assert_stats_match_numpy(attrs, labels)


def test_kaggle_labels_are_stored_byte_identical(tmp_path):
    labels = labels_volume()
    source = write_tiff(tmp_path / "lab.tif", labels)
    convert(source, tmp_path / "plain.zarr", kind="label")
    convert(source, tmp_path / "kaggle.zarr", kind="label", labels=KAGGLE)
    assert KAGGLE.stored() == KAGGLE
    assert chunk_files(tmp_path / "plain.zarr") == chunk_files(tmp_path / "kaggle.zarr")
    assert open_volume(tmp_path / "kaggle.zarr")[:].tobytes() == labels.tobytes()


MULTI = LabelSpec({"background": 0, "sheet": 10, "fibre": 20, "pore": 30}, ignore=5)


def test_multiclass_labels_are_stored_as_stored_values(tmp_path):
    values = np.uint8([0, 10, 20, 30, 5])
    labels = np.random.default_rng(3).choice(values, SHAPE)
    source = write_tiff(tmp_path / "lab.tif", labels)

    attrs = convert(source, tmp_path / "lab.zarr", kind="label", labels=MULTI)

    stored = open_volume(tmp_path / "lab.zarr")[:]
    # background 0, the classes 1..3 in value order, the ignored value (5, below them) 4
    expected = np.select([labels == v for v in values], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(stored, expected)
    np.testing.assert_array_equal(MULTI.from_stored(stored), labels)
    assert attrs["label_counts"] == {
        str(s): int((labels == v).sum()) for v, s in zip(values, range(5), strict=True)
    }


def test_multiclass_bad_values_are_named_in_the_datasets_values(tmp_path):
    labels = np.random.default_rng(3).choice(np.uint8([0, 10, 20]), SHAPE)
    labels[35, 1, 1] = 1  # a stored value, but not one of the dataset's
    source = write_tiff(tmp_path / "lab.tif", labels)

    message = expect_error(source, tmp_path / "lab.zarr", kind="label", labels=MULTI)
    assert message.startswith(f"{source}: label values outside {{0, 5, 10, 20, 30}}: 1 in slice 35")


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda p, d: tifffile.imwrite(p, d, metadata=None), id="no-metadata"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, imagej=True), id="imagej"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, compression="zlib"), id="zlib"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, tile=(16, 16)), id="tiled"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, bigtiff=True), id="bigtiff"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, byteorder=">"), id="big-endian"),
    ],
)
def test_tiff_layouts_round_trip(tmp_path, write):
    data = random_volume((10, 33, 40), np.uint16, seed=7)
    write(tmp_path / "vol.tif", data)

    convert(tmp_path / "vol.tif", tmp_path / "vol.zarr", chunks=(4, 16, 16))

    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)


def test_pages_written_one_by_one_are_one_volume(tmp_path):
    # Each page written separately with shape metadata becomes its own tifffile series.
    data = random_volume((6, 20, 24))
    with tifffile.TiffWriter(tmp_path / "vol.tif") as writer:
        for plane in data:
            writer.write(plane, contiguous=False)

    convert(tmp_path / "vol.tif", tmp_path / "vol.zarr", chunks=(4, 8, 8))

    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)


def test_read_header(tmp_path):
    source = write_tiff(tmp_path / "vol.tif", random_volume(dtype=np.uint16))
    assert read_header(source) == (SHAPE, np.dtype(np.uint16))


# --- store configuration -------------------------------------------------------------------------


def test_chunks_and_default_codec_reach_the_store(tmp_path):
    source = write_tiff(tmp_path / "vol.tif", random_volume())

    convert(source, tmp_path / "vol.zarr", chunks=(8, 16, 32))

    arr = open_volume(tmp_path / "vol.zarr")
    assert arr.chunks == (8, 16, 32)
    assert arr.shards is None
    (codec,) = arr.compressors
    assert isinstance(codec, zarr.codecs.BloscCodec)
    assert codec.cname.value == "lz4"


def test_codec_and_shards_reach_the_store(tmp_path):
    data = random_volume()
    source = write_tiff(tmp_path / "vol.tif", data)

    convert(
        source,
        tmp_path / "vol.zarr",
        chunks=(8, 16, 16),
        shards=(16, 32, 32),
        codec={"name": "zstd", "level": 7},
    )

    arr = open_volume(tmp_path / "vol.zarr")
    assert arr.chunks == (8, 16, 16)
    assert arr.shards == (16, 32, 32)
    (codec,) = arr.compressors
    assert isinstance(codec, zarr.codecs.ZstdCodec)
    assert codec.level == 7
    np.testing.assert_array_equal(arr[:], data)


def test_chunks_larger_than_the_volume_are_clipped(tmp_path):
    data = random_volume((5, 6, 7))
    source = write_tiff(tmp_path / "vol.tif", data)

    convert(source, tmp_path / "vol.zarr", chunks=(64, 64, 64))

    arr = open_volume(tmp_path / "vol.zarr")
    assert arr.chunks == (5, 6, 7)
    np.testing.assert_array_equal(arr[:], data)


def test_an_existing_output_is_replaced(tmp_path):
    dest = tmp_path / "vol.zarr"
    convert(write_tiff(tmp_path / "a.tif", random_volume(seed=1)), dest)
    second = random_volume(seed=2)

    convert(write_tiff(tmp_path / "b.tif", second), dest)

    np.testing.assert_array_equal(open_volume(dest)[:], second)
    # No temporary siblings and no set-aside old copy.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tif", "b.tif", "vol.zarr"]


# --- bounded memory ------------------------------------------------------------------------------


def test_slab_depth_is_whole_write_units_within_the_budget():
    shape, mb = (320, 320, 320), 2**20
    row = 64 * 320 * 320  # one 64-deep chunk row of uint8: 6.25 MiB
    assert _slab_depth(shape, 1, 64, 1 * mb) == 64  # never less than one row
    assert _slab_depth(shape, 1, 64, 4 * row) == 128  # half the budget goes to the slab
    assert _slab_depth(shape, 2, 64, 4 * row) == 64
    assert _slab_depth(shape, 1, 64, 1024 * mb) == 320  # the whole volume in one slab
    assert _slab_depth((40, 50, 60), 1, 16, 1024 * mb) == 48  # rounded up to whole rows


def _traced_peak(source: Path, dest: Path, budget_mb: float) -> int:
    tracemalloc.start()
    try:
        convert_volume(source, dest, kind="image", chunks=(16, 64, 64), memory_budget_mb=budget_mb)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_follows_the_budget_not_the_volume(tmp_path):
    # 16 MiB of uint8; one 16-deep chunk row is 1 MiB. numpy reports its buffers to tracemalloc,
    # so the traced peak covers the slab, the histogram's temporaries and zarr's chunk copies
    # (not blosc's C buffers, which are a few chunks at most).
    data = random_volume((256, 256, 256), seed=9)
    source = write_tiff(tmp_path / "big.tif", data)
    volume_bytes = data.nbytes
    del data

    small = _traced_peak(source, tmp_path / "small.zarr", budget_mb=2)
    large = _traced_peak(source, tmp_path / "large.zarr", budget_mb=64)

    assert small < 0.4 * volume_bytes, f"peak {small / 2**20:.1f} MiB with a 2 MiB budget"
    # The measurement is honest: with room for it, the whole volume is one slab in memory.
    assert large >= volume_bytes
    a, b = open_volume(tmp_path / "small.zarr"), open_volume(tmp_path / "large.zarr")
    assert a.attrs["mean"] == b.attrs["mean"]
    assert a.attrs["p99_5"] == b.attrs["p99_5"]


# --- the fast paths give what the general ones give ----------------------------------------------


@pytest.mark.parametrize(
    ("write", "plain"),
    [
        pytest.param(lambda p, d: tifffile.imwrite(p, d), True, id="shaped"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, metadata=None), True, id="no-metadata"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, rowsperstrip=7), True, id="strips"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, byteorder=">"), True, id="big-endian"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, imagej=True), True, id="imagej"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, compression="zlib"), False, id="zlib"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, tile=(16, 16)), False, id="tiled"),
        pytest.param(
            lambda p, d: [tifffile.imwrite(p, z, append=True, metadata=None) for z in d],
            False,
            id="page-by-page",
        ),
    ],
)
def test_plain_pixel_data_is_read_in_one_piece_and_exactly(tmp_path, write, plain):
    # uint16 so that the big-endian file needs its bytes swapped.
    data = random_volume((10, 33, 40), np.uint16, seed=8)
    source = tmp_path / "vol.tif"
    write(source, data)

    src = _inspect(source)
    assert (src.data_offset is not None) == plain
    with _open_reader(src) as read:
        out = np.empty((4, 33, 40), np.uint16)
        read(3, 7, out)
    np.testing.assert_array_equal(out, data[3:7])
    convert(source, tmp_path / "vol.zarr", chunks=(4, 16, 16))
    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)


def test_a_file_cut_short_after_its_headers_were_read_is_detected(tmp_path):
    source = write_tiff(tmp_path / "vol.tif", random_volume())
    src = _inspect(source)
    assert src.data_offset is not None
    source.write_bytes(source.read_bytes()[: src.data_offset + 20 * 50 * 60 + 7])

    with _open_reader(src) as read, pytest.raises(CtsegError, match="ends inside slice 20"):
        read(16, 32, np.empty((16, 50, 60), np.uint8))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("codec", [None, {"name": "none"}])
def test_chunk_files_are_the_ones_zarr_writes(tmp_path, dtype, codec):
    # Edge chunks on every axis, and a zero region (a chunk zarr could skip).
    data = random_volume(dtype=dtype, seed=6)
    data[:16, :16, :16] = 0
    source = write_tiff(tmp_path / "vol.tif", data)
    ours = tmp_path / "ours.zarr"

    convert(source, ours, codec=codec)
    theirs = create_volume(tmp_path / "theirs.zarr", SHAPE, dtype, CHUNKS, codec)
    theirs[:] = data

    expected = chunk_files(tmp_path / "theirs.zarr")
    assert len(expected) == 3 * 4 * 4
    assert chunk_files(ours) == expected


def test_empty_chunks_are_left_out_as_zarr_leaves_them_out(tmp_path):
    data = random_volume(seed=6)
    data[:16, :16, :16] = 0
    ours = create_volume(tmp_path / "ours.zarr", SHAPE, np.uint8, CHUNKS, write_empty_chunks=False)
    theirs = create_volume(
        tmp_path / "theirs.zarr", SHAPE, np.uint8, CHUNKS, write_empty_chunks=False
    )

    with _SlabWriter(ours) as writer:
        for z0 in range(0, SHAPE[0], CHUNKS[0]):
            _SlabWriter.wait(writer.submit(z0, data[z0 : z0 + CHUNKS[0]]))
    theirs[:] = data

    expected = chunk_files(tmp_path / "theirs.zarr")
    assert "c/0/0/0" not in expected and len(expected) == 3 * 4 * 4 - 1
    assert chunk_files(tmp_path / "ours.zarr") == expected
    # A chunk left out on purpose is read as zeros only once the record says so.
    with pytest.raises(CtsegError, match=r"ours.zarr: chunk c/0/0/0 is missing.*no record"):
        open_volume(tmp_path / "ours.zarr")
    record_stores(tmp_path / "ours.zarr")
    np.testing.assert_array_equal(open_volume(tmp_path / "ours.zarr")[:], data)


def test_two_slabs_in_flight_round_trip(tmp_path):
    # A budget with room for two one-row slabs: one is read while the other is written.
    assert _slab_plan(SHAPE, 1, 16, 0.25 * 2**20) == (16, 2)
    data = random_volume(seed=11)
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr", memory_budget_mb=0.25)

    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)
    assert_stats_match_numpy(attrs, data)
    labels = labels_volume()
    labels[20, 1, 2] = 5
    source = write_tiff(tmp_path / "lab.tif", labels)
    expect_error(source, tmp_path / "lab.zarr", "5", kind="label", memory_budget_mb=0.25)


def test_slab_plan_never_exceeds_the_slab_share():
    mb = 2**20
    assert _slab_plan((320, 320, 320), 1, 64, 1024 * mb) == (320, 1)  # one slab: one buffer
    assert _slab_plan((320, 320, 320), 1, 64, 8 * 6.25 * mb) == (128, 2)
    # Two one-row buffers would not fit: one, as before.
    assert _slab_plan((320, 320, 320), 1, 64, 3 * 6.25 * mb) == (64, 1)


@pytest.mark.parametrize("size", [1, 2, 7, 100_001])
@pytest.mark.parametrize("piece", [1000, MIN_PAIR_PIECE])
def test_uint8_counted_in_pairs_is_exact(size, piece):
    histogram = Histogram(np.dtype(np.uint8), piece)
    assert histogram.pairs == (piece >= MIN_PAIR_PIECE)
    values = random_volume((size,), seed=size)

    counts = histogram.add(values)
    histogram.add(values[::-1].copy())

    np.testing.assert_array_equal(counts, np.bincount(values, minlength=256))
    np.testing.assert_array_equal(histogram.counts, 2 * np.bincount(values, minlength=256))


def test_statistics_are_exact_with_a_large_budget(tmp_path):
    # An odd number of voxels, counted in pairs in one slab.
    data = random_volume((41, 51, 61), seed=12)
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr", memory_budget_mb=256)

    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)
    assert_stats_match_numpy(attrs, data)


def test_saturated_and_empty_slabs_are_left_out_of_the_statistics(tmp_path):
    # A uint16 scan with a slab clipped at 65535 and a slab of zero padding: with them, the
    # 99.5th percentile would be 65535 and the 0.5th 0, and the normalisation of the whole
    # volume would shift. Saturated voxels elsewhere are left out too.
    rng = np.random.default_rng(21)
    data = rng.normal(20_000, 3_000, SHAPE).clip(1, 60_000).astype(np.uint16)
    data[5:13] = 65535
    data[30:34] = 0
    data[20, :3, :5] = 65535
    scan = np.concatenate([data[:5], data[13:30], data[34:]]).reshape(-1)
    scan = scan[scan != 65535]
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr", chunks=(4, 16, 16))

    assert attrs["p99_5"] == pytest.approx(np.percentile(scan, 99.5), rel=1e-12)
    assert attrs["p0_5"] == pytest.approx(np.percentile(scan, 0.5), rel=1e-12)
    assert attrs["p99_5"] < 40_000 < 65535 and attrs["p0_5"] > 5_000
    assert attrs["mean"] == pytest.approx(scan.mean(dtype=np.float64), rel=1e-12)
    assert attrs["stats_voxels"] == scan.size
    assert attrs["stats_left_out"] == {"saturated_voxels": 15, "empty_slices": 12}
    stored = dict(open_volume(tmp_path / "vol.zarr").attrs)
    assert stored["p99_5"] == attrs["p99_5"] and stored["stats_left_out"]["empty_slices"] == 12


def test_a_volume_of_nothing_but_empty_slices_keeps_every_voxel(tmp_path):
    data = np.zeros((6, 8, 8), np.uint8)
    data[3:] = 255
    source = write_tiff(tmp_path / "vol.tif", data)

    attrs = convert(source, tmp_path / "vol.zarr", chunks=(2, 8, 8))

    assert (attrs["p0_5"], attrs["p99_5"], attrs["mean"]) == (0.0, 255.0, 127.5)
    assert attrs["stats_voxels"] == data.size
    assert attrs["stats_left_out"] == {"saturated_voxels": 0, "empty_slices": 0}


# --- bad input: a clear error, and nothing left at dest ------------------------------------------


def expect_error(source: Path, dest: Path, *patterns: str, **kwargs) -> str:
    with pytest.raises(CtsegError) as info:
        convert(source, dest, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, message
    assert_nothing_left(dest)
    return message


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda p, d: tifffile.imwrite(p, d), id="shaped"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, metadata=None), id="no-metadata"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, compression="zlib"), id="zlib"),
        pytest.param(lambda p, d: tifffile.imwrite(p, d, tile=(16, 16)), id="tiled"),
    ],
)
@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_tiff_is_detected(tmp_path, write, keep):
    full = tmp_path / "full.tif"
    write(full, random_volume())
    raw = full.read_bytes()
    source = tmp_path / "vol.tif"
    source.write_bytes(raw[: int(len(raw) * keep)])

    message = expect_error(source, tmp_path / "vol.zarr", str(source))
    assert_damaged_tiff_line(message, source)


def assert_damaged_tiff_line(message: str, source: Path) -> None:
    """The file, the problem and the fix, in words of the file, not of tifffile's objects."""
    assert message.startswith(f"{source}: truncated or damaged TIFF: "), message
    assert message.endswith("; copy the file again from its source"), message
    assert "tifffile" not in message and "<" not in message and "\n" not in message


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_a_broken_page_chain_says_where_the_file_ends(tmp_path, keep):
    # tifffile logs "<tifffile.TiffPages @8> invalid page offset 120256" for these.
    full = write_tiff(tmp_path / "full.tif", random_volume())
    source = tmp_path / "vol.tif"
    source.write_bytes(full.read_bytes()[: int(full.stat().st_size * keep)])

    message = expect_error(source, tmp_path / "vol.zarr")
    assert_damaged_tiff_line(message, source)
    size = source.stat().st_size
    assert re.search(
        rf"a page should start at byte \d+, but the file has only {size} bytes", message
    )


def test_truncation_without_metadata_does_not_pass_as_2d(tmp_path):
    # tifffile alone reads this file as one 50x60 page and only logs the broken page chain.
    full = write_tiff(tmp_path / "full.tif", random_volume(), metadata=None)
    source = tmp_path / "vol.tif"
    source.write_bytes(full.read_bytes()[: full.stat().st_size // 2])

    message = expect_error(source, tmp_path / "vol.zarr")
    assert_damaged_tiff_line(message, source)


def test_truncated_pixel_data_is_found_from_the_headers(tmp_path):
    # Each page's directory comes before its pixels, so cutting the file's tail leaves every
    # directory intact and only the last strip runs past the end of the file.
    source = tmp_path / "vol.tif"
    with tifffile.TiffWriter(source) as writer:
        for plane in random_volume((6, 50, 60)):
            writer.write(plane, contiguous=False, metadata=None)
    source.write_bytes(source.read_bytes()[:-100])

    with pytest.raises(CtsegError, match=r"truncated or damaged TIFF: page 5 needs bytes"):
        read_header(source)  # before any pixel is read
    expect_error(source, tmp_path / "vol.zarr", str(source), "truncated")


def test_truncated_slice_in_a_directory_is_detected(tmp_path):
    paths = write_slices(tmp_path / "slices", random_volume((6, 50, 60)))
    paths[4].write_bytes(paths[4].read_bytes()[:1500])

    expect_error(tmp_path / "slices", tmp_path / "vol.zarr", str(paths[4]))


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        pytest.param(
            b"\x89PNG\r\n\x1a\n" + bytes(4000),
            "not a TIFF file (its first bytes are 89 50 4e 47, where a TIFF's are 49 49 (II) or "
            "4d 4d (MM)); save the volume as a multi-page TIFF, or copy the file again from its "
            "source if it is one",
            id="png",
        ),
        pytest.param(
            b"II*\x00" + bytes(4000),
            "truncated or damaged TIFF: it holds no image data; copy the file again from its "
            "source",
            id="zeros-after-header",
        ),
        pytest.param(
            b"",
            "an empty file (0 bytes), not a TIFF; copy the file again from its source",
            id="empty",
        ),
    ],
)
def test_corrupt_tiff(tmp_path, content, problem):
    source = tmp_path / "vol.tif"
    source.write_bytes(content)

    assert expect_error(source, tmp_path / "vol.zarr") == f"{source}: {problem}"


def test_garbage_after_a_tiff_header_is_one_line_naming_the_file(tmp_path):
    source = tmp_path / "vol.tif"
    source.write_bytes(b"II*\x00" + np.random.default_rng(1).bytes(4000))

    message = expect_error(source, tmp_path / "vol.zarr", str(source), "TIFF")
    assert "copy the file again from its source" in message and "tifffile" not in message


def test_2d_image_is_rejected(tmp_path):
    source = write_tiff(tmp_path / "vol.tif", random_volume((50, 60)))

    expect_error(source, tmp_path / "vol.zarr", str(source), "2D", "(50, 60)")


@pytest.mark.parametrize(
    ("shape", "kwargs", "pattern"),
    [
        ((4, 5, 16, 16), {}, "4 dimensions"),
        ((5, 16, 16, 3), {"photometric": "rgb"}, "samples per pixel"),
        ((16, 16, 3), {"photometric": "rgb"}, "samples per pixel"),
    ],
    ids=["4d", "rgb-stack", "rgb-image"],
)
def test_wrong_dimensionality_is_rejected(tmp_path, shape, kwargs, pattern):
    source = write_tiff(tmp_path / "vol.tif", random_volume(shape), **kwargs)

    expect_error(source, tmp_path / "vol.zarr", str(source), pattern)


def test_shape_mismatch_names_both_files_and_shapes(tmp_path):
    source = write_tiff(tmp_path / "lab.tif", labels_volume())
    like = tmp_path / "img.zarr"

    message = expect_error(
        source, tmp_path / "lab.zarr", kind="label", expect_shape=(40, 50, 61), like_source=like
    )
    assert message == (
        f"{source}: label shape (40, 50, 60) differs from its image's (40, 50, 61) ({like}); a "
        "label holds one value per image voxel (z, y, x): replace it with the label volume made "
        "for that image"
    )


def test_label_values_outside_0_1_2_are_named(tmp_path):
    labels = labels_volume()
    labels[35, 10, 10], labels[36, 0, 0] = 3, 7  # in the last slab: earlier ones are written
    source = write_tiff(tmp_path / "lab.tif", labels)

    message = expect_error(source, tmp_path / "lab.zarr", kind="label")
    assert message == (
        f"{source}: label values outside {{0, 1, 2}}: 3 in slice 35; 7 in slice 36 (0 is "
        "background, 1 surface, 2 unlabelled): set those voxels to one of them (2 where unsure)"
    )


def test_bad_label_values_name_the_exact_slices_not_the_chunk_row(tmp_path):
    labels = labels_volume((64, 20, 20))
    labels[10:12, 3, 4] = 7  # inside the one 64-slice chunk row
    labels[[30, 31, 32, 50], 0, 0] = 7
    labels[40, 1, 1] = 255
    source = write_tiff(tmp_path / "lab.tif", labels)

    message = expect_error(source, tmp_path / "lab.zarr", kind="label", chunks=(64, 64, 64))
    assert ": 7 in slices 10..11, 30..32, 50; 255 in slice 40 (" in message, message


def test_zero_size_volume_is_rejected(tmp_path):
    source = tmp_path / "vol.tif"
    with pytest.warns(UserWarning, match="zero-size"):
        tifffile.imwrite(source, np.zeros((0, 16, 16), np.uint8))

    expect_error(source, tmp_path / "vol.zarr", str(source), "zero-size")


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.uint32])
def test_unsupported_dtype_is_rejected(tmp_path, dtype):
    source = write_tiff(tmp_path / "vol.tif", np.ones(SHAPE, dtype))

    expect_error(source, tmp_path / "vol.zarr", str(source), np.dtype(dtype).name, "uint8")


def test_missing_source(tmp_path):
    source = tmp_path / "nope.tif"

    expect_error(source, tmp_path / "vol.zarr", str(source), "no such file")


def test_slice_directory_without_tiffs(tmp_path):
    (tmp_path / "slices").mkdir()
    (tmp_path / "slices" / "readme.txt").write_text("no slices here")

    expect_error(tmp_path / "slices", tmp_path / "vol.zarr", "slices", "no .tif")


def test_slice_directory_with_different_shapes(tmp_path):
    write_slices(tmp_path / "slices", random_volume((5, 20, 24)))
    tifffile.imwrite(tmp_path / "slices" / "slice_5.tif", random_volume((21, 24)))

    expect_error(
        tmp_path / "slices", tmp_path / "vol.zarr", "slice_0.tif", "slice_5.tif", "(21, 24)"
    )


def test_slice_directory_with_a_3d_slice(tmp_path):
    write_slices(tmp_path / "slices", random_volume((5, 20, 24)))
    tifffile.imwrite(tmp_path / "slices" / "slice_5.tif", random_volume((2, 20, 24)))

    expect_error(tmp_path / "slices", tmp_path / "vol.zarr", "slice_5.tif", "one 2D page")


def test_slice_directory_with_a_missing_slice_is_rejected(tmp_path):
    paths = write_slices(tmp_path / "slices", random_volume((8, 20, 24)), "slice_{:04d}.tif")
    paths[5].unlink()

    message = expect_error(tmp_path / "slices", tmp_path / "vol.zarr", "slices", "missing")
    assert "number(s) 5;" in message and "slice_0000.tif and slice_0007.tif" in message


@pytest.mark.parametrize(
    "stray",
    ["extra.tif", "slice_0005 (copy).tif", "slice_0003.tiff", "scan_0001.tif"],
)
def test_slice_directory_with_a_stray_tiff_is_rejected(tmp_path, stray):
    paths = write_slices(tmp_path / "slices", random_volume((8, 20, 24)), "slice_{:04d}.tif")
    tifffile.imwrite(tmp_path / "slices" / stray, random_volume((20, 24)))

    message = expect_error(tmp_path / "slices", tmp_path / "vol.zarr", repr(stray))
    assert "slice_<number>.tif" in message and "move them out" in message
    stray_path = tmp_path / "slices" / stray
    stray_path.unlink()
    convert(tmp_path / "slices", tmp_path / "vol.zarr")  # without it, the same slices convert
    assert open_volume(tmp_path / "vol.zarr").shape == (len(paths), 20, 24)


def test_two_files_with_the_same_slice_number_are_rejected(tmp_path):
    write_slices(tmp_path / "slices", random_volume((4, 20, 24)))
    tifffile.imwrite(tmp_path / "slices" / "slice_02.tif", random_volume((20, 24)))

    expect_error(tmp_path / "slices", tmp_path / "vol.zarr", "slice_02.tif", "slice_2.tif")


def test_unnumbered_slices_are_rejected(tmp_path):
    (tmp_path / "slices").mkdir()
    for name in ("top.tif", "bottom.tif"):
        tifffile.imwrite(tmp_path / "slices" / name, random_volume((20, 24)))

    expect_error(tmp_path / "slices", tmp_path / "vol.zarr", "must be numbered", "'top.tif'")


def test_slices_may_start_at_any_number_and_change_digit_count(tmp_path):
    data = random_volume((12, 20, 24))
    (tmp_path / "slices").mkdir()
    for z, plane in enumerate(data):
        tifffile.imwrite(tmp_path / "slices" / f"scan_v2_{z + 95}.TIF", plane)

    convert(tmp_path / "slices", tmp_path / "vol.zarr")
    np.testing.assert_array_equal(open_volume(tmp_path / "vol.zarr")[:], data)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"codec": {"name": "lzma"}},
        {"chunks": (0, 16, 16)},
        {"shards": (16, 16)},
        {"memory_budget_mb": 0},
        {"kind": "mask"},
    ],
)
def test_bad_settings_are_rejected_before_reading(tmp_path, kwargs):
    source = write_tiff(tmp_path / "vol.tif", random_volume())

    expect_error(source, tmp_path / "vol.zarr", **kwargs)


def test_a_failed_conversion_keeps_the_previous_output(tmp_path):
    dest = tmp_path / "lab.zarr"
    good = labels_volume()
    convert(write_tiff(tmp_path / "good.tif", good), dest, kind="label")
    bad = good.copy()
    bad[-1, -1, -1] = 9

    with pytest.raises(CtsegError, match="9"):
        convert(write_tiff(tmp_path / "bad.tif", bad), dest, kind="label")

    np.testing.assert_array_equal(open_volume(dest)[:], good)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- through the command line --------------------------------------------------------------------


def test_cli_converts_and_reports_errors(tmp_path, capsys):
    image = write_tiff(tmp_path / "img.tif", random_volume())
    label = write_tiff(tmp_path / "lab.tif", labels_volume((40, 50, 61)))

    assert cli_main(["convert", str(image), str(tmp_path / "img.zarr"), "--chunks", "16"]) == 0
    status = cli_main(
        [
            "convert",
            str(label),
            str(tmp_path / "lab.zarr"),
            "--kind",
            "label",
            "--like",
            str(tmp_path / "img.zarr"),
        ]
    )

    assert status == 2
    err = capsys.readouterr().err
    # The image is named as the store and the TIFF it was converted from.
    assert (
        f"differs from its image's (40, 50, 60) ({tmp_path / 'img.zarr'}, converted from {image})"
        in err
    )
    assert "(40, 50, 61)" in err
    assert open_volume(tmp_path / "img.zarr").chunks == (16, 16, 16)
    assert_nothing_left(tmp_path / "lab.zarr")
