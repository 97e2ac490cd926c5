"""Loader benchmark: samples/s and worker memory of the training DataLoader, same run, same data.

    python bench/loader.py            # 3 records of 256^3, 3 rounds, more batches
    python bench/loader.py --quick    # 2 records of 192^3, 2 rounds; under 2 minutes on 2 cores
    python bench/loader.py --smoke    # every path at its smallest: a test runs it

What is measured. Every configuration runs at exp001_full's data settings: 72x136x136 patches,
its fg_fraction, flips and permutations applied in the worker, intensity parameters drawn there
(the intensity maths itself runs on the device in `ctseg.data.to_device`, after the loader), and
every target (label, ignore, skeleton, tube, sdt). The configurations:
- phases 0-5 of config/phases.yaml (workers, batch, prefetch, persistent workers, pin memory
  when CUDA exists), precomputed targets, raw scratch;
- run-time targets (`runtime_targets=True`: the status quo of README.md's "The starting point",
  every target recomputed per sample in the worker from the label plus the halo), phase 1, raw
  scratch, against phase 1 with precomputed targets;
- zarr scratch against raw scratch, phase 1, precomputed targets;
- the loader without workers against 2 workers: phase 2 (batch 2) with `workers: 0` against
  phase 2 itself (`workers_vs_main`; below 1, workers cost more than they bring);
- the chunk check: zarr scratch samples alone (`dataset.packed([i])`, no loader), each chunk's
  bytes checked against the crc32c recorded for its position (`ctseg.store.CheckedStore`, as
  every read does) against the same samples read through zarr's own store, unchecked, in
  alternating rounds of the same process (`chunk_check_ratio`: checked / unchecked CPU
  ms/sample, the median of the rounds' ratios; the check is meant to cost under 5%), and the
  check's own CPU time per sample (`chunk_check_own_share`, of the unchecked read). On its
  own: ``python bench/loader.py --quick --chunk-check-only``;
- the layout batches travel in: `build_loader`'s packed batches (one uint8 tensor per batch,
  written into buffers the workers reuse, `ctseg.data.PackedBatch`) against the host layout
  that the loader sent before (ten tensors per sample, `default_collate` of
  `PatchDataset.__getitem__`, reconstructed here by giving `build_loader` a plain dataset), at
  phase 1 and for the phase 2 pair. "loader adds ms" is the loader's own CPU cost per sample:
  CPU ms/sample in the loader minus the same samples timed alone (packed: `dataset.packed`,
  host layout: `dataset[i]`).

The data is built once: demo volumes (`generate_demo`) converted (`convert_volume`), targets
precomputed (`compute_targets`), both with config/config.yaml's settings, laid out as the
pipeline's store (``zarr/images/<id>.zarr``, ``targets/<id>.zarr``) and staged from it into a
``raw`` and a ``zarr`` scratch (`stage_records`).

How. One child process (torch imported once) runs every configuration in turn, for several
rounds, in an order that puts each compared pair next to each other in time (run-time, phase 1,
zarr, then the other phases). Each run builds the dataset and
`build_loader(dataset, phase, seed=0)` and iterates it:
- The first max(2, workers) batches are warm-up (worker start-up, stores opened) and are not
  timed; samples/s is wall clock from the end of the warm-up to the last timed batch. The
  dataset is longer than what is consumed by workers x prefetch batches, so the workers are as
  busy at the last timed batch as at the first: prefetched batches neither flatter the start nor
  starve the end. The workers are shut down before the next run forks its own.
- Per configuration the best round is reported (the median beside it): on a shared machine
  other processes only ever slow a run down. "CPU ms/sample" is the CPU time of the main process
  and the workers over the timed batches, per sample (lowest round), a cross-check that depends
  less on other load. At the end a forked process also times the compared samples alone,
  `dataset[i]` without a loader (the very samples the loader runs timed), so the loader's own
  cost per sample can be told apart.
- A thread in the parent samples the child and its workers every 20 ms from /proc/<pid>/status
  (kernel counters: no page-table walk, no mmap lock, so it does not slow the workers): RSS
  (RssAnon + RssFile + RssShmem, and for a worker the kernel's high-water mark VmHWM, so no
  spike is missed) and RssAnon. Per-worker figures are the peak of each worker over its run,
  then the largest over the configuration's workers and rounds; the main process is reported
  separately (its peak RSS during the configuration's runs).
- USS (Private_Clean + Private_Dirty from /proc/<pid>/smaps_rollup, psutil's uss) walks the page
  tables, about 25 ms a read for a process that imported torch, and holds the worker's mmap lock
  meanwhile; it is read once per worker at the end of each run, after the timing.

Which memory figure worker_rss_ratio uses, and why. It is the peak per-worker **own memory**,
precomputed / run-time: the worker's peak RssAnon minus the RssAnon it inherited at fork (the
main process's, read just before the workers start), i.e. the anonymous memory the worker
allocated itself: patch buffers, target computation, heap kept by `ctseg.data.tune_malloc`.
- Plain RSS counts every page shared with the main process (torch's libraries, the parent's heap
  inherited copy-on-write: hundreds of MB that exist once however many workers run), so RSS
  ratios sit near 1 whatever a worker does. It also counts the page cache of the memmapped .npy
  files the worker has touched: clean, shared, reclaimable, and the precomputed path maps one
  more file (sdt.npy) than the run-time path does.
- USS drops the shared pages, but keeps the memmapped file pages that only this worker has
  mapped (with one worker, every page it has read: tens of MB in phase 0, near nothing in
  phase 1 where both workers read the same volumes) and the shared-memory buffer of a batch the
  worker is still filling (tens of MB at batch 4). Both depend on how many workers share the
  files and on when the read happens, not on what the data path needs; freshly staged files can
  even show their page cache as Private_Dirty until it is written back.
RSS and USS ratios are printed beside it.
- Since batches are packed, a worker writes its samples straight into shared-memory
  batch buffers that it reuses (`ctseg.data._SlotPool`), so its RssAnon no longer holds patch
  buffers at all: with precomputed targets "own" is near 0 and the ratio says little more than
  that. The buffers show as "worker shm MB" (peak RssShmem: the worker's slots, each one
  batch, shared with the main process, which maps them too; about prefetch_factor + 1 slots).

Only the usable cores (the process's CPU affinity) run the workers: phases with more workers
than cores cannot scale (the workers time-share them), which the output says; the ratios are
what the benchmark is for.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import json
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

EXPERIMENT = REPO / "config" / "experiments" / "exp001_full.yaml"
PHASES = REPO / "config" / "phases.yaml"
CONFIG = REPO / "config" / "config.yaml"
TABLE_PHASES = (0, 1, 2, 3, 4, 5)
PAIR_PHASE = 1  # 2 workers: as many as the benchmark machine has cores
SAMPLE_S = 0.02
CHILDREN_EVERY_S = 0.05
MB = 2**20
NAN = float("nan")
HAS_CHILDREN_FILE = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()
MAIN_PHASE = 2  # workers_vs_main: this phase with workers 0 against the phase itself
HOST = f"phase {PAIR_PHASE}, host layout"
# Samples also timed without the loader.
ALONE = (f"phase {PAIR_PHASE}", "run-time", "zarr", HOST)

SETTINGS = {
    "quick": {"size": 192, "records": 2, "rounds": 2, "phase": 96, "runtime": 10, "zarr": 40},
    # Every configuration and figure, at the fewest samples that give each one (CI runs it).
    "smoke": {"size": 144, "records": 2, "rounds": 1, "phase": 12, "runtime": 2, "zarr": 4},
    "full": {"size": 256, "records": 3, "rounds": 3, "phase": 480, "runtime": 48, "zarr": 192},
}


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def configurations(settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Name -> (phase, scratch format, run-time targets, timed samples), in run order."""
    main, two = f"phase {MAIN_PHASE}, 0 workers", f"phase {MAIN_PHASE}"
    runs: dict[str, dict[str, Any]] = {
        "run-time": {"phase": PAIR_PHASE, "fmt": "raw", "runtime": True, "samples": "runtime"},
        f"phase {PAIR_PHASE}": {"phase": PAIR_PHASE, "fmt": "raw", "runtime": False},
        "zarr": {"phase": PAIR_PHASE, "fmt": "zarr", "runtime": False, "samples": "zarr"},
        HOST: {"phase": PAIR_PHASE, "fmt": "raw", "runtime": False, "layout": "host"},
        main: {"phase": MAIN_PHASE, "fmt": "raw", "runtime": False, "workers": 0},
        two: {"phase": MAIN_PHASE, "fmt": "raw", "runtime": False},
        f"{main}, host layout": {
            "phase": MAIN_PHASE,
            "fmt": "raw",
            "runtime": False,
            "workers": 0,
            "layout": "host",
        },
        f"{two}, host layout": {
            "phase": MAIN_PHASE,
            "fmt": "raw",
            "runtime": False,
            "layout": "host",
        },
    }
    for p in TABLE_PHASES:
        runs.setdefault(f"phase {p}", {"phase": p, "fmt": "raw", "runtime": False})
    return {
        name: {"layout": "packed", **run, "samples": int(settings[run.get("samples", "phase")])}
        for name, run in runs.items()
    }


