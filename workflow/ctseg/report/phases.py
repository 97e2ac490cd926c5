"""The report's phase trials: each trial's settings, figures, precision and the verdict it
recorded, as tables and plots.

Everything here is read from the trials' summary.json (`ctseg.summaries.TrialSummary`) and
steps.csv. The verdict, next knob, step-time spread, thresholds and the machine facts
(CPU count, device, scratch format) are the trial's own (ctseg.trials.trials,
ctseg.trials.diagnosis): a summary from an older version without them shows "not recorded"; nothing
is worked out here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatter

from ctseg.formatting import fmt, num, pct
from ctseg.io import CtsegError
from ctseg.report.markup import Sources, esc, missing, png, read_table, setting, source_line, table
from ctseg.summaries import TrialSummary

NOT_RECORDED = "not recorded"
# Phase settings always shown (the knobs of the staged plan in README.md, "The starting point");
# any other setting is shown when it varies.
KEY_SETTINGS = ("workers", "batch_size", "prefetch_factor", "persistent_workers", "precision")
SETTING_LABELS = {
    "workers": "workers",
    "batch_size": "batch",
    "accumulate": "accum.",
    "prefetch_factor": "prefetch",
    "persistent_workers": "persistent",
    "pin_memory": "pin mem.",
    "device_prefetch": "dev. prefetch",
    "precision": "precision",
    "channels_last": "ch. last",
    "compile": "compile",
    "mp_context": "mp context",
    "scratch_format": "scratch",
    "drop_last": "drop last",
}
SETTING_ORDER = tuple(SETTING_LABELS)
# The verdict of a trial whose timings carry no signal (ctseg.trials.diagnosis.LABELS): no speed
# ratio is taken from it.
NOT_MEASURABLE = "not measurable"
STATUS_COLOURS = {"ok": "#4c72b0", "oom": "#c44e52", "over_memory": "#dd8452", "failed": "#8c8c8c"}
THRESHOLD_LABELS = {
    "data_wait_fraction": ("data wait above", pct),
    "feed_efficiency": ("feed efficiency below", lambda v: fmt(v, 2)),
    "h2d_fraction": ("host-to-device above", pct),
    "vram_headroom_for_batch": ("larger batch with VRAM headroom above", lambda v: f"{v:g}x"),
    "min_measured_steps": ("fewest measured steps per run", fmt),
    "band_standard_errors": ("uncertainty band, standard errors", fmt),
}


def _recorded(value: Any) -> str:
    return NOT_RECORDED if value is None else fmt(value)


def _phase_columns(summaries: Sequence[TrialSummary]) -> tuple[list[str], dict[str, Any]]:
    """Settings to show as columns (key ones + any that vary) and those equal in every phase."""
    keys: list[str] = []
    for summary in summaries:
        keys += [k for k in summary.settings if k not in keys]
    keys.sort(key=lambda k: (SETTING_ORDER.index(k) if k in SETTING_ORDER else 99, k))
    shown, constant = [], {}
    for key in keys:
        values = [setting(s.settings.get(key)) for s in summaries]
        if key in KEY_SETTINGS or len(set(values)) > 1:
            shown.append(key)
        else:
            constant[key] = summaries[0].settings.get(key)
    return shown, constant


def _unmeasured(*summaries: TrialSummary | None) -> bool:
    return any(s is not None and s.verdict == NOT_MEASURABLE for s in summaries)


def _speedup(summary: TrialSummary, base: TrialSummary | None) -> str:
    if base is None or summary.status != "ok" or base.status != "ok":
        return "n/a"
    if _unmeasured(summary, base):
        return NOT_MEASURABLE
    now, then = num(summary.samples_per_s), num(base.samples_per_s)
    return f"{now / then:.2f}×" if now and then else "n/a"


def _previous_speedup(summary: TrialSummary, by_phase: Mapping[Any, TrialSummary]) -> str:
    """The trial's recorded ratio to the phase before it, unless either is not measurable."""
    checks = summary.checks
    previous = num(checks.get("speedup_vs_previous"))
    if previous is None:
        return "n/a"
    if _unmeasured(summary, by_phase.get(checks.get("previous_phase"))):
        return NOT_MEASURABLE
    return f"{previous:.2f}× (vs {checks.get('previous_phase')})"


def _on_gpu(summaries: Sequence[TrialSummary]) -> bool:
    """Whether any trial recorded a GPU's figures (utilisation, peak VRAM): a CPU has none, so
    their columns and plot are left out of a CPU run's page."""
    return any(
        num(s.peak_vram_gb) is not None or num(s.gpu_util_mean) is not None for s in summaries
    )


