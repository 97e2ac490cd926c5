"""Fixtures shared by the tests: a private copy of the workflow and a way to run snakemake on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Whole modules of the slow tier (see pyproject's `slow` marker); single slow tests elsewhere
# carry @pytest.mark.slow themselves.
SLOW_MODULES = {
    "test_workflow",
    "test_workflow_phase6",
    "test_phases_as_shipped",
    "test_ddp",
    "test_slurm",
    "test_slurm_cluster",
    "test_bench_smoke",
    "test_workflow_runs",
    "test_scroll_workflow",
}


# Fixtures that start real training processes and kill them (test_train's resume checks).
SLOW_FIXTURES = {"resume_runs"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        in_slow_module = item.module is not None and item.module.__name__ in SLOW_MODULES
        if in_slow_module or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# The smallest dataset that still has several chunks and blocks per axis.
TINY_CONFIG = {
    "dataset": "demo",
    "demo": {"n_train": 2, "n_test": 1, "shape": [40, 48, 40], "scroll_ids": [7, 8], "seed": 3},
    "convert": {
        "chunks": [16, 16, 16],
        "shards": None,
        "codec": {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"},
        "memory_budget_mb": 1,
    },
    "targets": {
        "clip_distance": 4,
        "skeleton_method": "medial_surface",
        "tube_dilations": 2,
        "block": [32, 32, 32],
        "max_samples": 500,
        "seed": 0,
        "workers": 1,
    },
}


# An experiment that trains a two-level U-Net for a handful of steps.
TINY_EXPERIMENT = {
    "name": "tiny",
    "subset": {"ids": None, "scroll_ids": None, "fraction": 1.0},
    "split": {"val_ids": None, "val_fraction": 0.5, "seed": 0},
    "source": None,
    "scratch_format": "raw",
    "data": {
        "patch_size": [16, 16, 16],
        "fg_fraction": 0.5,
        "runtime_targets": False,
        "augment": {"flip": True, "permute": True, "intensity": {"prob": 0.5}},
    },
    "model": {"filters": [4, 8], "deep_supervision": True},
    "loss": {"weights": {"bce": 1.0, "dice": 1.0, "cldice": 0.5, "skel_recall": 0.5}},
    "train": {"epochs": 2, "steps_per_epoch": 3, "val_batches": 1, "warmup_steps": 1},
    "trial": {"steps": 3, "warmup_steps": 1, "ceiling_steps": 2, "phases": [0, 1]},
}


def copy_workflow(dest: Path, config: dict | None = None) -> Path:
    """Copy the workflow definition (not results, not data) so each test owns its directory."""
    (dest / "workflow").mkdir(exist_ok=True)
    shutil.copy2(REPO / "workflow" / "Snakefile", dest / "workflow" / "Snakefile")
    for folder in ("workflow/rules", "workflow/schemas", "workflow/profiles", "workflow/report"):
        if (REPO / folder).exists():
            shutil.copytree(REPO / folder, dest / folder)
    shutil.copytree(REPO / "config", dest / "config")
    shutil.copy2(REPO / "environment.yml", dest / "environment.yml")
    if config is not None:
        (dest / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    (dest / "config" / "experiments" / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    return dest


def run_snakemake(
    workdir: Path, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {}))
    proc = subprocess.run(
        [str(BIN / "snakemake"), *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.fixture
def workflow_dir(tmp_path: Path) -> Path:
    return copy_workflow(tmp_path, TINY_CONFIG)


def settings_args(directory: Path, experiment: dict, phases: dict) -> list[str]:
    """`--experiment FILE --phases FILE` as the rules pass them, the files written from mappings
    (the experiment file is named for the experiment, as ctseg.config requires)."""
    directory.mkdir(parents=True, exist_ok=True)
    exp_path = directory / f"{experiment['name']}.yaml"
    exp_path.write_text(yaml.safe_dump(json.loads(json.dumps(experiment))))
    phases_path = directory / "phases.yaml"
    table = {int(k): json.loads(json.dumps(dict(v))) for k, v in phases.items()}
    phases_path.write_text(yaml.safe_dump({"phases": table}))
    return ["--experiment", str(exp_path), "--phases", str(phases_path)]


# --------------------------------------------------------------------------- S3 on loopback
@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3-compatible HTTP server on loopback (moto's standalone server)."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as patch:
        # Dummy credentials, and no profile, config file or instance metadata lookups that
        # could leave the machine.
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            patch.delenv(name, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def s3_options(endpoint: str) -> dict:
    """fsspec's storage options for the loopback server's test credentials."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def upload(endpoint: str, local: Path, bucket: str, prefix: str) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(local).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
