"""ctseg.ome_zarr: a prediction as an OME-Zarr 0.5 image with a pyramid, written chunk by chunk.

The references here are the definitions written as plain loops over output voxels, independent
of the vectorised implementation: each level from the level above, a group of up to 2x2x2
voxels per output voxel (fewer at an odd end, 1 along an axis the level keeps), the mode's tie
going to the larger value. Every kind of image ctseg writes (a mask, a label map, probabilities
with a channel axis) is validated by ome-zarr-models, the OME-Zarr 0.5 models of the NGFF
community (`validate`).
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
from typing import Any

import numpy as np
import ome_zarr_models
import pytest
import zarr
from ome_zarr_models.common.omero import Omero
from ome_zarr_models.v05 import Image, ImageLabel

from ctseg import ome_zarr
from ctseg.io import CtsegError, remove_path

SHAPE = (37, 50, 61)
CHUNKS = (16, 16, 16)  # at spacing 1: 37x50x61, 19x25x31, 10x13x16 (fits one chunk)
ANISOTROPIC = (2.5, 1.0, 1.0)  # 37x50x61, 37x25x31 (y, x only), 19x13x16, 10x7x8
ANISOTROPIC_LEVELS = [(37, 50, 61), (37, 25, 31), (19, 13, 16), (10, 7, 8)]
ANISOTROPIC_STEPS = [(1, 2, 2), (2, 2, 2), (2, 2, 2)]
ANISOTROPIC_SCALES = [[2.5, 1.0, 1.0], [2.5, 2.0, 2.0], [5.0, 4.0, 4.0], [10.0, 8.0, 8.0]]


# --------------------------------------------------------------------------- references


def reduced(shape: tuple[int, ...], step: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-s // f) for s, f in zip(shape, step, strict=True))


def groups(shape: tuple[int, ...], step: tuple[int, ...] = (2, 2, 2)):
    """Each output voxel of a reduction by `step` and the input slices of its group."""
    for index in itertools.product(*(range(o) for o in reduced(shape, step))):
        yield (
            index,
            tuple(
                slice(f * i, min(f * i + f, s)) for i, f, s in zip(index, step, shape, strict=True)
            ),
        )


def mode_reference(data: np.ndarray, step: tuple[int, ...] = (2, 2, 2)) -> np.ndarray:
    out = np.zeros(reduced(data.shape, step), data.dtype)
    for index, box in groups(data.shape, step):
        counts = Counter(data[box].ravel().tolist())
        out[index] = max(counts, key=lambda value: (counts[value], value))
    return out


def mean_reference(data: np.ndarray, step: tuple[int, ...] = (2, 2, 2)) -> np.ndarray:
    """float: the float32 sum (in the group's C order) over the count, cast back; integers:
    the mean rounded half up."""
    out = np.zeros(reduced(data.shape, step), data.dtype)
    for index, box in groups(data.shape, step):
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
    """Level 0, one chunk per call (all channels of a (C, Z, Y, X) `data` at once), in a shuffled
    order (from `threads` threads at once)."""
    spatial = data.shape[-3:]
    boxes = [
        tuple(
            slice(i * c, min((i + 1) * c, s))
            for i, c, s in zip(index, CHUNKS, spatial, strict=True)
        )
        for index in itertools.product(
            *(range(-(-s // c)) for s, c in zip(spatial, CHUNKS, strict=True))
        )
    ]
    random.Random(seed).shuffle(boxes)

    def write(box: tuple[slice, ...]) -> None:
        ome_zarr.write_level0(group, box, data[(Ellipsis, *box)])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, boxes))


def label_map(seed: int = 0) -> np.ndarray:
    """Labels 0-3, background most frequent, with an all-zero slab (z < 16, whole chunks)."""
    rng = np.random.default_rng(seed)
    data = rng.choice(np.arange(4, dtype=np.uint8), size=SHAPE, p=[0.55, 0.25, 0.15, 0.05])
    data[:16] = 0
    return data


def pyramid_reference(data: np.ndarray, steps, reference) -> list[np.ndarray]:
    """Level 0 and each coarser level by `reference` from the level above, per channel of a
    (C, Z, Y, X) `data`."""
    levels = [data]
    for step in steps:
        above = levels[-1]
        if above.ndim == 4:
            levels.append(np.stack([reference(channel, step) for channel in above]))
        else:
            levels.append(reference(above, step))
    return levels


def validate(path: Path, kind: type) -> Any:
    """The group at `path` parsed by ome-zarr-models as `kind` (`Image` or `ImageLabel`, NGFF
    0.5): its pydantic models check the ``ome`` metadata (version, multiscales: axes' kinds and
    order, one scale (translation) per dataset of one number per axis, scales coarsening level
    by level, image-label: colours' label values unique and the same as the properties') and
    each level array (zarr v3, present, as many dimensions as axes, ``dimension_names`` the
    axes' names). `open_ome_zarr` (what a reader that guesses the kind does) must find the same
    kind."""
    group = zarr.open_group(str(path), mode="r")
    model = kind.from_zarr(group)
    assert type(ome_zarr_models.open_ome_zarr(group, version="0.5")) is kind
    return model


# --------------------------------------------------------------------------- pyramid_shapes


def test_pyramid_shapes_cubic_halves_every_axis_until_one_chunk() -> None:
    assert ome_zarr.pyramid_shapes((512, 512, 512), (64, 64, 64)) == [
        (512, 512, 512),
        (256, 256, 256),
        (128, 128, 128),
        (64, 64, 64),
    ]
    assert ome_zarr.pyramid_shapes((512, 512, 512), (32, 32, 32))[-1] == (32, 32, 32)
    assert len(ome_zarr.pyramid_shapes((512, 512, 512), (64, 64, 64), max_levels=2)) == 2
    # Odd sizes round up.
    assert ome_zarr.pyramid_shapes((131, 129, 128), (64, 64, 64)) == [
        (131, 129, 128),
        (66, 65, 64),
        (33, 33, 32),
    ]
    # A whole scroll: eight levels (the default most), every axis halved each time.
    scroll = ome_zarr.pyramid_shapes((14000, 8000, 8000), (128, 128, 128))
    assert len(scroll) == 8 and scroll[7] == (110, 63, 63)


def test_pyramid_halves_toward_isotropic_voxels(tmp_path: Path) -> None:
    shape, chunks = (96, 300, 250), (64, 64, 64)
    # Spacing 1, 1, 1: all axes together (the old rule kept z and, at level 2, x).
    path = tmp_path / "iso.ome.zarr"
    ome_zarr.create_image(path, shape, np.uint8, chunks)
    info = ome_zarr.check_image(path)
    assert info["levels"] == [(96, 300, 250), (48, 150, 125), (24, 75, 63), (12, 38, 32)]
    assert info["scales"] == [[1.0] * 3, [2.0] * 3, [4.0] * 3, [8.0] * 3]
    assert ome_zarr.pyramid_shapes(shape, chunks) == info["levels"]
    validate(path, Image)
    # Spacing 2.5, 1, 1: y and x first (2.5 x 2 x 2), then all three (z is then the smallest's
    # 1.25 times, below twice).
    path = tmp_path / "aniso.ome.zarr"
    ome_zarr.create_image(path, shape, np.uint8, chunks, spacing=(2.5, 1, 1))
    info = ome_zarr.check_image(path)
    assert info["levels"] == [(96, 300, 250), (96, 150, 125), (48, 75, 63), (24, 38, 32)]
    assert info["scales"] == [[2.5, 1.0, 1.0], [2.5, 2.0, 2.0], [5.0, 4.0, 4.0], [10.0, 8.0, 8.0]]
    assert ome_zarr.pyramid_shapes(shape, chunks, spacing=(2.5, 1, 1)) == info["levels"]
    validate(path, Image)


def test_pyramid_shapes_anisotropic_spacing() -> None:
    # Exactly twice as coarse is not less than twice: z waits one level, then all are equal.
    assert ome_zarr.pyramid_shapes((64, 256, 256), (16, 16, 16), spacing=(2, 1, 1))[:3] == [
        (64, 256, 256),
        (64, 128, 128),
        (32, 64, 64),
    ]
    # Thick sections (8x the pixel): y and x three times first, then all.
    assert ome_zarr.pyramid_shapes((100, 1000, 1000), (64, 64, 64), spacing=(8, 1, 1)) == [
        (100, 1000, 1000),
        (100, 500, 500),
        (100, 250, 250),
        (100, 125, 125),
        (50, 63, 63),
    ]
    # Fine z: z alone until its voxels catch up.
    assert ome_zarr.pyramid_shapes((400, 100, 100), (64, 64, 64), spacing=(0.25, 1, 1)) == [
        (400, 100, 100),
        (200, 100, 100),
        (100, 100, 100),
        (50, 50, 50),
    ]
    # A spacing that is twice another only up to rounding counts as twice (z waits).
    twice = (0.7 * (1 - 1e-12), 0.35, 0.35)
    assert ome_zarr.pyramid_shapes((64, 64, 64), (16, 16, 16), spacing=twice)[:3] == [
        (64, 64, 64),
        (64, 32, 32),
        (32, 16, 16),
    ]


def test_pyramid_shapes_one_voxel_axes_and_bad_shapes() -> None:
    assert ome_zarr.pyramid_shapes((5, 3, 1), (16, 16, 16)) == [(5, 3, 1)]
    assert ome_zarr.pyramid_shapes((1, 1, 1), (1, 1, 1)) == [(1, 1, 1)]
    # An axis one voxel long is kept and leaves the comparison: the others go on.
    assert ome_zarr.pyramid_shapes((4, 40, 40), (8, 8, 8)) == [
        (4, 40, 40),
        (2, 20, 20),
        (1, 10, 10),
        (1, 5, 5),
    ]
    assert ome_zarr.pyramid_shapes((1, 64, 64), (16, 16, 16), spacing=(0.1, 1, 1)) == [
        (1, 64, 64),
        (1, 32, 32),
        (1, 16, 16),
    ]
    assert ome_zarr.pyramid_shapes((40, 2, 1), (4, 4, 4), spacing=(1, 8, 8)) == [
        (40, 2, 1),
        (20, 2, 1),
        (10, 2, 1),
        (5, 2, 1),
        (3, 1, 1),  # z's voxels have caught up with y's (8): both halved
    ]
    with pytest.raises(ValueError, match="three positive"):
        ome_zarr.pyramid_shapes((10, 10), (4, 4))
    with pytest.raises(ValueError, match="three positive"):
        ome_zarr.pyramid_shapes((10, 0, 10), (4, 4, 4))
    with pytest.raises(ValueError, match="spacing"):
        ome_zarr.pyramid_shapes((10, 10, 10), (4, 4, 4), spacing=(1, -1, 1))
    with pytest.raises(ValueError, match="max_levels"):
        ome_zarr.pyramid_shapes((10, 10, 10), (4, 4, 4), max_levels=0)


# --------------------------------------------------------------------------- the image


def test_mode_pyramid_matches_the_reference_and_opens_with_plain_zarr(tmp_path: Path) -> None:
    data = label_map()
    path = tmp_path / "mask.ome.zarr"
    group = ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS)
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
    group = ome_zarr.create_image(path, SHAPE, dtype, CHUNKS, name="probabilities")
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
    group = ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS)
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
        spacing=(7.91, 7.91, 3.5),
        name="mask",
        attributes={"ctseg": {"run": "r1"}},
        codec={"name": "zstd", "level": 3},
    )
    axes = [{"name": name, "type": "space", "unit": "micrometer"} for name in ("z", "y", "x")]
    # x first (3.5 -> 7), then all three.
    shapes = [(37, 50, 61), (37, 50, 31), (19, 25, 16), (10, 13, 8)]
    scales = [[7.91, 7.91, 3.5], [7.91, 7.91, 7.0], [15.82, 15.82, 14.0], [31.64, 31.64, 28.0]]
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
    for index, shape in enumerate(shapes):
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
    group = ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS)
    with pytest.raises(ValueError, match="mode"):
        ome_zarr.build_pyramid(group, "mode", 1 << 20)
    with pytest.raises(ValueError, match="method"):
        ome_zarr.build_pyramid(group, "max", 1 << 20)


# --------------------------------------------------------------------------- the three kinds

CLASSES = ["background", "recto", "verso", "ink"]
# What the lead's provenance looks like: any JSON beside "ome" is kept as it is.
PROVENANCE = {
    "ctseg": {
        "run": "r1",
        "weights": {"sha256": "ab" * 32},
        "settings": {"overlap": 0.5, "tta": [None, "flip"]},
        "input": {"url": "s3://bucket/scroll.zarr", "level": 0, "range": [[0, 37], [0, 50]]},
    },
    "note": ["free", 1, True, None],
}


def test_mask_is_an_image_label_at_its_spacing(tmp_path: Path) -> None:
    data = (label_map() >= 2).astype(np.uint8)
    path = tmp_path / "mask.ome.zarr"
    values = ome_zarr.default_label_values(["background", "papyrus"])
    group = ome_zarr.create_image(
        path,
        SHAPE,
        np.uint8,
        CHUNKS,
        spacing=ANISOTROPIC,
        name="mask",
        label_values=values,
        attributes=PROVENANCE,
    )
    write_blocks(group, data, threads=2)
    ome_zarr.build_pyramid(group, "mode", memory_budget_bytes=200_000)

    model = validate(path, ImageLabel)
    multiscale = model.ome_attributes.multiscales[0]
    assert [(a.name, a.type, a.unit) for a in multiscale.axes] == [
        (axis, "space", "micrometer") for axis in "zyx"
    ]
    assert [d.coordinateTransformations[0].scale for d in multiscale.datasets] == (
        ANISOTROPIC_SCALES
    )
    label = model.ome_attributes.image_label
    assert label is not None and label.version == "0.5" and label.source is None
    assert [(c.label_value, c.rgba) for c in label.colors] == [
        (0, (0, 0, 0, 0)),
        (1, values[1].rgba),
    ]
    assert [p.model_dump(by_alias=True) for p in label.properties] == [
        {"label-value": 0, "class": "background"},
        {"label-value": 1, "class": "papyrus"},
    ]
    meta = json.loads((path / "zarr.json").read_text())["attributes"]
    assert meta["ome"]["image-label"] == {
        "version": "0.5",
        "colors": [
            {"label-value": 0, "rgba": [0, 0, 0, 0]},
            {"label-value": 1, "rgba": list(values[1].rgba)},
        ],
        "properties": [
            {"label-value": 0, "class": "background"},
            {"label-value": 1, "class": "papyrus"},
        ],
    }
    # The provenance beside "ome" survives the pyramid's metadata update, as it was given.
    assert {k: v for k, v in meta.items() if k != "ome"} == PROVENANCE

    info = ome_zarr.check_image(path)
    assert info["levels"] == ANISOTROPIC_LEVELS and info["scales"] == ANISOTROPIC_SCALES
    assert info["axes"] == ["z", "y", "x"] and info["channels"] is None
    assert info["label_values"] == values and info["attributes"] == PROVENANCE
    opened = zarr.open_group(str(path), mode="r")
    levels = pyramid_reference(data, ANISOTROPIC_STEPS, mode_reference)
    for index, reference in enumerate(levels):
        assert np.array_equal(opened[str(index)][:], reference), index


def test_label_map_names_and_colours_its_classes(tmp_path: Path) -> None:
    data = label_map(seed=5)
    values = {
        0: ("background", (0, 0, 0, 0)),
        3: ome_zarr.LabelClass("ink", (255, 255, 0, 200)),
        1: ("recto", [255, 0, 0, 255]),
        2: ("verso", (0, 0, 255, 255)),
    }
    path = tmp_path / "classes.ome.zarr"
    group = ome_zarr.create_image(
        path, SHAPE, np.uint8, CHUNKS, spacing=ANISOTROPIC, name="classes", label_values=values
    )
    write_blocks(group, data, seed=1)
    ome_zarr.build_pyramid(group, "mode", memory_budget_bytes=100_000)

    label = validate(path, ImageLabel).ome_attributes.image_label
    assert label is not None
    assert [(c.label_value, c.rgba) for c in label.colors] == [
        (0, (0, 0, 0, 0)),
        (1, (255, 0, 0, 255)),
        (2, (0, 0, 255, 255)),
        (3, (255, 255, 0, 200)),
    ]
    assert [p.model_dump(by_alias=True)["class"] for p in label.properties] == [
        "background",
        "recto",
        "verso",
        "ink",
    ]
    info = ome_zarr.check_image(path)
    assert info["levels"] == ANISOTROPIC_LEVELS and info["scales"] == ANISOTROPIC_SCALES
    assert info["label_values"] == {
        v: ome_zarr.LabelClass(name, tuple(rgba)) for v, (name, rgba) in values.items()
    }
    opened = zarr.open_group(str(path), mode="r")
    for index, reference in enumerate(pyramid_reference(data, ANISOTROPIC_STEPS, mode_reference)):
        assert np.array_equal(opened[str(index)][:], reference), index


def test_label_image_also_validates_under_an_images_labels_group(tmp_path: Path) -> None:
    """NGFF's own layout: the scan at the root, the label image at labels/<name>. ome-zarr-models
    then also checks the label image's integer dtype and its number of levels against the
    scan's."""
    root = tmp_path / "scan.ome.zarr"
    ome_zarr.create_image(root, SHAPE, np.uint8, CHUNKS, spacing=ANISOTROPIC, name="scan")
    zarr.open_group(str(root), mode="r+").create_group(
        "labels", attributes={"ome": {"version": "0.5", "labels": ["classes"]}}
    )
    values = ome_zarr.default_label_values(CLASSES)
    ome_zarr.create_image(
        root / "labels" / "classes", SHAPE, np.uint8, CHUNKS, spacing=ANISOTROPIC,
        label_values=values,
    )  # fmt: skip
    image = validate(root, Image)
    assert image.labels is not None and image.labels.label_paths == ["classes"]
    label = image.labels.get_image_labels_group("classes").ome_attributes.image_label
    assert label is not None and [c.label_value for c in label.colors] == [0, 1, 2, 3]
    validate(root / "labels" / "classes", ImageLabel)


def test_probabilities_have_a_channel_axis(tmp_path: Path) -> None:
    names = ["background", "papyrus", "ink"]
    rng = np.random.default_rng(4)
    data = rng.random((3, *SHAPE), dtype=np.float32).astype(np.float16)
    data[:, :16] = 0
    data[2] = 0  # a class never predicted: its chunks are never written, at any level
    path = tmp_path / "probabilities.ome.zarr"
    group = ome_zarr.create_image(
        path,
        SHAPE,
        np.float16,
        CHUNKS,
        spacing=ANISOTROPIC,
        name="probabilities",
        channels=names,
        attributes=PROVENANCE,
    )
    write_blocks(group, data, seed=3, threads=2)
    ome_zarr.build_pyramid(group, "mean", memory_budget_bytes=100_000)

    ome = validate(path, Image).ome_attributes
    multiscale = ome.multiscales[0]
    assert [(a.name, a.type) for a in multiscale.axes] == [
        ("c", "channel"),
        ("z", "space"),
        ("y", "space"),
        ("x", "space"),
    ]
    scales = [[1.0, *scale] for scale in ANISOTROPIC_SCALES]
    assert [d.coordinateTransformations[0].scale for d in multiscale.datasets] == scales
    # The channel names under "ome" (NGFF 0.5's omero block, which ome-zarr-models' 0.5 Image
    # passes through unchecked): checked with its omero model.
    omero = Omero.model_validate(ome.model_extra["omero"])
    assert [c.model_dump()["label"] for c in omero.channels] == names
    colors = ome_zarr.label_colors(3)
    assert [c.color for c in omero.channels] == ["FFFFFF"] + [
        "{:02X}{:02X}{:02X}".format(*rgba[:3]) for rgba in colors[1:]
    ]
    assert all(c.window.min == 0 and c.window.max == 1 for c in omero.channels)

    info = ome_zarr.check_image(path)
    levels = [(3, *shape) for shape in ANISOTROPIC_LEVELS]
    assert info["levels"] == levels and info["scales"] == scales and info["dtype"] == "float16"
    assert info["axes"] == ["c", "z", "y", "x"] and info["channels"] == names
    assert info["label_values"] is None and info["attributes"] == PROVENANCE
    opened = zarr.open_group(str(path), mode="r")
    for index, shape in enumerate(levels):
        array = opened[str(index)]
        assert array.metadata.dimension_names == ("c", "z", "y", "x")
        assert array.chunks == (1, *(min(16, s) for s in shape[1:]))
        assert not any(chunk[0] == 2 for chunk in chunk_files(path / str(index))), index
    references = pyramid_reference(data[:2], ANISOTROPIC_STEPS, mean_reference)
    for index, reference in enumerate(references):
        level = opened[str(index)][:]
        assert np.array_equal(level[:2], reference), index
        assert not level[2].any(), index


def test_label_colors_are_distinct_and_background_transparent() -> None:
    colors = ome_zarr.label_colors(300)
    assert colors[0] == (0, 0, 0, 0)
    assert all(c[3] == 255 for c in colors[1:])
    assert len(set(colors)) == 300
    assert ome_zarr.label_colors(300) == colors and ome_zarr.label_colors(4) == colors[:4]
    assert ome_zarr.label_colors(0) == [] and ome_zarr.label_colors(1) == [(0, 0, 0, 0)]
    values = ome_zarr.default_label_values(CLASSES)
    assert values == {v: ome_zarr.LabelClass(n, colors[v]) for v, n in enumerate(CLASSES)}


def test_create_image_refuses_bad_channels_and_labels(tmp_path: Path) -> None:
    path = tmp_path / "m.zarr"
    labels = ome_zarr.default_label_values(["background", "papyrus"])
    with pytest.raises(ValueError, match="labels are integers"):
        ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS, label_values=labels)
    with pytest.raises(ValueError, match="one value per voxel"):
        ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, channels=["a"], label_values=labels)
    for bad in ({1: ("papyrus", (1, 2, 3))}, {1: ("papyrus", (0, 0, 0, 256))}, {1: "papyrus"}):
        with pytest.raises(ValueError, match="label_values"):
            ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, label_values=bad)
    for key in (1.5, "1", 256, -1):
        with pytest.raises(ValueError, match="label value .* is not an integer of uint8"):
            ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, label_values={key: labels[1]})
    assert not path.exists()  # refused before anything was replaced
    for bad_channels in ("ab", [], ["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="channels"):
            ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS, channels=bad_channels)
    # A label image's pyramid is the mode: a mean of labels is no label.
    group = ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, label_values=labels)
    with pytest.raises(ValueError, match="label image"):
        ome_zarr.build_pyramid(group, "mean", 1 << 20)
    # Level 0 of a channel image takes all channels of a box at once.
    group = ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS, channels=["a", "b"])
    box = (slice(0, 16), slice(0, 16), slice(0, 16))
    with pytest.raises(ValueError, match=r"expected \(2, 16, 16, 16\)"):
        ome_zarr.write_level0(group, box, np.ones((16, 16, 16), np.float16))
    ome_zarr.write_level0(group, box, np.ones((2, 16, 16, 16), np.float16))
    assert chunk_files(path / "0") == {(0, 0, 0, 0), (1, 0, 0, 0)}


