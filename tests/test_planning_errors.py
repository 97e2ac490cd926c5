"""Bad settings refused while the workflow is planned, as one line that names the file, the key
and the fix: a key given twice in a YAML file, an unset variable in `scratch`, a phase that is
not a phase number, post-processing settings that only the job would have refused, and
dataset files missing by the dozen."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake

from ctseg.config import (
    check_configured_phase,
    load_ensemble,
    load_experiment,
    load_phases,
    read_yaml,
)
from ctseg.io import CtsegError, check_writable_folder
from ctseg.records import read_records

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- keys given twice
@pytest.mark.parametrize(
    ("text", "key", "line", "first"),
    [
        ("a: 1\nb: 2\na: 3\n", "a", 3, 1),
        ("infer:\n  threshold: 0.3\n  overlap: 0.5\n  threshold: 0.4\n", "infer.threshold", 4, 2),
        ("phases:\n  0: {workers: 1}\n  1: {workers: 2}\n  0: {workers: 3}\n", "phases.0", 4, 2),
        ("runs:\n  - {name: a, name: b}\n", "runs.0.name", 2, 2),
    ],
)
def test_a_key_given_twice_is_refused_with_the_file_key_and_line(
    tmp_path: Path, text: str, key: str, line: int, first: int
) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    with pytest.raises(CtsegError) as info:
        read_yaml(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: key {key!r} appears twice (first at line {first})")
    assert message.endswith("merge the two into one") and "\n" not in message


def test_a_merge_key_may_still_override_what_it_merges(tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("base: &base {lr: 0.01, epochs: 3}\nrun:\n  <<: *base\n  lr: 0.005\n")
    assert read_yaml(path)["run"] == {"lr": 0.005, "epochs": 3}


def test_a_second_train_block_in_an_experiment_is_refused(tmp_path: Path) -> None:
    """YAML keeps the last block: epochs, steps_per_epoch and warmup_steps silently became the
    schema's defaults."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_EXPERIMENT, sort_keys=False) + "train:\n  lr: 0.005\n")
    first = path.read_text().splitlines().index("train:") + 1
    last = len(path.read_text().splitlines()) - 1
    with pytest.raises(CtsegError, match=rf"tiny.yaml:{last}: key 'train' appears twice "):
        load_experiment(path)
    assert f"(first at line {first})" in str(read_yaml_error(path))


def read_yaml_error(path: Path) -> CtsegError:
    with pytest.raises(CtsegError) as info:
        read_yaml(path)
    return info.value


def test_phases_and_ensembles_are_read_with_the_same_check(tmp_path: Path) -> None:
    phases = tmp_path / "phases.yaml"
    shipped = (REPO / "config" / "phases.yaml").read_text()
    phases.write_text(shipped + "  0:\n    workers: 4\n")
    with pytest.raises(CtsegError, match=r"phases.yaml:\d+: key 'phases.0' appears twice"):
        load_phases(phases)
    ensemble = tmp_path / "ens.yaml"
    ensemble.write_text("name: ens\nmembers: [a, b]\nweights: [1, 1]\nweights: [3, 1]\n")
    with pytest.raises(CtsegError, match=r"ens.yaml:4: key 'weights' appears twice"):
        load_ensemble(ensemble, {"a", "b"})


# ----------------------------------------------------------------------------- config phase
@pytest.mark.parametrize("phase", [3.0, True, "3"])
def test_only_a_whole_phase_number_or_auto_is_a_phase(phase: object) -> None:
    phases = load_phases(REPO / "config" / "phases.yaml")
    with pytest.raises(
        CtsegError, match=r"is not a phase number: config/phases.yaml defines \[0, "
    ):
        check_configured_phase(phase, phases)
    check_configured_phase(3, phases)
    check_configured_phase("auto", phases)
    with pytest.raises(CtsegError, match=r"config 'phase': 99 is not in config/phases.yaml"):
        check_configured_phase(99, phases)


