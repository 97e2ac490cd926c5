"""Training data, by its old name: the names that used to live here, re-exported.

The training data path is split along its contracts, one module each:
- `ctseg.patches`: the patch stream (`PatchDataset`, `SamplePlan`): sample `i` is a function of
  `(seed, i)`, read from the scratch copy, padded and augmented into its packed row;
- `ctseg.packing`: the packed sample and batch (`PackedLayout`, `PackedBatch`, `SAMPLE_KEYS`,
  `unpack_bits`);
- `ctseg.slots`: the loader workers' reused shared-memory buffers and handing them back;
- `ctseg.loader`: the DataLoader (`build_loader`, `PackedLoader`, `StreamSampler`,
  `seed_worker`);
- `ctseg.device_batches`: the device transfer and prefetch (`to_device`, `DevicePrefetcher`);
- `ctseg.heap`: `tune_malloc`;
- `ctseg.torch_private`: the private torch APIs the loader relies on, checked.

New code imports from those modules; this one keeps ``from ctseg.data import ...`` working.
"""

from __future__ import annotations

from ctseg.device_batches import DevicePrefetcher, to_device
from ctseg.heap import tune_malloc
from ctseg.loader import MP_CONTEXTS, PackedLoader, StreamSampler, build_loader, seed_worker
from ctseg.packing import SAMPLE_KEYS, PackedBatch, PackedLayout, unpack_bits
from ctseg.patches import MASK_PAD, PatchDataset, SamplePlan

__all__ = [
    "MASK_PAD",
    "MP_CONTEXTS",
    "SAMPLE_KEYS",
    "DevicePrefetcher",
    "PackedBatch",
    "PackedLayout",
    "PackedLoader",
    "PatchDataset",
    "SamplePlan",
    "StreamSampler",
    "build_loader",
    "seed_worker",
    "to_device",
    "tune_malloc",
    "unpack_bits",
]