# --------------------------------------------------------------------------- check_image


def edit_json(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def multiscale(meta: dict) -> dict:
    return meta["attributes"]["ome"]["multiscales"][0]


def set_scale(meta: dict, scale: list) -> None:
    multiscale(meta)["datasets"][1]["coordinateTransformations"][0]["scale"] = scale


def make(kind: str, path: Path) -> None:
    """A small empty image of `kind` for `test_check_image_refuses_in_one_line` to damage."""
    if kind == "mask":
        ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS)
    elif kind == "labels":
        values = ome_zarr.default_label_values(CLASSES)
        ome_zarr.create_image(path, SHAPE, np.uint8, CHUNKS, label_values=values)
    elif kind == "float":
        ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS)
    else:
        ome_zarr.create_image(path, SHAPE, np.float16, CHUNKS, channels=CLASSES)


def ome(meta: dict) -> dict:
    return meta["attributes"]["ome"]


def image_label(meta: dict) -> dict:
    return ome(meta)["image-label"]


# case: (kind of image, damage, words of the refusal)
REFUSALS = {
    "no ome": (
        "mask",
        lambda path: edit_json(path / "zarr.json", lambda m: m["attributes"].pop("ome")),
        "no 'ome' attributes",
    ),
    "wrong version": (
        "mask",
        lambda path: edit_json(path / "zarr.json", lambda m: ome(m).update(version="0.4")),
        "ome version '0.4'",
    ),
    "missing level": ("mask", lambda path: remove_path(path / "1"), "no array at '1'"),
    "wrong shape": (
        "mask",
        lambda path: edit_json(path / "1" / "zarr.json", lambda m: m.update(shape=[19, 25, 30])),
        "level 1 has the shape (19, 25, 30), where (19, 25, 31)",
    ),
    "zero scale": (
        "mask",
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 0.0, 2.0])),
        "scale [2.0, 0.0, 2.0], where 3 positive numbers, one per axis",
    ),
    "short scale": (
        "mask",
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 2.0])),
        "where 3 positive numbers",
    ),
    "scale not a whole factor": (
        "mask",
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 3.0, 2.0])),
        "where (19, 17, 31)",
    ),
    "axes": (
        "mask",
        lambda path: edit_json(
            path / "zarr.json", lambda m: multiscale(m)["axes"][0].update(type="time")
        ),
        "where space axes z, y, x (after a channel axis c in a channel image)",
    ),
    "dimension names": (
        "mask",
        lambda path: edit_json(
            path / "0" / "zarr.json", lambda m: m.update(dimension_names=["x", "y", "z"])
        ),
        "names its dimensions",
    ),
    "channel axis not first": (
        "probabilities",
        lambda path: edit_json(
            path / "zarr.json",
            lambda m: multiscale(m).update(
                axes=[*multiscale(m)["axes"][1:], multiscale(m)["axes"][0]]
            ),
        ),
        "where space axes z, y, x",
    ),
    "channel dimension names": (
        "probabilities",
        lambda path: edit_json(
            path / "1" / "zarr.json", lambda m: m.update(dimension_names=["z", "y", "x", "c"])
        ),
        "where c, z, y, x (the axes)",
    ),
    "channel scaled": (
        "probabilities",
        lambda path: edit_json(path / "zarr.json", lambda m: set_scale(m, [2.0, 2.0, 2.0, 2.0])),
        "where 1 for the channel axis",
    ),
    "no omero": (
        "probabilities",
        lambda path: edit_json(path / "zarr.json", lambda m: ome(m).pop("omero")),
        "ome 'omero' channels None, where 4 with a 'label' each",
    ),
    "omero one channel short": (
        "probabilities",
        lambda path: edit_json(path / "zarr.json", lambda m: ome(m)["omero"]["channels"].pop()),
        "where 4 with a 'label' each",
    ),
    "label values named but not coloured": (
        "labels",
        lambda path: edit_json(path / "zarr.json", lambda m: image_label(m)["colors"].pop()),
        "image-label colours the values [0, 1, 2] and names [0, 1, 2, 3], where the same",
    ),
    "label value coloured twice": (
        "labels",
        lambda path: edit_json(
            path / "zarr.json", lambda m: image_label(m)["colors"][1].update({"label-value": 0})
        ),
        "where a new label-value and rgba 0-255",
    ),
    "rgba out of range": (
        "labels",
        lambda path: edit_json(
            path / "zarr.json", lambda m: image_label(m)["colors"][1].update(rgba=[0, 0, 0, 300])
        ),
        "where a new label-value and rgba 0-255",
    ),
    "float labels": (
        "float",
        lambda path: edit_json(
            path / "zarr.json",
            lambda m: ome(m).update({"image-label": {"colors": [], "properties": []}}),
        ),
        "an image-label of float16 voxels, where integers",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_check_image_refuses_in_one_line(tmp_path: Path, case: str) -> None:
    path = tmp_path / "image.ome.zarr"
    kind, damage, words = REFUSALS[case]
    make(kind, path)
    ome_zarr.check_image(path)
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
    group = ome_zarr.create_image(path, shape, np.float16, CHUNKS, levels=3)
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


@pytest.mark.parametrize("spacing", [None, (2.5, 1, 1)])
def test_a_pyramid_built_in_z_ranges_then_the_rest_is_the_whole_ones(
    tmp_path: Path, spacing
) -> None:
    """Jobs of disjoint z-ranges (each writing the chunks whose voxels all come from its range,
    no metadata), each run when level 0 is written in its range only, then one call with those
    ranges done: the same levels, chunk files and metadata as one call; the jobs wrote most
    chunks of level 1."""
    data = label_map()
    groups = {}
    for name in ("whole", "ranges"):
        group = ome_zarr.create_image(tmp_path / f"{name}.zarr", SHAPE, np.uint8, (4, 8, 8),
                                      spacing=spacing)  # fmt: skip
        groups[name] = group
    groups["whole"]["0"][...] = data
    ome_zarr.build_pyramid(groups["whole"], "mode", 50_000)
    ranges = [(0, 16), (16, 32), (32, 37)]
    for z_range in ranges:  # a job reading past its range would read zeros there
        groups["ranges"]["0"][z_range[0] : z_range[1]] = data[z_range[0] : z_range[1]]
        ome_zarr.build_pyramid(groups["ranges"], "mode", 50_000, z_range=z_range)
    by_jobs = {i: chunk_files(tmp_path / "ranges.zarr" / str(i)) for i in (1, 2)}
    assert "type" not in groups["ranges"].attrs["ome"]["multiscales"][0]  # no metadata yet
    ome_zarr.build_pyramid(groups["ranges"], "mode", 50_000, done=ranges)
    whole, parted = (zarr.open_group(tmp_path / f"{n}.zarr", mode="r") for n in groups)
    assert dict(whole.attrs) == dict(parted.attrs)
    for level in range(1, len(ome_zarr.check_image(tmp_path / "whole.zarr")["levels"])):
        assert np.array_equal(whole[str(level)][...], parted[str(level)][...]), level
        assert chunk_files(tmp_path / "whole.zarr" / str(level)) == chunk_files(
            tmp_path / "ranges.zarr" / str(level)
        )
    assert len(by_jobs[1]) > len(chunk_files(tmp_path / "ranges.zarr" / "1")) / 2
