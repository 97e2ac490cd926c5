"""The convolution backend on record (ctseg.network.backend): which library ran the 3D
convolutions, from operator and kernel names, and the known-bad combination's warning, with faked
version strings (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from ctseg.network import backend
from ctseg.network.backend import FIX, backend_of, conv_backend, known_bad


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["aten::conv3d", "aten::convolution", "aten::cudnn_convolution"], "cudnn"),
        (["sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_ndhwc"], "cudnn"),
        (
            [
                "aten::convolution",
                "aten::slow_conv_dilated3d",
                "void vol2col_kernel<c10::BFloat16>",
            ],
            "native",
        ),
        (["aten::slow_conv_transpose3d"], "native"),
        (["aten::cudnn_convolution", "aten::slow_conv_dilated3d"], "mixed"),
        (["aten::mkldnn_convolution", "cudnn::bn_fw_tr_1C11_kernel_NCHW"], None),
        ([], None),
    ],
)
def test_backend_from_operator_and_kernel_names(names, expected):
    assert backend_of(names) == expected


@pytest.mark.parametrize(
    ("torch_version", "cudnn", "half", "seen", "warns"),
    [
        # Seen in a profile: it decides, whatever the versions.
        ("2.9.0+cu128", 91002, True, "native", True),
        ("2.11.0+cu130", 91500, True, "mixed", True),
        ("2.9.0+cu128", 91002, True, "cudnn", False),
        ("2.9.0+cu128", 91002, False, "native", False),  # fp32: not the half-precision trap
        # Not seen: torch 2.9.x with cuDNN older than 9.15 predicts it.
        ("2.9.0+cu128", 91002, True, None, True),
        ("2.9.1+cu130", 91300, True, None, True),
        ("2.9.1+cu130", 91500, True, None, False),
        ("2.9.1", None, True, None, True),
        ("2.8.0+cu128", 91002, True, None, False),
        ("2.10.0+cu130", 91501, True, None, False),
    ],
)
def test_known_bad_combination_with_faked_versions(torch_version, cudnn, half, seen, warns):
    warning = known_bad(torch_version, cudnn, half, seen)
    if not warns:
        assert warning is None
        return
    assert "\n" not in warning and "half-precision 3D convolutions" in warning
    assert f"torch {torch_version}" in warning and f"cuDNN {cudnn}" in warning
    assert "166122" in warning and warning.endswith(FIX) and "9.15" in FIX


def test_cuda_record_names_versions_backend_and_warning(monkeypatch):
    """On CUDA (faked: versions and the probe's answer), the record and its warning."""
    monkeypatch.setattr(
        backend,
        "versions",
        lambda: {"torch": "2.9.0+cu128", "cuda": "12.8", "cudnn": 91002, "cudnn_enabled": True},
    )
    monkeypatch.setattr(backend, "_probed", lambda device, dtype: "native")
    record = conv_backend("cuda:0", torch.bfloat16)
    assert record["device_type"] == "cuda" and record["cudnn"] == 91002
    assert record["conv3d_backend"] == "native" and record["backend_source"] == "probe"
    assert "ran without cuDNN" in record["warning"]
    # The profile's answer beats the probe's; fp32 is never the trap.
    seen = conv_backend("cuda:0", torch.bfloat16, seen="cudnn")
    assert seen["backend_source"] == "profile" and seen["warning"] is None
    assert conv_backend("cuda:0", None)["warning"] is None


def test_cpu_record_has_the_versions_only():
    record = conv_backend("cpu", torch.bfloat16)
    assert record["torch"] == torch.__version__ and record["device_type"] == "cpu"
    assert record["conv3d_backend"] is None and record["warning"] is None


def test_the_probe_runs_a_real_convolution_and_reads_its_operators():
    """On the CPU the probe's convolution runs on oneDNN or torch's own slow_conv3d: the
    profile names the operator either way, so the probe itself is exercised here."""
    assert backend.probe(torch.device("cpu"), None) in (None, "native")


def test_announce_prints_one_line_per_warning(capsys):
    backend.announce(None, "first", None, "second")
    assert capsys.readouterr().err.splitlines() == [
        "ctseg: warning: first",
        "ctseg: warning: second",
    ]
