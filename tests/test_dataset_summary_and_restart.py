"""A run's dataset summary (ctseg.dataset_summary) and a finished run's checkpoints set aside
when it is retrained under another phase (ctseg.training.restart)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ctseg import layout
from ctseg.dataset_summary import main, small_volumes_line
from ctseg.store import create_volume
from ctseg.training.restart import STATE_FILES, set_aside_for_phase


def store(path: str, shape: tuple[int, int, int], attrs: dict) -> None:
    create_volume(Path(path), shape, np.dtype("uint8"), (8, 8, 8), None, None, attrs)


def test_the_summary_is_read_from_the_stores_attributes(tmp_path, capsys) -> None:
    root = str(tmp_path / "store")
    shapes = {"a": (40, 48, 48), "b": (16, 64, 64), "c": (40, 30, 48)}
    for i, shape in shapes.items():
        store(layout.image_store(root, i), shape, {"shape": list(shape), "p0_5": 3, "p99_5": 200})
        counts = {"0": 80, "1": 5, "2": 15}
        store(layout.label_store(root, i), shape, {"shape": list(shape), "label_counts": counts})
    split = tmp_path / "split.csv"
    pd.DataFrame({"id": list(shapes), "split": ["train", "val", "test"]}).to_csv(split)
    out = tmp_path / "run" / "dataset_summary.json"
    main(
        [
            "--run",
            "r",
            "--split",
            str(split),
            "--store",
            root,
            "--patch",
            "32",
            "48",
            "48",
            "--out",
            str(out),
        ]
    )
    summary = json.loads(out.read_text())
    assert [v["smaller_than_patch"] for v in summary["volumes"]] == [False, True, True]
    assert summary["volumes"][0]["class_fractions"] == {"surface": 0.05}
    assert summary["volumes"][0]["unlabelled_fraction"] == 0.15
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (
        "ctseg: r: dataset: 3 volumes (1 train, 1 val, 1 test), shapes 16–40 × 30–64 × 48–64 "
        "(z × y × x)"
    )
    assert printed[1] == (
        "ctseg: r: dataset: intensity p0.5 3, p99.5 200; surface 5.0% and unlabelled 15.0% of "
        "each label's voxels"
    )
    assert printed[2] == "ctseg: " + str(small_volumes_line("r", shapes, (32, 48, 48)))
    assert (
        "2 volume(s) smaller than the patch 32x48x48 along an axis: b (16x64x64), c "
        in (printed[2])
    )


def test_no_warning_when_every_volume_holds_the_patch() -> None:
    assert small_volumes_line("r", {"a": (32, 48, 48)}, (32, 48, 48)) is None


def test_a_finished_run_s_state_is_moved_aside_never_deleted(tmp_path) -> None:
    for name in STATE_FILES:
        (tmp_path / name).write_text(name)
    aside = set_aside_for_phase(tmp_path, "phase 0")
    assert aside is not None and aside.parent == tmp_path / "set-aside"
    assert aside.name.endswith("-phase-0")
    assert sorted(p.name for p in aside.iterdir()) == sorted(STATE_FILES)
    assert not any((tmp_path / name).exists() for name in STATE_FILES)
    assert set_aside_for_phase(tmp_path, "phase 0") is None  # nothing left to move


def test_a_multi_class_summary_gives_each_class_its_share_by_name() -> None:
    """Counts are by stored value (convert stores classes 1..K, ignored K+1): the shares are
    named by the dataset's classes, never read as Kaggle's surface and unlabelled."""
    from ctseg.dataset_summary import summarise, summary_lines
    from ctseg.labels import LabelSpec

    spec = LabelSpec({"background": 0, "sheet": 10, "fibre": 20, "pore": 30}, ignore=255)
    images = {"a": {"shape": [8, 8, 8], "dtype": "uint8", "p0_5": 1.0, "p99_5": 9.0}}
    labels = {"a": {"label_counts": {"0": 400, "1": 50, "2": 25, "3": 5, "4": 20}}}
    summary = summarise({"a": "train"}, images, labels, [8, 8, 8], spec, (2.0, 1.0, 1.0))
    volume = summary["volumes"][0]
    assert volume["class_fractions"] == {"sheet": 0.1, "fibre": 0.05, "pore": 0.01}
    assert volume["unlabelled_fraction"] == 0.04
    assert summary["classes"] == ["sheet", "fibre", "pore"] and summary["spacing"] == [2, 1, 1]
    assert summary_lines("r", summary)[1] == (
        "r: dataset: intensity p0.5 1, p99.5 9; sheet 10.0% and fibre 5.0% and pore 1.0% and "
        "unlabelled 4.0% of each label's voxels"
    )
