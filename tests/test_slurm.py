"""The SLURM profile, driven through the real snakemake-executor-plugin-slurm and a fake sbatch.

Nothing inside Snakemake is mocked: `snakemake --workflow-profile <profile>` runs as a user would
run it on a login node, with fake SLURM commands (tests/fake_slurm/) first on PATH. The fake
`sbatch` records its arguments and never runs the job; the fake `squeue` then reports every job
as FAILED, so the run ends at the plugin's first status check, or, for `train`, after the
resubmissions the profile allows it.

tests/test_slurm_cluster.py runs the profile on a real one-node cluster. The fake stays for what
that cluster cannot show: the requests of a larger phase (5 CPUs, 10 GB, a GPU model) that a
2-CPU node without GPU types could not grant, the plugin's account check against the accounts
sacctmgr lists (a real cluster needs accounting, slurmdbd, for that), and, without root, that
an unedited placeholder is refused before sbatch is ever called.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import snakemake_executor_plugin_slurm  # noqa: F401  (a dependency: fail loudly if missing)
import yaml
from conftest import BIN, TINY_CONFIG, copy_workflow, run_snakemake
from slurm_cluster import SHIPPED_PROFILE, edited_profile

FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
PROFILE = "workflow/profiles/slurm"
ACCOUNT = "proj01"  # the EDIT values a user fills in; the fake sinfo lists cpu and gpu
EXPERIMENT = "exp001"
TRAIN_PHASE = 3  # 4 loader workers: threads and memory differ from the trial's phase
TRAIN_RETRIES = 1  # the profile's preemptible-retries (10), lowered for speed: each costs a minute


def sbatch_options(argv: list[str]) -> dict[str, str | bool]:
    """`--opt value`, `--opt=value` and `-o value` pairs; bare flags map to True."""
    options: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            assert key not in options, f"sbatch option {key} given twice: {argv}"
            options[key] = value
        elif arg.startswith("-") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            assert arg not in options, f"sbatch option {arg} given twice: {argv}"
            options[arg] = argv[i + 1]
            i += 1
        else:
            options[arg] = True
        i += 1
    return options


def expected_gpus(rule_resources: dict) -> str:
    """What `--gpus` must say for one GPU: the plugin prefixes the model when one is set."""
    model = rule_resources.get("gpu_model")
    return f"{model}:1" if model else "1"


def slurm_env(log: Path, account: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # A test run inside a SLURM job, or a user's global profile, must not leak in.
        if not k.startswith("SLURM_")
        and k not in ("SNAKEMAKE_PROFILE", "SNAKEMAKE_SLURM_PARTITIONS")
    }
    env["PATH"] = os.pathsep.join([str(FAKE_SLURM), str(BIN), os.environ.get("PATH", "")])
    env["FAKE_SLURM_LOG"] = str(log)
    # sacctmgr lists the profile's account, so the plugin's account check passes.
    env["FAKE_SLURM_ACCOUNTS"] = account
    env["FAKE_SLURM_STATE"] = "FAILED"
    return env


def test_slurm_profile_requests_what_the_config_says(tmp_path: Path):
    (tmp_path / "wf").mkdir()
    workdir = copy_workflow(
        tmp_path / "wf", {**TINY_CONFIG, "experiment": EXPERIMENT, "phase": TRAIN_PHASE}
    )
    edited = edited_profile(
        workdir / "profiles" / "edited", account=ACCOUNT, cpu_partition="cpu", gpu_partition="gpu"
    )
    profile = yaml.safe_load((edited / "config.yaml").read_text())
    # Else the jobs would run here, for real.
    assert profile["executor"] == "slurm"
    # Training, and nothing else, is resubmitted until it finishes, a stated number of times.
    assert profile["preemptible-rules"] == ["train_model"] and profile["preemptible-retries"] >= 5
    defaults = profile["default-resources"]
    per_rule = profile["set-resources"]
    phases = yaml.safe_load((workdir / "config" / "phases.yaml").read_text())["phases"]
    experiment = yaml.safe_load(
        (workdir / "config" / "experiments" / f"{EXPERIMENT}.yaml").read_text()
    )
    trial_phase = experiment["trial"]["phases"][0]  # the first trial waits on no other

    # Everything the GPU jobs read is built locally first (default profile, no SLURM).
    run_snakemake(workdir, "stage")
    test_id = str(pd.read_csv(workdir / "resources" / "demo" / "test.csv", dtype=str)["id"][0])

    log = tmp_path / "slurm.jsonl"
    targets = [
        "train",
        f"results/{EXPERIMENT}/phases/phase{trial_phase}/summary.json",
        # A preprocessing job: a test volume is not upstream of training.
        f"results/preprocessed/demo/zarr/images/{test_id}.zarr",
    ]
    proc = subprocess.run(
        [
            str(BIN / "snakemake"),
            "--workflow-profile",
            str(edited),
            # Test speed only: the first status query 2 s after submission (40 s by default),
            # no resubmission of the other jobs the fake reports as FAILED, and fewer of train.
            "--slurm-init-seconds-before-status-checks",
            "2",
            "--retries",
            "0",
            "--preemptible-retries",
            str(TRAIN_RETRIES),
            # The fake fails every job: without this, the other jobs' failures would end the
            # run before train's resubmissions are used up.
            "--keep-going",
            *targets,
        ],
        cwd=workdir,
        env=slurm_env(log, str(defaults["slurm_account"])),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr

    # The jobs went through sbatch and the plugin's sacct/squeue status query, and nothing ran
    # locally: the fake reported them FAILED and none of their outputs exists.
    assert proc.returncode != 0, output
    assert "SLURM status is: 'FAILED'" in output, output
    assert not (workdir / "results" / EXPERIMENT / "last.pt").exists()
    assert not (workdir / "results" / EXPERIMENT / "phases" / f"phase{trial_phase}").exists()
    assert not (workdir / "results/preprocessed/demo/zarr/images" / f"{test_id}.zarr").exists()

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    status_queries = [c for c in calls if c["cmd"] in ("sacct", "squeue") and "--name" in c["argv"]]
    assert status_queries, "the plugin never asked for the jobs' state"
    submitted = {}
    submissions: dict[str, int] = {}
    for call in calls:
        if call["cmd"] == "sbatch":
            options = sbatch_options(call["argv"])
            submitted[options["--comment"]] = (options, call["script"])
            submissions[options["--comment"]] = submissions.get(options["--comment"], 0) + 1
    # The job of rule train_model (`train` only collects the trained runs).
    train_key = f"rule_train_model_wildcards_{EXPERIMENT}"
    trial_key = f"rule_train_trial_wildcards_{EXPERIMENT}_{trial_phase}"
    convert_key = f"rule_convert_image_wildcards_{test_id}"
    # Exactly the three target jobs: what ran locally is not resubmitted.
    assert set(submitted) == {train_key, trial_key, convert_key}, output
    # A failed train job (here every attempt; on a cluster one that stopped itself ahead of
    # its time limit) is resubmitted TRAIN_RETRIES times; the others, under --retries 0, never.
    assert submissions == {train_key: 1 + TRAIN_RETRIES, trial_key: 1, convert_key: 1}, output

    account = str(defaults["slurm_account"])
    for key, rule, phase in (
        (train_key, "train_model", TRAIN_PHASE),
        (trial_key, "train_trial", trial_phase),
    ):
        options, script = submitted[key]
        workers = phases[phase]["workers"]
        # The rule's own resources (common.smk): one CPU per loader worker plus the main
        # process; 4000 MB for the main process and 1500 MB per worker.
        assert options["--cpus-per-task"] == str(workers + 1), (rule, options)
        assert options["--mem"] == str(4000 + 1500 * workers), (rule, options)
        assert options["--gpus"] == expected_gpus(per_rule[rule]), (rule, options)
        assert options["-t"] == str(per_rule[rule]["runtime"]), (rule, options)
        assert options["-p"] == per_rule[rule]["slurm_partition"], (rule, options)
        assert options["-A"] == account, (rule, options)
        assert options["-D"] == str(workdir), (rule, options)
        # The job script runs this very job, through the jobstep executor on the node.
        assert f"--target-jobs '{rule}:" in script, script
        assert "--executor slurm-jobstep" in script, script
    # Only training asks for the early signal: SIGURG ahead of its time limit, as the profile
    # says (the job then checkpoints and stops; see docs/cluster.md).
    signal_option = per_rule["train_model"]["slurm_extra"].split("=", 1)
    assert signal_option[0] == "--signal" and signal_option[1].startswith("URG@")
    assert submitted[train_key][0]["--signal"] == signal_option[1]
    assert "--signal" not in submitted[trial_key][0] and "--signal" not in submitted[convert_key][0]

    options, script = submitted[convert_key]
    assert not {"--gpus", "--gres", "--gpus-per-task", "--gpus-per-node"} & set(options), options
    assert options["--cpus-per-task"] == "1", options
    assert options["--ntasks"] == "1", options
    assert options["--mem"] == str(defaults["mem_mb"]), options
    assert options["-t"] == str(defaults["runtime"]), options
    assert options["-p"] == defaults["slurm_partition"], options
    assert options["-A"] == account, options
    assert f"--target-jobs 'convert_image:id={test_id}'" in script, script


def test_an_unedited_placeholder_is_refused_before_anything_is_submitted(tmp_path: Path):
    (tmp_path / "wf").mkdir()
    workdir = copy_workflow(tmp_path / "wf", TINY_CONFIG)
    assert 'slurm_account: "CHANGE_ME"' in SHIPPED_PROFILE.read_text()
    log = tmp_path / "slurm.jsonl"
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--workflow-profile", PROFILE],
        cwd=workdir,
        env=slurm_env(log, "CHANGE_ME"),  # even where the account check would pass
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "CHANGE_ME" in line]
    assert len(errors) == 1, proc.stderr
    expected = f"ctseg: {PROFILE}/config.yaml: the placeholder 'CHANGE_ME' is still in "
    assert errors[0].startswith(expected), errors
    for where in (
        "default-resources: slurm_account",
        "default-resources: slurm_partition",
        "set-resources: train_model: slurm_partition",
        "set-resources: train_trial: slurm_partition",
        "set-resources: scroll_part: slurm_partition",
    ):
        assert where in errors[0], errors
    assert "Traceback" not in proc.stderr, proc.stderr
    # Refused while the workflow was read: no SLURM command ran, nothing was submitted.
    assert not log.exists() or "sbatch" not in log.read_text()