# ----------------------------------------------------------------------------- dataset files
def kaggle_dataset(root: Path, ids: list[str], test_ids: list[str] = ()) -> Path:
    """train.csv and test.csv with their files (read_records only looks for them)."""
    for split, listed in (("train", ids), ("test", test_ids)):
        folders = ("train_images", "train_labels") if split == "train" else ("test_images",)
        for folder in folders:
            (root / folder).mkdir(parents=True, exist_ok=True)
            for record_id in listed:
                (root / folder / f"{record_id}.tif").touch()
        rows = "".join(f"{i},1\n" for i in listed)
        (root / f"{split}.csv").write_text("id,scroll_id\n" + rows)
    return root


def test_every_missing_record_file_is_named_at_once(tmp_path: Path) -> None:
    root = kaggle_dataset(tmp_path / "data", [f"v{i}" for i in range(6)])
    for i in range(5):
        (root / "train_images" / f"v{i}.tif").unlink()
    (root / "train_labels" / "v0.tif").unlink()
    with pytest.raises(CtsegError) as info:
        read_records(root)
    message = str(info.value)
    csv = root / "train.csv"
    assert message.startswith(f"{csv}: 5 listed ids lack their files: 'v0' (")
    assert f"{root}/train_images/v0.tif and {root}/train_labels/v0.tif do not exist" in message
    assert "'v1'" in message and "'v2'" in message and "and 2 more" in message
    assert "'v3'" not in message and "'v5'" not in message
    assert message.endswith(f"remove those rows from {csv}, or add their files")


def test_missing_files_of_both_csv_files_are_named_together(tmp_path: Path) -> None:
    root = kaggle_dataset(tmp_path / "data", ["a", "b"], ["t"])
    (root / "train_labels" / "b.tif").unlink()
    (root / "test_images" / "t.tif").unlink()
    with pytest.raises(CtsegError) as info:
        read_records(root)
    message = str(info.value)
    assert f"{root}/train.csv: id 'b' is listed but {root}/train_labels/b.tif" in message
    assert f"; also {root}/test.csv: id 't' is listed but {root}/test_images/t.tif" in message
    assert message.endswith(f"remove its row from {root}/test.csv, or add the file")


