"""A stand-in for the SLURM commands snakemake-executor-plugin-slurm calls, for tests.

The executables beside this file (sbatch, sacct, squeue, scancel, sinfo, sacctmgr, sshare,
scontrol) all land here. Put this folder first on PATH and set:

FAKE_SLURM_LOG        required: a JSON-lines file. Every call appends
                      {"cmd": ..., "time": ..., "argv": [...], "stdin": ...}; an sbatch line
                      also gets "jobid", "job_name" and "script" (the --wrap command, or the
                      script given as a file or on stdin).
FAKE_SLURM_STATE      the state sacct/squeue report for every submitted job (default FAILED).
FAKE_SLURM_ACCOUNTS   comma-separated accounts sacctmgr/sshare list for the user (default none).
FAKE_SLURM_PARTITIONS comma-separated partitions sinfo lists; "*" marks the default
                      (default "cpu*,gpu").

Nothing is ever run: sbatch only records the submission and prints a job id, and the status
commands report the submitted jobs in FAKE_SLURM_STATE so that Snakemake's run ends at the
first status check.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FIRST_JOBID = 4001


@contextmanager
def _locked_log() -> Iterator[object]:
    # The plugin submits from two threads at once: job ids must not collide.
    path = Path(os.environ["FAKE_SLURM_LOG"])
    with path.open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _entries(handle) -> list[dict]:
    handle.seek(0)
    return [json.loads(line) for line in handle if line.strip()]


def _option(argv: list[str], *names: str) -> str | None:
    """The value of `--name value`, `--name=value` or `-n value`."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if name.startswith("--") and arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def _read_stdin() -> str:
    return "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()


def sbatch(argv: list[str]) -> int:
    wrap = _option(argv, "--wrap")
    positional = [a for a in argv if not a.startswith("-")]
    script = None
    stdin = ""
    if wrap is None:
        # `sbatch [options] script`: the plugin passes /dev/stdin with the script on stdin.
        if argv and argv[-1] == "/dev/stdin":
            stdin = _read_stdin()
            script = stdin
        elif positional and Path(argv[-1]).is_file():
            script = Path(argv[-1]).read_text()
    else:
        script = wrap
    if not script:
        print("sbatch: error: Batch script is empty or missing (no --wrap either)", file=sys.stderr)
        return 1
    with _locked_log() as handle:
        submitted = [e for e in _entries(handle) if e["cmd"] == "sbatch"]
        jobid = FIRST_JOBID + len(submitted)
        entry = {
            "cmd": "sbatch",
            "time": time.time(),
            "argv": argv,
            "stdin": stdin,
            "jobid": jobid,
            "job_name": _option(argv, "--job-name", "-J"),
            "script": script,
        }
        handle.write(json.dumps(entry) + "\n")
    print(jobid if "--parsable" in argv else f"Submitted batch job {jobid}")
    return 0


def _record(cmd: str, argv: list[str]) -> list[dict]:
    """Log the call; return the sbatch submissions logged so far."""
    with _locked_log() as handle:
        entries = _entries(handle)
        entry = {"cmd": cmd, "time": time.time(), "argv": argv, "stdin": ""}
        handle.write(json.dumps(entry) + "\n")
    return [e for e in entries if e["cmd"] == "sbatch"]


def _job_states(submitted: list[dict], name: str | None) -> list[tuple[int, str]]:
    state = os.environ.get("FAKE_SLURM_STATE", "FAILED")
    return [(e["jobid"], state) for e in submitted if name is None or e["job_name"] == name]


def sacct(argv: list[str]) -> int:
    submitted = _record("sacct", argv)
    if "--format=JobIdRaw,State" in argv:  # the plugin's status query, filtered by --name
        for jobid, state in _job_states(submitted, _option(argv, "--name")):
            print(f"{jobid}|{state}")
    elif _option(argv, "-o") == "Account%256":  # the plugin guessing an account
        accounts = _accounts()
        print(accounts[0] if accounts else "")
    # `sacct -j <id>.<step> --format=Reason` and `-o nodelist`: nothing to say.
    return 0


def squeue(argv: list[str]) -> int:
    submitted = _record("squeue", argv)
    for jobid, state in _job_states(submitted, _option(argv, "--name", "-n")):
        print(f"{jobid}|{state}")
    return 0


def _accounts() -> list[str]:
    return [a for a in os.environ.get("FAKE_SLURM_ACCOUNTS", "").split(",") if a]


def sacctmgr(argv: list[str]) -> int:
    _record("sacctmgr", argv)
    for account in _accounts():
        print(f"{account:>256}")
    return 0


def sshare(argv: list[str]) -> int:
    return sacctmgr(argv)


def sinfo(argv: list[str]) -> int:
    _record("sinfo", argv)
    print("PARTITION")
    for partition in os.environ.get("FAKE_SLURM_PARTITIONS", "cpu*,gpu").split(","):
        print(partition)
    return 0


def scontrol(argv: list[str]) -> int:
    _record("scontrol", argv)
    if argv[:2] == ["show", "config"]:
        print("MaxArraySize            = 1001")
        print("MinJobAge               = 300 sec")
    return 0


def scancel(argv: list[str]) -> int:
    _record("scancel", argv)
    return 0


COMMANDS = {
    f.__name__: f for f in (sbatch, sacct, squeue, sacctmgr, sshare, sinfo, scontrol, scancel)
}


def main(cmd: str, argv: list[str]) -> int:
    return COMMANDS[cmd](argv)
