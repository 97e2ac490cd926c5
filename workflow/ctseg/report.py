"""The HTML report: phase trials with a bottleneck verdict each, loss curves, scores, slice
overlays and stage timings, in one self-contained file.

Every figure in the page is read from a file under ``results/`` and each section names the
files it read (relative paths), so every number traces back to its source. Plots are PNGs
embedded as base64 data URIs and the CSS is inline: the page opens offline and makes no
requests. A section whose inputs are missing says so; an input that exists but cannot be read
is a `CtsegError` naming the file (a report built on a corrupt file would be silently wrong).

The page carries one small inline script, inert for a reader: once the page has loaded it
draws every image onto a canvas and writes how many rendered (a size and more than one pixel
value) onto ``<body data-images-ok data-images-total>``, so a headless browser's
``--dump-dom`` can prove the images render (tests/browser_check.py).

Bottleneck thresholds (used by `verdict`, and printed in the page):

- data-bound: data wait > 10% of step time, or feed efficiency < 0.90. nnU-Net reports
  0.986 for a well-fed A100 and 0.82 for a starved V100 (DOMAIN.md, "Other"), so below 0.90
  the loader visibly costs throughput.
- h2d-bound: host-to-device copy > 10% of step time and at least the data wait.
- larger batch: only when VRAM headroom (limit / peak) > 2x, so doubling the batch fits.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tifffile
import zarr
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import ScalarFormatter

from ctseg.io import CtsegError, atomic_path

DATA_WAIT_LIMIT = 0.10
FEED_EFFICIENCY_LIMIT = 0.90
H2D_LIMIT = 0.10
VRAM_HEADROOM_FOR_BATCH = 2.0

Overlay = tuple[str, Path, Path | None, Path | None]

# Phase settings always shown (the seeds' knobs); any other setting is shown when it varies.
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

# The steps.csv columns train.py always writes. Every other column is a loss term (each term
# with weight > 0), except the optional diagnostics in STEP_DIAGNOSTICS.
STEP_REQUIRED = {
    "epoch",
    "step",
    "data_wait_s",
    "h2d_s",
    "compute_s",
    "step_s",
    "samples_per_s",
    "loss",
    "lr",
    "gpu_util",
    "vram_peak_mb",
    "host_rss_mb",
}
STEP_DIAGNOSTICS = {"grad_norm"}
SCORE_COLUMNS = (
    "id",
    "score",
    "surface_dice",
    "voi_score",
    "voi_split",
    "voi_merge",
    "voi_total",
    "topo_score",
    "topo_f1_0",
    "topo_f1_1",
    "topo_f1_2",
    "topo_method",
    "dice",
    "cldice",
)
STATUS_COLOURS = {"ok": "#4c72b0", "oom": "#c44e52", "over_memory": "#dd8452", "failed": "#8c8c8c"}


# ---------------------------------------------------------------------------------------------
# Formatting


def _num(value: Any) -> float | None:
    """A finite float, or None for missing / NaN / non-numeric values."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers to `digits` significant figures (fixed notation); None / NaN as 'n/a'."""
    if isinstance(value, bool | np.bool_):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, int | np.integer):
        return str(int(value))
    number = _num(value)
    if number is None:
        return "n/a"
    if number == 0:
        return "0"
    if abs(number) >= 10 ** (digits - 1):
        return f"{number:.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(number))))
    return f"{number:.{decimals}f}"


def pct(value: Any) -> str:
    number = _num(value)
    return "n/a" if number is None else f"{100 * number:.0f}%"


