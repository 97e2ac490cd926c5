"""Where a training step's time goes: torch.profiler over a few steps, summarised by kernel class.

A phase trial profiles `PROFILE_STEPS` steps of its compute-ceiling run (the model on batches
already on the device, so the loader's wait is not in it: the trial's data-wait figure has
that), after the ceiling's measured steps and one profiler warm-up step; those extra steps are
left out of the ceiling's figures. The steps are found without touching the training loop: a
global optimizer-step hook advances the profiler's schedule, so each profiled step runs from the
end of one optimizer step to the end of the next.

Classes (`CLASSES`), from the operator that launched each kernel, its parents and the kernel's
own name, first match wins: optimizer (anything under ``Optimizer.step``/``zero_grad``, the
foreach/fused kernels, gradient clipping), convolution backward, convolution forward (transposed
convolutions included), normalisation, loss (the operators only the loss uses: sigmoid, BCE,
the soft skeleton's pooling; its products and sums are element-wise), copies (memcpy, memset,
layout and dtype conversions), compiled (a CPU's inductor code, which runs as one operator),
element-wise and activation (the rest), and idle:

- on CUDA, times are device kernel times; idle is the profiled wall time in which no kernel
  ran (launch gaps, synchronisation, Python);
- on a CPU the classes are operators' own (self) CPU time, and idle is the step's time outside
  any operator (Python and the loop's bookkeeping).

Fractions are of the profiled wall time; on CUDA the largest kernels of each class are named
(``kernels``). The summary names the largest class and the knob it
suggests, given the phase's settings, and which library ran the 3D convolutions
(``conv3d_backend``: cudnn, native, mixed, from the operator and kernel names;
`ctseg.network.backend`).
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook

from ctseg.network.backend import backend_of

PROFILE_STEPS = 3
TOP_KERNELS = 3  # the largest kernels named per class (on CUDA), with their share of the step
PROFILE_WARMUP = 1  # the profiler's own warm-up step (its overhead is not representative)
CLASSES = (
    "conv forward",
    "conv backward",
    "normalisation",
    "element-wise",
    "loss",
    "optimizer",
    "copies",
    "compiled",
    "idle",
)
# Lowercase fragments of operator or kernel names (spaces and underscores removed), per class,
# in the order they are tried.
_OPTIMIZER = ("optimizer.", "foreach", "adam", "sgd", "multitensorapply", "clipgrad", "vectornorm")
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("conv backward", ("convolutionbackward", "dgrad", "wgrad")),
    ("conv forward", ("convolution", "conv3d", "conv2d", "convtranspose", "fprop", "convolve")),
    ("normalisation", ("batchnorm", "instancenorm", "groupnorm", "layernorm", "varmean")),
    ("loss", ("sigmoid", "binarycrossentropy", "maxpool", "avgpool", "softplus")),
    ("copies", ("memcpy", "memset", "copy", "contiguous", "clone", "nchwtonhwc", "nhwctonchw")),
    ("compiled", ("compiledfunction", "compiledfxgraph", "torch-compiledregion")),
)
_COPY_NAMES = ("aten::to", "aten::_to_copy")


def _key(name: str) -> str:
    return name.lower().replace("_", "").replace(" ", "")


def _chain(event: Any) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def classify(names: Sequence[str], *, compiled: bool = True) -> str:
    """The class of a kernel or operator from its names: its own first, then its parents'
    (`compiled` False: a compiled region is no class of its own)."""
    keys = [_key(n) for n in names]
    if any(f in k for k in keys for f in _OPTIMIZER):
        return "optimizer"
    rules = _RULES if compiled else tuple(r for r in _RULES if r[0] != "compiled")
    for name, key in zip(names, keys, strict=True):
        if name in _COPY_NAMES:
            return "copies"
        for label, fragments in rules:
            if any(f in key for f in fragments):
                return label
    return "element-wise"


def _fused_compute(kernel: str) -> str:
    """An inductor kernel's name less its dtype conversions (``_to_copy``) when it fuses other
    operators too: ``triton_red_fused__to_copy_mean_mul_sub_sum_view_17`` computes a norm's
    reduction, converting bf16 to float32 on the way, and is no copy; a kernel that fuses
    nothing else (``triton_poi_fused__to_copy_3``) keeps its name and stays one."""
    rest = re.sub(r"_?_to_copy", "", kernel)
    fused = re.sub(r"^triton_[a-z]+_fused|_\d+$", "", rest).replace("view", "").strip("_")
    return rest if fused else kernel


def _kernel_class(kernel: str, chain: list[str]) -> str:
    """A device kernel's class. Inductor's kernels are named for the operators they fuse, and a
    kernel replayed from a CUDA graph has only the compiled region above it: for those the
    kernel's own name decides (cuDNN's fprop/dgrad/wgrad, memcpy, ...); otherwise the operator
    that launched it (a transposed convolution's forward runs a dgrad kernel)."""
    if kernel.lower().startswith("triton"):
        return classify([_fused_compute(kernel)])
    by_operator = classify(chain, compiled=False)
    return by_operator if by_operator != "element-wise" else classify([kernel], compiled=False)


# Kernels run one at a time on the profiled stream, so their times sum to at most the wall
# time; a little over allows for kernels that overlap on other streams (copies, NCCL).
OVERCOUNT = 1.05


def summarise(
    events: Iterable[Any], device_type: str, steps: int, settings: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The profile's summary: seconds per step and fraction of the profiled wall time per class,
    the largest class and its knob. `events`: torch.profiler's FunctionEvents."""
    events = list(events)
    marks = [
        e for e in events if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU
    ]
    if not marks:
        raise ValueError("no profiled steps (no ProfilerStep events)")
    start = min(e.time_range.start for e in marks)
    end = max(e.time_range.end for e in marks)
    wall_us = sum(e.time_range.end - e.time_range.start for e in marks)
    totals = dict.fromkeys(CLASSES, 0.0)
    by_kernel: collections.Counter = collections.Counter()  # (class, kernel name): device us
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    if device_type == "cuda":
        # Device activity, less the GPU-side mirrors of record_function ranges (user
        # annotations: they span whole steps and run nothing; torch's own tables skip them).
        device = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        _device_classes(device, cpu_events, events, totals, by_kernel)
        spans = sorted((max(e.time_range.start, start), min(e.time_range.end, end)) for e in device)
        busy, reach = 0.0, start
        for lo, hi in spans:
            lo = max(lo, reach)
            if hi > lo:
                busy += hi - lo
                reach = hi
        wall_us = end - start
        kernel_us = sum(us for label, us in totals.items() if label != "idle")
        if kernel_us > OVERCOUNT * wall_us:
            # Seen under CUDA graphs (compile mode reduce-overhead): a replay's kernels are
            # attributed to the profile more than once, so no share would mean anything.
            raise ValueError(
                f"kernel times sum to {kernel_us / wall_us:.1f}x the profiled wall time "
                "(CUDA graph replays are not attributed once each): no kernel classes"
            )
        totals["idle"] = max(0.0, wall_us - busy)
        basis = "device kernel time; idle: no kernel running"
    else:
        for event in cpu_events:
            if event.name.startswith("ProfilerStep"):
                totals["idle"] += event.self_cpu_time_total
            else:
                totals[classify(_chain(event))] += event.self_cpu_time_total
        basis = "operators' own CPU time; idle: outside any operator"
    classes = {
        label: {"s_per_step": us / 1e6 / steps, "fraction": us / wall_us if wall_us else None}
        for label, us in totals.items()
    }
    largest = max(CLASSES, key=lambda label: totals[label])
    kernels: dict[str, list] = {}
    for (label, name), us in by_kernel.most_common():
        if len(kernels.setdefault(label, [])) < TOP_KERNELS:
            kernels[label].append([name, us / wall_us if wall_us else None])
    return {
        "device_type": device_type,
        "conv3d_backend": backend_of(e.name for e in events) if device_type == "cuda" else None,
        "steps": steps,
        "step_s": wall_us / 1e6 / steps,
        "basis": basis,
        "classes": classes,
        "largest": largest,
        "next_knob": knob(largest, device_type, settings or {}),
        "kernels": kernels,
    }


def _device_classes(
    device: list[Any],
    cpu_events: list[Any],
    events: list[Any],
    totals: dict[str, float],
    by_kernel: collections.Counter,
) -> None:
    """Each device event's time into its class. A device event names the correlation id of
    the operator that launched it (`linked_correlation_id`); a torch without that attribute
    gets the operators' kernel lists instead, less the names of user annotations."""
    if all(hasattr(e, "linked_correlation_id") for e in device):
        # The launching operators (frontend events: no linked id of their own; the CUDA
        # runtime calls link to them too).
        launchers = {
            e.id: e
            for e in cpu_events
            if not e.is_async and not getattr(e, "linked_correlation_id", 0)
        }
        for kernel in device:
            launcher = launchers.get(kernel.linked_correlation_id)
            chain = _chain(launcher) if launcher is not None else []
            label = _kernel_class(kernel.name, chain)
            totals[label] += kernel.time_range.elapsed_us()
            by_kernel[label, _named(kernel.name, chain)] += kernel.time_range.elapsed_us()
        return
    annotations = {
        e.name
        for e in events
        if e.device_type == DeviceType.CUDA and getattr(e, "is_user_annotation", False)
    }
    for event in cpu_events:
        chain = _chain(event) if event.kernels else []
        for kernel in event.kernels:
            if kernel.name not in annotations:
                label = _kernel_class(kernel.name, chain)
                totals[label] += kernel.duration
                by_kernel[label, _named(kernel.name, chain)] += kernel.duration


def _named(kernel: str, chain: Sequence[str]) -> str:
    """A kernel's name cut to its first 120 characters, with the operators that launched it
    (innermost first): what to look for when a class is larger than it should be."""
    launched_by = " < ".join(chain[:4])
    return f"{kernel[:120]} [{launched_by}]" if launched_by else kernel[:120]


def knob(largest: str, device_type: str, settings: Mapping[str, Any]) -> str:
    """The next knob the largest class suggests, given what the phase already turns on."""
    compiled = bool(settings.get("compile"))
    if largest in ("conv forward", "conv backward"):
        if device_type != "cuda":  # tensor cores and cuDNN's layouts are a GPU's
            return (
                "the convolutions on the CPU: a GPU runs them many times faster; here, fewer "
                "or smaller feature maps (changes the maths)"
            )
        if (settings.get("precision") or "fp32") == "fp32":
            return "bf16 autocast: the convolutions run on the tensor cores, many times fp32's rate"
        if not settings.get("channels_last"):
            return "channels_last: cuDNN's fastest 3D convolutions want channels-last inputs"
        return (
            "the convolutions themselves: a larger batch per kernel (if VRAM allows; changes the "
            "maths) or a smaller network; MFU says how far they are from the peak"
        )
    if largest in ("normalisation", "element-wise"):
        if not compiled:
            return "torch.compile: fuses norms, activations and element-wise ops into few kernels"
        return (
            "already compiled: what still runs eager is the loss (compiling it needs a phase "
            "key; fewer cldice_iterations changes the maths), else a cheaper norm"
        )
    if largest == "loss":
        return "the loss: fewer cldice_iterations or a cheaper term set (changes the maths)"
    if largest == "optimizer":
        if not settings.get("fused_optimizer"):
            return "fused_optimizer: one kernel for every parameter's update"
        return "a larger batch amortises the optimizer step (changes the maths)"
    if largest == "copies":
        if not settings.get("pin_memory") or not settings.get("device_prefetch"):
            return "pin_memory and device_prefetch, so host copies overlap compute"
        return "channels_last end to end, so no layout conversion is copied"
    if largest == "idle":
        if device_type == "cuda" and settings.get("compile_mode") != "reduce-overhead":
            return "CUDA graphs (compile_mode: reduce-overhead): the device waits on launches"
        if not compiled:
            return "torch.compile: less Python and fewer launches between the kernels"
        return "a larger batch: more work per launch (changes the maths)"
    return "the compiled kernels themselves: compare with an uncompiled phase's profile"


def prepare(device_type: str) -> None:
    """Start the profiler's CUDA tracing (CUPTI, Kineto) once, empty, before any CUDA graph is
    captured: profiling graphs captured before the first profiler start raised or hung
    (pytorch/pytorch#75504; this empty profile is the workaround given there). A trial of a
    phase with CUDA graphs calls it before its first run (other phases skip it: CUPTI then
    starts only for the profiled steps); a failure here only means no profile."""
    if device_type != "cuda":
        return
    with contextlib.suppress(Exception):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities):
            pass


@contextlib.contextmanager
def profiled_steps(
    skip: int, steps: int, device_type: str, settings: Mapping[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Profile `steps` optimizer steps after `skip` steps and `PROFILE_WARMUP` more; yields a
    dict that holds the summary (or ``error``) once the block ends. Whatever fails here is
    recorded in the dict, never raised into the training it watches."""
    result: dict[str, Any] = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def ready(prof: torch.profiler.profile) -> None:
        try:
            result.update(summarise(prof.events(), device_type, steps, settings))
        except Exception as exc:  # noqa: BLE001 - a profile is a diagnostic, never a failure
            result["error"] = f"{type(exc).__name__}: {exc}"

    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=skip, warmup=PROFILE_WARMUP, active=steps, repeat=1),
        on_trace_ready=ready,
    )

    def advance(*_: Any) -> None:
        try:
            prof.step()
        except Exception as exc:  # noqa: BLE001 - see above
            result.setdefault("error", f"{type(exc).__name__}: {exc}")

    try:
        prof.start()
    except Exception as exc:  # noqa: BLE001 - see above: the run goes on unprofiled
        result["error"] = f"{type(exc).__name__}: {exc}"
        yield result
        return
    handle = register_optimizer_step_post_hook(advance)
    try:
        yield result
    finally:
        handle.remove()
        try:
            prof.stop()
        except Exception as exc:  # noqa: BLE001 - see above
            result.setdefault("error", f"{type(exc).__name__}: {exc}")
        if not result:
            result["error"] = "the run ended before the profiled steps"
