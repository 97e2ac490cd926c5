"""The voxel size a TIFF volume records, in micrometres (issue 32).

`tiff_spacing(path)` reads a multi-page 3D TIFF, or a directory of 2D slice TIFFs, and returns
its voxel spacing [z, y, x] in micrometres, or None when the files do not say it. The rule:

- **Sources.** Three places can give a size, each for some axes:
  - OME-XML (the first image's `Pixels`): `PhysicalSizeX/Y/Z` with `PhysicalSize*Unit` (the OME
    default unit is µm). A unit of `pixel` or `reference frame` is no physical size.
  - ImageJ metadata (its `ImageDescription`): x and y are 1 / `XResolution` and
    1 / `YResolution` in the metadata's `unit` (`yunit` for y if given), z is `spacing` in
    `zunit` or `unit`. Without a unit, or with `pixel`, ImageJ's calibration is uncalibrated:
    no physical size.
  - The TIFF resolution tags of a file that is neither: 1 / `XResolution` and 1 / `YResolution`
    in `ResolutionUnit` (inch, centimetre, and tifffile's millimetre and micrometre). These give
    no z.
- **Defaults are not sizes.** `ResolutionUnit` NONE (1) says the resolution has no unit: it is
  not read, except through an ImageJ unit. That covers the tags tifffile writes when nobody
  gave a resolution: `XResolution = YResolution = 1/1` with `ResolutionUnit = NONE`, written for
  every `imwrite` (plain, `imagej=True` and `ome=True` alike), which would otherwise read as a
  spacing of one "unit".
- **Agreement.** Where two sources (or two pages or slices) give the same axis, they must agree
  to a relative 1e-5 (rationals in the tags round a size such as 1/7.91). A disagreement, or a
  size that is zero, negative, infinite or NaN, or a unit ctseg cannot convert, is a one-line
  `CtsegError` naming the file.
- **All three or nothing.** The spacing is returned only when all three axes are known: a file
  that gives only the in-plane size (typical of plain TIFF resolution tags and of 2D slices)
  returns None rather than a z assumed equal to x. `tiff_axes` returns what is known, per
  axis, for a caller that decides otherwise.

A multi-page file's pages are all checked for their resolution tags; a directory's slices
(every `.tif`/`.tiff` file not hidden, in name order) are each read as a file and must agree.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import tifffile

from ctseg.io import CtsegError

Spacing = tuple[float, float, float]
AXES = ("z", "y", "x")
RELATIVE_TOLERANCE = 1e-5
TIFF_SUFFIXES = (".tif", ".tiff")

# Micrometres per unit, by the spellings ImageJ and OME use (ImageJ writes "micron" or
# "\u00B5m", OME "µm"; the Greek mu and "um" are common too).
MICROMETRES = {
    "pm": 1e-6,
    "å": 1e-4,
    "angstrom": 1e-4,
    "nm": 1e-3,
    "nanometer": 1e-3,
    "nanometre": 1e-3,
    "µm": 1.0,
    "μm": 1.0,
    "um": 1.0,
    "\\u00b5m": 1.0,
    "micron": 1.0,
    "microns": 1.0,
    "micrometer": 1.0,
    "micrometre": 1.0,
    "mm": 1e3,
    "millimeter": 1e3,
    "millimetre": 1e3,
    "cm": 1e4,
    "centimeter": 1e4,
    "centimetre": 1e4,
    "m": 1e6,
    "meter": 1e6,
    "metre": 1e6,
    "in": 25400.0,
    "inch": 25400.0,
}
NOT_PHYSICAL = {"", "pixel", "pixels", "px", "reference frame"}
# TIFF ResolutionUnit: 1 NONE, 2 inch, 3 centimetre; 4 and 5 are tifffile's millimetre and
# micrometre.
RESOLUTION_UNIT_MICROMETRES = {2: 25400.0, 3: 1e4, 4: 1e3, 5: 1.0}


def _unit(path: Path, unit: Any) -> float | None:
    """Micrometres per `unit`, None for no physical unit; CtsegError for an unknown one."""
    name = str(unit).strip()
    if name.lower() in NOT_PHYSICAL:
        return None
    factor = MICROMETRES.get(name) or MICROMETRES.get(name.lower())
    if factor is None:
        raise CtsegError(f"{path}: voxel size unit {name!r} is not one ctseg converts")
    return factor


def _positive(path: Path, what: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise CtsegError(f"{path}: {what} is {value!r}, not a number") from None
    if not (math.isfinite(number) and number > 0):
        raise CtsegError(f"{path}: {what} is {value!r}; a voxel size must be finite and > 0")
    return number


def _resolution(path: Path, page: Any, tag: str) -> float | None:
    """Pixels per unit from a rational resolution tag, None if the page has none."""
    if tag not in page.tags:
        return None
    value = page.tags[tag].value
    if isinstance(value, tuple) and len(value) == 2:
        numerator, denominator = value
        if denominator == 0:
            raise CtsegError(f"{path}: {tag} is {numerator}/{denominator}, not a number")
        value = numerator / denominator
    return _positive(path, tag, value)


def _add(path: Path, found: dict[str, float], axis: str, value: float, source: str) -> None:
    """Record `value` µm for `axis`; CtsegError if an earlier source said otherwise."""
    old = found.get(axis)
    if old is not None and not math.isclose(old, value, rel_tol=RELATIVE_TOLERANCE):
        raise CtsegError(
            f"{path}: contradictory voxel sizes along {axis}: {old:g} µm and {value:g} µm "
            f"({source})"
        )
    found[axis] = value


def _ome_axes(path: Path, xml: str, found: dict[str, float]) -> None:
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise CtsegError(f"{path}: its OME-XML cannot be parsed ({exc})") from None
    pixels = next((el for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "Pixels"), None)
    if pixels is None:
        return
    for axis in AXES:
        size = pixels.get(f"PhysicalSize{axis.upper()}")
        if size is None:
            continue
        factor = _unit(path, pixels.get(f"PhysicalSize{axis.upper()}Unit", "µm"))
        if factor is None:
            continue
        value = _positive(path, f"OME PhysicalSize{axis.upper()}", size) * factor
        _add(path, found, axis, value, "OME-XML")


def _imagej_axes(path: Path, page: Any, meta: dict, found: dict[str, float]) -> None:
    unit = _unit(path, meta.get("unit", ""))
    units = {
        "x": unit,
        "y": _unit(path, meta["yunit"]) if "yunit" in meta else unit,
        "z": _unit(path, meta["zunit"]) if "zunit" in meta else unit,
    }
    for axis, tag in (("x", "XResolution"), ("y", "YResolution")):
        per_unit = _resolution(path, page, tag)
        if per_unit is not None and units[axis] is not None:
            _add(path, found, axis, units[axis] / per_unit, f"ImageJ {tag}")
    if "spacing" in meta and units["z"] is not None:
        value = _positive(path, "ImageJ spacing", meta["spacing"]) * units["z"]
        _add(path, found, "z", value, "ImageJ spacing")


def _tag_axes(path: Path, page: Any, found: dict[str, float]) -> None:
    unit_tag = page.tags.get("ResolutionUnit")
    unit = int(unit_tag.value) if unit_tag is not None else 2  # the TIFF default is inch
    factor = RESOLUTION_UNIT_MICROMETRES.get(unit)
    if factor is None:  # NONE (tifffile's default) or unknown: no physical size
        return
    for axis, tag in (("x", "XResolution"), ("y", "YResolution")):
        per_unit = _resolution(path, page, tag)
        if per_unit is not None:
            _add(path, found, axis, factor / per_unit, f"{tag} of page {page.index}")


def _file_axes(path: Path) -> dict[str, float]:
    found: dict[str, float] = {}
    try:
        with tifffile.TiffFile(path) as tif:
            if tif.is_ome and tif.ome_metadata:
                _ome_axes(path, tif.ome_metadata, found)
            meta = tif.imagej_metadata if tif.is_imagej else None
            for page in tif.pages:
                if meta is not None:
                    _imagej_axes(path, page, meta, found)
                else:
                    _tag_axes(path, page, found)
    except CtsegError:
        raise
    except Exception as exc:  # tifffile raises many types for files it cannot read
        raise CtsegError(f"{path}: cannot read its TIFF tags ({type(exc).__name__})") from None
    return found


def _slices(directory: Path) -> list[Path]:
    files = sorted(
        p
        for p in directory.iterdir()
        if p.suffix.lower() in TIFF_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )
    if not files:
        raise CtsegError(f"{directory}: no .tif/.tiff slice files in this directory")
    return files


def tiff_axes(path: str | Path) -> dict[str, float]:
    """The voxel sizes the TIFF (a file, or a directory of slices) records, µm per axis name
    ("z", "y", "x"), only for the axes it records; the module docstring has the rule."""
    path = Path(path)
    if not path.is_dir():
        return _file_axes(path)
    found: dict[str, float] = {}
    for file in _slices(path):
        for axis, value in _file_axes(file).items():
            _add(path, found, axis, value, file.name)
    return found


def tiff_spacing(path: str | Path) -> Spacing | None:
    """Voxel spacing [z, y, x] in micrometres from a TIFF's tags (a multi-page file or a
    directory of slices), or None unless all three axes are recorded. CtsegError (one line,
    naming the file) on a contradictory or invalid size."""
    found = tiff_axes(path)
    if not all(axis in found for axis in AXES):
        return None
    return (found["z"], found["y"], found["x"])
