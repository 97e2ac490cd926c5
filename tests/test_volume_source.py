"""A volume read in place (`ctseg.inference.source`): Zarr arrays v2 and v3 and OME-Zarr
pyramids (NGFF 0.4 and 0.5) opened locally, on a loopback S3 server and over HTTP; boxes read
through the chunk cache equal numpy's slicing; overlapping z-major tiles through a slab-sized
cache fetch each chunk about once; and the computed intensity range is exactly the converter's.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import tifffile
import zarr
from conftest import s3_options, upload

from ctseg.inference.source import ChunkCache, intensity_range, open_source
from ctseg.io import CtsegError
from ctseg.preprocess.convert import convert_volume

SHAPE = (40, 48, 56)
CHUNK = 16
SCALE0 = [2.0, 0.5, 0.75]  # z, y, x: all different, so an axis mix-up shows


def random_volume(shape=SHAPE, dtype=np.uint8, seed=0, high=None) -> np.ndarray:
    info = np.iinfo(dtype)
    high = info.max if high is None else high
    return np.random.default_rng(seed).integers(0, high, shape, dtype=dtype, endpoint=True)


def write_array(path: Path, data: np.ndarray, fmt: int = 3, shards=None, attrs=None) -> Path:
    array = zarr.create_array(
        store=str(path),
        shape=data.shape,
        chunks=(CHUNK,) * data.ndim if shards is None else (CHUNK // 2,) * data.ndim,
        shards=shards,
        dtype=data.dtype,
        zarr_format=fmt,
        attributes=attrs,
    )
    array[...] = data
    return path


def multiscale(version: str) -> dict:
    """NGFF multiscales metadata for two levels, "0" and "1" (half size), as the spec has it."""
    return {
        **({"version": version} if version == "0.4" else {}),
        "name": "scroll",
        "axes": [{"name": a, "type": "space", "unit": "micrometer"} for a in "zyx"],
        "datasets": [
            {
                "path": str(i),
                "coordinateTransformations": [
                    {"type": "scale", "scale": [s * 2**i for s in SCALE0]}
                ],
            }
            for i in range(2)
        ],
    }


def write_ome(path: Path, data: np.ndarray, version: str) -> list[np.ndarray]:
    """An OME-Zarr group with two levels, its metadata written by hand: NGFF 0.4 in zarr v2's
    .zgroup/.zattrs, NGFF 0.5 in zarr v3's zarr.json under attributes["ome"]."""
    levels = [data, np.ascontiguousarray(data[::2, ::2, ::2])]
    fmt = 2 if version == "0.4" else 3
    for i, level in enumerate(levels):
        write_array(path / str(i), level, fmt=fmt)
    if version == "0.4":
        (path / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
        (path / ".zattrs").write_text(json.dumps({"multiscales": [multiscale("0.4")]}))
    else:
        ome = {"version": "0.5", "multiscales": [multiscale("0.5")]}
        group = {"zarr_format": 3, "node_type": "group", "attributes": {"ome": ome}}
        (path / "zarr.json").write_text(json.dumps(group))
    return levels


def random_boxes(shape, n: int, seed: int = 1) -> list[tuple[slice, slice, slice]]:
    rng = np.random.default_rng(seed)
    boxes = []
    for _ in range(n):
        box = []
        for size in shape:
            a, b = sorted(int(v) for v in rng.integers(0, size + 1, 2))
            box.append(slice(a, max(b, a + 1) if a < size else b))
        boxes.append(tuple(box))
    return boxes


def assert_reads_equal(source, data: np.ndarray, n: int = 12) -> None:
    cache = ChunkCache(source, budget_bytes=4 * CHUNK**3 * data.itemsize)
    for box in random_boxes(data.shape, n):
        np.testing.assert_array_equal(cache.read(box), data[box])


def one_line_error(match: str, call, *args, **kwargs) -> str:
    with pytest.raises(CtsegError, match=match) as caught:
        call(*args, **kwargs)
    text = str(caught.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- plain arrays


@pytest.mark.parametrize(
    "fmt, shards, unit",
    [(3, None, (16, 16, 16)), (3, (16, 16, 32), (16, 16, 32)), (2, None, (16, 16, 16))],
    ids=["v3", "v3-sharded", "v2"],
)
def test_plain_array_opens_and_reads_like_numpy(tmp_path, fmt, shards, unit):
    data = random_volume(dtype=np.uint16, seed=fmt)
    url = str(write_array(tmp_path / "vol.zarr", data, fmt=fmt, shards=shards))
    source = open_source(url)
    assert (source.shape, source.dtype, source.chunks) == (SHAPE, np.dtype(np.uint16), unit)
    assert source.level is None and source.spacing is None and source.url == url
    assert source.describe() == f"{url}: shape 40x48x56 uint16, chunks {'x'.join(map(str, unit))}"
    assert_reads_equal(source, data)


def test_counters_count_fetches_hits_and_bytes(tmp_path):
    data = random_volume()
    source = open_source(str(write_array(tmp_path / "vol.zarr", data)))
    cache = ChunkCache(source, budget_bytes=100 * CHUNK**3)
    box = (slice(3, 20), slice(17, 40), slice(0, 16))  # 2 x 2 x 1 whole interior chunks
    np.testing.assert_array_equal(cache.read(box), data[box])
    assert (cache.chunks_fetched, cache.hits) == (4, 0)
    assert cache.bytes_fetched == 4 * CHUNK**3
    assert cache.bytes_requested == 17 * 23 * 16
    np.testing.assert_array_equal(cache.read(box), data[box])
    assert (cache.chunks_fetched, cache.hits, cache.bytes_fetched) == (4, 4, 4 * CHUNK**3)
    assert cache.peak_cached_bytes == 4 * CHUNK**3
    # The whole volume: the rest of the chunks, edge chunks counted by their part inside it.
    whole = tuple(slice(0, n) for n in SHAPE)
    np.testing.assert_array_equal(cache.read(whole), data)
    assert cache.chunks_fetched == 3 * 3 * 4 and cache.bytes_fetched == data.nbytes
    assert cache.read_amplification(data.nbytes) == 1.0


def test_the_cache_stays_within_its_budget(tmp_path):
    data = random_volume()
    source = open_source(str(write_array(tmp_path / "vol.zarr", data)))
    chunk = CHUNK**3
    box = (slice(0, 16), slice(0, 16), slice(0, 48))  # three chunks along x
    lru = ChunkCache(source, budget_bytes=2 * chunk)
    lru.read(box)
    assert lru.peak_cached_bytes == 2 * chunk
    lru.read((slice(0, 16), slice(0, 16), slice(32, 48)))  # the last one is still held
    assert lru.hits == 1 and lru.chunks_fetched == 3
    lru.read((slice(0, 16), slice(0, 16), slice(0, 16)))  # the first one was evicted
    assert lru.chunks_fetched == 4
    for budget in (0, chunk - 1):  # nothing kept: every read fetches again
        cache = ChunkCache(source, budget_bytes=budget)
        np.testing.assert_array_equal(cache.read(box), data[box])
        np.testing.assert_array_equal(cache.read(box), data[box])
        assert (cache.chunks_fetched, cache.hits, cache.peak_cached_bytes) == (6, 0, 0)
        assert cache.read_amplification() == 1.0


@pytest.mark.parametrize(
    "box",
    [
        (slice(None, 4), slice(0, 4), slice(0, 4)),
        (slice(0, 41), slice(0, 4), slice(0, 4)),
        (slice(0, 4), slice(0, 4, 2), slice(0, 4)),
        (slice(5, 4), slice(0, 4), slice(0, 4)),
        (slice(0, 4), slice(0, 4)),
    ],
)
def test_a_box_outside_the_volume_is_refused(tmp_path, box):
    source = open_source(str(write_array(tmp_path / "vol.zarr", random_volume())))
    with pytest.raises(ValueError):
        ChunkCache(source, 0).read(box)


# --------------------------------------------------------------------------- OME-Zarr


@pytest.mark.parametrize("version", ["0.4", "0.5"])
def test_ome_zarr_levels_by_index_and_path(tmp_path, version):
    data = random_volume()
    url = str(tmp_path / "scroll.ome.zarr")
    levels = write_ome(Path(url), data, version)
    for level, index in [(None, 0), (0, 0), ("1", 1), (1, 1)]:
        source = open_source(url, level=level)
        assert source.level == str(index)
        assert source.shape == levels[index].shape
        assert source.spacing == tuple(s * 2**index for s in SCALE0)
        np.testing.assert_array_equal(ChunkCache(source, 0).read(full(source)), levels[index])
    assert open_source(url).describe().startswith(f"{url} level 0: shape 40x48x56 uint8")


def full(source) -> tuple[slice, slice, slice]:
    return tuple(slice(0, n) for n in source.shape)


@pytest.mark.parametrize("version", ["0.4", "0.5"])
def test_a_level_the_pyramid_lacks_is_refused_naming_its_levels(tmp_path, version):
    url = str(tmp_path / "scroll.ome.zarr")
    write_ome(Path(url), random_volume(), version)
    for level in (5, "5", "s1"):
        text = one_line_error(f"level {level}: the pyramid has levels 0-1", open_source, url, level)
        assert text.startswith(url) and "(paths 0, 1)" in text and "--level 0..1" in text


def test_ome_zarr_levels_by_their_path_names(tmp_path):
    url = tmp_path / "named.ome.zarr"
    data = random_volume()
    write_ome(url, data, "0.5")
    meta = json.loads((url / "zarr.json").read_text())
    for i, dataset in enumerate(meta["attributes"]["ome"]["multiscales"][0]["datasets"]):
        (url / str(i)).rename(url / f"s{i}")
        dataset["path"] = f"s{i}"
    (url / "zarr.json").write_text(json.dumps(meta))
    assert open_source(str(url), "s1").level == "s1"
    assert open_source(str(url), 1).level == "s1"
    assert open_source(str(url)).level == "s0"


def test_a_group_without_multiscales_is_refused(tmp_path):
    group = zarr.open_group(str(tmp_path / "plain"), mode="w")
    group.create_array("raw", shape=SHAPE, chunks=(CHUNK,) * 3, dtype="uint8")
    url = str(tmp_path / "plain")
    one_line_error(
        re.escape(
            f"a group without multiscales metadata: give the array inside it, e.g. {url}/raw"
        ),
        open_source,
        url,
    )


def test_what_is_not_a_3d_volume_is_refused(tmp_path):
    url = str(write_array(tmp_path / "czyx.zarr", random_volume((1, 8, 8, 8))))
    one_line_error(re.escape("shape (1, 8, 8, 8) is not 3D"), open_source, url)
    missing = str(tmp_path / "nowhere.zarr")
    one_line_error(f"{re.escape(missing)}: no such file or directory", open_source, missing)
    (tmp_path / "empty").mkdir()
    one_line_error("not a Zarr array or OME-Zarr group", open_source, str(tmp_path / "empty"))
    plain = str(write_array(tmp_path / "vol.zarr", random_volume()))
    one_line_error("a plain Zarr array has no levels", open_source, plain, level=1)


# --------------------------------------------------------------------------- read amplification


def tiles(shape, tile: int, halo: int):
    """Tiles in z-major order, each grown by `halo` and clipped to the volume."""
    for z in range(0, shape[0], tile):
        for y in range(0, shape[1], tile):
            for x in range(0, shape[2], tile):
                yield tuple(
                    slice(max(0, o - halo), min(n, o + tile + halo))
                    for o, n in zip((z, y, x), shape, strict=True)
                )


def test_overlapping_z_major_tiles_fetch_each_chunk_about_once(tmp_path):
    shape, tile, halo = (160, 128, 128), 64, 16
    data = random_volume(shape, seed=5)
    source = open_source(str(write_array(tmp_path / "vol.zarr", data)))
    # One z-slab of chunks: the chunk rows a tile grown by its halo spans, over whole planes.
    rows = -(-(tile + 2 * halo) // CHUNK)
    slab = rows * (shape[1] // CHUNK) * (shape[2] // CHUNK) * CHUNK**3
    amplification = {}
    for budget in (slab, 0):
        cache = ChunkCache(source, budget)
        for box in tiles(shape, tile, halo):
            np.testing.assert_array_equal(cache.read(box), data[box])
        amplification[budget] = cache.read_amplification(data.nbytes)
        assert cache.peak_cached_bytes <= budget
    assert amplification[slab] <= 1.2, amplification
    assert amplification[0] > 1.5, amplification


def test_a_schedule_keeps_the_chunks_needed_soonest(tmp_path):
    """A cache a third of the chunk rows a plane of tiles reads: least recently used drops each
    row before the next plane of tiles needs it again; the schedule keeps the ones needed
    next."""
    shape, tile, halo = (160, 128, 128), 64, 16
    data = random_volume(shape, seed=6)
    source = open_source(str(write_array(tmp_path / "vol.zarr", data)))
    boxes = list(tiles(shape, tile, halo))
    budget = 128 * CHUNK**3
    amplification = {}
    for schedule in (None, boxes):
        cache = ChunkCache(source, budget, schedule)
        for box in boxes:
            np.testing.assert_array_equal(cache.read(box), data[box])
        assert cache.peak_cached_bytes <= budget
        amplification["schedule" if schedule else "lru"] = cache.read_amplification(data.nbytes)
    assert amplification["schedule"] < 0.85 * amplification["lru"], amplification
    assert amplification["schedule"] <= 1.2, amplification


# --------------------------------------------------------------------------- intensity range


def test_a_given_range_wins_then_the_attributes(tmp_path):
    attrs = {"p0_5": 12.0, "p99_5": 240.5}
    source = open_source(str(write_array(tmp_path / "vol.zarr", random_volume(), attrs=attrs)))
    assert intensity_range(source, given=(1, 9)) == (1.0, 9.0, "given")
    assert intensity_range(source) == (12.0, 240.5, "the array's attributes p0_5/p99_5")
    one_line_error("LOW below HIGH", intensity_range, source, given=(9, 1))


def volume_with_outliers(dtype) -> np.ndarray:
    """Random voxels, a saturated patch and an empty (constant) slice: what the converter's
    statistics leave out."""
    data = random_volume(dtype=dtype, seed=7, high=np.iinfo(dtype).max // 3)
    data[3, 5:20, 7:30] = np.iinfo(dtype).max
    data[11] = 9
    return data


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_the_computed_range_is_the_converters(tmp_path, dtype):
    data = volume_with_outliers(dtype)
    tiff = tmp_path / "vol.tif"
    tifffile.imwrite(tiff, data, photometric="minisblack")
    converted = convert_volume(tiff, tmp_path / "converted.zarr", kind="image", chunks=(16,) * 3)
    assert converted["stats_left_out"]["empty_slices"] == 1
    expected = (converted["p0_5"], converted["p99_5"])
    url = str(write_array(tmp_path / "bare.zarr", data, fmt=2))
    source = open_source(url)
    # Whole planes; one chunk row cut in y bands; cut in y and x bands.
    for budget in (256 * 2**20, 100_000, 20_000):
        low, high, how = intensity_range(source, memory_budget_bytes=budget)
        assert (low, high) == expected, budget
    voxels = data.size
    assert (
        how
        == f"computed from all {voxels} voxels of {url} (one pass, {data.nbytes / 1e6:.1f} MB read)"
    )
    # The converted store carries them: read back as they were written.
    assert intensity_range(open_source(str(tmp_path / "converted.zarr")))[:2] == expected


def test_a_float_volume_without_attributes_needs_a_given_range(tmp_path):
    data = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    source = open_source(str(write_array(tmp_path / "vol.zarr", data)))
    one_line_error("give --intensity-range LOW HIGH", intensity_range, source)
    assert intensity_range(source, given=(0.1, 0.9))[:2] == (0.1, 0.9)


# --------------------------------------------------------------------------- remote


# ----------------------------------------------------------------------------- TIFF volumes
def test_tiff_volumes_are_read_in_place_as_convert_reads_them(tmp_path):
    """A multi-page TIFF (one shaped series, or pages written one at a time) and a folder of
    numbered slices open through tifffile's Zarr interface, the voxels `ctseg convert` stores,
    and their computed range is the converter's."""
    data = random_volume((12, 20, 24), np.uint16, high=4000)
    shaped = tmp_path / "shaped.tif"
    tifffile.imwrite(shaped, data, photometric="minisblack")
    paged = tmp_path / "paged.tiff"
    for plane in data:
        tifffile.imwrite(paged, plane, append=True)
    (tmp_path / "slices").mkdir()
    for z, plane in enumerate(data):
        tifffile.imwrite(tmp_path / "slices" / f"s_{z:03d}.tif", plane)
    for path in (shaped, paged, tmp_path / "slices"):
        source = open_source(str(path))
        assert source.shape == data.shape and source.dtype == np.uint16, path
        cache = ChunkCache(source, 1 << 20)
        box = (slice(3, 9), slice(5, 17), slice(0, 24))
        np.testing.assert_array_equal(cache.read(box), data[box])
        converted = convert_volume(path, tmp_path / f"{path.name}.zarr", kind="image")
        low, high, how = intensity_range(source, None, 1 << 20)
        assert (low, high) == (converted["p0_5"], converted["p99_5"]) and "computed" in how


def test_a_tiff_convert_refuses_is_refused_in_place_with_its_line(tmp_path):
    (tmp_path / "slices").mkdir()
    for z in (0, 1, 3):  # slice 2 missing
        tifffile.imwrite(tmp_path / "slices" / f"s_{z}.tif", np.zeros((4, 4), np.uint8))
    missing = "1 slice\\(s\\) missing between s_0.tif and s_3.tif: number\\(s\\) 2;"
    with pytest.raises(CtsegError, match=missing):
        open_source(str(tmp_path / "slices"))
    (tmp_path / "flat.tif").write_bytes(b"II*\x00garbage")
    with pytest.raises(CtsegError, match="flat.tif"):
        open_source(str(tmp_path / "flat.tif"))


def test_s3_reads_equal_the_local_array(tmp_path, s3_endpoint):
    data = random_volume(seed=3)
    local = tmp_path / "bucket"
    write_array(local / "vol.zarr", data, shards=(16, 32, 32))
    levels = write_ome(local / "scroll.ome.zarr", data, "0.4")
    upload(s3_endpoint, local, "scrolls", "v1")
    options = s3_options(s3_endpoint)
    source = open_source("s3://scrolls/v1/vol.zarr", storage_options=options)
    assert source.chunks == (16, 32, 32)
    assert_reads_equal(source, data, n=4)
    pyramid = open_source("s3://scrolls/v1/scroll.ome.zarr", level=1, storage_options=options)
    assert pyramid.spacing == tuple(2 * s for s in SCALE0)
    np.testing.assert_array_equal(ChunkCache(pyramid, 0).read(full(pyramid)), levels[1])
    one_line_error(
        "not a Zarr array or OME-Zarr group",
        open_source,
        "s3://scrolls/v1/nothing.zarr",
        storage_options=options,
    )


RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeHandler(SimpleHTTPRequestHandler):
    """A static file server that answers byte ranges, as web servers and object stores do
    (the standard library's ignores them): zarr reads a shard's index and chunks by range."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        match = RANGE.match(self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if match is None or not os.path.isfile(path):
            super().do_GET()
            return
        body = Path(path).read_bytes()
        first, last = match.groups()
        if first:
            start, stop = int(first), min(int(last) + 1 if last else len(body), len(body))
        else:  # the last N bytes
            start, stop = max(0, len(body) - int(last)), len(body)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(body)}")
        self.send_header("Content-Length", str(stop - start))
        self.end_headers()
        self.wfile.write(body[start:stop])


@pytest.fixture
def http_root(tmp_path):
    """A folder served over http on loopback: yields (folder, base url)."""
    root = tmp_path / "www"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=root))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_http_reads_equal_the_local_array(http_root):
    root, base = http_root
    data = random_volume(dtype=np.uint16, seed=4)
    write_array(root / "vol.zarr", data, shards=(16, 16, 32))
    levels = write_ome(root / "scroll.ome.zarr", data, "0.5")
    source = open_source(f"{base}/vol.zarr")
    assert (source.shape, source.chunks) == (SHAPE, (16, 16, 32))
    assert_reads_equal(source, data, n=4)
    pyramid = open_source(f"{base}/scroll.ome.zarr", level="1")
    assert pyramid.spacing == tuple(2 * s for s in SCALE0)
    np.testing.assert_array_equal(ChunkCache(pyramid, 0).read(full(pyramid)), levels[1])
    one_line_error("not a Zarr array or OME-Zarr group", open_source, f"{base}/nothing.zarr")


def test_an_unreachable_server_is_one_line():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/vol.zarr"
    text = one_line_error("cannot be read", open_source, url)
    assert text.startswith(url)
