"""ctseg.preprocess.spacing: the voxel size from real TIFFs written by tifffile (ImageJ spacing
and resolution, plain resolution tags with a unit, OME-XML, none), the defaults tifffile writes
not mistaken for a size, and one-line errors on invalid or contradictory sizes."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile

from ctseg.io import CtsegError
from ctseg.preprocess.spacing import tiff_axes, tiff_spacing

VOLUME = np.zeros((6, 8, 9), np.uint8)
IMAGEJ_AXES = {"axes": "ZYX"}


def _approx(values):
    return pytest.approx(values, rel=1e-6)


def test_imagej_spacing_and_resolution(tmp_path):
    path = tmp_path / "a.tif"
    tifffile.imwrite(
        path,
        VOLUME,
        imagej=True,
        resolution=(1 / 0.5, 1 / 0.25),
        metadata={**IMAGEJ_AXES, "spacing": 2.0, "unit": "micron"},
    )
    assert tiff_spacing(path) == _approx((2.0, 0.25, 0.5))


@pytest.mark.parametrize(
    ("unit", "micrometres"),
    [("um", 1.0), ("\\u00B5m", 1.0), ("mm", 1e3), ("nm", 1e-3)],
)
def test_imagej_units(tmp_path, unit, micrometres):
    path = tmp_path / "a.tif"
    tifffile.imwrite(
        path,
        VOLUME,
        imagej=True,
        resolution=(1 / 7.91, 1 / 7.91),
        metadata={**IMAGEJ_AXES, "spacing": 15.82, "unit": unit},
    )
    assert tiff_spacing(path) == _approx(tuple(micrometres * v for v in (15.82, 7.91, 7.91)))


def test_imagej_without_unit_is_uncalibrated(tmp_path):
    path = tmp_path / "a.tif"
    tifffile.imwrite(
        path, VOLUME, imagej=True, resolution=(0.5, 0.5), metadata={**IMAGEJ_AXES, "spacing": 2.0}
    )
    assert tiff_spacing(path) is None and tiff_axes(path) == {}


@pytest.mark.parametrize(
    ("unit", "micrometres"), [("CENTIMETER", 1e4), ("INCH", 25400.0), ("MICROMETER", 1.0)]
)
def test_resolution_tags_give_the_plane_only(tmp_path, unit, micrometres):
    path = tmp_path / "a.tif"
    tifffile.imwrite(path, VOLUME, resolution=(4.0, 2.0), resolutionunit=unit)
    assert tiff_axes(path) == _approx({"y": micrometres / 2.0, "x": micrometres / 4.0})
    assert tiff_spacing(path) is None  # no z: not assumed equal to x


def test_ome_physical_sizes(tmp_path):
    path = tmp_path / "a.ome.tif"
    metadata = {
        "axes": "ZYX",
        "PhysicalSizeX": 0.5,
        "PhysicalSizeY": 0.5,
        "PhysicalSizeZ": 2.0,
        "PhysicalSizeXUnit": "µm",
        "PhysicalSizeYUnit": "µm",
        "PhysicalSizeZUnit": "mm",
    }
    tifffile.imwrite(path, VOLUME, ome=True, metadata=metadata)
    assert tiff_spacing(path) == _approx((2000.0, 0.5, 0.5))


def test_ome_default_unit_is_micrometre(tmp_path):
    path = tmp_path / "a.ome.tif"
    sizes = {"PhysicalSizeX": 0.7, "PhysicalSizeY": 0.7, "PhysicalSizeZ": 1.4}
    tifffile.imwrite(path, VOLUME, ome=True, metadata={"axes": "ZYX", **sizes})
    assert tiff_spacing(path) == _approx((1.4, 0.7, 0.7))


def test_ome_agreeing_with_resolution_tags(tmp_path):
    path = tmp_path / "a.ome.tif"
    sizes = {"PhysicalSizeX": 0.5, "PhysicalSizeY": 0.5, "PhysicalSizeZ": 1.0}
    tifffile.imwrite(
        path,
        VOLUME,
        ome=True,
        resolution=(2e4, 2e4),  # pixels per cm: 0.5 µm
        resolutionunit="CENTIMETER",
        metadata={"axes": "ZYX", **sizes},
    )
    assert tiff_spacing(path) == _approx((1.0, 0.5, 0.5))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # tifffile writes XResolution = YResolution = 1/1, ResolutionUnit NONE
        {"metadata": None},
        {"imagej": True, "metadata": IMAGEJ_AXES},
        {"ome": True, "metadata": {"axes": "ZYX"}},
        {"resolution": (3.0, 3.0), "resolutionunit": "NONE"},
    ],
)
def test_no_resolution_information(tmp_path, kwargs):
    path = tmp_path / "a.tif"
    tifffile.imwrite(path, VOLUME, **kwargs)
    with tifffile.TiffFile(path) as tif:  # the default tags are there, and not a size
        assert tif.pages[0].tags["ResolutionUnit"].value == 1
    assert tiff_axes(path) == {} and tiff_spacing(path) is None


def test_directory_of_slices(tmp_path):
    for z in range(3):
        tifffile.imwrite(
            tmp_path / f"slice_{z:04d}.tif",
            VOLUME[z],
            imagej=True,
            resolution=(2.0, 2.0),
            metadata={"spacing": 1.5, "unit": "um"},
        )
    assert tiff_spacing(tmp_path) == _approx((1.5, 0.5, 0.5))


def test_directory_of_slices_plane_only_and_none(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for z in range(3):
        tifffile.imwrite(plain / f"s{z}.tif", VOLUME[z])
    assert tiff_spacing(plain) is None
    tags = tmp_path / "tags"
    tags.mkdir()
    for z in range(3):
        tifffile.imwrite(tags / f"s{z}.tif", VOLUME[z], resolution=(1e4, 1e4), resolutionunit=3)
    assert tiff_axes(tags) == _approx({"y": 1.0, "x": 1.0}) and tiff_spacing(tags) is None


def _one_line_error(path, *words):
    with pytest.raises(CtsegError) as info:
        tiff_spacing(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message
    return message


def test_slices_that_disagree(tmp_path):
    for z, res in enumerate((2.0, 2.0, 4.0)):
        tifffile.imwrite(
            tmp_path / f"slice_{z}.tif", VOLUME[z], resolution=(res, res), resolutionunit=5
        )
    _one_line_error(tmp_path, "contradictory", "slice_2.tif")


def test_ome_contradicting_resolution_tags(tmp_path):
    path = tmp_path / "a.ome.tif"
    sizes = {"PhysicalSizeX": 0.5, "PhysicalSizeY": 0.5, "PhysicalSizeZ": 1.0}
    tifffile.imwrite(
        path,
        VOLUME,
        ome=True,
        resolution=(1e4, 1e4),  # 1 µm, not 0.5
        resolutionunit="CENTIMETER",
        metadata={"axes": "ZYX", **sizes},
    )
    _one_line_error(path, "contradictory", "along x")


@pytest.mark.parametrize("spacing", [0.0, -2.0, float("nan"), float("inf")])
def test_invalid_imagej_spacing(tmp_path, spacing):
    path = tmp_path / "a.tif"
    tifffile.imwrite(
        path,
        VOLUME,
        imagej=True,
        resolution=(2.0, 2.0),
        metadata={**IMAGEJ_AXES, "spacing": spacing, "unit": "um"},
    )
    _one_line_error(path, "spacing")


@pytest.mark.parametrize("size", ["0", "-0.5", "NaN"])
def test_invalid_ome_size(tmp_path, size):
    path = tmp_path / "a.ome.tif"
    tifffile.imwrite(path, VOLUME, ome=True, metadata={"axes": "ZYX"})
    with tifffile.TiffFile(path) as tif:
        xml = tif.ome_metadata
    xml = xml.replace("<Pixels ", f'<Pixels PhysicalSizeX="{size}" ', 1)
    tifffile.tiffcomment(path, xml.encode())
    _one_line_error(path, "PhysicalSizeX")


def test_zero_resolution_tag(tmp_path):
    path = tmp_path / "a.tif"
    tifffile.imwrite(path, VOLUME, resolution=((0, 1), (0, 1)), resolutionunit="CENTIMETER")
    _one_line_error(path, "XResolution")


def test_unknown_unit(tmp_path):
    path = tmp_path / "a.tif"
    tifffile.imwrite(
        path,
        VOLUME,
        imagej=True,
        resolution=(2.0, 2.0),
        metadata={**IMAGEJ_AXES, "spacing": 1.0, "unit": "furlong"},
    )
    _one_line_error(path, "furlong")


def test_not_a_tiff(tmp_path):
    path = tmp_path / "a.tif"
    path.write_bytes(b"not a tiff at all")
    _one_line_error(path, "cannot read")