def _maths_short(summary: TrialSummary) -> str:
    maths = summary.maths
    return (
        f"{fmt(maths.get('batch_size'))}×{fmt(maths.get('accumulate', 1))}"
        f"={fmt(summary.effective_batch)} {maths.get('precision') or 'fp32'}"
    )


def _feed(summary: TrialSummary) -> str:
    feed, band = summary.feed_efficiency, summary.feed_efficiency_band
    if num(feed) is None or num(band) is None:
        return fmt(feed, 2)
    return f"{fmt(feed, 2)} ± {fmt(band, 2)}"


def _mfu(summary: TrialSummary) -> str:
    """The useful MFU as recorded (padding left out), with the peak it is a fraction of and
    where that came from; a summary from before the useful MFU shows the MFU it has, so
    marked."""
    peak = summary.peak or {}
    useful = num(summary.useful_mfu)
    mfu = useful if useful is not None else num(summary.mfu)
    if mfu is None or not peak:
        return "n/a" if summary.version and summary.version >= 3 else NOT_RECORDED
    devices = int(peak.get("devices", 1) or 1)
    source = "measured" if peak.get("source") == "measured" else peak.get("detail", "table")
    times = f"{devices}×" if devices > 1 else ""
    kind = "" if useful is not None else "computed FLOPs; useful not recorded, "
    return (
        f"{100 * mfu:.1f}% ({kind}{times}{fmt(peak.get('tflops'))} "
        f"{peak.get('precision')}, {source})"
    )


def _padding(summary: TrialSummary) -> str:
    """The patch, the size the network computed it at and the share of FLOPs on padding."""
    flops = summary.flops or {}
    share = num(flops.get("padding_share"))
    if share is None:
        return NOT_RECORDED if flops or summary.status == "ok" else "n/a"
    patch = "×".join(str(s) for s in flops.get("patch", []))
    computed = "×".join(str(s) for s in flops.get("computed_patch", []))
    return pct(share) if patch == computed else f"{pct(share)} ({patch} at {computed})"


def _mfu_absent_note(summaries: Sequence[TrialSummary]) -> str:
    """Why a trial shows no MFU: no peak is known for its device (a CPU has no datasheet
    figure), so there is nothing to take a fraction of; GPU-only advice is not given there."""
    absent = [s for s in summaries if s.status == "ok" and (num(s.mfu) is None or not s.peak)]
    if not absent:
        return ""
    devices = sorted({str(s.device or NOT_RECORDED) for s in absent})
    phases = ", ".join(str(s.phase) for s in absent)
    return (
        f"<p class='note'>No MFU for phase(s) {esc(phases)} (device {esc(', '.join(devices))}): "
        "MFU is a fraction of the device's peak, and no peak is known for it (the table has "
        "GPUs' datasheet figures only; a CPU's reachable rate depends on its cores, threads "
        "and load, so a measured figure would not compare across phases). Their TFLOP/s is "
        "shown as measured; advice that needs a GPU (tensor cores, cuDNN layouts) is not "
        "given for them.</p>"
    )


def _profile_table(summaries: Sequence[TrialSummary]) -> str:
    """Each trial's kernel profile: the share of the profiled step per class, as recorded."""
    profiled = [s for s in summaries if s.profile]
    if not profiled:
        return ""
    classes: list[str] = []
    for s in profiled:
        classes += [c for c in (s.profile.get("classes") or {}) if c not in classes]
    header = ["phase", "profiled step s", *classes, "largest", "its knob"]
    rows = []
    for s in profiled:
        profile = s.profile
        if "error" in profile:
            rows.append([fmt(s.phase), f"no profile: {profile['error']}"])
            continue
        shares = profile.get("classes") or {}
        rows.append(
            [fmt(s.phase), fmt(profile.get("step_s"))]
            + [pct((shares.get(c) or {}).get("fraction")) for c in classes]
            + [profile.get("largest", NOT_RECORDED), profile.get("next_knob", NOT_RECORDED)]
        )
    basis = "; ".join(
        sorted({str(s.profile.get("basis")) for s in profiled if s.profile.get("basis")})
    )
    return (
        "<h3>Kernel profile</h3><p class='note'>torch.profiler over the last steps of each "
        "trial's compute-ceiling run (no loader wait in them: the data wait column has that), "
        f"by kernel class, as the trial recorded it (<code>profile</code>). Shares of the "
        f"profiled wall time; basis: {esc(basis)}.</p>" + table(header, rows)
    )


