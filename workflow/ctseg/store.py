"""Zarr v3 layout shared by every step: how arrays are created, compressed and opened.

Layout (the results contract), under one root per dataset, ``results/preprocessed/<dataset>/``
(the root a `ctseg.preprocess.stage` source points at):
- ``zarr/images/<id>.zarr`` and ``zarr/labels/<id>.zarr``: one 3D array each,
  attributes ``source``, ``source_sha256``, ``shape``, ``dtype``, ``mean``, ``std``,
  ``p0_5``, ``p99_5`` (of the voxels neither saturated nor in an empty slice:
  ``stats_voxels``, ``stats_left_out``; see `ctseg.preprocess.convert`).
- ``targets/<id>.zarr``: a group with 3D arrays ``ignore``, ``foreground``,
  ``skeleton``, ``tube`` (uint8, 0/1) and ``sdt`` (float16, clipped signed distance, positive
  outside the foreground), all on the label's chunk grid, plus ``fg_locations`` (int32, N x 3,
  z/y/x of sampled foreground voxels).

Every array a step writes carries the record of the chunks written to it (``chunks_written``,
see `ctseg.chunks`), and the open functions here refuse a store that lacks one of them. They
read through `CheckedStore`, which checks each chunk's bytes against the crc32c recorded for its
position as zarr reads them: a damaged chunk, or another chunk's file in its place, is a
`CtsegError` naming the store and the chunk, never data.

The scratch formats a staged record takes (raw .npy or zarr), and the results paths, are
`ctseg.layout`'s: each format's writer beside its reader.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import zarr
import zarr.codecs
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from ctseg import chunks
from ctseg.io import CtsegError

DEFAULT_CODEC: dict[str, Any] = {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}
TARGET_VOLUMES = ("ignore", "foreground", "skeleton", "tube", "sdt")
MASK_BITS = {"foreground": 1, "ignore": 2, "skeleton": 4, "tube": 8}
# Bits 4-7 of the mask byte: a multi-class spec's stored class (0 background, 1..K; K <= 15) of
# each voxel; always 0 for a binary spec. A target store's ``foreground`` array holds the same
# byte's bits 0 and 4-7 (1 + 16 * class on a foreground voxel of a multi-class spec, 1 for a
# binary spec's), so `pack_masks` of the target arrays keeps the class.
CLASS_SHIFT = 4
CLASS_BITS = 0xF0
MAX_CLASSES = 15
# A probability store's attribute naming the weights files it was made with: their sha256
# (`ctseg.training.checkpoint.stored_digest`), in member order for an ensemble. tuned.json
# keeps it, so that `ctseg predict` can tell settings tuned for other weights.
WEIGHTS_ATTRIBUTE = "weights_sha256"


def pack_masks(targets: Mapping[str, np.ndarray]) -> np.ndarray:
    """The four binary targets as one uint8 array of bit flags (`MASK_BITS`), and a multi-class
    spec's class (bits 4-7), which ``foreground`` carries (`CLASS_SHIFT`)."""
    packed = np.zeros(np.shape(targets["foreground"]), np.uint8)
    for name, bit in MASK_BITS.items():
        values = np.asarray(targets[name], np.uint8)
        if name == "foreground":
            packed |= values & np.uint8(bit | CLASS_BITS)
        else:
            packed |= values * np.uint8(bit)
    return packed


def unpack_mask(packed: np.ndarray, name: str) -> np.ndarray:
    return (packed & MASK_BITS[name]) != 0


def make_compressors(codec: Mapping[str, Any] | None) -> Any:
    """Translate the config's codec mapping into zarr v3 compressor objects."""
    spec = dict(DEFAULT_CODEC if codec is None else codec)
    name = spec.pop("name", "blosc")
    if name == "blosc":
        return zarr.codecs.BloscCodec(
            cname=spec.get("cname", "lz4"),
            clevel=int(spec.get("clevel", 5)),
            shuffle=spec.get("shuffle", "shuffle"),
        )
    if name == "zstd":
        return zarr.codecs.ZstdCodec(level=int(spec.get("level", 3)))
    if name == "gzip":
        return zarr.codecs.GzipCodec(level=int(spec.get("level", 5)))
    if name == "none":
        return None
    raise ValueError(f"unknown codec {name!r}; expected blosc, zstd, gzip or none")