def _setting(value: Any) -> str:
    if isinstance(value, Mapping | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return fmt(value)


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


# ---------------------------------------------------------------------------------------------
# Bottleneck verdict


def verdict(summary: Mapping[str, Any], cpu_count: int) -> tuple[str, str]:
    """(label, explanation) for one phase trial, from its measured figures.

    Labels: out of memory, over memory, failed, no figures, h2d-bound, data-bound,
    compute-bound. The explanation states the numbers it used, the rule that fired and the
    next knob worth turning. Thresholds: see the module docstring. Free cores are judged on
    the summary's own ``cpu_count`` where it records one (the machine that ran the trial),
    else on `cpu_count`.
    """
    cpu_count = int(summary.get("cpu_count") or cpu_count)
    status = summary.get("status", "failed")
    settings = summary.get("settings") or {}
    if status == "oom":
        return "out of memory", _oom_text(summary, settings)
    if status == "over_memory":
        return "over memory", _over_memory_text(summary, settings)
    if status != "ok":
        error = _short(summary.get("error") or "no error recorded")
        return "failed", f"trial {status}: {error} → failed: fix this error and rerun the trial"
    wait = _num(summary.get("data_wait_fraction"))
    h2d = _num(summary.get("h2d_fraction"))
    feed = _num(summary.get("feed_efficiency"))
    if wait is None and feed is None:
        return "no figures", "status ok, but no data-wait fraction or feed efficiency recorded"
    numbers = (
        f"data wait {pct(wait)} of step time, feed efficiency {fmt(feed, 2)}, "
        f"host-to-device {pct(h2d)}"
    )
    if h2d is not None and h2d > H2D_LIMIT and h2d >= (wait or 0.0):
        rule = f"host-to-device > {pct(H2D_LIMIT)} of step time and ≥ data wait"
        return "h2d-bound", f"{numbers} → h2d-bound ({rule}): {_h2d_knobs(settings)}"
    starved = (wait is not None and wait > DATA_WAIT_LIMIT) or (
        feed is not None and feed < FEED_EFFICIENCY_LIMIT
    )
    if starved:
        rule = f"data wait > {pct(DATA_WAIT_LIMIT)} or feed efficiency < {FEED_EFFICIENCY_LIMIT}"
        return "data-bound", f"{numbers} → data-bound ({rule}): {_data_knobs(settings, cpu_count)}"
    rule = f"data wait ≤ {pct(DATA_WAIT_LIMIT)}, feed efficiency ≥ {FEED_EFFICIENCY_LIMIT}"
    return "compute-bound", f"{numbers} → compute-bound ({rule}): {_compute_knobs(summary)}"


def _short(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _knobs(knobs: list[str], fallback: str) -> str:
    if not knobs:
        return f"next knob: {fallback}"
    rest = f"; then {'; '.join(knobs[1:])}" if len(knobs) > 1 else ""
    return f"next knob: {knobs[0]}{rest}"


def _data_knobs(settings: Mapping[str, Any], cpu_count: int) -> str:
    workers = int(settings.get("workers", 0) or 0)
    # One core stays with the training process itself; the rest can run loader workers.
    spare = cpu_count - 1 - workers
    knobs = []
    if spare > 0:
        more = min(cpu_count - 1, max(2 * workers, workers + 1))
        knobs.append(f"more workers ({workers} → {more}; {cpu_count} CPU cores, {spare} free)")
    fmt_now = settings.get("scratch_format")
    if fmt_now != "raw":
        now = f"{fmt_now} now" if fmt_now else "if not already"
        knobs.append(f"raw scratch format (uncompressed memmap reads; {now})")
    prefetch = int(settings.get("prefetch_factor", 2) or 2)
    if workers > 0 and prefetch < 4:
        knobs.append(f"larger prefetch_factor ({prefetch} → {2 * prefetch})")
    if workers > 0 and not settings.get("persistent_workers"):
        knobs.append("persistent workers")
    if spare <= 0:
        knobs.append(f"no free CPU core for more workers ({cpu_count} cores, {workers} workers)")
    return _knobs(knobs, "cheaper augmentation or smaller patches: the loader knobs are spent")


def _h2d_knobs(settings: Mapping[str, Any]) -> str:
    knobs = []
    if not settings.get("pin_memory"):
        knobs.append("pin_memory (off now)")
    if not settings.get("device_prefetch"):
        knobs.append("device-side prefetch (off now), so the copy overlaps compute")
    return _knobs(knobs, "pin_memory and device prefetch are on: send smaller dtypes (uint8)")


def _compute_knobs(summary: Mapping[str, Any]) -> str:
    settings = summary.get("settings") or {}
    knobs = []
    if settings.get("precision", "fp32") == "fp32":
        knobs.append("bf16 autocast (fp32 now; changes the maths, reported beside the result)")
    if not settings.get("channels_last"):
        knobs.append("channels_last")
    if not settings.get("compile"):
        knobs.append("torch.compile")
    peak, limit = _num(summary.get("peak_vram_gb")), _num(summary.get("vram_limit_gb"))
    batch = int(settings.get("batch_size", 0) or 0)
    if not (peak and limit):
        batch_note = "no VRAM figure (CPU run), so no batch headroom to judge"
    else:
        room = f"VRAM headroom {limit / peak:.1f}x (peak {fmt(peak)} of {fmt(limit)} GB)"
        if limit / peak > VRAM_HEADROOM_FOR_BATCH and batch:
            knobs.append(
                f"a larger batch, {room} > {VRAM_HEADROOM_FOR_BATCH:g}x: batch {batch} → "
                f"{2 * batch} (changes the maths; scale the LR)"
            )
            batch_note = ""
        else:
            batch_note = f"keep the batch: {room} ≤ {VRAM_HEADROOM_FOR_BATCH:g}x"
    if not knobs:
        return f"next knob: none left on the loader side, the device is the limit ({batch_note})"
    return _knobs(knobs, "") + (f"; {batch_note}" if batch_note else "")


def _maths_text(summary: Mapping[str, Any]) -> str:
    maths = summary.get("maths") or {}
    batch, accumulate = maths.get("batch_size"), maths.get("accumulate", 1)
    effective = summary.get("effective_batch")
    return (
        f"batch {fmt(batch)} × accum. {fmt(accumulate)} = {fmt(effective)}, "
        f"{maths.get('precision') or 'fp32'}"
    )


def _maths_short(summary: Mapping[str, Any]) -> str:
    maths = summary.get("maths") or {}
    return (
        f"{fmt(maths.get('batch_size'))}×{fmt(maths.get('accumulate', 1))}"
        f"={fmt(summary.get('effective_batch'))} {maths.get('precision') or 'fp32'}"
    )


def _oom_text(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    batch = int(settings.get("batch_size", 1) or 1)
    error = _short(summary.get("error") or "no error recorded", 120)
    # The largest divisor up to half the batch keeps the effective batch exactly.
    smaller = next((d for d in range(batch // 2, 0, -1) if batch % d == 0), None)
    knobs = []
    if smaller is not None:
        knobs.append(
            f"batch {batch} → {smaller} with accumulate ×{batch // smaller} (same effective batch)"
        )
    knobs.append("gradient checkpointing")
    if settings.get("precision", "fp32") == "fp32":
        knobs.append("bf16 autocast (halves activation memory)")
    return f"status oom at {_maths_text(summary)} ({error}) → out of memory: {_knobs(knobs, '')}"


def _over_memory_text(summary: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    checks = summary.get("checks") or {}
    parts, knobs = [], []
    if checks.get("vram_ok") is False:
        parts.append(
            f"peak VRAM {fmt(summary.get('peak_vram_gb'))} GB > limit "
            f"{fmt(summary.get('vram_limit_gb'))} GB"
        )
        knobs.append("a smaller batch with gradient accumulation, or gradient checkpointing")
    if checks.get("host_ram_ok") is False:
        parts.append(
            f"peak host RSS {fmt(summary.get('peak_host_rss_gb'))} GB > limit "
            f"{fmt(summary.get('host_ram_limit_gb'))} GB"
        )
        workers = int(settings.get("workers", 0) or 0)
        prefetch = int(settings.get("prefetch_factor", 1) or 1)
        # Host memory in flight grows with workers x prefetch_factor x batch.
        knobs.append(f"fewer workers ({workers} → {max(1, workers // 2)})")
        if prefetch > 1:
            knobs.append(f"prefetch_factor {prefetch} → {max(1, prefetch // 2)}")
    measured = "; ".join(parts) or "a memory check failed"
    return f"{measured} → over memory: {_knobs(knobs, 'a smaller batch')}"


# ---------------------------------------------------------------------------------------------
# Page pieces


@dataclass
class _Sources:
    """Paths shown relative to `root`, and every file read, for the page's source list."""

    root: Path
    read: list[str] = field(default_factory=list)

    def rel(self, path: Path) -> str:
        try:
            return str(Path(path).resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(path)

    def use(self, path: Path) -> str:
        name = self.rel(path)
        if name not in self.read:
            self.read.append(name)
        return name


def _png(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    # Constrained layout already fits the figure; bbox_inches="tight" would draw it twice.
    fig.savefig(buffer, format="png", dpi=90)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{_esc(alt)}">'


def _table(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, row_classes: Sequence[str] = ()
) -> str:
    """A plain HTML table of escaped text: number columns right-aligned, text columns left."""
    rows = list(rows)
    # A column is text (left-aligned, header too) if any of its cells is not a number.
    text = {i for row in rows for i, cell in enumerate(row) if not NUMBER_CELL.match(cell)}
    head = "".join(_cell(h, i in text, "th") for i, h in enumerate(header))
    body = []
    for i, row in enumerate(rows):
        klass = f' class="{row_classes[i]}"' if i < len(row_classes) and row_classes[i] else ""
        cells = "".join(_cell(c, j in text) for j, c in enumerate(row))
        body.append(f"<tr{klass}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="scroll">{table}</div>'


NUMBER_CELL = re.compile(r"^(n/a|[-+]?\d[\d.]*(e[-+]?\d+)?\s*[%×]?)(\s*\(.*\))?$")


def _cell(content: str, is_text: bool, tag: str = "td") -> str:
    klass = ' class="t"' if is_text else ""
    return f"<{tag}{klass}>{_esc(content)}</{tag}>"


def _source_line(names: Iterable[str]) -> str:
    items = ", ".join(f"<code>{_esc(n)}</code>" for n in names)
    return f'<p class="source">Read from: {items}</p>' if items else ""


def _missing(what: str, paths: Iterable[str] = ()) -> str:
    where = ", ".join(f"<code>{_esc(p)}</code>" for p in paths)
    suffix = f": not found ({where})" if where else ": no input given"
    return f'<p class="missing">{_esc(what)}{suffix}.</p>'


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows with each column's own type (iterrows would turn an all-number row into floats)."""
    return frame.astype(object).to_dict("records")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CtsegError(f"{path}: cannot read JSON for the report ({exc})") from exc
    if not isinstance(data, dict):
        raise CtsegError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_table(path: Path, **kwargs: Any) -> pd.DataFrame:
    try:
        return pd.read_csv(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise CtsegError(f"{path}: cannot read table for the report ({exc})") from exc


# ---------------------------------------------------------------------------------------------
# Phases


def _phase_columns(summaries: Sequence[Mapping[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Settings to show as columns (key ones + any that vary) and those equal in every phase."""
    keys: list[str] = []
    for summary in summaries:
        keys += [k for k in (summary.get("settings") or {}) if k not in keys]
    keys.sort(key=lambda k: (SETTING_ORDER.index(k) if k in SETTING_ORDER else 99, k))
    shown, constant = [], {}
    for key in keys:
        values = [_setting((s.get("settings") or {}).get(key)) for s in summaries]
        if key in KEY_SETTINGS or len(set(values)) > 1:
            shown.append(key)
        else:
            constant[key] = (summaries[0].get("settings") or {}).get(key)
    return shown, constant


def _speedup(summary: Mapping[str, Any], base: Mapping[str, Any] | None) -> str:
    if base is None or summary.get("status") != "ok" or base.get("status") != "ok":
        return "n/a"
    now, then = _num(summary.get("samples_per_s")), _num(base.get("samples_per_s"))
    return f"{now / then:.2f}×" if now and then else "n/a"


def _phase_rows(
    summaries: Sequence[Mapping[str, Any]], shown: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    base = summaries[0]
    header = (
        ["phase"]
        + [SETTING_LABELS.get(k, k) for k in shown]
        + ["status", "median step s", "samples/s", "data wait", "h2d", "feed eff."]
        + ["GPU util %", "peak VRAM GB (limit)", "peak RSS GB (limit)"]
        + [f"× phase {base.get('phase')}", "× previous", "maths: batch×accum.", "verdict"]
    )
    rows = []
    for summary in summaries:
        settings = summary.get("settings") or {}
        checks = summary.get("checks") or {}
        previous = _num(checks.get("speedup_vs_previous"))
        maths = _maths_short(summary)
        if (summary.get("maths") or {}) != (base.get("maths") or {}):
            maths += f" (≠ {base.get('phase')})"
        rows.append(
            [fmt(summary.get("phase"))]
            + [_setting(settings.get(k)) for k in shown]
            + [
                str(summary.get("status", "n/a")),
                fmt(summary.get("median_step_s")),
                fmt(summary.get("samples_per_s")),
                pct(summary.get("data_wait_fraction")),
                pct(summary.get("h2d_fraction")),
                fmt(summary.get("feed_efficiency"), 2),
                fmt(summary.get("gpu_util_mean")),
                f"{fmt(summary.get('peak_vram_gb'))} ({fmt(summary.get('vram_limit_gb'))})",
                f"{fmt(summary.get('peak_host_rss_gb'))} ({fmt(summary.get('host_ram_limit_gb'))})",
                _speedup(summary, base),
                "n/a"
                if previous is None
                else f"{previous:.2f}× (vs {checks.get('previous_phase')})",
                maths,
                summary["_verdict"][0],
            ]
        )
    return header, rows


def _bar(ax: Any, summaries: Sequence[Mapping[str, Any]], key: str, title: str) -> None:
    xs = [str(s.get("phase")) for s in summaries]
    values = [_num(s.get(key)) for s in summaries]
    colours = [STATUS_COLOURS.get(str(s.get("status")), "#8c8c8c") for s in summaries]
    ax.bar(xs, [v or 0.0 for v in values], color=colours)
    for x, value, s in zip(xs, values, summaries, strict=True):
        if value is None:
            ax.annotate(str(s.get("status")), (x, 0), ha="center", va="bottom", fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("phase")


def _phase_figure(summaries: Sequence[Mapping[str, Any]]) -> Figure:
    fig = Figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    _bar(axes[0], summaries, "samples_per_s", "samples/s")
    _bar(axes[1], summaries, "data_wait_fraction", "data-wait fraction")
    axes[1].axhline(DATA_WAIT_LIMIT, color="k", ls="--", lw=1, label="data-bound above")
    _bar(axes[2], summaries, "feed_efficiency", "feed efficiency (real / ceiling)")
    axes[2].axhline(FEED_EFFICIENCY_LIMIT, color="k", ls="--", lw=1, label="data-bound below")
    _bar(axes[3], summaries, "peak_vram_gb", "peak VRAM GB")
    _bar(axes[4], summaries, "peak_host_rss_gb", "peak host RSS GB (with workers)")
    for ax, key in ((axes[3], "vram_limit_gb"), (axes[4], "host_ram_limit_gb")):
        limits = {_num(s.get(key)) for s in summaries} - {None}
        if len(limits) == 1:
            ax.axhline(limits.pop(), color="k", ls="--", lw=1, label="limit")
    _split_bars(axes[5], summaries)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    legend = [Patch(color=c, label=s) for s, c in STATUS_COLOURS.items()]
    fig.legend(handles=legend, loc="outside lower center", ncols=4, fontsize=8)
    return fig


def _split_bars(ax: Any, summaries: Sequence[Mapping[str, Any]]) -> None:
    xs = [str(s.get("phase")) for s in summaries]
    wait = np.array([_num(s.get("data_wait_fraction")) or 0.0 for s in summaries])
    h2d = np.array([_num(s.get("h2d_fraction")) or 0.0 for s in summaries])
    ran = np.array([_num(s.get("data_wait_fraction")) is not None for s in summaries])
    compute = np.where(ran, 1.0 - wait - h2d, 0.0)
    ax.bar(xs, wait, color="#c44e52", label="data wait")
    ax.bar(xs, h2d, bottom=wait, color="#dd8452", label="host-to-device")
    ax.bar(xs, compute, bottom=wait + h2d, color="#55a868", label="compute")
    ax.set_title("step time split", fontsize=10)
    ax.set_xlabel("phase")


def _trial_steps_figure(steps: Sequence[tuple[int, pd.DataFrame]]) -> Figure:
    fig = Figure(figsize=(13, 3.2), layout="constrained")
    ax_step, ax_wait = fig.subplots(1, 2)
    for phase, frame in steps:
        ax_step.plot(frame["step"], frame["step_s"], marker=".", lw=1, label=f"phase {phase}")
        fraction = frame["data_wait_s"] / frame["step_s"]
        ax_wait.plot(frame["step"], fraction, marker=".", lw=1, label=f"phase {phase}")
    ax_step.set(title="step time per trial step (s, log scale)", xlabel="step", yscale="log")
    # Plain numbers on the log axis: phases differ by up to 10x, so decades are rarely crossed.
    ax_step.yaxis.set_major_formatter(ScalarFormatter())
    ax_step.yaxis.set_minor_formatter(ScalarFormatter())
    ax_wait.set(title="data-wait fraction per trial step", xlabel="step", ylim=(0, 1))
    ax_step.legend(fontsize=7, ncols=2)
    return fig


def _read_trial_steps(path: Path, src: _Sources) -> pd.DataFrame | None:
    if not path.exists():
        return None
    frame = _read_table(path)
    # A failed trial leaves a header-only steps.csv; nothing to plot, nothing to cite.
    if not {"step", "step_s", "data_wait_s"} <= set(frame.columns) or frame.empty:
        return None
    src.use(path)
    return frame


def _phase_section(paths: Sequence[Path], src: _Sources, cpu_count: int) -> str:
    out = ['<h2 id="phases">Phase trials</h2>']
    present = [Path(p) for p in paths if Path(p).exists()]
    absent = [src.rel(Path(p)) for p in paths if not Path(p).exists()]
    if absent:
        out.append(_missing("Phase summaries", absent))
    if not present:
        if not paths:
            out.append(_missing("Phase summaries"))
        return "\n".join(out)
    loaded = sorted(
        ((_read_json(p), src.use(p), p) for p in present),
        key=lambda t: _num(t[0].get("phase")) or 0.0,
    )
    summaries = [dict(s, _verdict=verdict(s, cpu_count)) for s, _, _ in loaded]
    names = [name for _, name, _ in loaded]
    shown, constant = _phase_columns(summaries)
    header, rows = _phase_rows(summaries, shown)
    out.append(_table(header, rows, row_classes=[f"st-{s.get('status')}" for s in summaries]))
    if constant:
        same = ", ".join(f"{k} = {_setting(v)}" for k, v in constant.items())
        out.append(f"<p>Same in every phase: {_esc(same)}.</p>")
    out.append(
        "<p class='note'>× previous is the summary's <code>checks.speedup_vs_previous</code> "
        "(against the last phase before it whose trial was ok). <em>maths</em> is what a phase "
        "changes besides speed: batch × gradient accumulation and precision.</p>"
    )
    out.append(_verdict_list(summaries, cpu_count))
    out.append(_png(_phase_figure(summaries), "phase trial figures"))
    steps, step_files = [], []
    for summary, _, path in loaded:
        frame = _read_trial_steps(path.parent / "steps.csv", src)
        if frame is not None:
            steps.append((summary.get("phase"), frame))
            step_files.append(src.rel(path.parent / "steps.csv"))
    if steps:
        out.append(_png(_trial_steps_figure(steps), "per-step times of the phase trials"))
        out.append(_source_line(step_files))
    out.append(_source_line(names))
    return "\n".join(out)


def _verdict_list(summaries: Sequence[Mapping[str, Any]], cpu_count: int) -> str:
    items = "".join(
        f"<li><b>phase {_esc(s.get('phase'))}: {_esc(s['_verdict'][0])}</b>: "
        f"{_esc(s['_verdict'][1])}</li>"
        for s in summaries
    )
    rules = (
        f"Rules: data-bound when data wait &gt; {pct(DATA_WAIT_LIMIT)} of step time or feed "
        f"efficiency &lt; {FEED_EFFICIENCY_LIMIT}; h2d-bound when host-to-device &gt; "
        f"{pct(H2D_LIMIT)} of step time and at least the data wait; otherwise compute-bound. "
        f"A larger batch is suggested only with VRAM headroom &gt; {VRAM_HEADROOM_FOR_BATCH:g}x. "
        "Free CPU cores are judged against the trial's recorded cpu_count, else the "
        f"{cpu_count} cores of the machine that built this report; one core is kept for the "
        "training process."
    )
    return (
        f"<h3>Bottleneck verdicts</h3><ul class='verdicts'>{items}</ul><p class='note'>{rules}</p>"
    )


# ---------------------------------------------------------------------------------------------
# Training


def loss_terms(columns: Iterable[str]) -> list[str]:
    """The loss-term columns of a training steps.csv, in file order."""
    return [c for c in columns if c not in STEP_REQUIRED | STEP_DIAGNOSTICS]


def _smooth(series: pd.Series) -> pd.Series:
    window = max(1, len(series) // 50)
    return series.rolling(window, min_periods=1).mean()


def _loss_figure(steps: pd.DataFrame, epochs: pd.DataFrame | None) -> Figure:
    panels = ["loss", *loss_terms(steps.columns)]
    has_dice = epochs is not None and "val_dice" in epochs and epochs["val_dice"].notna().any()
    count = len(panels) + int(has_dice)
    cols = min(3, count)
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(4.3 * cols, 3.0 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    for ax, name in zip(axes, panels, strict=False):
        smooth = _smooth(steps[name])
        if not smooth.equals(steps[name]):
            ax.plot(
                steps["step"], steps[name], color="#4c72b0", alpha=0.3, lw=0.8, label="per step"
            )
        ax.plot(steps["step"], smooth, color="#4c72b0", lw=1.5, label="train")
        if name == "loss" and epochs is not None:
            _epoch_lines(ax, epochs)
        ax.set(title="total loss" if name == "loss" else name, xlabel="step")
        ax.legend(fontsize=7)
    if has_dice:
        ax = axes[len(panels)]
        ax.plot(epochs["step"], epochs["val_dice"], marker="o", color="#c44e52")
        ax.set(title="validation Dice", xlabel="step", ylim=(0, 1))
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig


def _epoch_lines(ax: Any, epochs: pd.DataFrame) -> None:
    if "train_loss" in epochs:
        ax.plot(epochs["step"], epochs["train_loss"], "s-", color="#55a868", label="train (epoch)")
    if "val_loss" in epochs and epochs["val_loss"].notna().any():
        ax.plot(epochs["step"], epochs["val_loss"], "o-", color="#c44e52", label="validation")


def _throughput_figure(steps: pd.DataFrame) -> Figure:
    extra = [c for c in sorted(STEP_DIAGNOSTICS) if c in steps]
    fig = Figure(figsize=(13, 3.0), layout="constrained")
    axes = fig.subplots(1, 3 + len(extra))
    axes[0].plot(steps["step"], _smooth(steps["samples_per_s"]), color="#4c72b0")
    axes[0].set(title="samples/s (smoothed)", xlabel="step")
    wait = steps["data_wait_s"] / steps["step_s"]
    axes[1].plot(steps["step"], _smooth(wait), color="#c44e52")
    axes[1].set(title="data-wait fraction (smoothed)", xlabel="step", ylim=(0, 1))
    axes[2].plot(steps["step"], steps["lr"], color="#55a868")
    axes[2].set(title="learning rate", xlabel="step")
    for ax, name in zip(axes[3:], extra, strict=True):
        ax.plot(steps["step"], steps[name], color="#8172b2", lw=0.8)
        ax.set(title=name.replace("_", " "), xlabel="step", yscale="log")
    return fig


def _training_table(steps: pd.DataFrame) -> str:
    step_time = steps["step_s"].sum()
    rows = [
        ["optimizer steps", fmt(len(steps))],
        ["epochs logged", fmt(int(steps["epoch"].nunique()))],
        ["median step s", fmt(steps["step_s"].median())],
        ["mean samples/s", fmt(steps["samples_per_s"].mean())],
        ["data wait (share of step time)", pct(steps["data_wait_s"].sum() / step_time)],
        ["host-to-device (share of step time)", pct(steps["h2d_s"].sum() / step_time)],
        ["mean GPU util %", fmt(steps["gpu_util"].mean())],
        ["peak VRAM MB", fmt(steps["vram_peak_mb"].max())],
        ["peak host RSS MB", fmt(steps["host_rss_mb"].max())],
        ["final loss (last step)", fmt(steps["loss"].iloc[-1])],
    ]
    return _table(["steps.csv", "value"], rows)


def _epochs_table(epochs: pd.DataFrame) -> str:
    digits = {"data_wait_fraction": pct}
    rows = [[digits.get(c, fmt)(row[c]) for c in epochs.columns] for row in _records(epochs)]
    return _table(list(epochs.columns), rows)


def _training_section(train_dir: Path | None, src: _Sources) -> str:
    out = ['<h2 id="training">Training</h2>']
    if train_dir is None:
        return "\n".join([*out, _missing("Training logs")])
    steps_csv, epochs_csv = Path(train_dir) / "steps.csv", Path(train_dir) / "epochs.csv"
    if not steps_csv.exists():
        return "\n".join([*out, _missing("Training steps", [src.rel(steps_csv)])])
    steps = _read_table(steps_csv)
    needed = STEP_REQUIRED - set(steps.columns)
    if needed or steps.empty:
        problem = f"missing columns {sorted(needed)}" if needed else "no rows"
        raise CtsegError(f"{steps_csv}: not a training steps.csv ({problem})")
    names = [src.use(steps_csv)]
    epochs = None
    if epochs_csv.exists():
        epochs = _read_table(epochs_csv)
        names.append(src.use(epochs_csv))
    else:
        out.append(_missing("Epoch log (validation)", [src.rel(epochs_csv)]))
    out.append(_training_table(steps))
    out.append("<h3>Loss curves</h3>")
    out.append(_png(_loss_figure(steps, epochs), "training and validation loss curves"))
    out.append(
        "<p class='note'>Validation logs the total loss and Dice once per epoch "
        "(<code>epochs.csv</code>); the per-term curves are training only.</p>"
    )
    out.append(_png(_throughput_figure(steps), "training throughput"))
    if epochs is not None and not epochs.empty:
        out.append("<h3>Epochs</h3>" + _epochs_table(epochs))
    out.append(_source_line(names))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Evaluation


def _evaluation_section(evaluation_dir: Path | None, src: _Sources) -> str:
    out = ['<h2 id="evaluation">Evaluation</h2>']
    if evaluation_dir is None:
        return "\n".join([*out, _missing("Evaluation")])
    scores_csv = Path(evaluation_dir) / "scores.csv"
    summary_json = Path(evaluation_dir) / "summary.json"
    names = []
    summary = None
    if summary_json.exists():
        summary = _read_json(summary_json)
        names.append(src.use(summary_json))
        out.append(_means_block(summary))
    else:
        out.append(_missing("Evaluation means", [src.rel(summary_json)]))
    if scores_csv.exists():
        scores = _read_table(scores_csv, dtype={"id": str})
        names.append(src.use(scores_csv))
        out.append("<h3>Per volume</h3>" + _scores_table(scores))
    else:
        out.append(_missing("Per-volume scores", [src.rel(scores_csv)]))
    out.append(_source_line(names))
    return "\n".join(out)


def _topo_note(method: Any) -> str:
    note = f"Topology term computed with <b>{_esc(method)}</b>"
    if method == "betti_counts":
        note += (
            " (no Betti-Matching-3D module: matched counts are the upper bound min(p, g), "
            "so TopoScore is overstated on noisy predictions)"
        )
    return f"<p>{note}.</p>"


def _means_block(summary: Mapping[str, Any]) -> str:
    rows = [[k, fmt(v, 4)] for k, v in summary.items() if _num(v) is not None]
    rows += [[k, str(v)] for k, v in summary.items() if isinstance(v, str) and k != "topo_method"]
    method = summary.get("topo_method", "not stated in summary.json")
    return "<h3>Means</h3>" + _topo_note(method) + _table(["summary.json", "value"], rows)


def _scores_table(scores: pd.DataFrame) -> str:
    columns = [c for c in SCORE_COLUMNS if c in scores.columns]
    extra = [c for c in scores.columns if c not in SCORE_COLUMNS]
    rows = [[fmt(row[c], 4) for c in columns] for row in _records(scores)]
    note = ""
    if extra:
        note = f"<p class='note'>Also in the file, not shown: {_esc(', '.join(extra))}.</p>"
    return _table(columns, rows) + note


# ---------------------------------------------------------------------------------------------
# Slice overlays


def _middle_slice_zarr(path: Path) -> tuple[np.ndarray, int, int, Mapping[str, Any]]:
    try:
        array = zarr.open_array(str(path), mode="r")
    except Exception as exc:  # zarr raises several types for a missing or broken store
        raise CtsegError(f"{path}: cannot open Zarr array for the report ({exc})") from exc
    depth = int(array.shape[0])
    # Only the middle slice is read, so memory is bounded by one slice.
    return np.asarray(array[depth // 2]), depth // 2, depth, dict(array.attrs)


def _middle_slice_tif(path: Path, index: int) -> np.ndarray:
    try:
        with tifffile.TiffFile(path) as tif:
            if len(tif.pages) > 1:
                return tif.pages[index].asarray()
            return tif.asarray()[index]
    except (OSError, IndexError, ValueError, tifffile.TiffFileError) as exc:
        raise CtsegError(f"{path}: cannot read slice {index} for the report ({exc})") from exc


def _display_range(image: np.ndarray, attrs: Mapping[str, Any]) -> tuple[float, float]:
    low, high = _num(attrs.get("p0_5")), _num(attrs.get("p99_5"))
    if low is None or high is None or high <= low:
        low, high = (float(v) for v in np.percentile(image, [0.5, 99.5]))
    return low, max(high, low + 1e-6)


def _overlay_figure(
    name: str,
    image: np.ndarray,
    attrs: Mapping[str, Any],
    label: np.ndarray | None,
    pred: np.ndarray | None,
    index: int,
) -> Figure:
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    low, high = _display_range(image, attrs)
    for ax in axes:
        ax.imshow(image, cmap="gray", vmin=low, vmax=high, interpolation="nearest")
        ax.set_axis_off()
    axes[0].set_title(f"{name}: image, z = {index}", fontsize=10)
    if label is not None:
        _draw_label(axes[1], label, fill=True)
        _draw_label(axes[2], label, fill=False)
    axes[1].set_title("label: 1 green, 2 (ignore) grey hatch", fontsize=10)
    if pred is not None:
        axes[2].imshow(_tint(pred != 0, PRED_RGBA), interpolation="nearest")
        if pred.any() and not pred.all():
            axes[2].contour(pred != 0, levels=[0.5], colors="red", linewidths=1.0)
    axes[2].set_title("prediction (red) over label contours", fontsize=10)
    handles = [
        Patch(facecolor=LABEL_RGBA, edgecolor="#2ca02c", label="label 1"),
        Patch(facecolor=IGNORE_RGBA, hatch="//", label="label 2 (ignore)"),
        Patch(facecolor=PRED_RGBA, edgecolor="red", label="prediction"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
    return fig


LABEL_RGBA = (0.17, 0.63, 0.17, 0.45)
IGNORE_RGBA = (0.6, 0.6, 0.6, 0.5)
PRED_RGBA = (1.0, 0.0, 0.0, 0.3)


def _tint(mask: np.ndarray, rgba: tuple[float, float, float, float]) -> np.ndarray:
    """An RGBA layer: `rgba` where `mask` is set, transparent elsewhere."""
    layer = np.zeros((*mask.shape, 4), np.float32)
    layer[mask] = rgba
    return layer


def _draw_label(ax: Any, label: np.ndarray, *, fill: bool) -> None:
    fg, ignore = label == 1, label == 2
    if fill:
        ax.imshow(_tint(fg, LABEL_RGBA), interpolation="nearest")
        ax.imshow(_tint(ignore, IGNORE_RGBA), interpolation="nearest")
    if ignore.any() and not ignore.all():
        ax.contourf(ignore, levels=[0.5, 1.5], colors="none", hatches=["//"])
    if fg.any() and not fg.all():
        ax.contour(fg, levels=[0.5], colors="#2ca02c", linewidths=1.0)


def _one_overlay(item: Overlay, src: _Sources) -> str:
    name, image_path, label_path, pred_path = item
    image_path = Path(image_path)
    if not image_path.exists():
        return _missing(f"Overlay {name}: image", [src.rel(image_path)])
    image, index, depth, attrs = _middle_slice_zarr(image_path)
    names, notes = [src.use(image_path)], []
    label = pred = None
    if label_path is not None and Path(label_path).exists():
        label, _, _, _ = _middle_slice_zarr(Path(label_path))
        names.append(src.use(Path(label_path)))
    else:
        notes.append(
            _missing(f"Overlay {name}: label", [src.rel(label_path)] if label_path else [])
        )
    if pred_path is not None and Path(pred_path).exists():
        pred = _middle_slice_tif(Path(pred_path), index)
        names.append(src.use(Path(pred_path)))
    else:
        notes.append(
            _missing(f"Overlay {name}: prediction", [src.rel(pred_path)] if pred_path else [])
        )
    for what, plane in (("label", label), ("prediction", pred)):
        if plane is not None and plane.shape != image.shape:
            raise CtsegError(
                f"overlay {name}: {what} slice shape {plane.shape} != image slice {image.shape}"
            )
    fig = _overlay_figure(name, image, attrs, label, pred, index)
    caption = f"<h3>{_esc(name)} (slice {index} of {depth})</h3>"
    return caption + "".join(notes) + _png(fig, f"overlay {name}") + _source_line(names)


def _overlay_section(overlays: Sequence[Overlay], src: _Sources) -> str:
    out = ['<h2 id="overlays">Slice overlays</h2>']
    if not overlays:
        return "\n".join([*out, _missing("Slice overlays")])
    out += [_one_overlay(item, src) for item in overlays]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Stage timings


def _read_benchmarks(benchmarks_dir: Path, src: _Sources) -> pd.DataFrame:
    rows = []
    for path in sorted(benchmarks_dir.rglob("*.tsv")):
        frame = _read_table(path, sep="\t", na_values=["NA", "-"])
        if "s" not in frame.columns or frame.empty:
            raise CtsegError(f"{path}: not a Snakemake benchmark TSV (no 's' column or no rows)")
        parts = path.relative_to(benchmarks_dir).with_suffix("").parts
        rule, job = (parts[0], "/".join(parts[1:])) if len(parts) > 1 else (parts[0], "")
        rows.append(
            {
                "rule": rule,
                "job": job,
                # A benchmark with repeat(...) has one row per repeat: report their mean.
                "repeats": len(frame),
                "s": float(frame["s"].mean()),
                "max_rss_mb": _num(frame["max_rss"].max()) if "max_rss" in frame else None,
                "cpu_time": _num(frame["cpu_time"].mean()) if "cpu_time" in frame else None,
                "file": src.use(path),
            }
        )
    return pd.DataFrame(rows)


def _timing_figure(totals: pd.Series) -> Figure:
    fig = Figure(figsize=(9, 0.45 * len(totals) + 1.2), layout="constrained")
    ax = fig.subplots()
    ax.barh(totals.index, totals.values, color="#4c72b0")
    ax.invert_yaxis()
    ax.set(title="total seconds per rule (sum over jobs)", xlabel="seconds")
    return fig


def _timing_section(benchmarks_dir: Path | None, src: _Sources) -> str:
    out = ['<h2 id="timings">Stage timings</h2>']
    if benchmarks_dir is None:
        return "\n".join([*out, _missing("Stage timings")])
    benchmarks_dir = Path(benchmarks_dir)
    table = _read_benchmarks(benchmarks_dir, src) if benchmarks_dir.is_dir() else pd.DataFrame()
    if table.empty:
        where = src.rel(benchmarks_dir) + "/<rule>/*.tsv"
        return "\n".join([*out, _missing("Stage timings (benchmark TSVs)", [where])])
    rows = [
        [
            r.rule,
            r.job,
            fmt(r.s),
            fmt(r.max_rss_mb),
            fmt(r.cpu_time),
            fmt(r.repeats),
            r.file,
        ]
        for r in table.itertuples()
    ]
    header = ["rule", "job", "seconds", "max RSS MB", "CPU s", "repeats", "file"]
    out.append(_table(header, rows))
    totals = table.groupby("rule")["s"].sum().sort_values(ascending=False)
    out.append(_png(_timing_figure(totals), "total seconds per rule"))
    out.append(
        f"<p class='source'>Read from the Snakemake <code>benchmark:</code> files under "
        f"<code>{_esc(src.rel(benchmarks_dir))}</code> (listed per row).</p>"
    )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Page

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1500px;
       padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 2px 5px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; white-space: normal; vertical-align: bottom; } .t { text-align: left; }
div.scroll { overflow-x: auto; }
tr.st-oom td, tr.st-failed td { background: #fbeaea; } tr.st-over_memory td { background: #fdf2e6; }
img { max-width: 100%; display: block; margin: 0.6em 0; }
code { background: #f4f4f4; padding: 0 3px; } .source { color: #555; font-size: 12.5px; }
.missing { color: #a33; font-style: italic; } .note { color: #555; font-size: 12.5px; }
ul.verdicts li { margin-bottom: 0.35em; } nav a { margin-right: 1em; }
"""

# Inert for readers: records how many images rendered, for the headless-browser check. Drawing
# each image onto a canvas decodes it synchronously at load, so the count is final before
# chromium's --dump-dom (img.decode() promises may still be pending then). An image counts as
# rendered when it has a size and its pixels are not all one value.
IMAGE_CHECK_SCRIPT = """
window.addEventListener("load", function () {
  function rendered(img) {
    if (!img.complete || img.naturalWidth === 0) return false;
    try {
      var canvas = document.createElement("canvas");
      canvas.width = img.naturalWidth;
      canvas.height = img.naturalHeight;
      var context = canvas.getContext("2d");
      context.drawImage(img, 0, 0);
      var px = context.getImageData(0, 0, canvas.width, canvas.height).data;
      for (var i = 4; i < px.length; i++) if (px[i] !== px[i % 4]) return true;
    } catch (error) {
      document.body.dataset.imagesError = String(error);
    }
    return false;
  }
  var imgs = Array.prototype.slice.call(document.images);
  document.body.dataset.imagesTotal = String(imgs.length);
  document.body.dataset.imagesOk = String(imgs.filter(rendered).length);
  document.body.dataset.imagesChecked = "done";
});
"""


def _sources_section(src: _Sources) -> str:
    items = "".join(f"<li><code>{_esc(name)}</code></li>" for name in src.read)
    return (
        '<h2 id="sources">Files read</h2>'
        f"<p>Every number above comes from one of these files (paths relative to "
        f"<code>{_esc(src.root)}</code>).</p><ul>{items}</ul>"
    )


def _page(title: str, experiment: str, sections: Sequence[str]) -> str:
    nav = " ".join(
        f'<a href="#{key}">{label}</a>'
        for key, label in (
            ("phases", "Phases"),
            ("training", "Training"),
            ("evaluation", "Evaluation"),
            ("overlays", "Overlays"),
            ("timings", "Timings"),
            ("sources", "Files"),
        )
    )
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_esc(title)}</title><style>{CSS}</style></head>\n<body>"
        f"<h1>{_esc(title)}</h1><p>Experiment <b>{_esc(experiment)}</b></p><nav>{nav}</nav>\n"
        f"{body}\n<script>{IMAGE_CHECK_SCRIPT}</script></body></html>\n"
    )


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def build_report(
    out_html: Path,
    *,
    experiment: str,
    phase_summaries: list[Path],
    train_dir: Path | None,
    evaluation_dir: Path | None,
    overlays: list[Overlay],
    benchmarks_dir: Path | None,
    title: str = "ctseg report",
    root: Path | None = None,
    cpu_count: int | None = None,
) -> None:
    """Write the report to `out_html` atomically; see the module docstring.

    `overlays` holds (id, image zarr, label zarr or None, prediction tif or None). Paths in the
    page are shown relative to `root` (default: the working directory, the workflow root).
    `cpu_count` (default: the CPUs this process may use) judges whether more workers fit.
    """
    src = _Sources(Path(root) if root is not None else Path.cwd())
    cpus = cpu_count if cpu_count is not None else _available_cpus()
    sections = [
        _phase_section(phase_summaries, src, cpus),
        _training_section(train_dir, src),
        _evaluation_section(evaluation_dir, src),
        _overlay_section(overlays, src),
        _timing_section(benchmarks_dir, src),
    ]
    sections.append(_sources_section(src))
    page = _page(title, experiment, sections)
    with atomic_path(Path(out_html)) as tmp:
        tmp.write_text(page, encoding="utf-8")
