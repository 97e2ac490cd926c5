"""ctseg.ome_zarr: a prediction as an OME-Zarr 0.5 image with a pyramid, written chunk by chunk.

The references here are the definitions written as plain loops over output voxels, independent
of the vectorised implementation: each level from the level above, a group of up to 2x2x2
voxels per output voxel (fewer at an odd end), the mode's tie going to the larger value.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zarr

from ctseg import ome_zarr
from ctseg.io import CtsegError, remove_path

SHAPE = (37, 50, 61)
CHUNKS = (16, 16, 16)
MIN_SIZE = 8  # so that the small test volume has a pyramid: 37x50x61, 19x25x31, 10x13x16


# --------------------------------------------------------------------------- references


def groups(shape: tuple[int, ...]):
    """Each output voxel of a 2x2x2 reduction and the input slices of its group."""
    out = tuple(-(-s // 2) for s in shape)
    for index in itertools.product(*(range(o) for o in out)):
        yield (
            index,
            tuple(slice(2 * i, min(2 * i + 2, s)) for i, s in zip(index, shape, strict=True)),
        )


def mode_reference(data: np.ndarray) -> np.ndarray:
    out = np.zeros(tuple(-(-s // 2) for s in data.shape), data.dtype)
    for index, box in groups(data.shape):
        counts = Counter(data[box].ravel().tolist())
        out[index] = max(counts, key=lambda value: (counts[value], value))
    return out


def mean_reference(data: np.ndarray) -> np.ndarray:
    """float: the float32 sum (in the group's C order) over the count, cast back; integers:
    the mean rounded half up."""
    out = np.zeros(tuple(-(-s // 2) for s in data.shape), data.dtype)
    for index, box in groups(data.shape):
        values = data[box].ravel()
        if data.dtype.kind == "f":
            total = np.float32(0)
            for value in values:
                total = np.float32(total + np.float32(value))
            out[index] = total / np.float32(values.size)
        else:
            out[index] = math.floor(int(values.astype(np.int64).sum()) / values.size + 0.5)
    return out


def chunk_files(array_dir: Path) -> set[tuple[int, ...]]:
    """The chunks stored under an array's ``c/`` folder (zarr v3's default key encoding)."""
    folder = array_dir / "c"
    if not folder.exists():
        return set()
    return {
        tuple(int(p) for p in f.relative_to(folder).parts) for f in folder.rglob("*") if f.is_file()
    }


def nonzero_chunks(data: np.ndarray, chunks: tuple[int, ...]) -> set[tuple[int, ...]]:
    grid = [range(-(-s // c)) for s, c in zip(data.shape, chunks, strict=True)]
    return {
        index
        for index in itertools.product(*grid)
        if data[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks, strict=True))].any()
    }


def write_blocks(group: zarr.Group, data: np.ndarray, seed: int = 0, threads: int = 1) -> None:
    """Level 0, one chunk per call, in a shuffled order (from `threads` threads at once)."""
    boxes = [
        tuple(
            slice(i * c, min((i + 1) * c, s))
            for i, c, s in zip(index, CHUNKS, data.shape, strict=True)
        )
        for index in itertools.product(
            *(range(-(-s // c)) for s, c in zip(data.shape, CHUNKS, strict=True))
        )
    ]
    random.Random(seed).shuffle(boxes)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda box: ome_zarr.write_level0(group, box, data[box]), boxes))


def label_map(seed: int = 0) -> np.ndarray:
    """Labels 0-3, background most frequent, with an all-zero slab (z < 16, whole chunks)."""
    rng = np.random.default_rng(seed)
    data = rng.choice(np.arange(4, dtype=np.uint8), size=SHAPE, p=[0.55, 0.25, 0.15, 0.05])
    data[:16] = 0
    return data


# --------------------------------------------------------------------------- pyramid_shapes


def test_pyramid_shapes_cubic_halves_every_axis_until_one_chunk() -> None:
    assert ome_zarr.pyramid_shapes((512, 512, 512), (64, 64, 64)) == [
        (512, 512, 512),
        (256, 256, 256),
        (128, 128, 128),
        (64, 64, 64),
    ]
    # With smaller chunks it stops at min_size instead: 64 < 2 * 64.
    assert ome_zarr.pyramid_shapes((512, 512, 512), (32, 32, 32))[-1] == (64, 64, 64)
    assert len(ome_zarr.pyramid_shapes((512, 512, 512), (64, 64, 64), max_levels=2)) == 2
    # Odd sizes round up.
    assert ome_zarr.pyramid_shapes((131, 129, 128), (32, 32, 32)) == [
        (131, 129, 128),
        (66, 65, 64),
    ]


def test_pyramid_shapes_anisotropic_keeps_the_short_axes() -> None:
    assert ome_zarr.pyramid_shapes((600, 100, 100), (64, 64, 64), min_size=64) == [
        (600, 100, 100),
        (300, 100, 100),
        (150, 100, 100),
        (75, 100, 100),
    ]
    # A whole scroll: eight levels, the short axes kept once they are below 2 * min_size.
    scroll = ome_zarr.pyramid_shapes((14000, 8000, 8000), (128, 128, 128))
    assert len(scroll) == 8
    assert scroll[6] == (219, 125, 125) and scroll[7] == (110, 125, 125)


def test_pyramid_shapes_tiny_and_bad_shapes() -> None:
    assert ome_zarr.pyramid_shapes((5, 3, 1), (16, 16, 16)) == [(5, 3, 1)]
    assert ome_zarr.pyramid_shapes((1, 1, 1), (1, 1, 1)) == [(1, 1, 1)]
    assert ome_zarr.pyramid_shapes((40, 2, 2), (4, 4, 4), min_size=8) == [
        (40, 2, 2),
        (20, 2, 2),
        (10, 2, 2),
    ]
    with pytest.raises(ValueError, match="three positive"):
        ome_zarr.pyramid_shapes((10, 10), (4, 4))
    with pytest.raises(ValueError, match="three positive"):
        ome_zarr.pyramid_shapes((10, 0, 10), (4, 4, 4))


# --------------------------------------------------------------------------- the image


def test_mode_pyramid_matches_the_reference_and_opens_with_plain_zarr(tmp_path: Path) -> None:
    data = label_map()
    path = tmp_path / "mask.ome.zarr"
    group = ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, min_size=MIN_SIZE)
    write_blocks(group, data, threads=4)
    ome_zarr.build_pyramid(group, "mode", memory_budget_bytes=200_000)

    info = ome_zarr.check_image(path)
    assert info["levels"] == [(37, 50, 61), (19, 25, 31), (10, 13, 16)]
    assert info["dtype"] == "uint8"

    opened = zarr.open_group(str(path), mode="r")
    assert np.array_equal(opened["0"][:], data)
    level1 = mode_reference(data)
    assert np.array_equal(opened["1"][:], level1)
    assert np.array_equal(opened["2"][:], mode_reference(level1))


def test_mode_ties_go_to_the_larger_value() -> None:
    block = np.zeros((2, 2, 3), np.uint8)
    block[0] = 1  # the first group: four ones against four zeros -> 1
    block[1, :, 2] = 5  # the last group (x is odd: 2x2x1): two ones against two fives -> 5
    out = ome_zarr.downsample(block, (2, 2, 2), "mode")
    assert out.tolist() == [[[1, 5]]]
    assert np.array_equal(out, mode_reference(block))


@pytest.mark.parametrize("dtype", [np.float16, np.uint8])
def test_mean_pyramid_matches_the_reference(tmp_path: Path, dtype: type) -> None:
    rng = np.random.default_rng(1)
    if dtype is np.uint8:
        data = rng.integers(0, 256, SHAPE, dtype=np.uint8)
    else:
        data = rng.random(SHAPE, dtype=np.float32).astype(np.float16)
    data[:, :16] = 0
    path = tmp_path / "probabilities.ome.zarr"
    group = ome_zarr.create_image(
        path, SHAPE, dtype, CHUNKS, min_size=MIN_SIZE, name="probabilities"
    )
    write_blocks(group, data, seed=2)
    ome_zarr.build_pyramid(group, "mean", memory_budget_bytes=100_000)

    opened = zarr.open_group(str(path), mode="r")
    assert np.array_equal(opened["0"][:], data)
    level1 = mean_reference(data)
    assert np.array_equal(opened["1"][:], level1)
    assert np.array_equal(opened["2"][:], mean_reference(level1))


def test_all_zero_chunks_are_not_written(tmp_path: Path) -> None:
    # Foreground in one corner only: most chunks of every level stay empty.
    data = np.zeros(SHAPE, np.uint8)
    data[33:, 34:46, 50:] = label_map()[33:, 34:46, 50:] | 1
    path = tmp_path / "sparse.ome.zarr"
    group = ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, min_size=MIN_SIZE)
    write_blocks(group, data)
    ome_zarr.build_pyramid(group, "mode", memory_budget_bytes=50_000)

    level1 = mode_reference(data)
    levels = [data, level1, mode_reference(level1)]
    for index, reference in enumerate(levels):
        stored = chunk_files(path / str(index))
        assert stored == nonzero_chunks(reference, CHUNKS), index
    assert chunk_files(path / "0") == {(2, 2, 3)}
    assert chunk_files(path / "1") == {(1, 1, 1)}

    # Writing zeros over a written chunk removes its file again.
    box = (slice(32, 37), slice(32, 48), slice(48, 61))
    ome_zarr.write_level0(group, box, np.zeros((5, 16, 13), np.uint8))
    assert chunk_files(path / "0") == set()


def test_write_level0_takes_whole_chunks_only(tmp_path: Path) -> None:
    group = ome_zarr.create_image(tmp_path / "m.zarr", SHAPE, np.uint8, CHUNKS)
    with pytest.raises(ValueError, match="whole chunks"):
        ome_zarr.write_level0(
            group, (slice(0, 16), slice(8, 24), slice(0, 16)), np.ones((16, 16, 16), np.uint8)
        )
    with pytest.raises(ValueError, match="shape"):
        ome_zarr.write_level0(
            group, (slice(0, 16), slice(0, 16), slice(0, 16)), np.ones((16, 16, 8), np.uint8)
        )
    # The last chunk of an axis ends at the array's end.
    ome_zarr.write_level0(
        group, (slice(32, 37), slice(48, 50), slice(48, 61)), np.ones((5, 2, 13), np.uint8)
    )
    assert chunk_files(tmp_path / "m.zarr" / "0") == {(2, 3, 3)}


def test_zarr_json_is_ngff_05(tmp_path: Path) -> None:
    path = tmp_path / "mask.ome.zarr"
    group = ome_zarr.create_image(
        path,
        SHAPE,
        np.uint8,
        CHUNKS,
        min_size=MIN_SIZE,
        spacing=(7.91, 7.91, 3.5),
        name="mask",
        attributes={"ctseg": {"run": "r1"}},
        codec={"name": "zstd", "level": 3},
    )
    axes = [{"name": name, "type": "space", "unit": "micrometer"} for name in ("z", "y", "x")]
    scales = [[7.91, 7.91, 3.5], [15.82, 15.82, 7.0], [31.64, 31.64, 14.0]]
    datasets = [
        {"path": str(index), "coordinateTransformations": [{"type": "scale", "scale": scale}]}
        for index, scale in enumerate(scales)
    ]
    meta = json.loads((path / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "group"
    assert meta["attributes"] == {
        "ome": {
            "version": "0.5",
            "multiscales": [{"name": "mask", "axes": axes, "datasets": datasets}],
        },
        "ctseg": {"run": "r1"},
    }
    for index, shape in enumerate([(37, 50, 61), (19, 25, 31), (10, 13, 16)]):
        array = json.loads((path / str(index) / "zarr.json").read_text())
        assert array["node_type"] == "array" and array["shape"] == list(shape)
        assert array["dimension_names"] == ["z", "y", "x"]  # NGFF 0.5: match the axes' names
        assert array["fill_value"] == 0 and array["data_type"] == "uint8"
        chunk = array["chunk_grid"]["configuration"]["chunk_shape"]
        assert chunk == [min(16, s) for s in shape]
        assert array["codecs"][-1]["name"] == "zstd"

    # The pyramid's maker records its downsampling method (NGFF 0.5: "type", "metadata").
    ome_zarr.build_pyramid(group, "mode", memory_budget_bytes=1 << 20)
    multiscale = json.loads((path / "zarr.json").read_text())["attributes"]["ome"]["multiscales"]
    assert multiscale == [
        {
            "name": "mask",
            "axes": axes,
            "datasets": datasets,
            "type": "mode",
            "metadata": {
                "description": ome_zarr.METHOD_DESCRIPTIONS["mode"],
                "method": "ctseg.ome_zarr.build_pyramid",
            },
        }
    ]
    assert ome_zarr.check_image(path)["scales"] == scales


def test_create_image_overwrites_and_refuses_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "m.zarr"
    path.mkdir()
    (path / "stale").write_text("left by an earlier run")
    ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, levels=1)
    assert not (path / "stale").exists()
    assert ome_zarr.check_image(path)["levels"] == [SHAPE]
    with pytest.raises(ValueError, match="ome"):
        ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, attributes={"ome": {}})
    with pytest.raises(ValueError, match="spacing"):
        ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, spacing=(1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="levels"):
        ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, levels=0)
    group = ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS, min_size=MIN_SIZE)
    with pytest.raises(ValueError, match="mode"):
        ome_zarr.build_pyramid(group, "mode", 1 << 20)
    with pytest.raises(ValueError, match="method"):
        ome_zarr.build_pyramid(group, "max", 1 << 20)


# --------------------------------------------------------------------------- check_image


def edit_json(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def multiscale(meta: dict) -> dict:
    return meta["attributes"]["ome"]["multiscales"][0]


def set_scale(meta: dict, scale: list) -> None:
    multiscale(meta)["datasets"][1]["coordinateTransformations"][0]["scale"] = scale


REFUSALS = {
    "no ome": (
        lambda path: edit_json(path / "zarr.json", lambda m: m["attributes"].pop("ome")),
        "no 'ome' attributes",
    ),
    "wrong version": (
        lambda path: edit_json(
            path / "zarr.json", lambda m: m["attributes"]["ome"].update(version="0.4")
        ),
        "ome version '0.4'",
    ),
    "missing level": (lambda path: remove_path(path / "1"), "no array at '1'"),
    "wrong shape": (
        lambda path: edit_json(path / "1" / "zarr.json", lambda m: m.update(shape=[19, 25, 30])),
        "level 1 has the shape (19, 25, 30), where (19, 25, 31)",
    ),
    "zero scale": (
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 0.0, 2.0])),
        "scale [2.0, 0.0, 2.0], where three positive numbers",
    ),
    "short scale": (
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 2.0])),
        "where three positive numbers",
    ),
    "scale not a whole factor": (
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 3.0, 2.0])),
        "where (19, 17, 31)",
    ),
    "axes": (
        lambda path: edit_json(
            path / "zarr.json", lambda m: multiscale(m)["axes"][0].update(type="time")
        ),
        "three space axes z, y, x",
    ),
    "dimension names": (
        lambda path: edit_json(
            path / "0" / "zarr.json", lambda m: m.update(dimension_names=["x", "y", "z"])
        ),
        "names its dimensions",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_check_image_refuses_in_one_line(tmp_path: Path, case: str) -> None:
    path = tmp_path / "mask.ome.zarr"
    ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, min_size=MIN_SIZE)
    ome_zarr.check_image(path)
    damage, words = REFUSALS[case]
    damage(path)
    with pytest.raises(CtsegError) as refused:
        ome_zarr.check_image(path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert words in message and "write it again" in message


def test_check_image_refuses_what_is_not_a_group(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.zarr", tmp_path / "array.zarr"):
        if path.name == "array.zarr":
            zarr.create_array(str(path), shape=(4, 4, 4), dtype=np.uint8)
        with pytest.raises(CtsegError, match="no zarr group there") as refused:
            ome_zarr.check_image(path)
        assert str(refused.value).startswith(f"{path}: ")


# --------------------------------------------------------------------------- memory


def test_build_pyramid_stays_within_its_memory_budget(tmp_path: Path) -> None:
    shape = (128, 128, 128)
    rng = np.random.default_rng(3)
    data = rng.random(shape, dtype=np.float32).astype(np.float16)
    path = tmp_path / "probabilities.ome.zarr"
    group = ome_zarr.create_image(path, shape, np.float16, CHUNKS, min_size=32)
    for corner in itertools.product(range(0, 128, 64), repeat=3):
        box = tuple(slice(c, c + 64) for c in corner)
        ome_zarr.write_level0(group, box, data[box])
    budget = 1 << 20
    chunk_bytes = 8 * math.prod(CHUNKS) * 2  # one output chunk's input, float16

    tracemalloc.start()
    try:
        ome_zarr.build_pyramid(group, "mean", memory_budget_bytes=budget)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 2 * budget + 16 * chunk_bytes, peak
    assert peak < data.nbytes / 2, peak  # far from reading level 0 whole (4 MiB)
    opened = zarr.open_group(str(path), mode="r")
    assert [opened[str(i)].shape for i in range(3)] == [shape, (64,) * 3, (32,) * 3]
    # The whole-volume reduction (checked against the plain-loop reference above) is what the
    # blocks add up to.
    level1 = ome_zarr.downsample(data, (2, 2, 2), "mean")
    assert np.array_equal(opened["1"][:], level1)
    assert np.array_equal(opened["2"][:], ome_zarr.downsample(level1, (2, 2, 2), "mean"))
