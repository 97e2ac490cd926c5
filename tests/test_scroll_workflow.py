"""The scroll target (workflow/rules/scroll.smk): config scroll.volume, a Zarr array read in
place, its statistics counted in scroll.parts jobs (rule scroll_statistics), predicted by `ctseg
predict` in scroll.parts jobs (rule scroll_part), post-processed in z-range jobs (rule
scroll_post) and finished (rule scroll_finish), through the shipped SLURM profile on a real
one-node cluster
(tests/slurm_cluster.py, as tests/test_slurm_cluster.py runs it).

The run is a random two-level U-Net saved as a trained run's last.pt (as tests/test_predict.py
builds its runs), not trained: Snakemake takes an existing last.pt as it is. One part is killed
with SIGKILL (`scancel --signal=KILL`) after it finished a tile; the profile resubmits it, the
new job goes on from the tiles in the work folder (results/<run>/scroll/.<name>.zarr.predict/,
which no rule declares, so nothing deletes it), and the finished mask is bit for bit the mask of
one `ctseg predict` of the whole volume, without parts, in tiles of another size.

A hook (written below into the test's folder and put on PYTHONPATH, which the jobs inherit)
holds the first part that finishes a tile right there, until it is killed, so that the kill
lands in a known place: observation only, no result changes.

Needs root, and Debian's slurm-wlm and munge (`sudo make test` installs both); the cluster test
is skipped otherwise, the dry run is not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import BIN, TINY_CONFIG, copy_workflow, run_snakemake
from slurm_cluster import edited_profile, one_node_cluster, unavailable
from test_predict import save_run

from ctseg.ome_zarr import check_image

SHAPE = (40, 48, 40)  # 3 x 3 x 3 chunks of 16, the last ones partial
PARTS = 3
RUN = "tiny"
NAME = "scroll1"
TIMEOUT = 300

# The first process of the test's jobs that finishes a tile (ctseg.inference.tiled writes
# tiles/<tile>.done into the work folder with os.replace) writes its pid to `held` and waits
# there for `release`, at most TIMEOUT s; every later one passes.
HOLD_HOOK = f'''"""Test-only, written by tests/test_scroll_workflow.py: hold the first part that
finishes a tile until it is killed."""
import os
import time
from pathlib import Path

HOLD_DIR = os.environ.get("CTSEG_TEST_SCROLL_HOLD")
if HOLD_DIR:
    _replace = os.replace

    def replace(src, dst, *args, **kwargs):
        _replace(src, dst, *args, **kwargs)
        path = Path(os.fsdecode(dst))
        if path.suffix != ".done" or path.parent.name != "tiles":
            return
        held, tmp = Path(HOLD_DIR) / "held", Path(HOLD_DIR) / f"held-{{os.getpid()}}"
        if held.exists():
            return
        tmp.write_text(str(os.getpid()))
        try:
            os.link(tmp, held)
        except FileExistsError:
            return
        deadline = time.monotonic() + {TIMEOUT}
        while not (Path(HOLD_DIR) / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    os.replace = replace
'''


def write_volume(path: Path, seed: int = 0) -> Path:
    """A uint8 Zarr array in chunks of 16: noise over sheets along z."""
    rng = np.random.default_rng(seed)
    zz = np.arange(SHAPE[0])[:, None, None]
    data = np.clip(rng.integers(0, 256, size=SHAPE) * 0.5 + 90 * np.sin(zz / 4) + 60, 0, 255)
    array = zarr.create_array(str(path), shape=SHAPE, chunks=(16, 16, 16), dtype="uint8")
    array[...] = data.astype(np.uint8)
    return path


def scroll_config(volume: Path) -> dict:
    # Fixed post-processing: tuned.json would be searched on the run's val volumes first.
    # Tiles of 16 x 16 x 32 under the small memory budget: 18, six a part.
    return {
        **TINY_CONFIG,
        "experiment": RUN,
        "infer": {"postprocess": "fixed"},
        "scroll": {"volume": str(volume), "parts": PARTS, "memory_budget_mb": 2},
    }


def test_a_dry_run_plans_a_job_per_part_and_a_finish_and_says_what_is_missing(tmp_path):
    workdir = copy_workflow(tmp_path, scroll_config(tmp_path / f"{NAME}.zarr"))
    # A local volume is an input: a missing one is named before any job runs.
    missing = run_snakemake(workdir, "-n", "scroll", check=False)
    assert missing.returncode != 0 and f"{NAME}.zarr" in missing.stdout + missing.stderr
    write_volume(tmp_path / f"{NAME}.zarr")
    out = run_snakemake(workdir, "-n", "-p", "scroll").stdout
    assert len(re.findall(r"^rule scroll_statistics:$", out, re.M)) == PARTS, out
    assert len(re.findall(r"^rule scroll_part:$", out, re.M)) == PARTS, out
    assert len(re.findall(r"^rule scroll_finish:$", out, re.M)) == 1, out
    for k in range(PARTS):
        assert f"--parts {PARTS} --part {k} --summary results/{RUN}/scroll/{NAME}/part-" in out
        assert f"--parts {PARTS} --statistics {k} --summary results/{RUN}/scroll/{NAME}/st" in out
    assert f"-o results/{RUN}/scroll/{NAME}.zarr --parts {PARTS} --finish " in out
    assert "rule train_model:" in out  # no last.pt: the run is trained first
    # The post-processing's one round (a threshold: the mask's write), a job per z-range.
    assert len(re.findall(r"^rule scroll_post:$", out, re.M)) == PARTS, out
    for k in range(PARTS):
        assert f"--parts {PARTS} --post filled --part {k} --summary" in out
    # Hysteresis and a closing: a component round with its merge, the write, the closing.
    rounds = run_snakemake(
        workdir, "-n", "-p", "scroll", "--config",
        "infer={postprocess: fixed, hysteresis_high: 0.8, closing_radius: 1}",
    ).stdout  # fmt: skip
    assert len(re.findall(r"^rule scroll_post:$", rounds, re.M)) == 3 * PARTS + 1, rounds
    assert f"--parts {PARTS} --post binarise  --summary" in rounds  # the merge: no --part
    for name in ("binarise", "filled", "closed"):
        assert f"--parts {PARTS} --post {name} --part {PARTS - 1} --summary" in rounds
    # A cross-validation predicts the scroll with every fold's model in each part.
    cv = run_snakemake(
        workdir, "-n", "-p", "scroll", "--config",
        f"scroll={{volume: {tmp_path / NAME}.zarr, parts: {PARTS}, run: exp001_cv.cv}}",
    ).stdout  # fmt: skip
    assert len(re.findall(r"^rule scroll_part:$", cv, re.M)) == PARTS, cv
    assert f"--run results/exp001_cv.cv -i {tmp_path / NAME}.zarr" in cv
    assert len(re.findall(r"^rule train_model:$", cv, re.M)) == 2  # its two folds
    # Without scroll.volume the target is one line naming the key.
    refused = run_snakemake(
        workdir, "-n", "scroll", "--config", "scroll={volume: null}", check=False
    )
    assert refused.returncode != 0
    assert "config scroll.volume: not set" in refused.stdout + refused.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with one_node_cluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


def wait_for(condition, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended before {what}:\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {TIMEOUT} s:\n{log.read_text()[-6000:]}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def test_parts_on_slurm_one_killed_and_resumed_give_the_single_process_mask(
    cluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    volume = write_volume(tmp_path / f"{NAME}.zarr")
    (tmp_path / "wf").mkdir()
    workdir = copy_workflow(tmp_path / "wf", scroll_config(volume))
    run_dir = save_run(workdir / "results" / RUN, 0)
    profile = edited_profile(
        workdir / "profiles" / "cluster",
        account="ctseg",
        cpu_partition="cpu",
        gpu_partition="gpu",
        max_threads=cluster.cpus,
    )
    hooks, holds = tmp_path / "hooks", tmp_path / "holds"
    hooks.mkdir()
    holds.mkdir()
    (hooks / "sitecustomize.py").write_text(HOLD_HOOK)
    # One thread per process, in the jobs and in the reference: the same arithmetic in both.
    plain_env = dict(
        cluster.env, PATH=f"{BIN}{os.pathsep}{cluster.env['PATH']}", OMP_NUM_THREADS="1"
    )
    env = dict(plain_env, PYTHONPATH=str(hooks), CTSEG_TEST_SCROLL_HOLD=str(holds))
    log = tmp_path / "snakemake.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(BIN / "snakemake"),
                "--workflow-profile",
                str(profile),
                "scroll",
                # Test speed only, as tests/test_slurm_cluster.py.
                "--slurm-init-seconds-before-status-checks",
                "1",
                "--slurm-keep-successful-logs",
            ],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    # Meanwhile the reference: one process, no parts, the rule's settings but the default
    # memory budget (one tile of the whole volume), with the hook off.
    reference = tmp_path / "reference.zarr"
    single = subprocess.Popen(
        [str(BIN / "ctseg"), "predict", "--run", str(run_dir), "-i", str(volume),
         "-o", str(reference), "--overlap", "0.5", "--batch-size", "4", "--threshold", "0.5",
         "--min-component-voxels", "0", "--summary", str(tmp_path / "reference.json")],
        cwd=workdir, env=plain_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # The first part to finish a tile is held there: kill its job.
        wait_for((holds / "held").exists, "a part held at its first tiles/*.done", proc, log)
        pid = int((holds / "held").read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        killed = int(argv[argv.index(b"--part") + 1])
        running = [
            j
            for j in cluster.jobs()
            if j["comment"].startswith("rule_scroll_part") and j["state"] == "RUNNING"
        ]
        assert len(running) == 1, running  # one GPU on the node: one part at a time
        first = running[0]["id"]
        assert running[0]["comment"].endswith(f"_{killed}_{PARTS}"), running
        cluster.run("scancel", "--signal=KILL", first)
        wait_for(lambda: not alive(pid), "the killed part's end", proc, log)
        (holds / "release").touch()  # nothing is held any more; a hold would be a bug
        assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()[-6000:]
        cluster_seconds = time.monotonic() - started
        output, _ = single.communicate(timeout=TIMEOUT)
        assert single.returncode == 0, output[-3000:]
    finally:
        for child in (proc, single):
            if child.poll() is None:
                child.kill()
                child.wait()
    text = log.read_text()

    # The jobs: three statistics jobs, the three parts (the killed one twice), the
    # post-processing's one round in three z-range jobs, then the finish; only the parts on a
    # GPU.
    submitted = re.findall(
        r"Job \d+ has been submitted with SLURM jobid (\d+) .*?/rule_(\w+?)/", text
    )
    assert sorted(rule for _, rule in submitted) == (
        ["scroll_finish"] + ["scroll_part"] * 4 + ["scroll_post"] * 3 + ["scroll_statistics"] * 3
    ), text
    for job_id, rule in submitted:
        job = cluster.job(job_id)
        gpu = re.search(r"gpu[:=]1$", job.get("TresPerJob", ""))  # gres:gpu:1 (22.05)
        assert bool(gpu) == (rule == "scroll_part"), job
    assert cluster.job(first)["JobState"] in ("FAILED", "CANCELLED"), cluster.job(first)

    # The killed part's second job went on from the tiles of its first; the others ran once.
    scroll = workdir / "results" / RUN / "scroll"
    for k in range(PARTS):
        part = json.loads((scroll / NAME / f"part-{k}-of-{PARTS}.json").read_text())["part"]
        assert part["tiles"] == 6 == part["tiles_computed"] + part["tiles_resumed"], part
        assert (part["tiles_resumed"] > 0) == (k == killed), (k, killed, part)
    logs = workdir / "results" / "logs" / "scroll"
    attempts = sorted((logs / f"{RUN}_{NAME}_part-{killed}-of-{PARTS}.log.attempts").iterdir())
    assert [a.name.split("-")[1] for a in attempts][0] == first, attempts
    done = f"ctseg predict: part {killed + 1} of {PARTS} (--part {killed}) of {volume} done"
    assert len(attempts) == 2, attempts
    assert done not in attempts[0].read_text() and done in attempts[1].read_text()
    assert not (scroll / f".{NAME}.zarr.predict").exists()  # removed by the finish

    # The same mask, bit for bit, as one process without parts; a valid OME-Zarr image.
    mask = scroll / f"{NAME}.zarr"
    check_image(mask)
    ours = zarr.open_group(str(mask), mode="r")["0"][...]
    theirs = zarr.open_group(str(reference), mode="r")["0"][...]
    assert ours.dtype == theirs.dtype == np.uint8 and ours.shape == SHAPE
    assert 0 < int(ours.sum()) < ours.size  # not a trivial mask
    assert np.array_equal(ours, theirs)
    summary = json.loads((scroll / NAME / "summary.json").read_text())
    assert summary["outputs"]["foreground_voxels"] == int(ours.sum()), summary
    # The statistics jobs read the volume once between them; no part and not the finish did.
    read = [
        json.loads((scroll / NAME / f"{kind}-{k}-of-{PARTS}.json").read_text())
        for kind in ("statistics", "part")
        for k in range(PARTS)
    ]
    assert sum(r["statistics_bytes_read"] for r in read[:PARTS]) == int(np.prod(SHAPE))
    assert [r["statistics_bytes_read"] for r in read[PARTS:]] == [0] * PARTS
    assert summary["statistics_bytes_read"] == 0
    print(
        f"\nscroll on SLURM: {cluster_seconds:.0f} s to the end of the cluster run, "
        f"{time.monotonic() - started:.0f} s in all"
    )
