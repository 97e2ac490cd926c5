"""A real one-node SLURM cluster for the tests, and the shipped SLURM profile with its EDIT lines
filled in.

`one_node_cluster` starts Debian's munged, slurmctld and slurmd (packages `munge` and
`slurm-wlm`, which `make test` installs when run as root) as plain processes, no systemd: a
munge key, slurm.conf and gres.conf written into a temporary folder, the daemons on free ports
of the loopback. The node is this machine, `localhost`, with the CPUs and memory `slurmd -C`
finds. There is no accounting (no slurmdbd), as on many small clusters: `sacct` fails there.
Two partitions, `cpu` and `gpu`, share the node; the node offers one GPU as a count
(`gres/gpu` backed by /dev/null), so that `--gpus=1` is accepted and the job runs on the CPU.
The daemons run as root and so do the jobs, which is why the cluster needs root.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SHIPPED_PROFILE = REPO / "workflow" / "profiles" / "slurm" / "config.yaml"
DAEMONS = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "scontrol",
    "scancel",
)
HOW_TO_RUN = "run `sudo make test`, which installs Debian's slurm-wlm and munge"


def binary(name: str) -> str | None:
    """The program's path; daemons live in /usr/sbin, which a PATH may lack."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin:/sbin")


def unavailable() -> str | None:
    """Why the cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return f"a real SLURM cluster needs root (its daemons and jobs run as root): {HOW_TO_RUN}"
    missing = [d for d in DAEMONS if binary(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed: {HOW_TO_RUN}"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_line() -> str:
    """`slurmd -C`'s description of this machine (CPUs, sockets, cores, RealMemory), named
    localhost."""
    argv = [binary("slurmd"), "-C"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("NodeName="))
    return re.sub(r"^NodeName=\S+", "NodeName=localhost NodeAddr=127.0.0.1", line)


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    cpus: int
    memory_mb: int
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True) -> str:
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld still knows (finished ones for MinJobAge, 300 s): id, state,
        CPUs, partition, the plugin's comment (rule and wildcards)."""
        out = self.run("squeue", "--states=all", "--noheader", "--format=%i|%T|%C|%P|%k|%r")
        keys = ("id", "state", "cpus", "partition", "comment", "reason")
        return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines()]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields, such as JobState, ExitCode, Restarts."""
        out = self.run("scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("log/*.log"))
        )


def _write_config(root: Path, ports: tuple[int, int]) -> tuple[Path, int, int]:
    node = node_line()
    cpus = int(re.search(r"CPUs=(\d+)", node).group(1))
    memory = int(re.search(r"RealMemory=(\d+)", node).group(1))
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=ctsegtest",
                "SlurmctldHost=localhost(127.0.0.1)",
                f"SlurmctldPort={ports[0]}",
                f"SlurmdPort={ports[1]}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root}/munge/munge.socket",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log",
                f"SlurmdLogFile={root}/log/slurmd.log",
                # No cgroups, no systemd: processes are tracked by their parent ids.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                # No accounting (no slurmdbd): sacct fails, as on many small clusters.
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerType=sched/backfill",
                "SchedulerParameters=bf_interval=1,sched_interval=1",
                "MpiDefault=none",
                "ReturnToService=2",
                # Finished jobs stay listed an hour (300 s by default), for the test to read.
                "MinJobAge=3600",
                "GresTypes=gpu",
                f"{node} Gres=gpu:1 State=UNKNOWN",
                "PartitionName=cpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                "PartitionName=gpu Nodes=localhost MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    # A GPU as a count only: jobs may ask for --gpus=1 and run on the CPU.
    (root / "gres.conf").write_text("NodeName=localhost Name=gpu File=/dev/null\n")
    return conf, cpus, memory


@contextlib.contextmanager
def one_node_cluster(root: Path, timeout: float = 60) -> Iterator[Cluster]:
    """munged, slurmctld and slurmd, until the node is idle; stopped (every job cancelled
    first) when the block ends."""
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o711)  # munged wants its socket's folder reachable by all
    key = root / "munge" / "munge.key"
    subprocess.run([binary("mungekey"), "--create", "--keyfile", str(key)], check=True)
    conf, cpus, memory = _write_config(root, (_free_port(), _free_port()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["SLURM_CONF"] = str(conf)
    # The jobstep plugin starts the job's step with `srun` in an environment stripped of every
    # SLURM_* variable, SLURM_CONF included; a real cluster's srun finds /etc/slurm/slurm.conf.
    # This srun (first on PATH, which jobs inherit) only puts SLURM_CONF back for the real one.
    shims = root / "bin"
    shims.mkdir(exist_ok=True)
    srun = shims / "srun"
    srun.write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec {binary("srun")} "$@"\n')
    srun.chmod(0o755)
    env["PATH"] = f"{shims}{os.pathsep}{env.get('PATH', '')}"
    cluster = Cluster(root, env, cpus, memory)
    daemons = [
        [
            binary("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={root}/munge/munge.socket",
            f"--pid-file={root}/munge/munged.pid",
            f"--log-file={root}/log/munged.log",
            f"--seed-file={root}/munge/munged.seed",
        ],
        [binary("slurmctld"), "-D", "-f", str(conf)],
        [binary("slurmd"), "-D", "-f", str(conf), "-N", "localhost"],
    ]
    try:
        for argv in daemons:
            name = Path(argv[0]).name
            out = open(root / "log" / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
            cluster.processes.append(
                subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
            out.close()
            if name == "munged":
                _wait_for(lambda: (root / "munge" / "munge.socket").exists(), 10, cluster)
        _wait_for(
            # One line, both partitions: sinfo merges rows that print the same.
            lambda: (
                cluster.run("sinfo", "--noheader", "--format=%T", check=False).split() == ["idle"]
            ),
            timeout,
            cluster,
        )
        yield cluster
    finally:
        _stop(cluster)


def _wait_for(condition, timeout: float, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in cluster.processes:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{proc.args[0]} exited ({proc.returncode}):\n{cluster.log_tail()}"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the one-node cluster was not ready in {timeout} s:\n{cluster.log_tail()}"
            )
        time.sleep(0.2)


def _stop(cluster: Cluster) -> None:
    """Cancel every job, wait for them to go, then stop the daemons (slurmd first)."""
    if all(p.poll() is None for p in cluster.processes) and len(cluster.processes) == 3:
        cluster.run("scancel", "--full", "--user=root", check=False)
        with contextlib.suppress(RuntimeError):
            _wait_for(
                lambda: not any(j["state"] in ("RUNNING", "COMPLETING") for j in cluster.jobs()),
                60,
                cluster,
            )
    for proc in reversed(cluster.processes):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ----------------------------------------------------------------------------- the profile
def edited_profile(
    dest: Path,
    *,
    account: str,
    cpu_partition: str,
    gpu_partition: str,
    max_threads: int | None = None,
) -> Path:
    """The shipped profile with only its EDIT values changed, written to `dest`/config.yaml.
    Checks that nothing else differs."""
    text = SHIPPED_PROFILE.read_text()
    shipped = yaml.safe_load(text)
    edits = [
        ('slurm_account: "CHANGE_ME"', f'slurm_account: "{account}"', 1),
        (
            '  slurm_partition: "CHANGE_ME"\n  # Host',
            f'  slurm_partition: "{cpu_partition}"\n  # Host',
            1,
        ),
        ('    slurm_partition: "CHANGE_ME"', f'    slurm_partition: "{gpu_partition}"', 3),
    ]
    if max_threads is not None:
        edits.append(
            (f"max-threads: {shipped['max-threads']}\n", f"max-threads: {max_threads}\n", 1)
        )
    for old, new, count in edits:
        assert text.count(old) == count, f"the shipped profile changed: {old!r}"
        text = text.replace(old, new)
    edited = yaml.safe_load(text)
    # What was changed, and nothing else.
    assert edited["default-resources"]["slurm_account"] == account
    assert edited["default-resources"]["slurm_partition"] == cpu_partition
    for rule in ("train_model", "train_trial", "scroll_part"):
        assert edited["set-resources"][rule]["slurm_partition"] == gpu_partition
        edited["set-resources"][rule]["slurm_partition"] = shipped["set-resources"][rule][
            "slurm_partition"
        ]
    for key in ("slurm_account", "slurm_partition"):
        edited["default-resources"][key] = shipped["default-resources"][key]
    edited["max-threads"] = shipped["max-threads"]
    assert edited == shipped
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(text)
    return dest
