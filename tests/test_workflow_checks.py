"""ctseg.workflow_checks and ctseg.postprocess.checks: what the workflow checks of its config and
profile as it loads (settings.smk), and its one-line refusals, without Snakemake. Snakemake's
`workflow.config_settings` and `workflow.resource_settings` are stood in for by namespaces with
the same attributes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ctseg.config import load_config, load_phases
from ctseg.io import CtsegError
from ctseg.postprocess.checks import as_tuples, check_infer_config
from ctseg.preprocess.stage import expand_scratch
from ctseg.workflow_checks import (
    check_config,
    check_config_files,
    check_profile,
    choices,
    config_source,
    configured_scratch,
    planning,
    refuse,
)

REPO = Path(__file__).resolve().parents[1]


def settings(configfiles=(), config=None) -> SimpleNamespace:
    """Snakemake's `workflow.config_settings`: the --configfile paths and the --config values."""
    return SimpleNamespace(configfiles=list(configfiles), config=config or {})


def shipped() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def refusal(capsys, call, *args) -> str:
    """The one line `call(*args)` stops planning with (exit status 1)."""
    with pytest.raises(SystemExit) as info:
        call(*args)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ctseg: ")
    return err.removeprefix("ctseg: ").rstrip("\n")


@pytest.fixture
def in_repo(monkeypatch) -> None:
    """The workflow's paths (config/config.yaml, config/phases.yaml) are relative to the root."""
    monkeypatch.chdir(REPO)


def test_refuse_prints_one_line_and_exits_1(capsys) -> None:
    assert refusal(capsys, refuse, "x.yaml: bad") == "x.yaml: bad"


def test_planning_turns_a_ctseg_error_into_its_line(capsys) -> None:
    def check(value: int) -> int:
        """Doubles a positive value."""
        if value < 0:
            raise CtsegError(f"value {value}: expected >= 0")
        return 2 * value

    assert planning(check)(3) == 6
    assert planning(check).__doc__ == "Doubles a positive value."
    assert refusal(capsys, planning(check), -1) == "value -1: expected >= 0"
    assert refusal(capsys, planning(check, "config/config.yaml"), -1) == (
        "config/config.yaml: value -1: expected >= 0"
    )
    # Anything else is not the user's to fix: it is not turned into a line.
    with pytest.raises(TypeError):
        planning(check)("a")


def test_the_config_source_names_every_file_and_the_command_line() -> None:
    assert config_source(settings()) == "config/config.yaml"
    assert config_source(settings(["a.yaml", "b.yaml"], {"phase": 1})) == (
        "config/config.yaml with --configfile a.yaml with --configfile b.yaml with --config"
    )


def test_a_config_file_with_a_key_given_twice_is_refused(capsys, tmp_path, in_repo) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text("phase: 1\n")
    check_config_files(settings([extra]))  # valid: nothing said
    assert capsys.readouterr().err == ""
    extra.write_text("phase: 1\nphase: 2\n")
    line = refusal(capsys, check_config_files, settings([extra]))
    assert line.startswith(str(extra)) and "phase" in line


def test_the_keys_named_in_other_files_list_their_choices(in_repo) -> None:
    phases = sorted(load_phases("config/phases.yaml"))
    assert choices(("phase",)) == (f"expected a phase of config/phases.yaml ({phases}), or auto")
    experiment = choices(("experiment",))
    assert experiment.startswith("expected a run, or a list of runs: an experiment of ")
    assert "'exp001'" in experiment and "'ens_demo'" in experiment
    assert choices(("infer", "threshold")) is None


def test_check_config_fills_the_defaults_and_reads_nested_command_line_values(in_repo) -> None:
    config = shipped()
    config["infer"]["threshold"] = "0.3"  # as --config 'infer={threshold: 0.3}' gives it
    loaded = check_config(config, settings(config={"infer": {"threshold": "0.3"}}))
    assert config["infer"]["threshold"] == 0.3 and loaded["infer"]["threshold"] == 0.3
    expected = shipped()
    expected["infer"]["threshold"] = 0.3
    assert loaded == load_config(expected)


def test_check_config_refuses_in_one_line_naming_the_key(capsys, in_repo) -> None:
    line = refusal(capsys, check_config, {**shipped(), "phase": "fast"}, settings())
    assert line.startswith("config/config.yaml: phase: 'fast': expected a phase of ")
    line = refusal(capsys, check_config, {**shipped(), "experiment": None}, settings())
    assert line.startswith("config/config.yaml: experiment: no value: expected a run")
    # A wrong type given on the command line: how a nested key is set.
    bad = {**shipped(), "infer": 3}
    assert refusal(capsys, check_config, bad, settings(config={"infer": 3})).endswith(
        ". A nested key is set with e.g. --config 'infer={threshold: 0.3}' (the section's "
        "other keys keep their values)"
    )
    assert "nested key" not in refusal(capsys, check_config, bad, settings())


def test_the_scratch_with_an_unset_variable_is_refused_with_the_fix(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CTSEG_TEST_SCRATCH", "/fast")
    config = {"scratch": "$CTSEG_TEST_SCRATCH/x"}
    assert configured_scratch(config, settings(), expand_scratch) == Path("/fast/x")
    monkeypatch.delenv("CTSEG_TEST_SCRATCH")
    assert refusal(capsys, configured_scratch, config, settings(), expand_scratch) == (
        "config/config.yaml: scratch: '$CTSEG_TEST_SCRATCH/x' uses unset environment "
        "variable(s) ['CTSEG_TEST_SCRATCH']; export the variable, or set scratch to a "
        "directory (e.g. --config scratch=results/scratch)"
    )


def test_a_profile_placeholder_is_refused_as_written(capsys) -> None:
    class Evaluated:  # Snakemake's resource value: what was written is its `raw`
        def __init__(self, raw: object) -> None:
            self.raw = raw

    fine = SimpleNamespace(
        default_resources={"slurm_account": Evaluated("lab")}, overwrite_resources={}
    )
    check_profile(fine, ["snakemake"])
    assert capsys.readouterr().err == ""
    left = SimpleNamespace(
        default_resources=None,
        overwrite_resources={"train_model": {"slurm_partition": Evaluated("CHANGE_ME")}},
    )
    line = refusal(capsys, check_profile, left, ["snakemake", "--profile", "p/slurm"])
    assert line.startswith(
        "p/slurm/config.yaml: the placeholder 'CHANGE_ME' is still in set-resources: "
        "train_model: slurm_partition: "
    )


def test_the_configured_post_processing_is_checked_by_the_jobs_classes(in_repo) -> None:
    infer = load_config(shipped())["infer"]
    check_infer_config(infer)
    assert as_tuples([[0.5, 0.9], 3]) == ((0.5, 0.9), 3)
    with pytest.raises(CtsegError, match=r"^infer: .*hysteresis_high"):
        check_infer_config({**infer, "threshold": 0.6, "hysteresis_high": 0.4})
    with pytest.raises(CtsegError, match=r"^infer\.tune: thresholds \[1\.5\]"):
        check_infer_config({**infer, "tune": {**infer["tune"], "thresholds": [1.5]}})
