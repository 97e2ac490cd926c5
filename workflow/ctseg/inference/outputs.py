"""What a predict of a volume read in place may write, and the record every output carries.

Nothing of the user's is overwritten (`check_output_paths`, called before the input is read):

- the mask, the probabilities and the work folder must not be the input, lie inside it or hold
  it (for an input on this machine: a path or ``file://``; symbolic links resolved);
- the mask and the probabilities must be two paths;
- an existing path at the mask, the probabilities or the work folder must be ctseg's own of the
  same kind: an output that records it (`written_kind`), or a work folder with its manifest;
  anything else is refused and left as it is;
- an existing ctseg output is rewritten only with ``--overwrite``; without it the refusal gives
  the command that allows it.

Each output records how it was made (`provenance`) under the ``ctseg`` attribute of its OME-Zarr
group, or in the JSON description of its TIFF: the kind of output, the run, the weights' sha256,
the inference and post-processing settings, the labels, ctseg's version and commit, and the input's
url, level and intensity range. villa's predictions showed why: 35 of 36 published masks could not
be reproduced because nothing recorded whether flip TTA was on.
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tifffile
import zarr

from ctseg import __version__
from ctseg.inference.ensemble import WINDOW_ATTRIBUTES
from ctseg.io import CtsegError
from ctseg.preprocess.convert import TIFF_SUFFIXES

PROVENANCE_KEY = "ctseg"
# The kinds of output a predict in place writes, as their records name them.
MASK, LABEL_MAP, PROBABILITIES = "mask", "label map", "probabilities"
# What a work folder (`ctseg.inference.tiled`) holds before its manifest is written, or after a
# killed run: its subfolders, the stores of the finish, temporaries and lock files (and a
# combined run's member-<i>/ work folders).
WORK_MANIFEST = "manifest.json"
WORK_ENTRIES = (
    "tiles",
    "chunks",
    "spill",
    "probabilities.zarr",
    "closing.zarr",
    "mask.zarr",
    "postprocess",  # the finish's post-processing scratch (scroll._write_outputs)
    "intensity.json",
    "statistics",  # the statistics jobs' histograms (tiled.statistics_piece)
)


def local_path(url: str) -> Path | None:
    """The input's path on this machine (resolved), or None for a remote one (s3://, https://)."""
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    elif "://" in url:
        return None
    return Path(url).expanduser().resolve()


def _overlap(a: Path, b: Path) -> str | None:
    """How `a` (an output) and `b` (the input) overlap, or None."""
    if a == b:
        return "is the input"
    if b in a.parents:
        return "lies inside the input"
    if a in b.parents:
        return "holds the input"
    return None


@functools.cache
def _commit() -> str | None:
    """The commit of ctseg's checkout, when it is installed from one (``pip install -e``)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def provenance(
    kind: str,
    *,
    run: str,
    weights_sha256: Sequence[str | None],
    weights: Sequence[float],
    inference: Mapping[str, Any],
    postprocess: Mapping[str, Any] | None,
    labels: Mapping[str, Any],
    source: Mapping[str, Any],
) -> dict[str, Any]:
    """The record an output of `kind` carries (module docstring)."""
    return {
        "output": kind,
        "run": run,
        "weights_sha256": list(weights_sha256),
        "weights": list(weights),
        "inference": dict(inference),
        "postprocess": None if postprocess is None else dict(postprocess),
        "labels": dict(labels),
        "input": dict(source),
        "version": __version__,
        "commit": _commit(),
    }


def tiff_description(record: Mapping[str, Any]) -> str:
    """A TIFF's ImageDescription holding `record` (read back by `written_kind`)."""
    return json.dumps({PROVENANCE_KEY: record}, sort_keys=True)


def read_record(path: Path) -> dict[str, Any] | None:
    """The record ctseg wrote into the output at `path`, or None when it holds none (it is not
    ctseg's, or not an output at all)."""
    try:
        if path.suffix.lower() in TIFF_SUFFIXES and path.is_file():
            with tifffile.TiffFile(path) as tif:
                text = tif.pages.first.description
            record = json.loads(text).get(PROVENANCE_KEY) if text.startswith("{") else None
        elif path.is_dir():
            record = dict(zarr.open_group(str(path), mode="r").attrs).get(PROVENANCE_KEY)
        else:
            return None
    except Exception:  # anything unreadable as ctseg's output is someone else's
        return None
    return record if isinstance(record, dict) else None


def written_kind(path: Path) -> str | None:
    """The kind of ctseg output at `path` (`MASK`, `LABEL_MAP`, `PROBABILITIES`), or None."""
    record = read_record(path)
    kind = None if record is None else record.get("output")
    return kind if isinstance(kind, str) else None


