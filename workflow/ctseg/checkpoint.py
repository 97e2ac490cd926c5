"""A run's identity and its resumable state: checkpoints, RNG states and the logs beside them.

A checkpoint is resumed only by the run that wrote it (`run_identity`, `resume_state`); one
from another run is set aside, never deleted. Checkpoints are written atomically and refused
up front when the disk cannot hold them (`save_checkpoint`). The per-step and per-epoch logs
that a resumed run appends to live beside the checkpoint (`merge_log`, `write_csv`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctseg.distributed import Ranks
from ctseg.io import CtsegError, atomic_path, check_free_space, disk_full, free_bytes

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
    "train": ("log_every", "val_batches"),
}


def run_identity(
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    *,
    data: Mapping[str, str],
    total_steps: int,
    clip_distance: float,
) -> dict[str, Any]:
    """Everything that determines a run's trained weights, as a JSON-able dict.

    A checkpoint is resumed only by a run with the same identity: the experiment's settings
    that change the maths, the phase's maths keys (workers or prefetch do not change the sample
    stream, so a preempted run may resume under another loader phase), the staged data (each
    record's role and source fingerprint) and the total step count.
    """
    settings: dict[str, Any] = {}
    for key, value in exp.items():
        dropped = NOT_MATHS.get(key, ())
        if dropped is None:
            continue
        if isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in dropped}
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
            },
            sort_keys=True,
        )
    )


def data_identity(scratch: Path, train_ids: list[str], val_ids: list[str]) -> dict[str, str]:
    """Each record's role and staged source fingerprint, as the run identity names the data."""
    from ctseg.stage import staged_fingerprints

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


def save_checkpoint(path: Path, payload: Mapping[str, Any]) -> None:
    """Write a checkpoint atomically, refusing up front when it cannot fit.

    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]
    ... unexpected pos``, which never mentions space; a failed write is therefore checked
    against the free space it needed, and reported as what it is.
    """
    needed = _payload_bytes(payload)
    check_free_space(path.parent, needed, "save the checkpoint")
    try:
        with atomic_path(path) as tmp:
            torch.save(dict(payload), tmp)
    except Exception as exc:
        if disk_full(exc) is None and free_bytes(path.parent) >= needed:
            raise
        raise CtsegError(
            f"{path}: no space left to save the checkpoint ({needed} bytes needed, "
            f"{free_bytes(path.parent)} free); the partial file was removed and the previous "
            "checkpoint is intact: free some space and rerun, and training resumes from it"
        ) from exc


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


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is the same user problem
        raise CtsegError(
            f"{path}: cannot load checkpoint: {exc}; move it aside to start this run afresh"
        ) from exc


def resume_state(
    state_dir: Path, identity: Mapping[str, Any], ranks: Ranks
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The checkpoint to resume from, if it was written by this run, and what happened.

    A checkpoint of another run (changed settings, data or length, or a saved step beyond this
    run's end) is never resumed and never deleted: rank 0 moves it, and the logs beside it,
    into ``state_dir/set-aside/<time>-<digest>/``, and this run starts fresh. Every rank reads
    the checkpoint before anything moves, so all of them take the same decision.
    """
    path = state_dir / "resume.pt"
    if not path.exists():
        return None, {"resume": "fresh"}
    state = load_checkpoint(path)
    changes = identity_changes(state.get("identity"), identity)
    if int(state.get("step", 0)) > int(identity["total_steps"]) and not changes:
        changes = ["step beyond total_steps"]
    if not changes:
        return state, {"resume": "resumed", "from_step": int(state["step"])}
    ranks.barrier()  # every rank has read the checkpoint before rank 0 moves it
    aside = state_dir / "set-aside" / f"{time.strftime('%Y%m%dT%H%M%S')}-{state.get('fingerprint')}"
    if ranks.main:
        aside.mkdir(parents=True, exist_ok=True)
        for name in ("resume.pt", "steps.csv", "epochs.csv"):
            if (state_dir / name).exists():
                os.replace(state_dir / name, aside / name)
        print(
            f"{path} was written by a different run (changed: {', '.join(changes)}); "
            f"set it aside in {aside} and started this run afresh",
            file=sys.stderr,
        )
    ranks.barrier()
    return None, {"resume": "set_aside", "set_aside": str(aside), "changed": changes}


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def merge_log(path: Path, new_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows already on disk (from before a resume or an earlier epoch) followed by new ones.

    Rows on disk from the new rows' first (epoch, step) on are dropped: a run killed after an
    epoch's logs were written but before its checkpoint was redoes those steps, and their new
    rows replace the old ones, so no row is lost or doubled.
    """
    if not path.exists() or not new_rows:
        return new_rows
    with open(path, newline="") as handle:
        old = list(csv.DictReader(handle))
    first_new = (int(new_rows[0]["epoch"]), int(new_rows[0]["step"]))
    kept = [r for r in old if (int(r["epoch"]), int(r["step"])) < first_new]
    return kept + new_rows
