"""Shared input checks and atomic output helpers.

Every step writes to a temporary sibling and renames it into place, so a crash or a bad input
never leaves a partial output where Snakemake (or a person) would take it for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


class CtsegError(Exception):
    """An input or config problem the user can fix; the message names the file and the problem."""


def check_id(record_id: str, source: str | Path) -> str:
    """Reject ids that could escape their directory or break file names."""
    text = str(record_id)
    if not ID_PATTERN.match(text) or text in {".", ".."} or ".." in text:
        raise CtsegError(
            f"{source}: bad id {text!r}: ids may only use the characters [A-Za-z0-9_.-] "
            "and may not contain '..'"
        )
    return text


def _temporary_sibling(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `final`; rename it onto `final` only if the block succeeds.

    Works for files and directories (a Zarr store is a directory). On any exception the
    temporary path is removed and `final` is left exactly as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(final)
    try:
        yield tmp
        if final.exists() and final.is_dir() and tmp.is_dir():
            # A directory cannot be renamed over a non-empty one: move the old one aside first
            # so the swap stays a pair of renames.
            old = _temporary_sibling(final)
            os.replace(final, old)
            os.replace(tmp, final)
            remove_path(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_path(tmp)
        raise


def sha256_file(path: str | Path, block_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(block_size):
            digest.update(block)
    return digest.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """One digest over several files (a directory of slices), names included so order matters."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
