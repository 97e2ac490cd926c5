"""What a trained run was trained with: ``results/<run>/train/settings.json``.

`ctseg train` writes it when the run ends (rank 0, beside steps.csv and epochs.csv); the
report reads it back to show every run's settings side by side, so a reader comparing runs sees
which keys differ (the model's blocks, ``train.ema``, ``init_from``, the patch, the losses)
without opening any config file. It holds:

- ``experiment``: the experiment as training used it: ``extends`` resolved, the fold applied,
  the schema's defaults filled in;
- ``phase``: the settings of the loader phase the run trained under (after ``phase: auto``
  chose), ``phase_id`` its number in config/phases.yaml and ``phase_auto`` whether ``phase:
  auto`` chose it: the planner and the report read the phase from these two, never by
  comparing settings or reading logs (`recorded_phase`);
- ``weights``: ``ema`` or ``trained``, which weights last.pt holds;
- ``source_weights``: for a fine-tune, the digest of the weights it started from (else null);
- ``run_identity``: the digest of everything that determines the trained weights
  (`ctseg.training.checkpoint.run_identity`), as last.pt's ``fingerprint``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ctseg.io import CtsegError, atomic_path, strict_json

SETTINGS_JSON = "settings.json"


def write_run_settings(
    out_dir: Path,
    exp: Mapping[str, Any],
    phase: Mapping[str, Any],
    *,
    phase_id: int | None,
    phase_auto: bool,
    weights: str,
    source_weights: str | None,
    run_identity: str,
) -> Path:
    """Write ``<out_dir>/settings.json`` atomically; returns its path."""
    path = Path(out_dir) / SETTINGS_JSON
    record = {
        "experiment": dict(exp),
        "phase": dict(phase),
        "phase_id": phase_id,
        "phase_auto": phase_auto,
        "weights": weights,
        "source_weights": source_weights,
        "run_identity": run_identity,
    }
    with atomic_path(path) as tmp:
        tmp.write_text(strict_json(record, indent=1, sort_keys=True, default=str) + "\n")
    return path


def read_run_settings(path: Path) -> dict[str, Any]:
    """settings.json as written; a clear error for a file that is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CtsegError(
            f"{path}: cannot read a run's settings ({exc}); rerun its training to rewrite it"
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("experiment"), dict):
        raise CtsegError(
            f"{path}: not a run's settings (no 'experiment' mapping); rerun its training to "
            "rewrite it"
        )
    return data


def recorded_phase(settings: Mapping[str, Any] | None) -> tuple[int | None, bool]:
    """(phase id, chosen by auto) as settings.json records them; (None, False) where it
    records no id (no file, or one written before ids were recorded)."""
    if not settings:
        return None, False
    phase_id = settings.get("phase_id")
    if isinstance(phase_id, bool) or not isinstance(phase_id, int):
        return None, False
    return phase_id, settings.get("phase_auto") is True


def flat_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys to values (lists kept whole): ``train.ema.decay``, ``model.blocks_per_stage``,
    ``init_from``, ``phase.batch_size``, ``weights``, ``source_weights``."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key in sorted(value):
                walk(f"{prefix}.{key}" if prefix else str(key), value[key])
        else:
            out[prefix] = value

    walk("", settings["experiment"])
    walk("phase", settings.get("phase") or {})
    for key in ("weights", "source_weights"):
        out[key] = settings.get(key)
    return out
