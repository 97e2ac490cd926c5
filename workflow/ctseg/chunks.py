"""The chunks a zarr store's writer wrote, recorded so that a reader tells a lost chunk from an
empty one.

zarr reads a chunk whose file is absent as the fill value: a store that lost chunk files (a
partial copy, an interrupted rsync or S3 sync) reads as zeros there, without an error. A chunk
file cut short is no better: blosc decodes a truncated buffer into garbage, again without an
error. So every array a ctseg step writes carries, in its attributes under `RECORD`, its chunk
grid, how many chunks were written and which were left unwritten on purpose (all fill value),
as runs of linear chunk indices in C order, and the total bytes of its chunk files with a
digest of each one's size (`sizes`), so that a chunk file of another size is found too.
It also holds the crc32c of every chunk file's bytes, by position (`DIGESTS`: 8 hex digits per
chunk of the grid, in C order), so that a chunk file of the right size is checked too: bytes
flipped in place, a damaged compressed chunk, or another chunk's file in its place (two files
of one size swapped). The readers check each chunk's bytes against the digest of its own
position as they read it (`ctseg.store.CheckedStore`, `digest_problem`), before a decompressor
sees them.
`ctseg.io.atomic_path` writes the record (`record_stores`) once the step's block has finished,
just before the store is renamed into place, so it describes exactly what the step wrote.
Readers (`ctseg.store`'s open functions; `ctseg.preprocess.stage` for a source, local or
s3://) list the chunk files present with their sizes and compare (`problem`).

A store whose record has no digests (written by ctseg before they were recorded) is refused
with the command that writes it again. A store without any record (made by another tool), or
whose record describes another grid, is read only when every chunk of its grid is present:
there a lost chunk cannot be told from one left empty on purpose, and its chunks' bytes cannot
be checked.

A chunk here is a storage object: with sharding, a shard (``chunk_grid`` in zarr v3 metadata
is the shard grid). Pure metadata and file names, so `ctseg.io` can use it without zarr.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import google_crc32c

RECORD = "chunks_written"
DIGESTS = "crc32c"
METADATA = "zarr.json"
DIGEST_CHARS = 8  # a crc32c in hex
ABSENT_DIGEST = "-" * DIGEST_CHARS  # a position the writer left unwritten
# The stores of a staged record (`ctseg.layout`'s zarr scratch format): copies, made again by
# staging, not by the step that wrote their source.
SCRATCH_STORES = ("image.zarr", "targets.zarr")


def grid_shape(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """Chunks (or shards) per axis of an array's regular chunk grid."""
    shape = [int(s) for s in meta["shape"]]
    chunk_shape = [int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"]]
    return tuple(-(-s // max(c, 1)) for s, c in zip(shape, chunk_shape, strict=True))


def chunk_key(meta: Mapping[str, Any], coords: Sequence[int]) -> str:
    """The storage key of the chunk at `coords`, relative to the array (``c/0/1/2``)."""
    encoding = meta.get("chunk_key_encoding") or {"name": "default"}
    name = encoding.get("name", "default")
    config = encoding.get("configuration") or {}
    if name == "v2":
        separator = config.get("separator", ".")
        return separator.join(str(c) for c in coords) if coords else "0"
    separator = config.get("separator", "/")
    return separator.join(["c", *(str(c) for c in coords)])


def _keys(meta: Mapping[str, Any]) -> Iterator[str]:
    """Every chunk key of the grid, in C order (the linear index order of the record)."""
    for coords in itertools.product(*(range(n) for n in grid_shape(meta))):
        yield chunk_key(meta, coords)


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """Sorted indices as [start, stop) runs: an empty background region is a few numbers."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def record_for(
    meta: Mapping[str, Any], present: Mapping[str, int], digests: Mapping[str, str]
) -> dict[str, Any]:
    """The record of an array whose chunk files are `present` (keys relative to the array,
    and their sizes in bytes), with `digests` the crc32c (`chunk_digest`) of each one."""
    absent = [i for i, key in enumerate(_keys(meta)) if key not in present]
    grid = grid_shape(meta)
    sizes = _chunk_sizes(meta, present)
    return {
        "grid": list(grid),
        "written": math.prod(grid) - len(absent),
        "absent": _runs(absent),
        "bytes": sum(sizes.values()),
        "sizes": sizes_digest(sizes),
        DIGESTS: "".join(digests[key] if key in sizes else ABSENT_DIGEST for key in _keys(meta)),
    }


def chunk_digest(data: bytes | memoryview | Any) -> str:
    """The crc32c of a chunk file's bytes (anything with the buffer protocol), as 8 hex digits:
    hardware crc32c, several GB/s, so checking every chunk read costs little beside decoding.
    google_crc32c takes only read-only buffers: others are copied, at memory speed."""
    return f"{google_crc32c.value(data if isinstance(data, bytes) else bytes(data)):08x}"


def expected_digests(meta: Mapping[str, Any], node: str = "") -> dict[str, str | None] | None:
    """{chunk key relative to the store: its recorded crc32c, or None where the writer left the
    position unwritten}, for the array at `node`; None when the record holds no digests (or
    describes another grid)."""
    record = (meta.get("attributes") or {}).get(RECORD) or {}
    digests = record.get(DIGESTS) if _valid_record(meta) else None
    if not isinstance(digests, str) or len(digests) != DIGEST_CHARS * math.prod(grid_shape(meta)):
        return None
    prefix = f"{node}/" if node else ""
    expected: dict[str, str | None] = {}
    for i, key in enumerate(_keys(meta)):
        digest = digests[i * DIGEST_CHARS : (i + 1) * DIGEST_CHARS]
        expected[prefix + key] = None if digest == ABSENT_DIGEST else digest
    return expected


def recreate_fix(store: str) -> str:
    """How to write `store` again: a staged copy by staging, any other by its own step."""
    if PurePosixPath(str(store).rstrip("/")).name in SCRATCH_STORES:
        return (
            "stage the records again (snakemake -R stage; with stage: per_job, rerun the "
            "training job)"
        )
    return f"re-create the store: snakemake --force {store} (or rerun the ctseg step that wrote it)"


def digest_problem(store: str, key: str, expected: str | None, data: Any) -> str | None:
    """One line when chunk `key`'s bytes `data` (None: no file) are not those its writer wrote
    at that position (`expected`, None: it wrote none there), else None."""
    if data is None and expected is None:
        return None
    if data is None:
        found = "is missing (zarr would read it as zeros)"
    elif expected is None:
        found = "holds data where its writer wrote none (another chunk's file put there?)"
    else:
        got = chunk_digest(data)
        if got == expected:
            return None
        found = (
            f"does not hold the bytes written there (crc32c {got}, {expected} recorded): "
            "damaged, or another chunk's file in its place"
        )
    return f"{store}: chunk {key} {found}; {recreate_fix(store)}"


def _chunk_sizes(meta: Mapping[str, Any], present: Mapping[str, int]) -> dict[str, int]:
    """The sizes of the grid's chunk files among `present`: other files in the array's folder
    (Snakemake's ``.snakemake_timestamp`` in a directory output) are not chunks."""
    return {key: int(present[key]) for key in _keys(meta) if key in present}


def sizes_digest(present: Mapping[str, int]) -> str:
    """A digest of every chunk file's key and size: equal only for the same files and sizes."""
    digest = hashlib.sha256()
    for key in sorted(present):
        digest.update(f"{key}\0{int(present[key])}\n".encode())
    return digest.hexdigest()[:32]


def _valid_record(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    record = (meta.get("attributes") or {}).get(RECORD)
    try:
        if [int(n) for n in record["grid"]] != list(grid_shape(meta)):
            return None
        absent = bytearray(math.prod(grid_shape(meta)))
        for start, stop in record["absent"]:
            absent[int(start) : int(stop)] = b"\x01" * (int(stop) - int(start))
        if len(absent) != math.prod(grid_shape(meta)):
            return None
        return {"written": int(record["written"]), "absent": absent}
    except (TypeError, KeyError, ValueError):
        return None


def missing_chunks(meta: Mapping[str, Any], present: Collection[str]) -> tuple[list[str], bool]:
    """The keys of chunks that should be there and are not, and whether a record said so.

    With a valid record, a chunk is expected unless the record lists it as left unwritten;
    without one, every chunk of the grid is expected.
    """
    record = _valid_record(meta)
    absent = record["absent"] if record else bytearray(math.prod(grid_shape(meta)))
    missing = [key for i, key in enumerate(_keys(meta)) if not absent[i] and key not in present]
    return missing, record is not None


def problem(store: str, node: str, meta: Mapping[str, Any], present: Collection[str]) -> str | None:
    """One line naming `store` and its first missing chunk, or None when none is missing.

    `node` is the array's path inside the store ("" for a store that is one array), `present`
    its chunk files, relative to the array."""
    missing, recorded = missing_chunks(meta, present)
    if not missing:
        return _size_problem(store, meta, present) or undigested_problem(store, meta)
    chunk = f"{node}/{missing[0]}" if node else missing[0]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    if recorded:
        written = _valid_record(meta)["written"]  # type: ignore[index]
        return (
            f"{store}: chunk {chunk} is missing{more}: {len(missing)} of the {written} chunks "
            "written to this store are gone (a partial copy or sync?), and zarr would read them "
            "as zeros; copy the store again, or rerun the step that writes it"
        )
    return (
        f"{store}: chunk {chunk} is missing{more}, and the store has no record of the chunks "
        f"written to it ('{RECORD}' in its attributes), so a lost chunk cannot be told from an "
        "empty one; write the store again with the ctseg step that makes it"
    )


def _size_problem(store: str, meta: Mapping[str, Any], present: Collection[str]) -> str | None:
    """One line when the chunk files' sizes are not those written (a file cut short or
    replaced), or None; None too where the sizes are unknown (a listing without them, or a
    record written before sizes were recorded)."""
    record = (meta.get("attributes") or {}).get(RECORD) or {}
    if not isinstance(present, Mapping) or "sizes" not in record:
        return None
    sizes = _chunk_sizes(meta, present)
    if sizes_digest(sizes) == record["sizes"]:
        return None
    found, written = sum(sizes.values()), record.get("bytes")
    return (
        f"{store}: its chunk files hold {found} bytes where {written} were written: a chunk "
        "file was cut short or replaced (a partial copy or sync?), and zarr would read it as "
        "garbage; copy the store again, or rerun the step that writes it"
    )


def undigested_problem(store: str, meta: Mapping[str, Any]) -> str | None:
    """One line for a store whose record holds no chunk digests (a ctseg store written before
    they were recorded), whose chunks' bytes could not be checked as they are read."""
    if _valid_record(meta) is None or expected_digests(meta) is not None:
        return None
    return (
        f"{store}: written by an older ctseg that recorded no digest of each chunk "
        f"('{DIGESTS}' in '{RECORD}'), so a damaged or misplaced chunk could not be found as it "
        f"is read; {recreate_fix(store)}"
    )


# --------------------------------------------------------------------------- a local directory


def list_files(root: Path) -> dict[str, int]:
    """Every file under `root`, as a path relative to it with / separators, and its size."""
    found = {}
    for directory, _, names in os.walk(root):
        rel = os.path.relpath(directory, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for name in names:
            found[prefix + name] = os.path.getsize(os.path.join(directory, name))
    return found


def arrays_in(files: Collection[str], read: Any) -> dict[str, dict[str, Any]]:
    """{node: metadata} of every array among `files` (paths relative to a store or a directory
    of stores); `read(rel)` returns the text of one file."""
    nodes = {}
    for rel in sorted(f for f in files if f == METADATA or f.endswith(f"/{METADATA}")):
        try:
            meta = json.loads(read(rel))
        except ValueError:
            continue
        if isinstance(meta, dict) and meta.get("node_type") == "array":
            nodes[rel[: -len(METADATA)].rstrip("/")] = meta
    return nodes


def chunk_files(files: Mapping[str, int], node: str) -> dict[str, int]:
    """The files under array `node` (with their sizes), relative to it, but its metadata."""
    prefix = f"{node}/" if node else ""
    return {
        f[len(prefix) :]: size
        for f, size in files.items()
        if f.startswith(prefix) and f != f"{prefix}{METADATA}"
    }


def record_stores(root: Path) -> int:
    """Write the record into every zarr v3 array under `root` (a store, a group, or a directory
    holding some); returns how many arrays were recorded. Only for a store no one is writing."""
    files = list_files(root)
    nodes = arrays_in(files, lambda rel: (root / rel).read_bytes())
    for node, meta in nodes.items():
        present = chunk_files(files, node)
        folder = root / node if node else root
        digests = {
            key: chunk_digest((folder / key).read_bytes()) for key in _chunk_sizes(meta, present)
        }
        meta.setdefault("attributes", {})[RECORD] = record_for(meta, present, digests)
        path = root / node / METADATA if node else root / METADATA
        path.write_text(json.dumps(meta, indent=2))
    return len(nodes)
