"""The tiny training setup shared by test_train and test_ddp: a two-level U-Net on 16^3
patches, and three small staged records (raw scratch) with oblique sheets."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch

from ctseg.preprocess.stage import stage_records
from ctseg.preprocess.targets import compute_targets
from ctseg.store import create_volume

SHAPE = (24, 24, 24)
TRAIN_IDS, VAL_IDS = ["a", "b"], ["c"]
CLIP = 4.0
EXPERIMENT = {
    "name": "tiny_train",
    "scratch_format": "raw",
    "data": {
        "patch_size": [16, 16, 16],
        "fg_fraction": 0.5,
        "runtime_targets": False,
        "augment": {
            "flip": True,
            "permute": True,
            "intensity": {
                "prob": 0.5,
                "scale": [0.9, 1.1],
                "shift": [-0.1, 0.1],
                "gamma": [0.8, 1.25],
                "noise_std": 0.05,
            },
            "elastic": False,
            "scale": False,
        },
    },
    "model": {
        "filters": [4, 8],
        "block": "basic",
        "norm": "instance",
        "deep_supervision": True,
        "checkpointing": False,
    },
    "loss": {
        "weights": {"bce": 1.0, "dice": 1.0, "cldice": 0.5, "skel_recall": 0.5, "boundary": 0.1},
        "pos_weight": 2.0,
        "cldice_iterations": 3,
    },
    "train": {
        "optimizer": "adamw",
        "lr": 0.002,
        "weight_decay": 0.0001,
        "momentum": 0.9,
        "lr_scaling": "sqrt",
        "base_batch_size": 1,
        "warmup_steps": 2,
        "min_lr_ratio": 0.05,
        "grad_clip": 1.0,
        "epochs": 2,
        "steps_per_epoch": 3,
        "val_batches": 1,
        "log_every": 4,
        "tf32": False,
        "deterministic": True,
        "seed": 0,
    },
    "trial": {
        "steps": 3,
        "warmup_steps": 1,
        "ceiling_steps": 2,
        "vram_limit_gb": None,
        "host_ram_limit_gb": None,
        "phases": [0, 1],
    },
}
PHASE = {
    "workers": 0,
    "batch_size": 1,
    "prefetch_factor": 1,
    "persistent_workers": False,
    "pin_memory": False,
    "mp_context": "fork",
    "drop_last": True,
    "device_prefetch": False,
    "precision": "fp32",
    "channels_last": False,
    "compile": False,
}


def build_scratch(root: Path) -> Path:
    """Three staged records (raw format) with oblique sheets and an unlabelled slab."""
    source = root / "store"
    z, y, x = np.indices(SHAPE)
    for k, rid in enumerate(TRAIN_IDS + VAL_IDS):
        label = (((z + 0.5 * y + 0.3 * x + 2 * k) % 9) < 3).astype(np.uint8)
        label[:3] = 2
        noise = np.random.default_rng(k).integers(0, 100, SHAPE)
        image = (label * 120 + noise).astype(np.uint8)
        attrs = {"shape": list(SHAPE), "dtype": "uint8", "p0_5": 0.0, "p99_5": 220.0}
        create_volume(
            source / f"zarr/images/{rid}.zarr", SHAPE, "uint8", (16, 16, 16), attributes=attrs
        )[:] = image
        create_volume(root / f"labels/{rid}.zarr", SHAPE, "uint8", (16, 16, 16))[:] = label
        compute_targets(
            root / f"labels/{rid}.zarr",
            source / f"targets/{rid}.zarr",
            clip_distance=CLIP,
            block_shape=(32, 32, 32),
            max_samples=200,
        )
    dest = root / "scratch"
    stage_records(str(source), TRAIN_IDS + VAL_IDS, dest, fmt="raw", workers=1)
    return dest


@contextlib.contextmanager
def torch_globals():
    """train() sets process-wide state (seeds, determinism, TF32); give it back afterwards.

    One intra-op thread: the tests run on shared cores, and a second thread only adds
    contention at these sizes.
    """
    saved = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
    )
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _restore(saved)


def _restore(saved: tuple) -> None:
    torch.set_num_threads(saved[0])
    torch.use_deterministic_algorithms(saved[1])
    torch.backends.cuda.matmul.allow_tf32 = saved[2]
    torch.backends.cudnn.allow_tf32 = saved[3]
    torch.backends.cudnn.benchmark = saved[4]
    random.setstate(saved[5])
    np.random.set_state(saved[6])
    torch.set_rng_state(saved[7])


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]
