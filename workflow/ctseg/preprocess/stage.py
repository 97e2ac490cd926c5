"""Choose an experiment's records and copy them from the preprocessed store to local scratch.

The store may sit behind a slow mount or an object store (s3://...); training reads every patch
many times, so it reads a local copy instead. The copy is laid out as `ctseg.store` describes
(the scratch layout) in one of two formats:

- ``zarr``: the store's files, byte for byte (compressed, smallest on disk);
- ``raw``: uncompressed ``.npy`` files that the loader reads through memmap, with no codec work.

Guarantees, so a staged directory can be trusted without looking inside it:

- Every record is written into a temporary sibling, verified (each file's size and sha256
  recomputed from disk and compared with what was read from the source), then renamed to
  ``<dest>/<id>/``. ``<dest>/manifest.json`` is written (atomically) only after every record is
  in place, so its presence means the whole subset is staged.
- A rerun skips records whose own manifest matches the format and the source fingerprint and
  whose files pass verification, so it copies nothing. Verification is ``"sha256"`` by default:
  it rereads the local copy once (local disk at 1-2 GB/s per core, far cheaper than the copy it
  guards, and the only way to see a same-size corruption). ``"size"`` only stats the files, for
  very large scratch sets where a rerun must be instant; it still catches deleted and truncated
  files, which is what an interrupted copy or a scratch cleaner leaves behind.
- The source fingerprint hashes each source file's relative path and size plus the full text of
  every ``zarr.json`` (shape, codecs, attributes such as ``source_sha256``), so re-converting or
  recomputing targets upstream re-stages the record. It does not name the source URL: moving the
  same store from disk to S3 does not force a copy.
- Each source store is checked complete from its listing before anything is copied: a chunk
  that its writer recorded (`ctseg.chunks`) and the listing lacks is an error naming the store
  and the chunk, where zarr would have read zeros (a partial upload or sync).
- Temporaries from a killed run are removed at the start of the next one, under an exclusive
  lock on ``<dest>`` that also refuses a second concurrent staging run into the same directory.
- The bytes needed are computed before anything is written and checked against free space.

The raw format is decoded slab by slab (one chunk row along the first axis, capped at
`SLAB_BYTES`) and each ``.npy`` is written sequentially behind the header that
``np.lib.format.open_memmap`` would write. Writing in file order, rather than through a memmap,
lets the sha256 be taken from the decoded source data as it streams past, so the check after
writing compares the disk against the source and not against itself.

Records in ``dest`` that are not in ``ids`` (from an earlier, larger subset) are left alone and
are not listed in the manifest; the manifest's ``ids`` are what was staged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import fsspec
import numpy as np

from ctseg import chunks
from ctseg.io import (
    TEMP_NAME,
    CtsegError,
    atomic_path,
    check_free_space,
    check_id,
    disk_full_is_an_error,
    remove_path,
    sha256_file,
    strict_json,
)
from ctseg.layout import SCRATCH_FORMATS, RawFile, npy_header, raw_files, raw_meta
from ctseg.progress import Progress
from ctseg.store import TARGET_VOLUMES, open_checked

VERIFY_MODES = ("size", "sha256")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
TARGET_ARRAYS = (*TARGET_VOLUMES, "fg_locations")
# Memory for one decoded slab of one output file; a slab is normally one chunk row deep, and
# only planes wider than this budget allows are read in thinner slabs (decoding chunks twice).
SLAB_BYTES = 64 << 20
# Small files are fetched in batches, which async filesystems (s3fs) run concurrently; this
# hides per-request latency without holding more than this many bytes in memory.
BATCH_BYTES = 32 << 20
BATCH_FILES = 256
STREAM_BLOCK = 8 << 20
# `check_staged` rereads files up to this size (metadata, zarr.json) for their sha256; larger
# ones are only checked for presence and size, so the check costs a stat per file.
CHEAP_HASH_BYTES = 64 << 10
# What repairs a damaged scratch copy: staging again, which keeps what still verifies.
STAGE_FIX = (
    "restage it with `snakemake -R stage` (with stage: per_job, rerun the training job, which "
    "stages its own copy)"
)

Format = Literal["raw", "zarr"]
Verify = Literal["size", "sha256"]


def expand_scratch(path: str) -> Path:
    """Expand $VARS and ~ in the configured scratch path; an unset variable is an error."""
    expanded = os.path.expanduser(os.path.expandvars(str(path)))
    unset = re.findall(r"\$\{?(\w+)\}?", expanded)
    if unset:
        raise CtsegError(
            f"scratch: {path!r} uses unset environment variable(s) {sorted(set(unset))}"
        )
    if not expanded.strip():
        raise CtsegError("scratch: empty path")
    return Path(expanded)


# --------------------------------------------------------------------------- source scanning


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str  # in the source filesystem
    rel: str  # in the record directory: image.zarr/... or targets.zarr/...
    size: int


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk0: int  # chunk (or shard) extent along the first axis


@dataclasses.dataclass(frozen=True)
class SourceRecord:
    id: str
    image_url: str
    targets_url: str
    files: tuple[SourceFile, ...]
    image: ArrayInfo
    targets: Mapping[str, ArrayInfo]
    attributes: Mapping[str, Any]
    target_attributes: Mapping[str, Any]
    fingerprint: str


def _scan_record(fs: Any, root: str, source: str, record_id: str) -> SourceRecord:
    parts = {
        "image.zarr": f"zarr/images/{record_id}.zarr",
        "targets.zarr": f"targets/{record_id}.zarr",
    }
    files = [f for local, rel in parts.items() for f in _list_store(fs, root, source, local, rel)]
    texts = _read_metadata(fs, source, files)
    image_url, targets_url = (_join(source, rel) for rel in parts.values())
    image = _array_info(texts, "image.zarr", image_url)
    targets = {
        name: _array_info(texts, f"targets.zarr/{name}", f"{targets_url}/{name}")
        for name in TARGET_ARRAYS
    }
    _check_shapes(image_url, targets_url, image, targets)
    _check_chunks(files, texts, {"image.zarr": image_url, "targets.zarr": targets_url})
    return SourceRecord(
        id=record_id,
        image_url=image_url,
        targets_url=targets_url,
        files=tuple(files),
        image=image,
        targets=targets,
        attributes=json.loads(texts["image.zarr"]).get("attributes", {}),
        target_attributes=_group_attributes(texts, "targets.zarr", targets_url),
        fingerprint=_fingerprint(files, texts),
    )


def _join(source: str, rel: str) -> str:
    return f"{source.rstrip('/')}/{rel}"


def _list_store(fs: Any, root: str, source: str, local: str, rel: str) -> list[SourceFile]:
    """Every file of one zarr store, named as it will be under the record directory."""
    base = f"{root}/{rel}"
    try:
        listing = fs.find(base, detail=True)
    except OSError as exc:
        raise CtsegError(f"{_join(source, rel)}: cannot be listed: {exc}") from exc
    if f"{base}/zarr.json" not in listing:
        raise CtsegError(
            f"{_join(source, rel)}: not found (no zarr.json); "
            "run precompute_targets first or check `source`"
        )
    files = []
    for path, info in sorted(listing.items()):
        if not path.startswith(f"{base}/"):
            raise CtsegError(f"{_join(source, rel)}: listing returned {path!r}, outside the store")
        files.append(SourceFile(path, f"{local}/{path[len(base) + 1 :]}", int(info["size"])))
    return files


def _read_metadata(fs: Any, source: str, files: Sequence[SourceFile]) -> dict[str, bytes]:
    """The text of every zarr.json, keyed by node: "image.zarr", "targets.zarr/sdt", ..."""
    wanted = {f.path: f.rel for f in files if f.rel.endswith("/zarr.json")}
    try:
        texts = fs.cat(list(wanted))
    except OSError as exc:
        raise CtsegError(f"{source}: cannot read zarr metadata: {exc}") from exc
    return {rel[: -len("/zarr.json")]: bytes(texts[path]) for path, rel in wanted.items()}


def _group_attributes(texts: Mapping[str, bytes], node: str, url: str) -> dict[str, Any]:
    try:
        return dict(json.loads(texts[node]).get("attributes", {}))
    except (KeyError, ValueError, AttributeError) as exc:
        raise CtsegError(
            f"{url}/zarr.json: missing or unreadable group metadata ({exc!r})"
        ) from exc


def _array_info(texts: Mapping[str, bytes], node: str, url: str) -> ArrayInfo:
    try:
        meta = json.loads(texts[node])
    except KeyError:
        raise CtsegError(f"{url}: missing (no zarr.json)") from None
    except ValueError as exc:
        raise CtsegError(f"{url}/zarr.json: not valid JSON: {exc}") from exc
    if meta.get("node_type") != "array":
        raise CtsegError(f"{url}: not a zarr array")
    try:
        shape = tuple(int(s) for s in meta["shape"])
        data_type = meta["data_type"]
        dtype = np.dtype(data_type if isinstance(data_type, str) else data_type["name"])
        chunk0 = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CtsegError(f"{url}/zarr.json: unreadable array metadata ({exc!r})") from exc
    return ArrayInfo(shape, dtype, max(chunk0, 1))


def _check_shapes(
    image_url: str, targets_url: str, image: ArrayInfo, targets: Mapping[str, ArrayInfo]
) -> None:
    if len(image.shape) != 3:
        raise CtsegError(f"{image_url}: {len(image.shape)}D, expected a 3D volume")
    for name in TARGET_VOLUMES:
        if targets[name].shape != image.shape:
            raise CtsegError(
                f"{targets_url}/{name}: shape {targets[name].shape} differs from the image's "
                f"{image.shape}"
            )
    locations = targets["fg_locations"].shape
    if len(locations) != 2 or locations[1] != 3:
        raise CtsegError(f"{targets_url}/fg_locations: shape {locations}, expected N x 3")


def _check_chunks(
    files: Sequence[SourceFile], texts: Mapping[str, bytes], urls: Mapping[str, str]
) -> None:
    """Refuse a source store that lacks a chunk its writer wrote (`ctseg.chunks`), from the
    listing already made: a partial upload would otherwise be staged, and read, as zeros."""
    rels = {f.rel: f.size for f in files}
    for node, text in sorted(texts.items()):
        meta = json.loads(text)
        if meta.get("node_type") != "array":
            continue
        store, _, inner = node.partition("/")
        problem = chunks.problem(urls[store], inner, meta, chunks.chunk_files(rels, node))
        if problem is not None:
            raise CtsegError(problem)


def _fingerprint(files: Sequence[SourceFile], texts: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.rel}\0{f.size}\n".encode())
    for node in sorted(texts):
        digest.update(node.encode() + b"\0" + texts[node])
    return digest.hexdigest()


# --------------------------------------------------------------------------- planning


def _raw_files(record: SourceRecord) -> tuple[RawFile, ...]:
    return raw_files(record.image, record.targets)


def _meta_json(record: SourceRecord) -> bytes:
    # The record of the chunks written describes the zarr store's files, not the .npy copies.
    attributes = {k: v for k, v in record.attributes.items() if k != chunks.RECORD}
    return raw_meta(attributes, record.target_attributes, record.image.shape, record.image.dtype)


def _bytes_needed(record: SourceRecord, fmt: Format) -> int:
    if fmt == "zarr":
        return sum(f.size for f in record.files)
    return sum(f.size for f in _raw_files(record)) + len(_meta_json(record))


# --------------------------------------------------------------------------- writing


class _Progress:
    """A thread-safe byte counter feeding one progress bar on stderr."""

    def __init__(self, total: int, n_records: int) -> None:
        self._lock = threading.Lock()
        self._n_records = n_records
        self._done = 0
        self.bar = Progress(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="stage",
            mininterval=0.5,
            disable=n_records == 0,
        )
        self.bar.set_postfix_str(f"records 0/{n_records}")

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bar.update(n)

    def record_done(self) -> None:
        with self._lock:
            self._done += 1
            self.bar.set_postfix_str(f"records {self._done}/{self._n_records}")

    def close(self) -> None:
        self.bar.close()


class _HashingWriter:
    """Writes a file while hashing exactly the bytes handed to it (the source's bytes)."""

    def __init__(self, path: Path, progress: _Progress) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._digest = hashlib.sha256()
        self._progress = progress
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._handle.write(data)
        self._digest.update(data)
        self.size += len(data)
        self._progress.add_bytes(len(data))

    def close(self) -> str:
        self._handle.close()
        return self._digest.hexdigest()


def _write_file(
    path: Path, rel: str, chunks: Iterable[bytes | memoryview], progress: _Progress
) -> dict:
    writer = _HashingWriter(path, progress)
    try:
        for chunk in chunks:
            writer.write(chunk)
    finally:
        digest = writer.close()
    return {"path": rel, "size": writer.size, "sha256": digest}


def _copy_zarr(fs: Any, record: SourceRecord, tmp: Path, progress: _Progress) -> list[dict]:
    """Copy the record's store files as they are, batching small ones into one request each."""
    entries = []
    small = [f for f in record.files if f.size <= STREAM_BLOCK]
    for batch in _batches(small):
        contents = fs.cat([f.path for f in batch])
        for f in batch:
            entries.append(_write_file(tmp / f.rel, f.rel, [contents[f.path]], progress))
    for f in (f for f in record.files if f.size > STREAM_BLOCK):
        with fs.open(f.path, "rb") as handle:
            blocks = iter(lambda h=handle: h.read(STREAM_BLOCK), b"")
            entries.append(_write_file(tmp / f.rel, f.rel, blocks, progress))
    by_rel = {f.rel: f.size for f in record.files}
    for entry in entries:
        if entry["size"] != by_rel[entry["path"]]:
            raise CtsegError(
                f"{record.image_url}: {entry['path']} read {entry['size']} bytes but the "
                f"listing said {by_rel[entry['path']]}; did the source change while staging?"
            )
    return sorted(entries, key=lambda e: e["path"])


def _batches(files: Sequence[SourceFile]) -> Iterator[list[SourceFile]]:
    batch: list[SourceFile] = []
    size = 0
    for f in files:
        if batch and (size + f.size > BATCH_BYTES or len(batch) >= BATCH_FILES):
            yield batch
            batch, size = [], 0
        batch.append(f)
        size += f.size
    if batch:
        yield batch


def _open_zarr(url: str, storage_options: Mapping) -> Any:
    # Each chunk's bytes are checked against the source's record as they are decoded.
    return open_checked(url, storage_options)


def _slab_depth(shape: Sequence[int], chunk0: int, bytes_per_item: int) -> int:
    plane = max(math.prod(shape[1:]) * bytes_per_item, 1)
    return max(1, min(chunk0, SLAB_BYTES // plane))


def _slabs(arrays: Sequence[Any], depth: int, combine: Callable) -> Iterator[memoryview]:
    # Each slab is whole rows along axis 0, so writing them in order produces C order.
    for start in range(0, arrays[0].shape[0], depth):
        block = combine([a[start : start + depth] for a in arrays])
        yield memoryview(np.ascontiguousarray(block)).cast("B")


def _write_npy(path: Path, spec: RawFile, arrays: Sequence[Any], progress: _Progress) -> dict:
    bytes_per_item = sum(a.dtype.itemsize for a in arrays) + spec.dtype.itemsize
    depth = _slab_depth(spec.shape, spec.chunk0, bytes_per_item)
    header = npy_header(spec.shape, spec.dtype)
    body = _slabs(arrays, depth, lambda blocks: np.asarray(spec.combine(blocks), spec.dtype))
    entry = _write_file(path, path.name, itertools.chain([header], body), progress)
    if entry["size"] != spec.size:
        raise CtsegError(
            f"{path.name}: came out {entry['size']} bytes, expected {spec.size}; "
            "the source arrays do not match their metadata"
        )
    return entry


def _stage_raw(
    record: SourceRecord, tmp: Path, storage_options: Mapping, progress: _Progress
) -> list[dict]:
    """Decode the record slab by slab into uncompressed .npy files, never the whole volume."""
    targets = _open_zarr(record.targets_url, storage_options)
    arrays = {
        "image": _open_zarr(record.image_url, storage_options),
        **{name: targets[name] for name in TARGET_ARRAYS},
    }
    entries = [
        _write_npy(tmp / spec.name, spec, [arrays[n] for n in spec.inputs], progress)
        for spec in _raw_files(record)
    ]
    entries.append(_write_file(tmp / "meta.json", "meta.json", [_meta_json(record)], progress))
    return entries


# --------------------------------------------------------------------------- verification


def _verify(directory: Path, entries: Sequence[Mapping], check_sha256: bool) -> str | None:
    """None when every file matches its entry, else what is wrong with the first that does not."""
    for entry in entries:
        path = directory / entry["path"]
        try:
            size = path.stat().st_size
        except OSError:
            return f"{entry['path']} is missing"
        if size != entry["size"]:
            return f"{entry['path']} has {size} bytes, the manifest says {entry['size']}"
        if check_sha256 and sha256_file(path) != entry["sha256"]:
            return f"{entry['path']} does not match its sha256"
    return None


def _current_entries(
    record_dir: Path, record: SourceRecord, fmt: Format, verify: Verify
) -> list[dict] | None:
    """The staged record's manifest entries if it can be kept as it is, else None."""
    try:
        manifest = json.loads((record_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if (
        manifest.get("version") != MANIFEST_VERSION
        or manifest.get("format") != fmt
        or manifest.get("fingerprint") != record.fingerprint
    ):
        return None
    entries = manifest.get("files", [])
    if _verify(record_dir, entries, check_sha256=verify == "sha256") is not None:
        return None
    return entries


def check_staged(scratch: Path, ids: Sequence[str], fix: str = STAGE_FIX) -> dict:
    """Check, cheaply, that `scratch` still holds the staged copy of `ids` its manifest lists.

    Training reads the scratch copy through memmaps in loader workers, where a deleted or
    truncated file ends in a long traceback, again on every rerun, since nothing upstream
    looks stale to Snakemake. This check runs before the loader is built: every file listed
    for `ids` must exist with its recorded size, and files up to `CHEAP_HASH_BYTES` (the
    metadata) must match their sha256. Bulk data is not reread; `stage_records` does that.
    Raises `CtsegError` naming the first bad file and `fix`; returns the top manifest.
    """
    scratch = Path(scratch)
    path = scratch / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        staged_ids = set(manifest["ids"])
    except FileNotFoundError:
        raise CtsegError(f"{path}: missing: nothing is staged in {scratch}; {fix}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CtsegError(f"{path}: unreadable staging manifest ({exc}); {fix}") from exc
    absent = sorted(set(ids) - staged_ids)
    if absent:
        raise CtsegError(f"{path}: record(s) {absent} are not staged here; {fix}")
    wanted = set(ids)
    for entry in files:
        record_id = entry["path"].split("/", 1)[0]
        if record_id not in wanted:
            continue
        problem = _verify(scratch, [entry], check_sha256=False)
        if problem is None and entry["size"] <= CHEAP_HASH_BYTES:
            problem = _verify(scratch, [entry], check_sha256=True)
        if problem is not None:
            raise CtsegError(f"{scratch / entry['path']}: staged copy damaged: {problem}; {fix}")
    for record_id in ids:
        if not (scratch / record_id / MANIFEST).is_file():
            raise CtsegError(f"{scratch / record_id / MANIFEST}: missing; {fix}")
    return manifest


def _write_json(path: Path, payload: Mapping) -> None:
    path.write_text(strict_json(payload, indent=2) + "\n")


# --------------------------------------------------------------------------- the stage step


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock on `dest` itself; the kernel drops it if the process dies."""
    fd = os.open(dest, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise CtsegError(f"{dest}: another staging run is writing here") from exc
        yield
    finally:
        os.close(fd)


def _remove_stale_temps(dest: Path) -> int:
    # Only called under the lock, so no living run owns these: a killed run's temporary record
    # directories, and the lock files `atomic_path` took beside them.
    stale = [p for p in dest.iterdir() if TEMP_NAME.match(p.name) or _lock_file(p)]
    for path in stale:
        remove_path(path)
    return len(stale)


def _lock_file(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".lock") and path.is_file()


def _check_args(ids: Sequence[str], fmt: str, verify: str, workers: int, reserve: int) -> list:
    if fmt not in SCRATCH_FORMATS:
        raise CtsegError(f"scratch_format: expected one of {SCRATCH_FORMATS}, got {fmt!r}")
    if verify not in VERIFY_MODES:
        raise CtsegError(f"verify: expected one of {VERIFY_MODES}, got {verify!r}")
    if workers < 1:
        raise CtsegError(f"workers: expected at least 1, got {workers}")
    if reserve < 0:
        raise CtsegError(f"reserve_bytes: expected >= 0, got {reserve}")
    ids = [check_id(i, "stage ids") for i in ids]
    if not ids:
        raise CtsegError("stage: no ids to stage")
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise CtsegError(f"stage ids: duplicate id(s) {duplicated}")
    if MANIFEST in ids:
        raise CtsegError(f"stage ids: {MANIFEST!r} is reserved for the manifest")
    return ids


def _stage_one(
    fs: Any,
    record: SourceRecord,
    dest: Path,
    fmt: Format,
    source: str,
    storage_options: Mapping,
    progress: _Progress,
) -> list[dict]:
    # The copy keeps the source's zarr.json byte for byte, with the source's chunk record.
    with atomic_path(dest / record.id, record_chunks=False) as tmp:
        tmp.mkdir()
        if fmt == "zarr":
            entries = _copy_zarr(fs, record, tmp, progress)
        else:
            entries = _stage_raw(record, tmp, storage_options, progress)
        # The digests above are of the bytes read from the source; reread what landed on disk.
        problem = _verify(tmp, entries, check_sha256=True)
        if problem is not None:
            raise CtsegError(f"{dest / record.id}: verification after copy failed: {problem}")
        manifest = {
            "version": MANIFEST_VERSION,
            "id": record.id,
            "format": fmt,
            "source": source,
            "fingerprint": record.fingerprint,
            "files": entries,
        }
        _write_json(tmp / MANIFEST, manifest)
    progress.record_done()
    return entries


def _open_source(source: str, storage_options: Mapping) -> tuple[Any, str]:
    try:
        fs, root = fsspec.core.url_to_fs(source, **storage_options)
    except (ValueError, ImportError, TypeError) as exc:
        raise CtsegError(f"source: cannot open {source!r}: {exc}") from exc
    # A long-lived process may hold listings from before the source changed.
    fs.invalidate_cache()
    return fs, root.rstrip("/")


def _run_all(function: Callable, items: Sequence, workers: int) -> list:
    """`function` over `items` in threads, results in order; the first error cancels the rest."""
    if workers == 1 or len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def stage_records(
    source: str,
    ids: Sequence[str],
    dest: Path,
    *,
    fmt: Format = "raw",
    storage_options: Mapping | None = None,
    reserve_bytes: int = 0,
    workers: int = 4,
    verify: Verify = "sha256",
) -> dict:
    """Copy images and targets of `ids` from `source` (a local dir or any fsspec URL such as
    s3://bucket/prefix) into `dest` in the scratch layout.

    Records already staged in `fmt` from an unchanged source, and passing `verify`, are kept.
    Returns a summary: bytes_copied, files_copied, records_copied, records_skipped, seconds,
    bytes_needed, stale_temps_removed, format, dest.
    """
    started = time.perf_counter()
    ids = _check_args(ids, fmt, verify, workers, reserve_bytes)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise CtsegError(f"{dest}: exists and is not a directory")
    storage_options = dict(storage_options or {})
    source = str(source)
    fs, root = _open_source(source, storage_options)
    records = _run_all(lambda i: _scan_record(fs, root, source, i), ids, workers)

    with contextlib.ExitStack() as stack:
        stale = 0
        if dest.exists():
            stack.enter_context(_locked(dest))
            stale = _remove_stale_temps(dest)
        current = _run_all(
            lambda r: _current_entries(dest / r.id, r, fmt, verify) if dest.exists() else None,
            records,
            workers,
        )
        todo = [r for r, entries in zip(records, current, strict=True) if entries is None]
        needed = sum(_bytes_needed(r, fmt) for r in todo)
        check_free_space(dest, needed, "stage", reserve_bytes)
        if not dest.exists():
            dest.mkdir(parents=True)
            stack.enter_context(_locked(dest))
        if todo:
            # The old manifest would claim a complete copy while records are being replaced.
            (dest / MANIFEST).unlink(missing_ok=True)
        progress = _Progress(needed, len(todo))
        stack.callback(progress.close)
        # The space check above can be beaten by other writers on the same disk; a record that
        # runs out of space is removed (atomic_path), and the records before it are kept.
        with disk_full_is_an_error(dest, "staging"):
            staged = _run_all(
                lambda r: _stage_one(fs, r, dest, fmt, source, storage_options, progress),
                todo,
                workers,
            )
            by_id = {r.id: e for r, e in zip(records, current, strict=True) if e is not None}
            by_id.update({r.id: e for r, e in zip(todo, staged, strict=True)})
            _write_top_manifest(dest, records, by_id, fmt, source, verify)

    copied = [e for entries in staged for e in entries]
    return {
        "bytes_copied": sum(e["size"] for e in copied),
        "files_copied": len(copied),
        "records_copied": len(todo),
        "records_skipped": len(records) - len(todo),
        "bytes_needed": needed,
        "stale_temps_removed": stale,
        "seconds": time.perf_counter() - started,
        "format": fmt,
        "dest": str(dest),
    }


def _write_top_manifest(
    dest: Path,
    records: Sequence[SourceRecord],
    entries_by_id: Mapping[str, Sequence[Mapping]],
    fmt: Format,
    source: str,
    verify: Verify,
) -> None:
    files = [
        {**entry, "path": f"{r.id}/{entry['path']}"}
        for r in records
        for entry in entries_by_id[r.id]
    ]
    manifest = {
        "version": MANIFEST_VERSION,
        "format": fmt,
        "source": source,  # never the storage options: they may hold credentials
        "ids": [r.id for r in records],
        "verify": verify,
        "bytes": sum(f["size"] for f in files),
        "records": {r.id: {"fingerprint": r.fingerprint} for r in records},
        "files": files,
    }
    with atomic_path(dest / MANIFEST) as tmp:
        _write_json(tmp, manifest)


def staged_fingerprints(scratch: Path, ids: Sequence[str]) -> dict[str, str]:
    """Each staged record's source fingerprint, from its own manifest under `scratch`.

    This is what training's run identity uses as "the data": it changes when the record is
    re-converted or its targets are recomputed upstream, not when the scratch format changes.
    """
    found: dict[str, str] = {}
    for record_id in ids:
        path = Path(scratch) / record_id / MANIFEST
        try:
            found[record_id] = str(json.loads(path.read_text())["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CtsegError(
                f"{path}: staged record {record_id!r} has no readable manifest ({exc}); "
                "stage the experiment again (snakemake -R stage)"
            ) from exc
    return found
