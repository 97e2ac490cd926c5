"""Shared input checks and atomic output helpers.

Every step writes to a temporary sibling and renames it into place, so a crash or a bad input
never leaves a partial output where Snakemake (or a person) would take it for a finished one,
and the next write of an output removes the temporaries a killed run left beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import chunks

ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
# atomic_path names its temporaries ".<name>.tmp-<pid>-<8 hex>".
TEMP_NAME = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]{8}$")
# A full disk and a full quota: both are fixed by freeing space, not by a plain rerun.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# numpy's tofile, which tifffile writes pages with, reports a full disk as a short write
# without an errno ("110592 requested and 40704 written").
SHORT_WRITE = re.compile(r"^(\d+) requested and (\d+) written$")


class CtsegError(Exception):
    """An input or config problem the user can fix; the message names the file and the problem."""

    def line(self) -> str:
        """The message as one line. A CtsegError raised in a DataLoader worker comes back
        re-raised by torch with "Caught CtsegError in DataLoader worker process 0" and the
        worker's traceback as its text; the traceback's last line is the original message."""
        text = str(self).strip()
        if "\n" not in text:
            return text
        last = text.splitlines()[-1]
        for name in (f"{type(self).__module__}.{type(self).__name__}", type(self).__name__):
            if last.startswith(f"{name}: "):
                return last[len(name) + 2 :]
        return " ".join(text.split())


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


def made_once(path: str | Path, make: Callable[[Path], None]) -> Path:
    """The directory `path` (a zarr store), made by `make` at a temporary name and renamed into
    place, unless a process beside this one made it first: then that one is kept (a directory
    is never renamed over one that holds files) and this one removed. Parallel jobs that all
    need one store make it once, whole."""
    path = Path(path)
    if path.exists():
        return path
    tmp = _temporary_sibling(path)
    try:
        make(tmp)
        os.rename(tmp, path)
    except OSError:
        if not path.exists():
            raise
    finally:
        with contextlib.suppress(OSError):
            remove_path(tmp)
    return path


@contextlib.contextmanager
def atomic_path(final: str | Path, *, record_chunks: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `final`; rename it onto `final` only if the block succeeds.

    Works for files and directories (a Zarr store is a directory). On any exception the
    temporary path is removed and `final` is left exactly as it was. A run killed before it
    could remove its temporary (SIGKILL, a lost node) leaves it behind: the next write of the
    same `final` removes it first, under a lock on `final` that a living writer holds (see
    `fresh_output`, which adds a free-space check). Every zarr array in a finished directory
    gets the record of the chunks written to it (`ctseg.chunks`), unless `record_chunks` is
    off (a byte-for-byte copy of stores that carry their own).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(final), _naming_the_output(final):
        _remove_stale_temporaries(final)
        with _renamed_into_place(final, record_chunks) as tmp:
            yield tmp


@contextlib.contextmanager
def _naming_the_output(final: Path) -> Iterator[None]:
    """An error leaving the block carries `final`, as does each exception it was raised from
    (`output_of`): the operating system's error of a write names no file (zarr's, tifffile's),
    and the user must know which disk filled. An inner output, written within, keeps its own."""
    try:
        yield
    except Exception as exc:
        for current in _chain(exc):
            if getattr(current, "ctseg_output", None) is None:
                with contextlib.suppress(AttributeError):
                    current.ctseg_output = final  # type: ignore[attr-defined]
        raise


def output_of(exc: BaseException) -> Path | None:
    """The output `atomic_path` was writing when `exc` (or an exception it was raised from)
    left it, if any."""
    for current in _chain(exc):
        output = getattr(current, "ctseg_output", None)
        if output is not None:
            return Path(output)
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the members of exception groups, each once."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


@contextlib.contextmanager
def _renamed_into_place(final: Path, record_chunks: bool = True) -> Iterator[Path]:
    tmp = _temporary_sibling(final)
    try:
        yield tmp
        if record_chunks and tmp.is_dir():
            chunks.record_stores(tmp)
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


# --------------------------------------------------------------------------- faults


def _existing(path: str | Path) -> Path:
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would, once it is created)."""
    return shutil.disk_usage(_existing(path)).free