def _phase_rows(
    summaries: Sequence[TrialSummary], shown: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    base = summaries[0]
    gpu = _on_gpu(summaries)
    by_phase = {s.phase: s for s in summaries}
    header = (
        ["phase"]
        + [SETTING_LABELS.get(k, k) for k in shown]
        + ["status", "median step s", "samples/s", "data wait", "h2d", "feed eff. ± band"]
        + ["TFLOP/s", "padding (patch at computed)", "useful MFU (peak TFLOP/s)"]
        + (["GPU util %", "peak VRAM GB (limit)"] if gpu else [])
        + ["peak RSS GB (limit)"]
        + [f"× phase {base.phase}", "× previous", "maths: batch×accum."]
        + ["CPU cores", "device", "verdict"]
    )
    rows = []
    for summary in summaries:
        maths = _maths_short(summary)
        if summary.maths != base.maths:
            maths += f" (≠ {base.phase})"
        device = (
            [
                fmt(summary.gpu_util_mean),
                f"{fmt(summary.peak_vram_gb)} ({fmt(summary.vram_limit_gb)})",
            ]
            if gpu
            else []
        )
        rows.append(
            [fmt(summary.phase)]
            + [setting(summary.settings.get(k)) for k in shown]
            + [
                summary.status,
                fmt(summary.median_step_s),
                fmt(summary.samples_per_s),
                pct(summary.data_wait_fraction),
                pct(summary.h2d_fraction),
                _feed(summary),
                fmt(summary.tflops),
                _padding(summary),
                _mfu(summary),
                *device,
                f"{fmt(summary.peak_host_rss_gb)} ({fmt(summary.host_ram_limit_gb)})",
                _speedup(summary, base),
                _previous_speedup(summary, by_phase),
                maths,
                _recorded(summary.cpu_count),
                _recorded(summary.device),
                summary.verdict or NOT_RECORDED,
            ]
        )
    return header, rows


def _precision_table(summaries: Sequence[TrialSummary]) -> str:
    """Each run's step-time spread, as the trial recorded it."""
    header = ["phase", "run", "measured steps", "median s", "IQR s", "MAD s", "min s", "max s"]
    rows = []
    for summary in summaries:
        if summary.status not in ("ok", "over_memory"):
            continue
        for run in ("real", "ceiling"):
            stats = summary.step_stats.get(run)
            if not stats:
                rows.append([fmt(summary.phase), run] + [NOT_RECORDED] * 6)
                continue
            rows.append(
                [fmt(summary.phase), run, fmt(stats.get("n"))]
                + [fmt(stats.get(k)) for k in ("median_s", "iqr_s", "mad_s", "min_s", "max_s")]
            )
    if not rows:
        return ""
    return (
        "<h3>Step-time spread per trial (how repeatable the timings are)</h3>"
        "<p class='note'>Step times after the warm-up, as each trial "
        "recorded them (<code>step_stats</code>): <em>real</em> is the run with the loader, "
        "<em>ceiling</em> the same model on batches already on the device. The feed "
        "efficiency's ± band is the trial's <code>feed_efficiency_band</code>.</p>"
        + table(header, rows)
    )


def _bar(ax: Any, summaries: Sequence[TrialSummary], key: str, title: str) -> list[float | None]:
    xs = [str(s.phase) for s in summaries]
    values = [num(getattr(s, key)) for s in summaries]
    colours = [STATUS_COLOURS.get(s.status, "#8c8c8c") for s in summaries]
    ax.bar(xs, [v or 0.0 for v in values], color=colours)
    for x, value, s in zip(xs, values, summaries, strict=True):
        if value is None:
            ax.annotate(s.status, (x, 0), ha="center", va="bottom", fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("phase")
    return values


def _phase_figure(summaries: Sequence[TrialSummary], thresholds: Mapping[str, float]) -> Figure:
    gpu = _on_gpu(summaries)
    fig = Figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    _bar(axes[0], summaries, "samples_per_s", "samples/s")
    _bar(axes[1], summaries, "data_wait_fraction", "data-wait fraction")
    if "data_wait_fraction" in thresholds:
        limit = thresholds["data_wait_fraction"]
        axes[1].axhline(limit, color="k", ls="--", lw=1, label="data-bound above")
    feeds = _bar(axes[2], summaries, "feed_efficiency", "feed efficiency (real / ceiling)")
    bands = [num(s.feed_efficiency_band) for s in summaries]
    xs = [str(s.phase) for s in summaries]
    shown = [(x, f, b) for x, f, b in zip(xs, feeds, bands, strict=True) if f is not None and b]
    if shown:
        axes[2].errorbar(
            [x for x, _, _ in shown],
            [f for _, f, _ in shown],
            yerr=[b for _, _, b in shown],
            fmt="none",
            ecolor="k",
            capsize=4,
            label="± band",
        )
    if "feed_efficiency" in thresholds:
        limit = thresholds["feed_efficiency"]
        axes[2].axhline(limit, color="k", ls="--", lw=1, label="data-bound below")
    # Peak VRAM only where a trial recorded one: a CPU has no VRAM, so no empty panel.
    memory = [("peak_host_rss_gb", "host_ram_limit_gb", "peak host RSS GB (with workers)")]
    if gpu:
        memory.insert(0, ("peak_vram_gb", "vram_limit_gb", "peak VRAM GB"))
    for ax, (key, limit_key, title) in zip(axes[3:], memory, strict=False):
        _bar(ax, summaries, key, title)
        limits = {num(getattr(s, limit_key)) for s in summaries} - {None}
        if len(limits) == 1:
            ax.axhline(limits.pop(), color="k", ls="--", lw=1, label="limit")
    _split_bars(axes[3 + len(memory)], summaries)
    for ax in axes[4 + len(memory) :]:
        ax.set_visible(False)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    legend = [Patch(color=c, label=s) for s, c in STATUS_COLOURS.items()]
    fig.legend(handles=legend, loc="outside lower center", ncols=4, fontsize=8)
    return fig


def _split_bars(ax: Any, summaries: Sequence[TrialSummary]) -> None:
    xs = [str(s.phase) for s in summaries]
    wait = np.array([num(s.data_wait_fraction) or 0.0 for s in summaries])
    h2d = np.array([num(s.h2d_fraction) or 0.0 for s in summaries])
    ran = np.array([num(s.data_wait_fraction) is not None for s in summaries])
    compute = np.where(ran, 1.0 - wait - h2d, 0.0)
    ax.bar(xs, wait, color="#c44e52", label="data wait")
    ax.bar(xs, h2d, bottom=wait, color="#dd8452", label="host-to-device")
    ax.bar(xs, compute, bottom=wait + h2d, color="#55a868", label="compute")
    ax.set_title("step time split", fontsize=10)
    ax.set_xlabel("phase")


class PlainLogLabels(LogFormatter):
    """The ticks `LogFormatter` labels, written as plain numbers (0.1, not 1e-01)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def _trial_steps_figure(steps: Sequence[tuple[int, pd.DataFrame]]) -> Figure:
    fig = Figure(figsize=(13, 3.2), layout="constrained")
    ax_step, ax_wait = fig.subplots(1, 2)
    for phase, frame in steps:
        ax_step.plot(frame["step"], frame["step_s"], marker=".", lw=1, label=f"phase {phase}")
        fraction = frame["data_wait_s"] / frame["step_s"]
        ax_wait.plot(frame["step"], fraction, marker=".", lw=1, label=f"phase {phase}")
    ax_step.set(title="step time per trial step (s, log scale)", xlabel="step", yscale="log")
    # Plain numbers on the log axis (0.3, not 3×10⁻¹). Phases may differ by 10x or 100x (a CPU
    # trial): minor ticks are labelled only where the axis spans under a decade, and then only
    # as many as fit (matplotlib's minor thresholds), so labels never overlap.
    ax_step.yaxis.set_major_formatter(PlainLogLabels())
    minor = PlainLogLabels(labelOnlyBase=False, minor_thresholds=(1, 0.4))
    ax_step.yaxis.set_minor_formatter(minor)
    ax_wait.set(title="data-wait fraction per trial step", xlabel="step", ylim=(0, 1))
    ax_step.legend(fontsize=7, ncols=2)
    return fig


def _read_trial_steps(path: Path, src: Sources) -> pd.DataFrame | None:
    if not path.exists():
        return None
    frame = read_table(path)
    # A failed trial leaves a header-only steps.csv; nothing to plot, nothing to cite.
    if not {"step", "step_s", "data_wait_s"} <= set(frame.columns) or frame.empty:
        return None
    src.use(path)
    return frame


def _read_summary(path: Path) -> TrialSummary:
    try:
        return TrialSummary.read(path)
    except CtsegError as exc:
        raise CtsegError(f"{exc} (read for the report)") from exc


def phase_section(paths: Sequence[Path], src: Sources) -> str:
    out = ['<h2 id="phases">Phase trials</h2>']
    present = [Path(p) for p in paths if Path(p).exists()]
    absent = [src.rel(Path(p)) for p in paths if not Path(p).exists()]
    if absent:
        out.append(missing("Phase summaries", absent))
    if not present:
        if not paths:
            out.append(missing("Phase summaries"))
        return "\n".join(out)
    loaded = sorted(((_read_summary(p), src.use(p), p) for p in present), key=lambda t: t[0].phase)
    summaries = [s for s, _, _ in loaded]
    names = [name for _, name, _ in loaded]
    shown, constant = _phase_columns(summaries)
    header, rows = _phase_rows(summaries, shown)
    # One column per phase, one row per figure: the figures outnumber the phases three to one,
    # and a row per phase would not fit a 900 px window without breaking words.
    by_figure = [[name, *(row[i] for row in rows)] for i, name in enumerate(header) if i]
    out.append(table([header[0], *(row[0] for row in rows)], by_figure))
    if constant:
        same = ", ".join(f"{k} = {setting(v)}" for k, v in constant.items())
        out.append(f"<p>Same in every phase: {esc(same)}.</p>")
    out.append(
        "<p class='note'>× previous is the summary's <code>checks.speedup_vs_previous</code> "
        "(against the last phase before it whose trial was ok). <em>maths</em> is what a phase "
        "changes besides speed: batch × gradient accumulation and precision. CPU cores and "
        "device are those of the machine that ran the trial. TFLOP/s: the model's counted "
        "FLOPs per sample (forward and backward, at the size the network computes the patch "
        "at) × samples/s; padding: the share of those FLOPs spent on the padding the network "
        "adds to the patch; useful MFU: the FLOP/s of the patch itself (padding left out) over "
        "the peak of the precision in use (a vendor table's dense figure, or a matmul probe's, "
        "<em>measured</em>); the summary's <code>mfu</code> counts the padding too.</p>"
    )
    out.append(_mfu_absent_note(summaries))
    out.append(_verdict_list(summaries))
    out.append(_precision_table(summaries))
    out.append(_profile_table(summaries))
    thresholds = next((s.thresholds for s in summaries if s.thresholds), {})
    out.append(png(_phase_figure(summaries, thresholds), "phase trial figures"))
    steps, step_files = [], []
    for summary, _, path in loaded:
        frame = _read_trial_steps(path.parent / "steps.csv", src)
        if frame is not None:
            steps.append((summary.phase, frame))
            step_files.append(src.rel(path.parent / "steps.csv"))
    if steps:
        out.append(png(_trial_steps_figure(steps), "per-step times of the phase trials"))
        out.append(source_line(step_files))
    out.append(source_line(names))
    return "\n".join(out)


def _verdict_item(s: TrialSummary) -> str:
    if s.verdict is None:
        return (
            f"<li><b>phase {esc(s.phase)}: verdict {NOT_RECORDED}</b>: this summary.json "
            "predates trials that record their own verdict, next knob and precision; rerun "
            "its trial for one.</li>"
        )
    facts = (
        f"CPU cores {_recorded(s.cpu_count)}, device {_recorded(s.device)}, "
        f"scratch {_recorded(s.scratch_format)}"
    )
    notes = "".join(f"; note: {esc(n)}" for n in s.notes)
    return (
        f"<li><b>phase {esc(s.phase)}: {esc(s.verdict)}</b>: "
        f"{esc(s.verdict_reason or NOT_RECORDED)}: next knob: "
        f"{esc(s.next_knob or NOT_RECORDED)} <span class='note'>({esc(facts)}{notes})</span></li>"
    )


def _verdict_list(summaries: Sequence[TrialSummary]) -> str:
    items = "".join(_verdict_item(s) for s in summaries)
    thresholds = next((s.thresholds for s in summaries if s.thresholds), None)
    if thresholds:
        rules = "; ".join(
            f"{label} {show(thresholds[key])}"
            for key, (label, show) in THRESHOLD_LABELS.items()
            if key in thresholds
        )
        note = (
            f"Each verdict is the trial's own (ctseg.trials.diagnosis), judged on the CPU cores "
            f"and device it ran on. Thresholds the trials recorded: {esc(rules)}."
        )
    else:
        note = f"Thresholds: {NOT_RECORDED} by these trials."
    return (
        f"<h3>Bottleneck verdicts</h3><ul class='verdicts'>{items}</ul><p class='note'>{note}</p>"
    )
