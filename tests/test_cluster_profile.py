"""The SLURM profile's own checks, without a cluster: the placeholder refusal, the settings the
plugin must know by these names, the early signal that only `ctseg train` acts on, the log
kept for every attempt of a resubmitted job, and a training's exit with a loader worker still
alive. tests/test_slurm_cluster.py runs all of it on a real cluster (where that exit hung)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
import yaml
from slurm_cluster import SHIPPED_PROFILE
from snakemake_executor_plugin_slurm import ExecutorSettings

from ctseg.cluster import PLACEHOLDER, check_placeholders, placeholders, profile_file
from ctseg.io import CtsegError
from ctseg.rule_args import KEEP_ATTEMPT_LOG
from ctseg.training.preempt import STOP_SIGNALS, stop_on_signals

PROFILE = yaml.safe_load(SHIPPED_PROFILE.read_text())


def test_every_placeholder_is_found_where_the_profile_has_it() -> None:
    found = placeholders(PROFILE["default-resources"], PROFILE["set-resources"])
    assert found == [
        "default-resources: slurm_account",
        "default-resources: slurm_partition",
        "set-resources: train_trial: slurm_partition",
        "set-resources: train_model: slurm_partition",
        "set-resources: scroll_part: slurm_partition",
    ]
    edited = {**PROFILE["default-resources"], "slurm_account": "proj01", "slurm_partition": ""}
    assert placeholders(edited, {"train_model": {"slurm_partition": "gpu", "runtime": 60}}) == []


def test_the_refusal_is_one_line_naming_the_profile_the_keys_and_the_fix() -> None:
    argv = ["snakemake", "--workflow-profile", "profiles/mine", "train"]
    with pytest.raises(CtsegError) as raised:
        check_placeholders({"slurm_account": PLACEHOLDER, "mem_mb": 4000}, {}, argv)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("profiles/mine/config.yaml: the placeholder 'CHANGE_ME' is still in")
    assert "default-resources: slurm_account" in message and "EDIT" in message
    assert profile_file(["--workflow-profile=p"]) == "p/config.yaml"
    assert profile_file(["snakemake"]) == "the profile (--workflow-profile)"


def test_the_profile_names_settings_the_installed_plugin_has() -> None:
    """`slurm-status-command` is the plugin's `status_command` (a typo would be refused by
    Snakemake, but a renamed option would silently bring sacct back)."""
    fields = {f.name for f in dataclasses.fields(ExecutorSettings)}
    assert "status_command" in fields
    assert PROFILE["slurm-status-command"] == "squeue"
    assert isinstance(PROFILE["max-threads"], int) and PROFILE["max-threads"] >= 4


def test_the_early_signal_is_one_that_only_ctseg_train_acts_on() -> None:
    """SIGURG: a stop request for `ctseg train`; ignored by default by every other process of
    the job step (the Snakemake that runs the rule, a bash, torchrun)."""
    option = PROFILE["set-resources"]["train_model"]["slurm_extra"]
    name = option.removeprefix("--signal=").split("@")[0]
    signum = signal.Signals[f"SIG{name}"]
    assert signum in STOP_SIGNALS
    assert signal.getsignal(signum) == signal.SIG_DFL  # default: ignored, for SIGURG
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.name == f"SIG{name}"
    # A plain process lives through it: what the jobstep Snakemake does.
    proc = subprocess.run(
        ["bash", "-c", f"kill -{name} $$; sleep 0.2; echo alive"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "alive"


def test_every_attempt_keeps_its_log(tmp_path) -> None:
    log = tmp_path / "logs" / "train" / "run one.log"
    for attempt in (1, 2):
        if log.exists():
            log.unlink()  # what Snakemake does before each attempt
        command = f"{KEEP_ATTEMPT_LOG} '{log}' && exec echo attempt {attempt} > '{log}' 2>&1"
        subprocess.run(
            ["bash", "-c", f"set -euo pipefail; {command}"],
            check=True,
            env={**os.environ, "SLURM_JOB_ID": str(100 + attempt)},
        )
    assert log.read_text() == "attempt 2\n"
    kept = sorted((log.parent / "run one.log.attempts").iterdir())
    assert [p.read_text() for p in kept] == ["attempt 1\n", "attempt 2\n"]
    assert [p.name.split("-")[1] for p in kept] == ["101", "102"]


EXIT_WITH_A_WORKER = """
import multiprocessing, time
from ctseg.training.preempt import shielded, stop_on_signals

def worker():
    time.sleep(600)

if __name__ == "__main__":
    with stop_on_signals() as stop, shielded(stop):
        multiprocessing.get_context("fork").Process(target=worker, daemon=True).start()
    print("done", flush=True)
"""


def test_a_shielded_worker_alive_at_exit_does_not_hold_the_exit() -> None:
    """A loader worker blocks SIGTERM (`shielded`), the signal multiprocessing ends daemonic
    children with at exit before it waits for them: still alive then, it held `ctseg train`'s
    exit for ever, a finished training left RUNNING. It is killed instead."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_WORKER], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
