"""A phase trial's efficiency figures and kernel profile (ctseg.trials.kernel_profile,
ctseg.network.flops in ctseg.trials.trials), from one real trial on the CPU with the tiny training
setup, and the classifier
on names as torch.profiler and cuDNN/inductor write them."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval
from training_setup import CLIP, EXPERIMENT, PHASE, TRAIN_IDS, build_scratch, torch_globals

from ctseg.network.flops import count_flops
from ctseg.summaries import EFFICIENCY_COLUMNS, TrialSummary
from ctseg.trials.diagnosis import diagnose
from ctseg.trials.kernel_profile import (
    CLASSES,
    PROFILE_STEPS,
    _kernel_class,
    classify,
    knob,
    summarise,
)
from ctseg.trials.trials import run_trial


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrialSummary, Path]:
    root = tmp_path_factory.mktemp("profile")
    scratch = build_scratch(root)
    exp = {**EXPERIMENT, "trial": {**EXPERIMENT["trial"], "steps": 4, "ceiling_steps": 4}}
    with torch_globals():
        summary = run_trial(
            exp,
            0,
            PHASE,
            scratch=scratch,
            train_ids=TRAIN_IDS,
            out_dir=root / "phase0",
            clip_distance=CLIP,
            device="cpu",
        )
    return summary, root / "phase0"


def test_cpu_trial_profile_has_every_class_and_sums_to_its_step(trial):
    summary, _ = trial
    assert summary.status == "ok", summary.error
    profile = summary.profile
    assert "error" not in profile, profile
    assert set(profile["classes"]) == set(CLASSES)
    assert profile["device_type"] == "cpu" and profile["steps"] == PROFILE_STEPS
    fractions = {k: v["fraction"] for k, v in profile["classes"].items()}
    # On one CPU thread the classes' own times and the time outside operators fill the step.
    assert sum(fractions.values()) == pytest.approx(1.0, abs=0.05)
    for name in ("conv forward", "conv backward", "normalisation", "loss", "optimizer", "idle"):
        assert fractions[name] > 0, name
    assert profile["largest"] == max(fractions, key=fractions.get)
    assert profile["next_knob"] == knob(profile["largest"], "cpu", PHASE)
    # The verdict names the largest class.
    assert f"largest class {profile['largest']}" in summary.verdict_reason
    assert diagnose(summary).reason == summary.verdict_reason


def test_profiled_steps_are_left_out_of_the_ceiling_figures(trial):
    summary, out = trial
    with open(out / "ceiling" / "steps.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    # ceiling steps, the profiler's warm-up step and the profiled steps ran ...
    assert len(rows) == summary.ceiling_steps + 1 + PROFILE_STEPS
    # ... and the ceiling's spread rests on its own measured steps only.
    assert summary.step_stats["ceiling"]["n"] == summary.ceiling_steps - summary.warmup_steps


def test_trial_records_tflops_and_mfu_in_summary_and_steps(trial):
    summary, out = trial
    flops = count_flops(EXPERIMENT["model"], EXPERIMENT["data"]["patch_size"])
    assert summary.flops["train_per_sample"] == pytest.approx(flops.train)
    assert summary.tflops == pytest.approx(flops.train * summary.samples_per_s / 1e12)
    peak = summary.peak
    assert peak["source"] == "measured" and peak["precision"] == "fp32" and peak["tflops"] > 0
    assert summary.mfu == pytest.approx(summary.tflops / peak["tflops"])
    assert summary.ceiling_mfu == pytest.approx(summary.ceiling_tflops / peak["tflops"])
    # The tiny setup's patch is a multiple of its network's: the useful MFU is the MFU.
    assert summary.flops["padding_share"] == 0 and summary.useful_mfu == summary.mfu
    assert summary.backend["torch"] and summary.backend["device_type"] == "cpu"
    for path in (out / "steps.csv", out / "ceiling" / "steps.csv"):
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
        assert list(reader.fieldnames)[-len(EFFICIENCY_COLUMNS) :] == list(EFFICIENCY_COLUMNS)
        for row in rows:
            tflops = flops.train * float(row["samples_per_s"]) / 1e12
            assert math.isclose(float(row["tflops"]), tflops, rel_tol=1e-6)
            assert math.isclose(float(row["mfu"]), tflops / peak["tflops"], rel_tol=1e-6)
            assert float(row["useful_mfu"]) == float(row["mfu"])


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["aten::mkldnn_convolution", "aten::_convolution", "aten::conv3d"], "conv forward"),
        (["aten::fill_", "evaluate_function: ConvolutionBackward0"], "conv backward"),
        # A transposed convolution's forward runs cuDNN's dgrad kernel: the operator decides.
        (["aten::cudnn_convolution_transpose", "sm90_xmma_dgrad_implicit_gemm"], "conv forward"),
        (["aten::native_batch_norm", "aten::instance_norm"], "normalisation"),
        (["triton_red_fused__native_batch_norm_legit_functional_leaky_relu_3"], "normalisation"),
        (["aten::leaky_relu"], "element-wise"),
        (["aten::mul", "autograd::engine::evaluate_function: SigmoidBackward0"], "loss"),
        (["aten::max_pool3d_with_indices"], "loss"),
        (["aten::_foreach_mul_"], "optimizer"),
        (["aten::mul", "Optimizer.step#AdamW.step"], "optimizer"),
        (["Memcpy HtoD (Pinned -> Device)"], "copies"),
        (["aten::copy_", "aten::_to_copy", "aten::to"], "copies"),
        (["## Call CompiledFxGraph f7x ##", "Torch-Compiled Region: 0/0"], "compiled"),
    ],
)
def test_classes_from_operator_and_kernel_names(names, expected):
    assert classify(names) == expected


@pytest.mark.parametrize(
    ("kernel", "chain", "expected"),
    [
        # Launched by an operator: the operator decides.
        ("sm90_xmma_dgrad_implicit_gemm", ["aten::cudnn_convolution_transpose"], "conv forward"),
        ("void at::native::vectorized_elementwise_kernel", ["aten::leaky_relu"], "element-wise"),
        # Replayed from a CUDA graph (reduce-overhead): only the compiled region is above it.
        ("sm90_xmma_wgrad_implicit_gemm", ["CompiledFunctionBackward"], "conv backward"),
        ("sm90_xmma_fprop_implicit_gemm", ["## Call CompiledFxGraph f ##"], "conv forward"),
        ("triton_per_fused_native_group_norm_2", ["CompiledFunction"], "normalisation"),
        ("Memcpy DtoD (Device -> Device)", ["CompiledFunction"], "copies"),
        ("multi_tensor_apply_kernel", ["Optimizer.step#AdamW.step"], "optimizer"),
        # Inductor's kernels that convert dtypes while they compute are no copies (H200,
        # phase 8: 13% of the step was filed under copies for the "_to_copy" in their names).
        (
            "triton_red_fused__to_copy_mean_mul_sub_sum_view_17",
            ["CompiledFunction"],
            "element-wise",
        ),
        ("triton_poi_fused__to_copy_3", ["CompiledFunction"], "copies"),
        ("triton_poi_fused_clone_2", ["CompiledFunction"], "copies"),
        # cuDNN's backward converting grad_output to the weights' layout: a copy.
        (
            "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>",
            ["aten::copy_", "aten::_to_copy", "aten::to", "aten::convolution_backward"],
            "copies",
        ),
    ],
)
def test_device_kernels_are_classed_by_operator_or_own_name(kernel, chain, expected):
    assert _kernel_class(kernel, chain) == expected


def _event(name, start, end, *, device="cpu", id=0, linked=0, parent=None, annotation=False):
    """A torch.profiler FunctionEvent's fields that summarise reads."""
    return SimpleNamespace(
        name=name,
        time_range=Interval(start, end),
        device_type=DeviceType.CUDA if device == "cuda" else DeviceType.CPU,
        id=id,
        linked_correlation_id=linked,
        cpu_parent=parent,
        is_async=False,
        is_user_annotation=annotation,
        kernels=[],
        self_cpu_time_total=0.0,
    )