def create_volume(
    path: str | Path,
    shape: Sequence[int],
    dtype: Any,
    chunks: Sequence[int],
    codec: Mapping[str, Any] | None = None,
    shards: Sequence[int] | None = None,
    attributes: Mapping[str, Any] | None = None,
    write_empty_chunks: bool = True,
) -> zarr.Array:
    """Create a 3D array store; chunks are clipped to the shape so tiny volumes still work.

    Empty chunks are written by default: zarr's check for all-fill chunks cost 4x the write
    time of dense CT volumes in bench/preprocess.py, and an all-zero lz4 chunk is a few bytes.
    """
    chunks = tuple(min(int(c), int(s)) for c, s in zip(chunks, shape, strict=True))
    shard_shape = None
    if shards is not None:
        # A shard must be a whole number of chunks; round it up to one.
        shard_shape = tuple(
            max(c, (min(int(s), int(n)) // c) * c)
            for s, c, n in zip(shards, chunks, shape, strict=True)
        )
    return zarr.create_array(
        store=str(path),
        shape=tuple(int(s) for s in shape),
        chunks=chunks,
        shards=shard_shape,
        dtype=np.dtype(dtype),
        compressors=make_compressors(codec),
        fill_value=0,
        zarr_format=3,
        attributes=dict(attributes or {}),
        config={"write_empty_chunks": write_empty_chunks},
        overwrite=True,
    )


def create_in_group(
    group: zarr.Group,
    name: str,
    shape: Sequence[int],
    dtype: Any,
    chunks: Sequence[int],
    codec: Mapping[str, Any] | None = None,
) -> zarr.Array:
    chunks = tuple(min(int(c), max(int(s), 1)) for c, s in zip(chunks, shape, strict=True))
    return group.create_array(
        name,
        shape=tuple(int(s) for s in shape),
        chunks=chunks,
        dtype=np.dtype(dtype),
        compressors=make_compressors(codec),
        fill_value=0,
        overwrite=True,
    )


class CheckedStore(WrapperStore[Store]):
    """A store whose chunk reads are checked against the crc32c its writer recorded for each
    chunk's position (`ctseg.chunks.expected_digests`): bytes flipped in place, a damaged
    compressed chunk, or another chunk's file of the same size swapped in are a `CtsegError`
    naming the store (`label`) and the chunk, raised before a decompressor sees the bytes.

    Keys without a recorded digest (metadata, a store without a record) pass through. A read of
    part of a chunk file (a shard's index or one of its inner chunks) checks the whole file the
    first time this store reads it; later partial reads of it are not checked again.
    """

    def __init__(
        self, store: Store, label: str, expected: Mapping[str, str | None] | None = None
    ) -> None:
        super().__init__(store)
        self.label = label
        self._expected: dict[str, str | None] = dict(expected or {})
        self._checked_whole: set[str] = set()

    def _with_store(self, store: Store) -> CheckedStore:
        # zarr may reopen a store (read-only, say): the copy checks what this one checks.
        copy = type(self)(store, self.label)
        copy._expected = self._expected
        return copy

    def expect(self, expected: Mapping[str, str | None]) -> None:
        """Check the chunks at these keys (relative to the store) against these digests."""
        self._expected.update(expected)

    def _check(self, key: str, data: Buffer | None) -> None:
        found = None if data is None else data.as_numpy_array()
        problem = chunks.digest_problem(self.label, key, self._expected[key], found)
        if problem is not None:
            raise CtsegError(problem)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if key not in self._expected:
            return await self._store.get(key, prototype, byte_range)
        if byte_range is None:
            data = await self._store.get(key, prototype)
            self._check(key, data)
            return data
        if key not in self._checked_whole:
            self._check(key, await self._store.get(key, prototype))
            self._checked_whole.add(key)
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)


def open_checked(
    path: str | Path, storage_options: Mapping[str, Any] | None = None, *, listed: bool = True
) -> zarr.Array | zarr.Group:
    """The array or group at `path` (a directory or an fsspec URL such as s3://...), once every
    chunk its writer wrote is found there (`check_complete`), read through a `CheckedStore`
    that checks each chunk's bytes as zarr reads them.

    Without `listed`, the store is not listed up front (a copy verified another way, opened
    once per loader worker): a recorded chunk found missing is then refused as it is read, and
    a store without a record is read as it is."""
    text = str(path)
    if "://" in text:
        inner: Store = FsspecStore.from_url(
            text, storage_options=dict(storage_options or {}), read_only=True
        )
    else:
        inner = LocalStore(text, read_only=True)
    store = CheckedStore(inner, text)
    node = zarr.open(store=store, mode="r")
    if isinstance(node, zarr.Array):
        arrays = {"": node.metadata.to_dict()}
    else:
        arrays = {name: array.metadata.to_dict() for name, array in node.arrays()}
    if listed:
        check_complete(path, arrays, storage_options)
    for name, meta in arrays.items():
        problem = chunks.undigested_problem(text, meta)
        if problem is not None:
            raise CtsegError(problem)
        store.expect(chunks.expected_digests(meta, name) or {})
    return node


def open_volume(path: str | Path) -> zarr.Array:
    """The array at `path` (`open_checked`)."""
    array = open_checked(path)
    if not isinstance(array, zarr.Array):
        raise CtsegError(f"{path}: a zarr group, where an array is expected")
    return array


def open_targets(path: str | Path) -> zarr.Group:
    """The targets group at `path` (`open_checked`), every one of its arrays checked."""
    group = open_checked(path)
    if not isinstance(group, zarr.Group):
        raise CtsegError(f"{path}: a zarr array, where a group of target arrays is expected")
    return group


def check_complete(
    path: str | Path,
    arrays: Mapping[str, Mapping[str, Any]],
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Refuse a store that lacks a chunk its writer wrote (`ctseg.chunks`): zarr would read it as
    zeros. `arrays` maps each array's path inside the store ("" for the store itself) to its
    metadata. Costs one listing of the store's files."""
    files = _stored_files(path, storage_options)
    for node, meta in arrays.items():
        problem = chunks.problem(str(path), node, meta, chunks.chunk_files(files, node))
        if problem is not None:
            raise CtsegError(problem)


def _stored_files(
    path: str | Path, storage_options: Mapping[str, Any] | None = None
) -> dict[str, int]:
    """Every file of the store, relative to it, and its size."""
    text = str(path)
    if "://" not in text:
        return chunks.list_files(Path(text))
    fs, root = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # a long-lived process may hold a listing from before a change
    return {
        f[len(root) + 1 :]: int(info["size"])
        for f, info in fs.find(root, detail=True).items()
        if f.startswith(f"{root}/")
    }
