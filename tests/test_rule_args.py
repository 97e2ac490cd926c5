"""ctseg.rule_args: the command-line options the rules build from the config."""

from __future__ import annotations

from pathlib import Path

import yaml

from ctseg import rule_args
from ctseg.config import load_config
from ctseg.postprocess.commands import configured_rounds

REPO = Path(__file__).resolve().parents[1]


def shipped_config() -> dict:
    return load_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), "config")


def test_preprocessing_options() -> None:
    assert rule_args.shape_arg([64, 32, 16]) == "64,32,16"
    assert rule_args.shards_arg(None) == ""
    assert rule_args.shards_arg([128, 128, 128]) == "--shards 128,128,128"
    codec = {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}
    assert rule_args.codec_arg(codec) == "blosc,clevel=5,cname=lz4,shuffle=shuffle"
    assert codec["name"] == "blosc"  # the config's own mapping is left as it was


def test_training_options() -> None:
    assert rule_args.fold_arg(None) == "" and rule_args.fold_arg(0) == "--fold 0"
    assert rule_args.launcher(1) == "ctseg"
    assert rule_args.launcher(4) == "torchrun --standalone --nproc_per_node 4 -m ctseg.cli"
    assert rule_args.phase_threads(1, 0) == 2 and rule_args.phase_threads(2, 3) == 8
    assert rule_args.phase_mem_mb(2, 3) == 2 * (rule_args.MAIN_PROCESS_MB + 3 * rule_args.WORKER_MB)
    assert (
        rule_args.init_arg([]) == ""
        and rule_args.init_arg(["a/last.pt"]) == "--init-from 'a/last.pt'"
    )
    shared = rule_args.scratch_args(
        "shared", manifest_dir="s/exp", node_scratch="$TMPDIR/x", experiment="exp", source="st"
    )
    assert shared == "--scratch 's/exp'"
    per_job = rule_args.scratch_args(
        "per_job", manifest_dir=None, node_scratch="$TMPDIR/x", experiment="exp", source="st"
    )
    assert per_job == "--scratch '$TMPDIR/x/exp' --stage-from 'st'"


def test_ensemble_options() -> None:
    tuned = rule_args.ensemble_weight_args(True, "w.json", ["a", "b"], [1.0, 1.0])
    assert tuned == "--weights-file 'w.json' --names a b"
    assert rule_args.ensemble_weight_args(False, [], ["a", "b"], [2, 1]) == "--weights 2 1"
    members = rule_args.ensemble_member_args({"a": ["p1", "p2"], "b": ["q1"]})
    assert members == "--member a 'p1' 'p2' --member b 'q1'"


def test_evaluation_options() -> None:
    provenance = rule_args.provenance_args({"run": "exp001", "kind": "trained"})
    assert provenance == "--provenance run=exp001 --provenance kind=trained"
    assert rule_args.scoring_mem_mb(8, 1) == 3000 and rule_args.scoring_mem_mb(2, 5) == 5000
    assert rule_args.scoring_mem_mb(8, 0) == 3000


def test_the_shipped_search_space_as_options() -> None:
    search = rule_args.tune_args(shipped_config()["infer"]["tune"])
    assert search.startswith("--thresholds 0.1 0.2 0.3")
    assert "--hysteresis-pairs 0.5,0.9" in search and "--no-fill-holes" not in search
    off = dict(shipped_config()["infer"]["tune"], fill_holes=False)
    assert "--no-fill-holes" in rule_args.tune_args(off)


def test_postprocess_options_fixed_and_tuned() -> None:
    infer = dict(shipped_config()["infer"])
    assert rule_args.postprocess_args(infer, "t/tuned.json") == "--settings 't/tuned.json'"
    fixed = dict(infer, postprocess="fixed")
    # An unchanged config gives only the first options: the later steps appear when on.
    assert rule_args.postprocess_args(fixed, []) == "--threshold 0.5 --min-component-voxels 0"
    on = dict(fixed, hysteresis_high=0.8, hysteresis_mode="z", closing_radius=1, fill_holes=True)
    assert rule_args.postprocess_args(on, []) == (
        "--threshold 0.5 --hysteresis-high 0.8 --min-component-voxels 0 --fill-holes "
        "--hysteresis-mode z --closing-radius 1"
    )


def test_overlay_options() -> None:
    args = rule_args.overlay_args(["a", "b"], "img/{id}.zarr", "lab/{id}.zarr")
    assert args == "--overlay a 'img/a.zarr' 'lab/a.zarr' --overlay b 'img/b.zarr' 'lab/b.zarr'"


def test_a_scrolls_post_rounds_from_the_config_or_tuned_json(tmp_path: Path) -> None:
    """The rounds of rule scroll_post: the fixed values' (a threshold alone: the write), each
    step's in order (z-hysteresis and the filter apart), tuned.json's, none for a label map."""
    import json

    fixed = dict(shipped_config()["infer"], postprocess="fixed")
    assert configured_rounds(fixed, None, True) == [("filled", "write")]
    on = dict(fixed, hysteresis_high=0.8, hysteresis_mode="z", min_component_voxels=8,
              fill_holes=True, plug_holes_max_area=4, closing_radius=1)  # fmt: skip
    assert [name for name, _ in configured_rounds(on, None, True)] == [
        "binarise", "filter", "fill", "filled", "plugged", "closed"
    ]  # fmt: skip
    shared = dict(on, hysteresis_mode="3d")  # 3D hysteresis and the filter share a pass
    assert [name for name, _ in configured_rounds(shared, None, True)][:2] == [
        "binarise", "fill"
    ]  # fmt: skip
    tuned = tmp_path / "tuned.json"
    settings = {"threshold": 0.3, "hysteresis_high": None, "min_component_voxels": 64,
                "fill_holes": False, "patch_holes_max_area": 256}  # fmt: skip
    tuned.write_text(json.dumps({"settings": settings}))
    infer = dict(fixed, postprocess="tuned")
    assert configured_rounds(infer, str(tuned), True) == [
        ("filter", "components"), ("filled", "write"), ("patched", "halo")
    ]  # fmt: skip
    assert configured_rounds(infer, str(tuned), False) == []


def test_what_a_scroll_post_job_and_the_finish_wait_on() -> None:
    rounds = [("binarise", "components"), ("filled", "write"), ("closed", "halo")]
    waits = rule_args.post_waits_on
    at = {"n": "2"}
    assert waits("s", rounds, 9, {**at, "round": "binarise", "which": "1"}) == [
        "s/part-0-of-2.json", "s/part-1-of-2.json"
    ]  # fmt: skip
    assert waits("s", rounds, 9, {**at, "round": "binarise", "which": "merge"}) == [
        "s/post-binarise-0-of-2.json", "s/post-binarise-1-of-2.json"
    ]  # fmt: skip
    assert waits("s", rounds, 9, {**at, "round": "filled", "which": "0"}) == [
        "s/post-binarise-merge-of-2.json"
    ]  # fmt: skip
    assert waits("s", rounds, 9, {**at, "round": "closed", "which": "0"}) == [
        "s/post-filled-0-of-2.json", "s/post-filled-1-of-2.json"
    ]  # fmt: skip
    assert waits("s", rounds, 2, {}) == ["s/post-closed-0-of-2.json", "s/post-closed-1-of-2.json"]
    assert waits("s", [], 2, {}) == ["s/part-0-of-2.json", "s/part-1-of-2.json"]  # label map
