"""A run's identity and its resumable state: checkpoints, RNG states and the logs beside them.

A checkpoint is resumed only by the run that wrote it (`run_identity`, `resume_state`); one
from another run is set aside, never deleted. Checkpoints are written atomically and refused
up front when the disk cannot hold them (`save_checkpoint`). Each carries a SHA-256 of its
bytes in a trailer after torch's zip archive (`CHECKSUM_TAG`), verified on load: a damaged
checkpoint, or one without the trailer, is set aside and the run resumes from the one before
it (`resume.previous.pt`, kept by every save of `resume.pt`), or starts afresh. The per-step
and per-epoch logs that a resumed run appends to live beside the checkpoint (`append_rows`,
`trim_logs`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctseg.io import CtsegError, atomic_path, check_free_space, disk_full, free_bytes
from ctseg.training.distributed import Ranks

# Experiment keys that cannot change the trained weights: where the data comes from and how it
# is laid out on scratch (the staged data enters the identity by its fingerprints), the
# trials, and what is logged or validated.
NOT_MATHS = {
    "name": None,
    "source": None,
    "scratch_format": None,
    "trial": None,
    "subset": None,
    "split": None,
    "train": ("log_every", "val_batches", "checkpoint_minutes"),
}
# Settings whose null means "off", left out of the identity while null: adding such a setting
# to the schema (its default filled in everywhere) must not make every earlier checkpoint
# another run's. Set, they are part of it like any other setting.
NULL_IS_OFF = {"init_from": None, "train": ("ema",)}
# Optimizer settings that pick a kernel, not an update: a resumed run keeps its own phase's.
SPEED_FLAGS = ("fused", "foreach")

# The trailer after torch's zip archive: the tag, then the SHA-256 (hex) of every byte before
# the tag. torch.load reads the archive from its end record and ignores what follows it. A
# checkpoint without the trailer (cut short, or rewritten by plain torch.save) cannot be
# verified, so it is never loaded: it counts as damaged.
CHECKSUM_TAG = b"\nctseg-sha256:"
TRAILER_BYTES = len(CHECKSUM_TAG) + 64
PREVIOUS = "resume.previous.pt"  # the checkpoint before resume.pt, kept by every save
BEST = "best.pt"  # the best validated weights, beside the checkpoint (`ctseg.training.run_state`)


class DamagedCheckpoint(CtsegError):
    """A checkpoint whose bytes do not match its checksum, or that torch cannot read."""


def run_identity(
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    *,
    data: Mapping[str, str],
    total_steps: int,
    clip_distance: float,
    source_weights: str | None = None,
) -> dict[str, Any]:
    """Everything that determines a run's trained weights, as a JSON-able dict.

    A checkpoint is resumed only by a run with the same identity: the experiment's settings
    that change the maths (``train.ema`` among them), the phase's maths keys (workers or
    prefetch do not change the sample stream, so a preempted run may resume under another
    loader phase), the staged data (each record's role and source fingerprint), the total step
    count and, for a fine-tune, the digest of the weights it starts from (`source_weights`,
    `ctseg.training.finetune.state_digest`): a retrained source makes it another run.
    """
    settings: dict[str, Any] = {}
    for key, value in exp.items():
        dropped = NOT_MATHS.get(key, ())
        if dropped is None or (value is None and key in NULL_IS_OFF):
            continue
        if isinstance(value, Mapping):
            off = NULL_IS_OFF.get(key) or ()
            value = {
                k: v for k, v in value.items() if k not in dropped and not (v is None and k in off)
            }
        settings[key] = value
    maths = {
        "batch_size": int(phase["batch_size"]),
        "accumulate": int(phase.get("accumulate", 1)),
        "precision": phase.get("precision") or "fp32",
        "gpus": int(phase.get("gpus", 1)),
    }
    return json.loads(
        json.dumps(
            {
                "experiment": settings,
                "phase": maths,
                "data": dict(sorted(data.items())),
                "total_steps": int(total_steps),
                "clip_distance": float(clip_distance),
                **({"source_weights": source_weights} if source_weights else {}),
            },
            sort_keys=True,
        )
    )


def data_identity(scratch: Path, train_ids: list[str], val_ids: list[str]) -> dict[str, str]:
    """Each record's role and staged source fingerprint, as the run identity names the data."""
    from ctseg.preprocess.stage import staged_fingerprints

    prints = staged_fingerprints(scratch, [*train_ids, *val_ids])
    roles = {**{i: "val" for i in val_ids}, **{i: "train" for i in train_ids}}
    return {f"{roles[i]}:{i}": fp for i, fp in prints.items()}


def identity_digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_changes(old: Any, new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys where two identities differ (what a user changed), sorted."""
    if not isinstance(old, Mapping):
        return [prefix.rstrip(".") or "identity"]
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changed += identity_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def save_checkpoint(path: Path, payload: Mapping[str, Any], *, keep_previous: bool = False) -> None:
    """Write a checkpoint atomically with its checksum, refusing up front when it cannot fit.

    With `keep_previous`, the checkpoint being replaced becomes ``resume.previous.pt`` once
    the new one is complete, so a damaged newest one still leaves an intact one to resume.
    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]
    ... unexpected pos``, which never mentions space; a failed write is therefore checked
    against the free space it needed, and reported as what it is.
    """
    needed = _payload_bytes(payload)
    check_free_space(path.parent, needed, "save the checkpoint")
    try:
        with atomic_path(path) as tmp:
            torch.save(dict(payload), tmp)
            with open(tmp, "r+b") as handle:
                digest = _sha256(handle, os.path.getsize(tmp))
                handle.seek(0, os.SEEK_END)
                handle.write(CHECKSUM_TAG + digest.encode())
                handle.flush()
                os.fsync(handle.fileno())
            if keep_previous and path.exists():
                os.replace(path, path.parent / PREVIOUS)
    except Exception as exc:
        if disk_full(exc) is None and free_bytes(path.parent) >= needed:
            raise
        raise CtsegError(
            f"{path}: no space left to save the checkpoint ({needed} bytes needed, "
            f"{free_bytes(path.parent)} free); the partial file was removed and the previous "
            "checkpoint is intact: free some space and rerun, and training resumes from it"
        ) from exc


def checkpoint_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *copies: torch.nn.Module
) -> int:
    """About what a resume checkpoint of this model and optimizer takes on disk: the weights
    (and any `copies` of them it carries, e.g. the EMA's) and the optimizer's state, or, before
    its first step has made that state, twice the parameters (AdamW's two moments, the most
    either optimizer keeps)."""
    weights = sum(_payload_bytes(m.state_dict()) for m in (model, *copies))
    state = _payload_bytes(optimizer.state_dict()["state"])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + max(state, 2 * params)


def restore(state: Mapping[str, Any], parts: Mapping[str, Any]) -> None:
    """Load a resume checkpoint into the live run: each of `parts` (model, optimizer, ...:
    anything with load_state_dict) from the entry of its name, then the RNG states. The
    optimizer keeps this run's `SPEED_FLAGS` (the checkpoint's phase may have had others)."""
    optimizer = parts["optimizer"]
    speed = [{k: g.get(k) for k in SPEED_FLAGS} for g in optimizer.param_groups]
    for name, part in parts.items():
        part.load_state_dict(state[name])
    for group, flags in zip(optimizer.param_groups, speed, strict=True):
        group.update(flags)
    set_rng_state(state["rng"])


def _sha256(handle: Any, size: int) -> str:
    digest = hashlib.sha256()
    handle.seek(0)
    left = size
    while left > 0:
        block = handle.read(min(left, 2**24))
        if not block:
            break
        digest.update(block)
        left -= len(block)
    return digest.hexdigest()


def _payload_bytes(payload: Any) -> int:
    """The tensor bytes in a (nested) checkpoint payload: what torch.save will write, roughly."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, Mapping):
        return sum(_payload_bytes(v) for v in payload.values())
    if isinstance(payload, list | tuple):
        return sum(_payload_bytes(v) for v in payload)
    return 0


def rng_state() -> dict[str, Any]:
    """The global RNG states, in types `torch.load(weights_only=True)` accepts.

    numpy's legacy state is a tuple holding an ndarray, which the weights-only unpickler
    refuses; its key travels as a tensor instead.
    """
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(kind),
            "key": torch.from_numpy(np.asarray(key, np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def verify_checksum(path: Path) -> bool | None:
    """True if `path` matches its checksum trailer, False if not, None if it has none."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        if size < TRAILER_BYTES:
            return None
        handle.seek(size - TRAILER_BYTES)
        trailer = handle.read(TRAILER_BYTES)
        if not trailer.startswith(CHECKSUM_TAG):
            return None
        return _sha256(handle, size - TRAILER_BYTES) == trailer[len(CHECKSUM_TAG) :].decode(
            "ascii", "replace"
        )


def stored_digest(path: Path) -> str | None:
    """The sha256 written in `path`'s checksum trailer (not recomputed: `verify_checksum` does
    that), or None without a trailer: what names a weights file in the outputs made with it."""
    size = os.path.getsize(path)
    if size < TRAILER_BYTES:
        return None
    with open(path, "rb") as handle:
        handle.seek(size - TRAILER_BYTES)
        trailer = handle.read(TRAILER_BYTES)
    if not trailer.startswith(CHECKSUM_TAG):
        return None
    return trailer[len(CHECKSUM_TAG) :].decode("ascii", "replace")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's contents, once its checksum is verified; one without a checksum is
    refused like a damaged one, since damage in it could not be found."""
    verified = verify_checksum(path)
    if verified is False:
        raise DamagedCheckpoint(
            f"{path}: damaged checkpoint: its bytes do not match the checksum written with it; "
            "move it aside to start this run afresh"
        )
    if verified is None:
        raise DamagedCheckpoint(
            f"{path}: unverifiable checkpoint: it has no checksum trailer (cut short, or "
            "rewritten by plain torch.save), so damage in it could not be found; move it aside "
            "to start this run afresh"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is the same user problem
        raise DamagedCheckpoint(
            f"{path}: cannot load checkpoint: {' '.join(str(exc).split())}; move it aside to "
            "start this run afresh"
        ) from exc


def resume_state(
    state_dir: Path, identity: Mapping[str, Any], ranks: Ranks
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The checkpoint to resume from, if it was written by this run, and what happened.

    ``resume.pt`` first, then ``resume.previous.pt``: a damaged one (checksum wrong or absent,
    or unreadable) is set aside into ``state_dir/set-aside/<time>-damaged/`` and the next is
    tried. A checkpoint of another run (changed settings, data or length, or a saved step
    beyond this run's end) is never resumed and never deleted: rank 0 moves it, the previous
    one, its best.pt and the logs beside them into ``state_dir/set-aside/<time>-<digest>/``,
    and this run starts fresh.
    Every rank reads the checkpoints before anything moves, so all of them take the same
    decision. The logs are then cut back to the resumed step (`trim_logs`).
    """
    damaged: list[tuple[Path, str]] = []
    state, changes, found = None, [], None
    for found in (state_dir / "resume.pt", state_dir / PREVIOUS):
        if not found.exists():
            continue
        try:
            state = load_checkpoint(found)
        except DamagedCheckpoint as exc:
            damaged.append((found, str(exc)))
            continue
        changes = identity_changes(state.get("identity"), identity)
        if int(state.get("step", 0)) > int(identity["total_steps"]) and not changes:
            changes = ["step beyond total_steps"]
        break
    else:
        state = None
    stamp = time.strftime("%Y%m%dT%H%M%S")
    ranks.barrier()  # every rank has read the checkpoints before rank 0 moves any
    info: dict[str, Any] = {}
    if damaged:
        aside = state_dir / "set-aside" / f"{stamp}-damaged"
        info["damaged"] = [str(aside / p.name) for p, _ in damaged]
        if ranks.main:
            aside.mkdir(parents=True, exist_ok=True)
            for path, why in damaged:
                os.replace(path, aside / path.name)
                print(f"{why.split(';')[0]}: set it aside in {aside}", file=sys.stderr)
    if state is not None and not changes:
        if ranks.main:
            trim_logs(state_dir, int(state["step"]))
            if damaged:
                print(f"resuming from the intact checkpoint {found}", file=sys.stderr)
        ranks.barrier()
        return state, {"resume": "resumed", "from_step": int(state["step"]), **info}
    if state is None:
        if ranks.main:
            trim_logs(state_dir, 0)
            if damaged:
                print("no intact checkpoint is left: this run starts afresh", file=sys.stderr)
        ranks.barrier()
        return None, {"resume": "fresh", **info}
    path = state_dir / "resume.pt"
    aside = state_dir / "set-aside" / f"{stamp}-{state.get('fingerprint')}"
    if ranks.main:
        aside.mkdir(parents=True, exist_ok=True)
        for name in ("resume.pt", PREVIOUS, BEST, "steps.csv", "epochs.csv"):
            if (state_dir / name).exists():
                os.replace(state_dir / name, aside / name)
        print(
            f"{path} was written by a different run (changed: {', '.join(changes)}); "
            f"set it aside in {aside} and started this run afresh",
            file=sys.stderr,
        )
    ranks.barrier()
    return None, {"resume": "set_aside", "set_aside": str(aside), "changed": changes, **info}


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A log's complete rows: a line cut short by a kill during an append is left out."""
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [r for r in rows if None not in r.values() and None not in r and _step(r) is not None]


def _step(row: Mapping[str, Any]) -> tuple[int, int] | None:
    try:
        return int(row["epoch"]), int(row["step"])
    except (KeyError, TypeError, ValueError):
        return None


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows to a log, flushed to the disk (a checkpoint written next must not get
    ahead of them). A file with other columns (an older layout) is rewritten whole."""
    if not rows:
        return
    columns = list(rows[0])
    header = None
    if path.exists() and path.stat().st_size > 0:
        with open(path, newline="") as handle:
            header = next(csv.reader(handle), None)
    if header is not None and header != columns:
        write_csv(path, [*read_rows(path), *rows])
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        if header is None:
            writer.writeheader()
        writer.writerows(rows)
        handle.flush()
        os.fsync(handle.fileno())


def publish_logs(log_dir: Path, out_dir: Path) -> None:
    """Copy the logs a run appended beside its checkpoint to its declared outputs."""
    if log_dir == out_dir:
        return
    for name in ("steps.csv", "epochs.csv"):
        if (log_dir / name).exists():
            publish_copy(log_dir / name, out_dir / name)


def publish_copy(kept: Path, published: Path) -> None:
    """Copy a file kept beside the checkpoint to a declared output, atomically."""
    with atomic_path(published) as tmp:
        shutil.copyfile(kept, tmp)


def trim_logs(log_dir: Path, step: int) -> None:
    """Cut steps.csv and epochs.csv back to the rows up to `step`, the step being resumed.

    Rows are appended before each checkpoint is written, so the rows up to a checkpoint's step
    are complete on disk; rows past it (a kill after a flush of the log, or a newer checkpoint
    that was damaged) are redone by the resumed run, whose new rows then follow: no row is
    lost or doubled. A file that needs no cut is left untouched.
    """
    for name in ("steps.csv", "epochs.csv"):
        path = log_dir / name
        if not path.exists():
            continue
        with open(path, newline="") as handle:
            total = sum(1 for _ in csv.DictReader(handle))
        kept = [r for r in read_rows(path) if int(r["step"]) <= step]
        if not kept:
            path.unlink()
        elif len(kept) != total:
            write_csv(path, kept)
