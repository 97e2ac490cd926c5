"""The shipped SLURM profile on a real SLURM cluster of one node (tests/slurm_cluster.py).

`snakemake --workflow-profile <the shipped profile, only its EDIT lines filled in>` runs the
tiny dataset's preprocessing and a short training through Debian's slurm-wlm 22.05: real
sbatch, squeue, scancel and scontrol, real job steps (the plugin's jobstep Snakemake under
srun), no accounting. Along the way the test stops the training job the ways a cluster does:

1. `scancel -s TERM` mid-run (a preemption's or a user's stop): `ctseg train` checkpoints and
   exits 75, SLURM records the job FAILED with ExitCode=1:0, and the profile resubmits it;
2. `scontrol requeue` of the resubmitted job (what PreemptMode=REQUEUE does): the same job id
   runs again and resumes;
3. the profile's early signal (`--signal=URG@...`, sent now with `scancel -s URG`) during the
   last step: the training ends, and the job counts as done, nothing deleted or resubmitted.

At the end last.pt holds the same weights as an uninterrupted run's, and every attempt's log
is kept. A hook (tests/slurm_hooks/sitecustomize.py, on PYTHONPATH, which the jobs inherit)
holds `ctseg train` at chosen samples until the test's signal has reached it, so each signal
lands in a known step; it changes no result.

Needs root, and Debian's slurm-wlm and munge (`sudo make test` installs both); skipped
otherwise. tests/test_slurm.py keeps a fake sbatch for what one node cannot show: the
requests of larger phases (5 CPUs, 10 GB, typed GPUs `--gpus=h100:1`) that this node could not
grant, the plugin's account check against accounting (slurmdbd), and the placeholder refusal
without root.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import BIN, TINY_CONFIG, TINY_EXPERIMENT, copy_workflow, run_snakemake
from slurm_cluster import edited_profile, one_node_cluster, unavailable

from ctseg.training.checkpoint import load_checkpoint

HOOKS = Path(__file__).resolve().parent / "slurm_hooks"
EXPERIMENT = "tiny"
# 2 epochs of 6 steps, batch 1 (phase 0): sample i is fetched in step i + 1.
EPOCH_STEPS = 6
STEPS = 2 * EPOCH_STEPS
TERM_AT = 3  # step 4: stopped by scancel -s TERM
REQUEUE_AT = 7  # step 8: stopped by scontrol requeue
URG_AT = STEPS - 1  # the last step: the early signal arrives, the training ends anyway
TIMEOUT = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with one_node_cluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


def train_job(cluster, exclude: set[str] = frozenset()) -> str:
    jobs = [
        j
        for j in cluster.jobs()
        if j["comment"].startswith("rule_train_model") and j["id"] not in exclude
    ]
    assert len(jobs) == 1, jobs
    return jobs[0]["id"]


def wait_for(condition, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended before {what}:\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {TIMEOUT} s:\n{log.read_text()[-6000:]}")
        time.sleep(0.2)


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def reference_run(workdir: Path, log: str, dest: Path, env: dict) -> subprocess.Popen:
    """The training command of the rule's job (from Snakemake's log), uninterrupted, with its
    outputs and checkpoints in `dest`."""
    command = re.search(r"Shell command: .*&& exec (ctseg train .*?) > ", log).group(1)
    argv = shlex.split(command)
    for option, name in (
        ("--out", "train"),
        ("--state-dir", "checkpoints"),
        ("--weights", "last.pt"),
    ):
        argv[argv.index(option) + 1] = str(dest / name)
    return subprocess.Popen(
        argv, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def test_the_shipped_profile_on_a_real_cluster_survives_stop_requeue_and_early_signal(
    cluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    (tmp_path / "wf").mkdir()
    workdir = copy_workflow(tmp_path / "wf", {**TINY_CONFIG, "experiment": EXPERIMENT, "phase": 0})
    experiment = copy.deepcopy(TINY_EXPERIMENT)
    experiment["train"].update(epochs=2, steps_per_epoch=EPOCH_STEPS)
    (workdir / "config" / "experiments" / f"{EXPERIMENT}.yaml").write_text(
        yaml.safe_dump(experiment)
    )
    weights = workdir / "results" / EXPERIMENT / "last.pt"
    target = str(weights.relative_to(workdir))
    # The demo volumes and their conversion locally (a minute less of job start-ups); the
    # rest of the preprocessing, targets, split and stage, runs as SLURM jobs.
    run_snakemake(workdir, target, "--until", "convert_label", "--cores", "2")
    profile = edited_profile(
        workdir / "profiles" / "cluster",
        account="ctseg",
        cpu_partition="cpu",
        gpu_partition="gpu",
        max_threads=cluster.cpus,
    )
    holds = tmp_path / "holds"
    holds.mkdir()
    # One thread per process here and in the reference: the same arithmetic in both.
    plain_env = dict(
        cluster.env, PATH=f"{BIN}{os.pathsep}{cluster.env['PATH']}", OMP_NUM_THREADS="1"
    )
    env = dict(
        plain_env,
        PYTHONPATH=str(HOOKS),
        CTSEG_TEST_HOLD_DIR=str(holds),
        CTSEG_TEST_HOLD_AT=f"{TERM_AT},{REQUEUE_AT},{URG_AT}",
    )
    log = tmp_path / "snakemake.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(BIN / "snakemake"),
                "--workflow-profile",
                str(profile),
                target,
                # Test speed only: the first status query 1 s after a submission (40 s by
                # default), and the logs of successful jobs kept to read.
                "--slurm-init-seconds-before-status-checks",
                "1",
                "--slurm-keep-successful-logs",
            ],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    reference = None
    try:
        # 1. A stop mid-run: the job checkpoints after step 4, fails, and is resubmitted.
        wait_for((holds / f"held-{TERM_AT}").exists, "training step 4", proc, log)
        # Meanwhile, the uninterrupted run to compare with, on the same staged data.
        reference = reference_run(workdir, log.read_text(), tmp_path / "reference", plain_env)
        first = train_job(cluster)
        cluster.run("scancel", "--signal=TERM", first)
        wait_for(
            lambda: cluster.job(first)["JobState"] == "FAILED", "the stopped job's end", proc, log
        )
        # What SLURM records: the jobstep Snakemake's exit status, not ctseg's 75.
        assert cluster.job(first)["ExitCode"] == "1:0", cluster.job(first)

        # 2. The resubmitted job resumes at step 5, and is requeued during step 8.
        wait_for((holds / f"held-{REQUEUE_AT}").exists, "training step 8", proc, log)
        second = train_job(cluster, exclude={first})
        cluster.run("scontrol", "requeue", second)
        # SLURM holds a requeued job for about two minutes (its BeginTime); release it now.
        wait_for(lambda: cluster.job(second)["JobState"] == "PENDING", "the requeue", proc, log)
        cluster.run("scontrol", "update", f"JobId={second}", "StartTime=now")

        # 3. The early signal during the last step: the training ends, the job is done.
        wait_for((holds / f"held-{URG_AT}").exists, "the last step", proc, log)
        cluster.run("scancel", "--signal=URG", second)
        assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()[-6000:]
        cluster_seconds = time.monotonic() - started
        assert reference.wait(timeout=TIMEOUT) == 0, reference.stderr.read()[-3000:]
    finally:
        for child in (proc, reference):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
    output = log.read_text()
    job = cluster.job(second)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", job

    # The SLURM jobs: preprocessing on the CPU partition, training on the GPU one, submitted
    # twice (the requeue and the early signal cost no submission), none asking for more CPUs
    # than the node has: stage_records declares 4 threads and gets the profile's max-threads.
    jobs = {j["id"]: j for j in cluster.jobs()}
    submitted = re.findall(
        r"Job \d+ has been submitted with SLURM jobid (\d+) .*?/rule_(\w+?)/", output
    )
    rules = sorted(rule for _, rule in submitted)
    assert rules == ["split", "stage_records", "targets", "targets", "train_model", "train_model"]
    for job_id, rule in submitted:
        assert jobs[job_id]["partition"] == ("gpu" if rule == "train_model" else "cpu"), jobs[
            job_id
        ]
        assert int(jobs[job_id]["cpus"]) <= cluster.cpus, jobs[job_id]
        if rule == "stage_records":
            assert int(jobs[job_id]["cpus"]) == min(4, cluster.cpus), jobs[job_id]
    assert "Removing output files of failed job train_model" not in output, output[-6000:]

    # Every attempt's log: stopped at step 4; resumed, stopped at step 8; resumed to the end.
    attempts = sorted((workdir / "results/logs/train" / f"{EXPERIMENT}.log.attempts").iterdir())
    assert [a.name.split("-")[1] for a in attempts] == [first, second, second], attempts
    texts = [a.read_text() for a in attempts]
    assert "stopped by SIGTERM at step 4 (epoch 0)" in texts[0], texts[0][-3000:]
    assert "resumed at step 4" in texts[1], texts[1][-3000:]
    assert "stopped by SIGTERM at step 8 (epoch 1)" in texts[1], texts[1][-3000:]
    assert "resumed at step 8" in texts[2] and "stopped by" not in texts[2], texts[2][-3000:]

    # The same weights as the uninterrupted run.
    ours, theirs = model_weights(weights), model_weights(tmp_path / "reference" / "last.pt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    print(
        f"\nreal SLURM test: {cluster_seconds:.0f} s to the end of the cluster run, "
        f"{time.monotonic() - started:.0f} s in all"
    )