def run_phase(phases: Mapping[int, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    """The phase a configuration runs: config/phases.yaml's, with its workers override."""
    phase = dict(phases[run["phase"]])
    if "workers" in run:
        phase["workers"] = run["workers"]
    return phase


def usable_cores() -> int:
    from ctseg.machine import available_cpus  # the package's one CPU count

    return available_cpus()


# ---------------------------------------------------------------- /proc readers
def children_of(pid: int) -> list[int]:
    """Child pids from /proc/<pid>/task/*/children.

    Microseconds a call, where psutil's children() scans all of /proc: milliseconds, a tenth of
    a core at the sampling rate.
    """
    if not HAS_CHILDREN_FILE:
        with contextlib.suppress(psutil.Error):
            return [c.pid for c in psutil.Process(pid).children()]
        return []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that has just exited
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def read_status(pid: int | str) -> dict[str, int] | None:
    """RSS (RssAnon + RssFile + RssShmem), VmHWM and RssAnon in bytes from /proc/<pid>/status."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
            kb[key] = int(value.split()[0]) * 1024
    if "RssAnon" not in kb:
        return None  # a zombie: its memory is gone
    rss = kb["RssAnon"] + kb.get("RssFile", 0) + kb.get("RssShmem", 0)
    return {
        "rss": rss,
        "hwm": kb.get("VmHWM", rss),
        "anon": kb["RssAnon"],
        "shmem": kb.get("RssShmem", 0),
    }


def read_uss(pid: int) -> int | None:
    """Private_Clean + Private_Dirty (psutil's uss) in bytes from /proc/<pid>/smaps_rollup."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = [int(line.split()[1]) for line in text.splitlines() if line.startswith("Private_")]
    return sum(kb) * 1024 if kb else None


def cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of a process and of each of its children, by pid."""
    out = {}
    for p in [pid, *children_of(pid)]:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(p).cpu_times()
            out[p] = times.user + times.system
    return out


# ---------------------------------------------------------------- child side
def make_dataset(spec: Mapping[str, Any], run: Mapping[str, Any], length: int) -> Any:
    from ctseg.data.patches import PatchDataset

    data = load_yaml(EXPERIMENT)["data"]
    return PatchDataset(
        spec["scratch"][run["fmt"]],
        spec["ids"],
        patch_size=data["patch_size"],
        fmt=run["fmt"],
        fg_fraction=data["fg_fraction"],
        augment=data["augment"],
        seed=0,
        length=length,
        runtime_targets=run["runtime"],
    )


class HostLayout:
    """A plain dataset of `PatchDataset.__getitem__` samples: given this, `build_loader` makes
    the loader the pipeline had before packing (default_collate, ten tensors per sample)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.dataset[index]


def make_loader(spec: Mapping[str, Any], run: Mapping[str, Any], phase: dict, length: int) -> Any:
    import torch

    from ctseg.data.loader import build_loader

    dataset = make_dataset(spec, run, length)
    if run["layout"] == "host":
        dataset = HostLayout(dataset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_loader(dataset, phase, seed=0, device=device)


def packed_one(dataset: Any, index: int) -> Any:
    return dataset.packed([index])


def time_alone(spec: Mapping[str, Any]) -> dict[str, float]:
    """Mean CPU ms of one sample without a loader (`dataset[i]`), per compared configuration.

    The samples are exactly those a loader run of the configuration timed (same seed, same
    indices), so the mean compares with the loader's CPU ms/sample.
    """
    phases = load_yaml(PHASES)["phases"]
    alone = {}
    for name in ALONE:
        run = spec["runs"][name]
        phase = run_phase(phases, run)
        batch = int(phase["batch_size"])
        first = max(2, int(phase["workers"])) * batch  # after the warm-up batches
        timed = max(1, -(-int(run["samples"]) // batch)) * batch
        dataset = make_dataset(spec, run, first + timed)
        host = run["layout"] == "host"
        one = dataset.__getitem__ if host else functools.partial(packed_one, dataset)
        one(0)  # opens the stores
        before = time.process_time()
        for i in range(first, first + timed):
            one(i)
        alone[name] = 1000 * (time.process_time() - before) / timed
    return alone


CHECK_ROUNDS = 11  # rounds of the chunk check comparison, each variant once per round


def unchecked_open(path: Any, storage_options: Any = None, *, listed: bool = True) -> Any:
    """The read without the chunk check: zarr's own store, nothing compared, nothing listed."""
    import zarr

    return zarr.open(str(path), mode="r")


def time_chunk_check(spec: Mapping[str, Any]) -> dict[str, Any]:
    """CPU ms of one zarr scratch sample alone, its chunks checked and unchecked.

    The scratch reader (`ctseg.layout`) opens each store with `open_checked`; unchecked, the
    same reader opens it with zarr's own store (`unchecked_open`). The variants alternate
    (their order swapped every round), each on a fresh dataset, so both meet the same page
    cache and machine load. The figure is the median of the rounds' ratios (each round's pair
    ran side by side, so load that drifts between rounds cancels); the lowest round of each is
    kept beside it. The check's own work (`ctseg.chunks.digest_problem`: the crc32c of each
    chunk read and the comparison) is also timed inside the checked rounds: a figure that
    other load on the machine hardly moves.
    """
    import ctseg.chunks as chunks
    import ctseg.layout as layout

    checked_open, digest_problem = layout.open_checked, chunks.digest_problem
    own = {"s": 0.0}

    def timed_digest_problem(*args: Any) -> Any:
        started = time.thread_time()
        try:
            return digest_problem(*args)
        finally:
            own["s"] += time.thread_time() - started

    run = spec["runs"]["zarr"]
    samples = int(run["samples"])
    rounds: dict[str, list[float]] = {"checked": [], "unchecked": []}
    own_ms: list[float] = []
    variants = [("unchecked", unchecked_open), ("checked", checked_open)]
    chunks.digest_problem = timed_digest_problem
    try:
        for round_ in range(CHECK_ROUNDS):
            for name, opener in variants if round_ % 2 else variants[::-1]:
                layout.open_checked = opener
                dataset = make_dataset(spec, run, samples + 1)
                dataset.packed([0])  # opens the stores
                own["s"] = 0.0
                before = time.process_time()
                for i in range(1, samples + 1):
                    dataset.packed([i])
                rounds[name].append(1000 * (time.process_time() - before) / samples)
                if name == "checked":
                    own_ms.append(1000 * own["s"] / samples)
    finally:
        layout.open_checked, chunks.digest_problem = checked_open, digest_problem
    ratios = [c / u for c, u in zip(rounds["checked"], rounds["unchecked"], strict=True)]
    return {
        "checked": min(rounds["checked"]),
        "unchecked": min(rounds["unchecked"]),
        "median_ratio": statistics.median(ratios),
        "own_ms": statistics.median(own_ms),
        "samples": samples,
    }


def print_chunk_check(check: Mapping[str, Any]) -> float:
    """The chunk check's table; returns checked / unchecked (the median of the rounds')."""
    ratio = check["median_ratio"]
    print(
        f"\nchunk check: {check['samples']} zarr scratch samples alone, each chunk's bytes "
        f"checked against its recorded crc32c vs unchecked ({CHECK_ROUNDS} alternating rounds)"
    )
    rows = [["unchecked", check["unchecked"]], ["checked", check["checked"]]]
    print(table(["read", "CPU ms/sample"], rows))
    print(
        f"  checked / unchecked: {ratio:.3f} (median of the rounds' ratios; lowest rounds "
        f"{check['checked'] / check['unchecked']:.3f}); the check's own work "
        f"{check['own_ms']:.2f} ms/sample = "
        f"{100 * check['own_ms'] / check['unchecked']:.1f}% of the unchecked read"
    )
    return ratio


def child_runs(spec: Mapping[str, Any]) -> dict:
    """Every configuration, `rounds` times; throughput here, memory mostly from the parent.

    At the end the samples of the compared configurations are also timed alone (`time_alone`).
    """
    import torch

    phases = load_yaml(PHASES)["phases"]
    cuda = torch.cuda.is_available()
    me = os.getpid()
    results = []
    for round_ in range(int(spec["rounds"])):
        for name, run in spec["runs"].items():
            phase = run_phase(phases, run)
            batch, workers = int(phase["batch_size"]), int(phase["workers"])
            prefetch = int(phase.get("prefetch_factor") or 2)
            warmup = max(2, workers)
            timed = max(1, -(-int(run["samples"]) // batch))
            # Work left after the last timed batch keeps every worker busy until then.
            length = (warmup + timed + workers * prefetch) * batch
            loader = make_loader(spec, run, phase, length)
            anon_at_fork = (read_status("self") or {}).get("anon", 0)
            started = time.time()
            stamps: list[float] = []
            cpu_start: dict[int, float] = {}
            iterator = iter(loader)
            for k in range(warmup + timed):
                next(iterator)
                stamps.append(time.perf_counter())
                if k == warmup - 1:
                    cpu_start = cpu_seconds(me)
            cpu_end = cpu_seconds(me)
            # The workers are alive while the iterator is: read their USS now, untimed.
            worker_pids = children_of(me)
            uss = [u for u in map(read_uss, worker_pids) if u is not None]
            # Shut the workers down (persistent ones live as long as the loader) before the
            # next run forks its own, so no two runs' workers overlap.
            del iterator, loader
            gc.collect()
            deadline = time.monotonic() + 30
            while children_of(me) and time.monotonic() < deadline:
                time.sleep(0.01)
            cpu = sum(cpu_end[pid] - cpu_start[pid] for pid in cpu_end if pid in cpu_start)
            results.append(
                {
                    "name": name,
                    "round": round_,
                    "samples_per_s": timed * batch / (stamps[-1] - stamps[warmup - 1]),
                    "cpu_ms_per_sample": 1000 * cpu / (timed * batch),
                    "timed_samples": timed * batch,
                    "anon_at_fork": anon_at_fork,
                    "worker_pids": worker_pids,
                    "worker_uss": max(uss, default=None),
                    "window": [started, time.time()],
                }
            )
    # Forked, so the main process's heap and malloc settings stay as the loader runs had them.
    with multiprocessing.get_context("fork").Pool(1) as pool:
        alone = pool.apply(time_alone, (spec,))
        chunk_check = pool.apply(time_chunk_check, (spec,))
    return {
        "runs": results,
        "alone_cpu_ms": alone,
        "chunk_check_cpu_ms": chunk_check,
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
        "torch": torch.__version__,
    }


# ---------------------------------------------------------------- parent side
class Sampler:
    """Peak memory of each child of a process (the workers), and the process's own over time."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peaks: dict[int, dict[str, int]] = {}
        self.main: list[tuple[float, int]] = []  # (time.time(), rss)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        children: list[int] = []
        last_children = 0.0
        while not self._done.is_set():
            now = time.monotonic()
            if now - last_children >= CHILDREN_EVERY_S:
                children = children_of(self.root.pid)
                last_children = now
            main = read_status(self.root.pid)
            if main is not None:
                self.main.append((time.time(), main["rss"]))
            for pid in children:
                status = read_status(pid)
                if status is not None:
                    peak = self.peaks.setdefault(pid, {})
                    for key, value in status.items():
                        peak[key] = max(peak.get(key, 0), value)
            time.sleep(SAMPLE_S)

    def run_memory(self, run: Mapping[str, Any]) -> dict[str, float]:
        """A run's peak worker RSS and own memory, and the main process's peak RSS, in MB."""
        workers = [self.peaks[p] for p in run["worker_pids"] if p in self.peaks]
        start, stop = run["window"]
        main = [rss for t, rss in self.main if start <= t <= stop]
        uss = run["worker_uss"]
        return {
            "worker_rss_mb": max((max(w["rss"], w["hwm"]) for w in workers), default=NAN) / MB,
            "worker_shm_mb": max((w["shmem"] for w in workers), default=NAN) / MB,
            "worker_own_mb": max((w["anon"] for w in workers), default=NAN) / MB
            - run["anon_at_fork"] / MB,
            "worker_uss_mb": NAN if uss is None else uss / MB,
            "main_rss_mb": max(main, default=NAN) / MB,
        }


def measure(spec: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict]:
    """Run every configuration in one child; per configuration its best round and memory."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(dict(spec))],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        with Sampler(proc.pid) as sampler:
            out, _ = proc.communicate()
        if proc.returncode != 0:
            err.seek(0)
            sys.stderr.write(err.read()[-4000:])
            raise RuntimeError(f"loader child failed with status {proc.returncode}")
    report = json.loads(out.strip().splitlines()[-1])
    by_name: dict[str, list[dict]] = {}
    for run in report["runs"]:
        by_name.setdefault(run["name"], []).append({**run, **sampler.run_memory(run)})
    summary = {}
    for name, runs in by_name.items():
        speeds = [r["samples_per_s"] for r in runs]
        summary[name] = {
            "samples_per_s": max(speeds),
            "median_samples_per_s": statistics.median(speeds),
            "cpu_ms_per_sample": min(r["cpu_ms_per_sample"] for r in runs),
            "timed_samples": runs[0]["timed_samples"],
            "rounds": len(runs),
            **{
                key: max((r[key] for r in runs if not math.isnan(r[key])), default=NAN)
                for key in (
                    "worker_rss_mb",
                    "worker_own_mb",
                    "worker_shm_mb",
                    "worker_uss_mb",
                    "main_rss_mb",
                )
            },
        }
    return summary, report


# ---------------------------------------------------------------- data
def build_data(workdir: Path, size: int, n_records: int) -> tuple[list[str], dict[str, str]]:
    """Demo volumes -> Zarr store with precomputed targets -> raw and zarr scratch copies."""
    from ctseg.preprocess.convert import convert_volume
    from ctseg.preprocess.demo_data import generate_demo
    from ctseg.preprocess.stage import stage_records
    from ctseg.preprocess.targets import compute_targets

    config = load_yaml(CONFIG)
    convert, targets = config["convert"], config["targets"]
    demo, source = workdir / "demo", workdir / "source"
    log = io.StringIO()  # progress bars; shown only if something fails
    try:
        with contextlib.redirect_stderr(log):
            generate_demo(
                demo, n_train=n_records, n_test=0, shape=(size,) * 3, scroll_ids=[1], seed=0
            )
            ids = sorted(p.stem for p in (demo / "train_images").glob("*.tif"))
            for rid in ids:
                for kind, folder, dest in (
                    ("image", "train_images", source / "zarr" / "images" / f"{rid}.zarr"),
                    ("label", "train_labels", workdir / "labels" / f"{rid}.zarr"),
                ):
                    convert_volume(
                        demo / folder / f"{rid}.tif",
                        dest,
                        kind=kind,
                        chunks=tuple(convert["chunks"]),
                        codec=convert["codec"],
                        shards=convert.get("shards"),
                    )
                compute_targets(
                    workdir / "labels" / f"{rid}.zarr",
                    source / "targets" / f"{rid}.zarr",
                    clip_distance=targets["clip_distance"],
                    skeleton_method=targets["skeleton_method"],
                    tube_dilations=targets["tube_dilations"],
                    block_shape=tuple(targets["block"]),
                    max_samples=targets["max_samples"],
                    seed=targets["seed"],
                    codec=convert["codec"],
                    workers=min(int(targets["workers"]), usable_cores()),
                )
            scratch = {}
            for fmt in ("raw", "zarr"):
                scratch[fmt] = str(workdir / "scratch" / fmt)
                stage_records(str(source), ids, Path(scratch[fmt]), fmt=fmt, workers=2)
    except BaseException:
        sys.stderr.write(log.getvalue()[-4000:])
        raise
    return ids, scratch


# ---------------------------------------------------------------- report
def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def machine(report: Mapping[str, Any]) -> str:
    usable = usable_cores()
    ram = psutil.virtual_memory().total / 2**30
    return (
        f"{cpu_model()}, {os.cpu_count()} cores ({usable} usable), {ram:.0f} GiB RAM, "
        f"GPU: {report['gpu']}, Python {platform.python_version()}, torch {report['torch']}"
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min)"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [
        [f"{v:.1f}" if isinstance(v, float) else str(v) for v in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join("  " + line for line in lines)


FIGURES = [
    "samples",
    "samples/s",
    "median",
    "CPU ms/sample",
    "worker RSS MB",
    "worker USS MB",
    "worker own MB",
    "worker shm MB",
    "main RSS MB",
]


def figures(run: Mapping[str, Any]) -> list[Any]:
    keys = ("samples_per_s", "median_samples_per_s", "cpu_ms_per_sample", "worker_rss_mb")
    rest = ("worker_uss_mb", "worker_own_mb", "worker_shm_mb", "main_rss_mb")
    return [run["timed_samples"], *(run[k] for k in keys), *(run[k] for k in rest)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller volumes, fewer batches")
    parser.add_argument("--smoke", action="store_true", help="every path at its smallest (CI)")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the temp data dir")
    parser.add_argument("--records", type=int, default=None, help="demo records (default: mode's)")
    parser.add_argument(
        "--chunk-check-only",
        action="store_true",
        help="build the data and measure only the chunk check (checked vs unchecked reads)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(child_runs(json.loads(args.child))))
        return

    started = time.perf_counter()
    load_before = load()
    settings = dict(SETTINGS["smoke" if args.smoke else "quick" if args.quick else "full"])
    if args.records:
        settings["records"] = args.records
    phases = load_yaml(PHASES)["phases"]
    patch = "x".join(map(str, load_yaml(EXPERIMENT)["data"]["patch_size"]))
    cores = usable_cores()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        size, n_records = settings["size"], settings["records"]
        ids, scratch = build_data(Path(tmp), size, n_records)
        built = time.perf_counter() - started
        runs = configurations(settings)
        spec = {"scratch": scratch, "ids": ids, "runs": runs, "rounds": settings["rounds"]}
        if args.chunk_check_only:
            print(f"machine: {cpu_model()}, {cores} usable cores; load average {load_before}")
            ratio = print_chunk_check(time_chunk_check(spec))
            print(f"RESULT loader chunk_check_ratio={ratio:.3f}")
            return
        results, report = measure(spec)

    print(f"machine: {machine(report)}")
    print(f"load average: {load_before} before, {load()} after; other processes share the cores")
    print(
        f"data: {n_records} demo records of {size}^3 (built and staged in {built:.1f} s); "
        f"patch {patch}; {settings['rounds']} rounds per configuration"
    )
    print(
        "samples/s: best round (median beside it); CPU ms/sample: main process + workers over "
        "the timed batches.\nworker own MB: peak RssAnon above what the worker inherited at fork; "
        "USS read at the end of each run (see the module docstring)."
    )

    print("\nphases 0-5 (config/phases.yaml): precomputed targets, raw scratch")
    rows = []
    for p in TABLE_PHASES:
        phase = phases[p]
        persistent = "yes" if phase["persistent_workers"] else "no"
        loader = [p, phase["workers"], phase["batch_size"], phase["prefetch_factor"], persistent]
        rows.append([*loader, *figures(results[f"phase {p}"])])
    print(table(["phase", "workers", "batch", "prefetch", "persistent", *FIGURES], rows))
    if any(int(phases[p]["workers"]) > cores for p in TABLE_PHASES):
        print(
            f"  note: this process may use {cores} cores; phases with more workers than cores only "
            "time-share them and cannot scale here."
        )

    precomputed, runtime = results[f"phase {PAIR_PHASE}"], results["run-time"]
    raw, zarr = precomputed, results["zarr"]
    print(f"\nprecomputed vs run-time targets: phase {PAIR_PHASE}, raw scratch")
    rows = [["precomputed", *figures(precomputed)], ["run-time", *figures(runtime)]]
    print(table(["targets", *FIGURES], rows))
    print(f"\nraw vs zarr scratch: phase {PAIR_PHASE}, precomputed targets")
    print(table(["format", *FIGURES], [["raw", *figures(raw)], ["zarr", *figures(zarr)]]))

    def ratio(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> float:
        return a[key] / b[key]

    alone = report["alone_cpu_ms"]
    print(
        "\nCPU per sample: the sample alone (no loader: dataset.packed([i]), host layout "
        f"dataset[i]) vs inside the loader, phase {PAIR_PHASE}"
    )
    rows = [
        [label, alone[name], results[name]["cpu_ms_per_sample"]]
        for label, name in (
            ("precomputed, raw", f"phase {PAIR_PHASE}"),
            ("run-time, raw", "run-time"),
            ("precomputed, zarr", "zarr"),
            ("precomputed, raw, host layout", HOST),
        )
    ]
    rows = [[*row, row[2] - row[1]] for row in rows]
    print(table(["configuration", "alone ms", "in loader ms", "loader adds ms"], rows))
    handoff = {"packed": rows[0][3], "host": rows[3][3]}
    print(
        "  loader adds: the loader's own cost per sample (collation, the hand-off to the main "
        "process through shared memory,\n  page faults, the main process). Host layout: ten "
        "tensors per sample as before; packed: one per batch."
    )

    check = report["chunk_check_cpu_ms"]
    check_ratio = print_chunk_check(check)

    main_name, two_name = f"phase {MAIN_PHASE}, 0 workers", f"phase {MAIN_PHASE}"
    print(f"\n0 workers vs 2 workers: phase {MAIN_PHASE} (batch 2), raw scratch")
    rows = []
    for layout, suffix in (("packed", ""), ("host layout", ", host layout")):
        for workers, name in ((0, main_name), (2, two_name)):
            rows.append([layout, workers, *figures(results[name + suffix])])
    print(table(["batches", "workers", *FIGURES], rows))
    workers_vs_main = {
        layout: ratio(results[two_name + suffix], results[main_name + suffix], "samples_per_s")
        for layout, suffix in (("packed", ""), ("host", ", host layout"))
    }
    print(
        f"  2 workers / 0 workers, samples/s: packed {workers_vs_main['packed']:.2f}, host layout "
        f"{workers_vs_main['host']:.2f} (median rounds: packed "
        f"{ratio(results[two_name], results[main_name], 'median_samples_per_s'):.2f})"
    )
    # On a loaded machine three processes get more of the cores than one, which flatters
    # workers; the CPU figures say what an idle machine with these cores would give.
    parallel = min(2, cores)
    cpu_bound = {
        layout: parallel
        * results[main_name + suffix]["cpu_ms_per_sample"]
        / results[two_name + suffix]["cpu_ms_per_sample"]
        for layout, suffix in (("packed", ""), ("host", ", host layout"))
    }
    print(
        f"  CPU-bound estimate for {parallel} idle cores ({parallel} x CPU ms/sample at 0 workers "
        f"/ at 2 workers): packed {cpu_bound['packed']:.2f}, host layout {cpu_bound['host']:.2f}"
    )
    print(
        "\ncross-checks: CPU per sample run-time / precomputed "
        f"{ratio(runtime, precomputed, 'cpu_ms_per_sample'):.1f} in the loader, "
        f"{alone['run-time'] / alone[f'phase {PAIR_PHASE}']:.1f} alone; zarr / raw "
        f"{ratio(zarr, raw, 'cpu_ms_per_sample'):.1f} in the loader, "
        f"{alone['zarr'] / alone[f'phase {PAIR_PHASE}']:.1f} alone; median samples/s "
        f"precomputed / run-time {ratio(precomputed, runtime, 'median_samples_per_s'):.1f}, "
        f"raw / zarr {ratio(raw, zarr, 'median_samples_per_s'):.1f}; worker memory precomputed / "
        f"run-time by RSS {ratio(precomputed, runtime, 'worker_rss_mb'):.3f}, "
        f"by USS {ratio(precomputed, runtime, 'worker_uss_mb'):.3f}"
    )
    print(f"wall time {time.perf_counter() - started:.1f} s")
    best = max(results[f"phase {p}"]["samples_per_s"] for p in TABLE_PHASES)
    print(
        "RESULT loader "
        f"precomputed_vs_runtime={ratio(precomputed, runtime, 'samples_per_s'):.1f} "
        f"worker_rss_ratio={ratio(precomputed, runtime, 'worker_own_mb'):.3f} "
        f"raw_vs_zarr={ratio(raw, zarr, 'samples_per_s'):.1f} "
        f"workers_vs_main={workers_vs_main['packed']:.2f} "
        f"workers_vs_main_host_layout={workers_vs_main['host']:.2f} "
        f"workers_vs_main_cpu_bound={cpu_bound['packed']:.2f} "
        f"handoff_ms_packed={handoff['packed']:.1f} "
        f"handoff_ms_host_layout={handoff['host']:.1f} "
        f"best_samples_per_s={best:.1f} "
        f"chunk_check_ratio={check_ratio:.3f} "
        f"chunk_check_own_share={check['own_ms'] / check['unchecked']:.3f}"
    )


if __name__ == "__main__":
    main()