def test_cuda_summary_uses_device_time_and_skips_annotations():
    """Two profiled steps of 1000 us on the CPU clock with 700 us of kernels: 1300 us idle.
    The GPU-side mirror of the steps (a user annotation) is neither busy time nor a class."""
    steps = [_event("ProfilerStep*", 0, 1000), _event("ProfilerStep*", 1000, 2000)]
    conv = _event("aten::cudnn_convolution", 10, 20, id=7, parent=steps[0])
    graph = _event("CompiledFunctionBackward", 1010, 1020, id=8, parent=steps[1])
    events = [
        *steps,
        conv,
        graph,
        _event("cudaLaunchKernel", 11, 12, id=900, linked=7),  # a runtime call, not a launcher
        _event("ProfilerStep*", 0, 2000, device="cuda", annotation=True, linked=1),
        _event("sm90_xmma_fprop_implicit_gemm", 100, 500, device="cuda", id=900, linked=7),
        _event("sm90_xmma_wgrad_implicit_gemm", 1100, 1300, device="cuda", id=901, linked=8),
        _event("triton_poi_fused_leaky_relu_0", 1300, 1400, device="cuda", id=902, linked=8),
    ]
    summary = summarise(events, "cuda", 2, {"compile": True, "compile_mode": "default"})
    classes = {k: v["fraction"] for k, v in summary["classes"].items() if v["fraction"]}
    assert classes == pytest.approx(
        {"conv forward": 0.2, "conv backward": 0.1, "element-wise": 0.05, "idle": 0.65}
    )
    assert summary["step_s"] == pytest.approx(0.001) and summary["largest"] == "idle"
    assert "reduce-overhead" in summary["next_knob"]


def test_knob_follows_the_largest_class_and_the_phase():
    assert "compile" in knob("element-wise", "cuda", {"compile": False})
    assert "reduce-overhead" in knob("idle", "cuda", {"compile": True})
    assert "fused_optimizer" in knob("optimizer", "cuda", {})
    assert "bf16" in knob("conv backward", "cuda", {"precision": "fp32"})
    assert "channels_last" in knob("conv forward", "cuda", {"precision": "bf16"})


def test_a_cpu_profile_gives_no_gpu_advice() -> None:
    for precision in ("fp32", "bf16"):
        advice = knob("conv forward", "cpu", {"precision": precision})
        assert "tensor cores" not in advice and "cuDNN" not in advice and "bf16" not in advice
        assert "CPU" in advice


def test_kernel_times_beyond_the_wall_time_are_refused_not_reported_as_shares():
    """Under CUDA graphs the profiler attributed each replayed kernel several times (H200:
    classes summing to 13x the step). Such a profile gives no classes, only the reason."""
    steps = [_event("ProfilerStep*", 0, 1000)]
    graph = _event("CompiledFunctionBackward", 10, 20, id=8, parent=steps[0])
    replayed = [
        _event("sm90_xmma_wgrad_implicit_gemm", 100, 900, device="cuda", id=900 + k, linked=8)
        for k in range(3)
    ]
    with pytest.raises(ValueError, match=r"2\.4x the profiled wall time"):
        summarise([*steps, graph, *replayed], "cuda", 1)
    # One pass of the same kernels is a valid profile.
    summary = summarise([*steps, graph, replayed[0]], "cuda", 1)
    assert summary["classes"]["conv backward"]["fraction"] == pytest.approx(0.8)