def check_writable_folder(folder: str | Path, what: str) -> None:
    """`folder` (or, while it does not exist, the nearest folder above it that does) is a folder
    this process may create files in; else one line naming it, the problem and the fix, said
    before anything tries to write there. `what` names what is written there."""
    existing = _existing(folder)
    shown = existing if str(existing) != "." else Path.cwd()
    if not existing.is_dir():
        raise CtsegError(f"{shown}: a file, where {what} need a folder: move the file aside")
    if os.access(existing, os.W_OK | os.X_OK):
        return
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        problem = "on a read-only filesystem"
        fix = "mount it read-write, or work in a copy of the project on a writable disk"
    else:
        problem = "not writable by this user"
        fix = f"change its permissions (chmod u+w {shown}), or run as its owner"
    raise CtsegError(f"{shown}: {problem}, and {what} are written there: {fix}")


def bytes_on_disk(path: str | Path, file_size: int, count: int = 1) -> int:
    """What `count` files of `file_size` bytes take on the filesystem of `path`: each file
    fills whole blocks, which for small chunk files (4 KiB of data) can double the size."""
    block = max(os.statvfs(_existing(path)).f_frsize, 1)
    return count * -(-int(file_size) // block) * block


def check_free_space(path: str | Path, needed: int, what: str, reserve_bytes: int = 0) -> None:
    """Refuse to start a write of `needed` bytes that cannot fit: failing up front leaves
    nothing to clean up, where running out half way leaves a partial output behind."""
    free = free_bytes(path)
    if needed > 0 and needed > free - reserve_bytes:
        raise CtsegError(
            f"{path}: not enough free space to {what}: {needed} bytes needed, {free} bytes free"
            f" ({reserve_bytes} bytes reserved); free some space and rerun"
        )


def disk_full(exc: BaseException) -> OSError | None:
    """The out-of-space OSError behind `exc` (itself, a cause or a member of a group), if any.

    zarr and thread or process pools re-raise a write error from where it happened, sometimes
    as the cause of another exception; the errno is what tells a full disk from a bad input,
    and a short write (`SHORT_WRITE`) is one too: a regular file takes fewer bytes than written
    only when its disk or quota is full.
    """
    for current in _chain(exc):
        if isinstance(current, OSError) and (
            current.errno in DISK_FULL_ERRNOS
            or (current.errno is None and SHORT_WRITE.match(str(current)))
        ):
            return current
    return None


# The fix to print with an operating-system error, by errno, where a plain rerun would not do.
_OS_ERROR_FIXES = {
    **dict.fromkeys(DISK_FULL_ERRNOS, "free some space there and rerun"),
    **dict.fromkeys(
        (errno.EACCES, errno.EPERM, errno.EROFS),
        "choose a path this user may write to, or change the folder's permissions",
    ),
    **dict.fromkeys(
        (errno.EEXIST, errno.ENOTDIR, errno.EISDIR),
        "a file and a folder are in each other's way: give a path to a folder, or move the "
        "file aside",
    ),
    errno.ENOENT: "check the path",
}


def os_error_line(exc: BaseException) -> str | None:
    """One line for the operating-system error behind `exc`: a full disk found anywhere in its
    chain (`disk_full`), else the error itself or its explicit cause (`raise ... from`). The
    path is the error's own file, or else the output being written (`output_of`), then the
    problem and the fix; None when there is no such error."""
    error = disk_full(exc) or _explicit_os_error(exc)
    if error is None:
        return None
    names = [str(f) for f in (error.filename, error.filename2) if f is not None]
    output = output_of(exc)
    if not names and output is not None:
        names = [str(output)]
    where = " -> ".join(names)
    short = SHORT_WRITE.match(str(error)) if error.errno is None else None
    if short is not None:
        code = errno.ENOSPC
        problem = (
            f"{os.strerror(code)} (a write of {short[1]} bytes stopped after {short[2]}: "
            "the disk or the quota is full)"
        )
    else:
        code = error.errno
        problem = error.strerror or os.strerror(code)
    fix = _OS_ERROR_FIXES.get(code)
    return f"{where + ': ' if where else ''}{problem}" + (f"; {fix}" if fix else "")


def _explicit_os_error(exc: BaseException) -> OSError | None:
    """`exc`, or the first of its explicit causes, that is an OSError with an errno."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__
    return None


@contextlib.contextmanager
def disk_full_is_an_error(
    path: str | Path,
    what: str,
    after: str = "the partial output was removed: free some space and rerun",
) -> Iterator[None]:
    """Turn running out of space inside the block into a one-line `CtsegError` naming `path`,
    ending with `after`: what is left and what to do.

    Use it outside `atomic_path`, so that the partial output is gone when the message says so.
    """
    try:
        yield
    except CtsegError:
        raise
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        raise CtsegError(
            f"{path}: no space left on the device while {what} ({full.strerror or full}; "
            f"{free_bytes(path)} bytes free now); {after}"
        ) from exc


def stale_temporaries(final: str | Path) -> list[Path]:
    """Temporary siblings that `atomic_path` made for `final` in earlier runs."""
    final = Path(final)
    prefix = f".{final.name}.tmp-"
    if not final.parent.is_dir():
        return []
    return sorted(
        p for p in final.parent.iterdir() if p.name.startswith(prefix) and TEMP_NAME.match(p.name)
    )


def _remove_stale_temporaries(final: Path) -> None:
    # Only under `output_lock`: no living run owns them.
    for stale in stale_temporaries(final):
        remove_path(stale)


class OutputBusy(CtsegError):
    """Another living run holds the lock on the output (`output_lock`)."""


@contextlib.contextmanager
def output_lock(final: Path) -> Iterator[None]:
    """An exclusive lock on ``.<name>.lock`` beside `final`, removed again on release.

    Held while an output is written, so that a later run may remove the temporaries it finds
    (a killed run's) without ever removing a living run's. The kernel drops the lock when the
    holder dies; a lock file left by a killed run is taken over and removed by the next one.
    """
    lock = final.with_name(f".{final.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise OutputBusy(f"{final}: another run is writing this output now") from exc
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        # The previous holder removed the file between our open and our lock: lock afresh.
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


@contextlib.contextmanager
def work_folder(path: str | Path) -> Iterator[Path]:
    """A scratch folder at `path` for this process alone, removed on the way out. One left by
    a run that was killed (SIGKILL, a lost node) is removed first, under the lock a living run
    holds on it, so a rerun cleans up after a killed one; a living one makes this an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(path):
        if path.exists():
            remove_path(path)
        path.mkdir()
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                remove_path(path)


@contextlib.contextmanager
def fresh_output(final: str | Path, needed_bytes: int = 0, what: str = "write") -> Iterator[Path]:
    """`atomic_path` for a large output, with what a failed run needs:

    - as in `atomic_path`, the temporaries of earlier, killed runs are removed first, under the
      lock on `final` (so before the free-space check: a retry on a full disk gets them back);
    - `needed_bytes` must be free before anything is written (`what` says what for);
    - running out of space anyway is a `CtsegError` naming `final`, after the temporary is gone.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(final):
        _remove_stale_temporaries(final)
        check_free_space(final, needed_bytes, what)
        try:
            with (
                disk_full_is_an_error(final, f"trying to {what}"),
                _renamed_into_place(final) as tmp,
            ):
                yield tmp
        except BaseException:
            # A write zarr still had in flight when the error (or SIGTERM, see ctseg.cli)
            # reached this thread can land after atomic_path removed the temporary, and
            # create it again: let those finish, then remove what they left.
            _settle_zarr_writes()
            for partial in stale_temporaries(final):
                with contextlib.suppress(OSError):
                    remove_path(partial)
            raise


def _settle_zarr_writes(timeout: float = 30.0) -> None:
    """Wait for the tasks on zarr's I/O event loop, if zarr has started one in this process.

    zarr runs every store operation as a task on its own thread; interrupting the thread that
    waits for one (a signal) does not cancel it.
    """
    zarr_sync = sys.modules.get("zarr.core.sync")
    if zarr_sync is None or zarr_sync.loop[0] is None:
        return

    async def drain() -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=timeout)

    with contextlib.suppress(Exception):
        zarr_sync.sync(drain(), timeout=timeout)


# --------------------------------------------------------------------------- strict JSON


def finite_or_none(value: object) -> object:
    """`value` with every non-finite float (NaN, inf; numpy's too) replaced by None, in nested
    dicts, lists and tuples: what strict JSON can hold."""
    if isinstance(value, float | np.floating):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def strict_json(value: object, **kwargs: Any) -> str:
    """`json.dumps` of `value` as strict JSON: null for a non-finite number (not NaN, which
    strict parsers refuse); the keyword arguments are json.dumps's."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
