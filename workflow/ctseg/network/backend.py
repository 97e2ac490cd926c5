"""Which library ran the network's 3D convolutions, and the versions that decide it.

On CUDA, torch sends a 3D convolution to cuDNN or, failing that, to its own vol2col + GEMM
kernels (``aten::slow_conv_dilated3d``, ``aten::slow_conv_transpose3d``), several times slower
in half precision. torch 2.9.0 stopped using cuDNN for bf16/fp16 3D convolutions with cuDNN 9.8
or newer, because of a cuDNN bug (pytorch issue 163539, the workaround in PR 163581); nnU-Net
measured 4x slower training (pytorch issue 166122). torch 2.9.1 turns cuDNN back on at run time
when the installed cuDNN is 9.15 or newer, and later releases ship a cuDNN that is. So the known-
bad combination is half-precision 3D convolutions that did not run on cuDNN, which torch 2.9.x
with a cuDNN older than 9.15 gives; the fix is a cuDNN of 9.15 or newer from PyPI
(``nvidia-cudnn-cu12``/``-cu13``, which torch 2.9.1+ then uses) or a newer torch.

`conv_backend` records the versions and probes the backend: one small 3D convolution in the
run's dtype under torch.profiler (CPU activity only: no CUPTI, nothing that disturbs a later CUDA
graph capture) and the name of the operator it dispatched to. A trial's kernel profile gives the
same answer from the real steps (`backend_of`, by operator and kernel names). A CPU run records
the versions only.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ctseg.network.flops import Efficiency, padding_warning

# Lowercase fragments of operator or kernel names: cuDNN's convolutions, and torch's own
# (vol2col/col2vol and the slow_conv operators that call them).
CUDNN_NAMES = ("cudnn_convolution", "cudnn::cnn", "xmma_fprop", "xmma_dgrad", "xmma_wgrad")
NATIVE_NAMES = ("slow_conv3d", "slow_conv_dilated3d", "slow_conv_transpose3d", "vol2col", "col2vol")
HALF = (torch.bfloat16, torch.float16)
FIXED_CUDNN = 91500  # cuDNN 9.15.0 as torch.backends.cudnn.version() writes it
FIX = (
    "install cuDNN >= 9.15 (pip install 'nvidia-cudnn-cu12>=9.15', or -cu13 to match the CUDA "
    "build; torch >= 2.9.1 then uses it) or a torch release that ships it"
)


def backend_of(names: Iterable[str]) -> str | None:
    """``cudnn``, ``native`` or ``mixed`` from the operator and kernel names a convolution ran
    under; None when none of them is a 3D convolution's."""
    keys = [n.lower() for n in names]
    cudnn = any(f in k for k in keys for f in CUDNN_NAMES)
    native = any(f in k for k in keys for f in NATIVE_NAMES)
    if cudnn and native:
        return "mixed"
    return "cudnn" if cudnn else "native" if native else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def known_bad(
    torch_version: str, cudnn_version: int | None, half: bool, backend: str | None
) -> str | None:
    """The one-line warning for half-precision 3D convolutions without cuDNN, or None. Where
    the backend was seen (`backend`) it decides; otherwise torch 2.9.x with a cuDNN older than
    9.15 (or none) predicts it."""
    if not half:
        return None
    if backend in ("native", "mixed"):
        why = "ran without cuDNN"
    elif backend is None and _version_tuple(torch_version)[:2] == (2, 9):
        if cudnn_version is not None and cudnn_version >= FIXED_CUDNN:
            return None
        why = "run without cuDNN under this torch"
    else:
        return None
    return (
        f"half-precision 3D convolutions {why} (torch {torch_version}, cuDNN "
        f"{cudnn_version}; pytorch issue 166122, about 4x slower): {FIX}"
    )


def versions() -> dict[str, Any]:
    """torch, its CUDA and the cuDNN it loaded (None where there is none)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "cudnn_enabled": bool(torch.backends.cudnn.enabled),
    }


def probe(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """The backend of one 3x3x3 convolution on `device` in `dtype` (autocast's, or float32),
    forward and backward, channels_last_3d; None if the profile names none."""
    dtype = dtype or torch.float32
    x = torch.randn(1, 8, 8, 8, 8, device=device, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    w = torch.randn(8, 8, 3, 3, 3, device=device, dtype=dtype, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.conv3d(x, w, padding=1).sum().backward()
    return backend_of(e.name for e in prof.events())


@functools.lru_cache(maxsize=8)
def _probed(device: str, dtype: torch.dtype | None) -> str | None:
    try:
        return probe(torch.device(device), dtype)
    except Exception:  # noqa: BLE001 - a probe that fails only leaves the backend unknown
        return None


def conv_backend(
    device: torch.device | str, dtype: torch.dtype | None, seen: str | None = None
) -> dict[str, Any]:
    """The record: `versions`, on CUDA the 3D convolutions' backend (`seen` in a profile of the
    real steps, else `probe`'s, once per process) and ``warning`` (`known_bad`, or None)."""
    device = torch.device(device)
    record: dict[str, Any] = {"device_type": device.type, **versions()}
    if device.type != "cuda":
        return {**record, "conv3d_backend": None, "backend_source": None, "warning": None}
    backend = seen or _probed(str(device), dtype)
    record["conv3d_backend"] = backend
    record["backend_source"] = "profile" if seen else "probe"
    record["warning"] = known_bad(record["torch"], record["cudnn"], dtype in HALF, backend)
    return record


def announce(*warnings: str | None) -> None:
    """Each warning that is not None, as one line on stderr."""
    for warning in warnings:
        if warning:
            print(f"ctseg: warning: {warning}", file=sys.stderr)


def announce_start(
    model_cfg: Mapping[str, Any],
    patch: Sequence[int],
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> None:
    """What a run says before it starts: a padded patch (`padding_warning`), and on CUDA the
    known-bad convolution backend (`conv_backend`'s warning)."""
    announce(padding_warning(model_cfg, patch), conv_backend(device, dtype)["warning"])


def run_record(
    efficiency: Efficiency, device: torch.device | str, dtype: torch.dtype | None
) -> dict[str, Any]:
    """What a training run's summary records of its arithmetic: ``flops`` (the patch, the size
    it is computed at, the padding share: `FlopCount.to_dict`) and ``backend`` (`conv_backend`)."""
    return {"flops": efficiency.flops.to_dict(), "backend": conv_backend(device, dtype)}