def _is_work_folder(folder: Path) -> bool:
    """Whether `folder` is a predict's work folder: one with its manifest, or one whose every
    entry is one a predict makes (a run killed before it wrote its manifest)."""
    if not folder.is_dir():
        return False
    if (folder / WORK_MANIFEST).is_file():
        return True
    return all(
        entry.name in WORK_ENTRIES
        or entry.name.startswith((".", "member-"))
        or entry.name.startswith(tuple(f"{name}.tmp-" for name in (WORK_MANIFEST, *WORK_ENTRIES)))
        for entry in folder.iterdir()
    )


def check_output_paths(
    url: str,
    outputs: Mapping[str, tuple[Path, str]],
    work: Path,
    overwrite: bool,
    command: Sequence[str] | None,
) -> None:
    """Refuse, before anything is read or written, an output that would replace or enter the
    input, or replace what ctseg did not write (module docstring). `outputs` maps each option
    (``-o``, ``--probabilities``) to its path and the kind of output it will be; `command` is
    the command line, repeated with ``--overwrite`` where that is the fix."""
    source = local_path(url)
    resolved = {
        option: (path.expanduser().resolve(), kind) for option, (path, kind) in outputs.items()
    }
    paths = [path for path, _ in resolved.values()]
    if len(set(paths)) < len(paths):
        raise CtsegError(f"{' and '.join(resolved)}: the same path {paths[0]}: give two paths")
    for option, (path, _) in [*resolved.items(), ("its work folder", (work.resolve(), ""))]:
        how = None if source is None else _overlap(path, source)
        if how is not None:
            raise CtsegError(
                f"{path}: {option} {how} ({url}); nothing was written: give a path outside it"
            )
    rewrite = []
    for option, (path, kind) in resolved.items():
        if not (path.exists() or path.is_symlink()):
            continue
        found = written_kind(path)
        if found != kind:
            what = "not an output of ctseg" if found is None else f"ctseg's {found}, not a {kind}"
            raise CtsegError(
                f"{path}: {option} exists and is {what}; it is left as it is: give another path, "
                "or move it aside yourself"
            )
        rewrite.append(option)
    if work.exists() and not _is_work_folder(work):
        raise CtsegError(
            f"{work}: the work folder of {outputs['-o'][0]} exists and is not a predict's (no "
            f"{WORK_MANIFEST}); it is left as it is: move it aside"
        )
    if rewrite and not overwrite:
        raise CtsegError(
            f"{', '.join(str(resolved[o][0]) for o in rewrite)}: a ctseg output is there "
            f"already; rerun with --overwrite to replace it{_with_overwrite(command)}"
        )


def _with_overwrite(command: Sequence[str] | None) -> str:
    """The refusal's fix: ``: <the command line> --overwrite`` (nothing without one)."""
    return "" if command is None else f": {shlex.join([*command, '--overwrite'])}"


def _is_probability_store(path: Path) -> bool:
    """Whether `path` is a probability store `ctseg infer` wrote: one that records its
    sliding window (`ctseg.inference.ensemble.WINDOW_ATTRIBUTES`)."""
    try:
        attrs = dict(zarr.open_array(str(path), mode="r").attrs)
    except Exception:  # not a zarr array: someone else's
        return False
    return all(key in attrs for key in WINDOW_ATTRIBUTES)


def check_folder_outputs(
    masks: Sequence[Path],
    probabilities: Sequence[Path],
    summary: Path,
    overwrite: bool,
    command: Sequence[str] | None,
) -> None:
    """What a predict of a folder of volumes will write, checked before any volume is read:
    each mask ``<id>.tif`` and probability store ``<id>.zarr`` already there must be ctseg's
    (one it recorded, `written_kind`; a store `ctseg infer` wrote) and is replaced only with
    `overwrite`; the summary file must be a ctseg summary (the predict adds its rows)."""
    rewrite = []
    kinds = [(path, True) for path in masks] + [(path, False) for path in probabilities]
    for path, is_mask in kinds:
        if not (path.exists() or path.is_symlink()):
            continue
        ours = written_kind(path) in (MASK, LABEL_MAP) if is_mask else _is_probability_store(path)
        if not ours:
            raise CtsegError(
                f"{path}: exists and is not an output of ctseg; it is left as it is: give "
                "another output folder, or move it aside yourself"
            )
        rewrite.append(path)
    if summary.exists() and not _is_summary(summary):
        raise CtsegError(
            f"{summary}: exists and is not a summary of ctseg predict; it is left as it is: "
            "give --summary another path, or move it aside yourself"
        )
    if rewrite and not overwrite:
        listed = ", ".join(p.name for p in rewrite[:3]) + (", ..." if len(rewrite) > 3 else "")
        raise CtsegError(
            f"{rewrite[0].parent}: ctseg outputs are there already ({listed}); rerun with "
            f"--overwrite to replace them{_with_overwrite(command)}"
        )


def _is_summary(path: Path) -> bool:
    try:
        volumes = json.loads(path.read_text()).get("volumes")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(volumes, dict)
