"""A folder of new volumes, as `ctseg predict` and the workflow's predict rules take it: each
multi-page TIFF ``<id>.tif``/``<id>.tiff`` or folder ``<id>/`` of 2D slice TIFFs is one volume,
the inputs `ctseg convert` takes. Free of torch, so that the workflow lists a folder while it
plans.
"""

from __future__ import annotations

from pathlib import Path

from ctseg.io import CtsegError, check_id
from ctseg.preprocess.convert import TIFF_SUFFIXES


def input_volumes(folder: Path) -> dict[str, Path]:
    """{id: source} of the volumes in `folder`, sorted by id: each ``<id>.tif``/``<id>.tiff``
    (a multi-page TIFF) or ``<id>/`` (a folder of 2D slice TIFFs). Hidden entries are skipped
    (macOS's ``._*`` files); anything else is an error naming it."""
    folder = Path(folder)
    if folder.is_file():
        raise CtsegError(
            f"{folder}: a file, where a folder of volumes is expected; give the folder that "
            f"holds it ({folder.parent}), with --only {folder.name.split('.')[0]} for this one"
        )
    if not folder.is_dir():
        raise CtsegError(f"{folder}: no such folder of volumes")
    found: dict[str, Path] = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            rid = entry.name
        elif entry.is_file() and entry.suffix.lower() in TIFF_SUFFIXES:
            rid = entry.stem
        else:
            raise CtsegError(
                f"{entry}: not a TIFF volume (.tif, .tiff) or a folder of slice TIFFs; move it "
                f"out of {folder}"
            )
        check_id(rid, entry)
        if rid in found:
            raise CtsegError(
                f"{folder}: two volumes with the id {rid!r} ({found[rid].name}, {entry.name}): "
                "rename one"
            )
        found[rid] = entry
    if not found:
        raise CtsegError(f"{folder}: no volumes (.tif/.tiff files or folders of slice TIFFs)")
    return dict(sorted(found.items()))


def predict_outputs(folder: str | None, run_dir: str) -> list[str]:
    """The masks the workflow's predict_folder target asks for: ``<run_dir>/predict/<folder
    name>/<id>.tif`` of every volume of config ``predict.input``, so each path names both the
    run and the folder."""
    if not folder:
        raise CtsegError(
            "config predict.input: not set: name the folder of volumes to predict, e.g. "
            "--config 'predict={input: new_volumes, run: exp001}'"
        )
    name = Path(folder).name
    return [f"{run_dir}/predict/{name}/{rid}.tif" for rid in input_volumes(Path(folder))]