# ----------------------------------------------------------------------------- the workflow
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy of the workflow for the cases that only change the command line."""
    return copy_workflow(tmp_path_factory.mktemp("workflow"), {**TINY_CONFIG, "experiment": "tiny"})


def refusal(workdir: Path, *args: str) -> str:
    """The one `ctseg:` line a dry run stops with (and no traceback)."""
    proc: subprocess.CompletedProcess = run_snakemake(workdir, "-n", *args, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "Traceback" not in text and 'File "' not in text, text
    [line] = [line for line in text.splitlines() if line.startswith("ctseg: ")]
    return line.removeprefix("ctseg: ")


def test_a_second_infer_block_in_the_config_file_is_refused(tmp_path: Path) -> None:
    workdir = copy_workflow(tmp_path, {**TINY_CONFIG, "experiment": "tiny"})
    config = workdir / "config" / "config.yaml"
    config.write_text(
        yaml.safe_dump({**TINY_CONFIG, "infer": {"postprocess": "fixed"}})
        + "infer:\n  overlap: 0.25\n"
    )
    line = refusal(workdir)
    assert line.startswith("config/config.yaml:") and "key 'infer' appears twice" in line
    extra = tmp_path / "extra.yaml"
    extra.write_text("infer:\n  overlap: 0.25\ninfer:\n  batch_size: 2\n")
    config.write_text(yaml.safe_dump(TINY_CONFIG))
    line = refusal(workdir, "--configfile", str(extra))
    assert line.startswith(f"{extra}:3: key 'infer' appears twice (first at line 1)")


def test_an_unset_variable_in_scratch_is_one_line(workdir: Path) -> None:
    line = refusal(workdir, "--config", "scratch=$CTSEG_TEST_NEVER_SET/x")
    assert line.startswith(
        "config/config.yaml with --config: scratch: '$CTSEG_TEST_NEVER_SET/x' uses unset "
        "environment variable(s) ['CTSEG_TEST_NEVER_SET']; export the variable, or set scratch"
    )


def test_a_phase_given_as_a_decimal_is_refused_naming_the_phases(workdir: Path) -> None:
    line = refusal(workdir, "train", "--config", "phase=3.0")
    assert line.startswith("config 'phase': 3.0 is not a phase number: config/phases.yaml defines ")
    assert "[0, 1, 2, 3" in line and "or auto" in line


@pytest.mark.parametrize(
    ("infer", "expected"),
    [
        (
            "infer={postprocess: fixed, hysteresis_high: 0.4}",
            "infer: hysteresis_high=0.4: expected threshold (0.5) < hysteresis_high < 1",
        ),
        (
            "infer={postprocess: fixed, hysteresis_mode: z}",
            "infer: hysteresis_mode='z' needs hysteresis_high",
        ),
        (
            "infer={tune: {hysteresis_pairs: [[0.9, 0.5]]}}",
            "infer.tune: hysteresis_pairs [[0.9, 0.5]]: expected [low, high] pairs with 0 < low",
        ),
    ],
)
def test_post_processing_settings_are_checked_before_any_job(
    workdir: Path, infer: str, expected: str
) -> None:
    line = refusal(workdir, "--config", infer)
    assert line.startswith(f"config/config.yaml with --config: {expected}"), line


def test_a_bad_phase_or_experiment_names_the_valid_ones(workdir: Path) -> None:
    phase = refusal(workdir, "--config", "phase=abc")
    assert phase.startswith("config/config.yaml with --config: phase: 'abc': expected a phase")
    assert "config/phases.yaml ([0, 1, 2, 3" in phase and "or auto" in phase
    experiment = refusal(workdir, "--config", "experiment=")
    assert experiment.startswith("config/config.yaml with --config: experiment: no value: ")
    assert "'tiny'" in experiment and "'exp001'" in experiment and "'ens_demo'" in experiment


def test_an_error_in_the_config_file_says_with_config_only_when_given(tmp_path: Path) -> None:
    workdir = copy_workflow(tmp_path, {**TINY_CONFIG, "dataset": 5})
    line = refusal(workdir)
    assert line == "config/config.yaml: dataset: 5 is not of type 'string'"
    given = refusal(workdir, "--config", "phase=1")
    assert given.startswith("config/config.yaml with --config: dataset: 5 is not of type")


# ----------------------------------------------------------------------------- results/
RESULTS_FOLDER = "the workflow's runs, logs and report"


def test_a_file_where_results_should_be_is_one_line_before_any_job(tmp_path: Path) -> None:
    workdir = copy_workflow(tmp_path, {**TINY_CONFIG, "experiment": "tiny"})
    (workdir / "results").write_text("")
    line = refusal(workdir)
    assert line == f"results: a file, where {RESULTS_FOLDER} need a folder: move the file aside"


def test_a_read_only_results_folder_is_one_line_before_any_job(tmp_path: Path) -> None:
    """Before, the plan was printed and the first job stopped with Snakemake's 18-frame
    traceback (`Failed to create output directory results/logs`)."""
    workdir = copy_workflow(tmp_path, {**TINY_CONFIG, "experiment": "tiny"})
    results = workdir / "results"
    results.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(results)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        line = refusal(workdir)
    finally:
        subprocess.run(["umount", "-l", str(results)], check=False)
    assert line == (
        f"results: on a read-only filesystem, and {RESULTS_FOLDER} are written there: mount it "
        "read-write, or work in a copy of the project on a writable disk"
    )


def test_a_folder_this_user_may_not_write_names_the_fix(tmp_path: Path, monkeypatch) -> None:
    from ctseg import io

    results = tmp_path / "results"
    results.mkdir()
    check_writable_folder(results / "mine" / "exp001", RESULTS_FOLDER)  # writable: no error
    # What access(2) answers another user for a folder of 0o555 (root may write anywhere).
    monkeypatch.setattr(io.os, "access", lambda path, mode: Path(path) != results)
    with pytest.raises(CtsegError) as info:
        check_writable_folder(results / "mine" / "exp001", RESULTS_FOLDER)
    assert str(info.value) == (
        f"{results}: not writable by this user, and {RESULTS_FOLDER} are written there: change "
        f"its permissions (chmod u+w {results}), or run as its owner"
    )
