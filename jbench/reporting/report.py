"""Reports over recorded runs: a self-contained HTML page, a markdown summary, PNG plots; and export.

`build_report(df, ...)` takes a run table from `jbench.tracking.runs_frame` (trial runs; sweep runs
may be included) and writes into out_dir:
  * report.html: one page, no external resource and no script: every plot is a PNG embedded as a
    base64 data URI, styles are inline;
  * report.md: the same sections as markdown (tables, and the PNGs by file name);
  * one PNG per plot (matplotlib, Agg canvas; pyplot's global state is not used).

Sections, each drawn only when its data exists (otherwise the page says "not enough data for ..."
and why), each followed by the table of the numbers behind it:
  * runs: one row per trial (label, device, quant, depth, KV type, power mode, rates, status); a setting every run
    shares is named once above the table instead of filling a column;
  * quant ladder: decode tok/s (and tokens per joule when recorded) per quant, one line per configuration that
    differs in something other than the quant, on an ordered categorical axis: by the files' real bits per weight
    (metric roofline_bits_per_weight) when every quant has it, else by 8 x bytes_per_weight(dominant_ggml_type(quant))
    from gguf's GGML_QUANT_SIZES (Q4_K_M -> Q4_K -> 4.5, the same as Q4_0: positions keep them apart); with the
    roofline ceiling (metric roofline_decode_tps) dashed when recorded;
  * context scaling: decode (and prefill) tok/s against params.backend.depth, one line per KV type
    (params.backend.cache_type_k) and other differing settings, roofline curve dashed when recorded;
  * power modes: decode tok/s against metrics.decode_avg_power_w per configuration, the Pareto
    frontier (no other point is both faster and lower-power) drawn as a step line, and tokens per
    joule per params.power.mode;
  * telemetry timelines (when `telemetry` is given, e.g. from jbench.tracking.telemetry_frame): power,
    GPU clock and temperature against seconds since the run's first sample, phases shaded;
  * quality and memory (each only when some trial recorded such figures; docs/choosing.md): per model and device,
    decode tok/s and decode tokens per joule against the mean KL divergence from the quality reference
    (metrics.quality_kld_mean, error bars from quality_kld_mean_err and the rates' spread), the Pareto front of each
    marked, the quality bar drawn, and the choice within the bar (`jbench.analysis.choice`) named in words with
    the caveat of the runs' quality.meaning tag; the bar is the report's `quality_bar` option, else the runs'
    params/tags quality.max_kld and quality.min_same_top_pct. Memory: per trial the measured peak, the prediction
    and its error, and the audit of each trial (`jbench.analysis.memory.audit`);
  * findings: every tag `finding.<name>` of the runs.
Error bars are the standard deviation of the pooled repetition samples when `samples` are given,
else the root mean square of the runs' `<rate>_std`. Every rate axis (tok/s, tokens per joule) starts at zero, and
each image's alt text says what its axes show (ticks, ranges), read back from the drawn figure.
A value is shown only where it was recorded: nothing missing is drawn as 0.

`export_frame(df, path)`: Parquet (.parquet/.pq, needs pyarrow) or CSV (.csv, .csv.gz, ...).
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from jbench.analysis.choice import Choice, QualityBar, choose, pareto_front
from jbench.analysis.compare import TPJ_RE, SamplesArg, normalize_samples
from jbench.analysis.roofline import RooflineError, bytes_per_weight, dominant_ggml_type
from jbench.reporting.exporters import export

try:  # the memory audit (`audit(metrics, tags)`, `audit_markdown(lines)`); the report says so when it is absent
    from jbench.analysis import memory as memory_audit
except ImportError:
    memory_audit = None

__all__ = ["ReportFiles", "build_report", "export_frame", "bits_per_weight", "pareto_frontier"]

QUANT_P, QUANT_T = "params.model.quant", "tags.model.quant"
DEPTH = "params.backend.depth"
KV_K, KV_V = "params.backend.cache_type_k", "params.backend.cache_type_v"
POWER_MODE = "params.power.mode"
DEVICE = "tags.device.name"
DECODE, PREFILL = "metrics.decode_tps", "metrics.prefill_tps"
POWER_W = "metrics.decode_avg_power_w"
ROOFLINE = "metrics.roofline_decode_tps"
ROOFLINE_FRACTION = "metrics.roofline_fraction"
FILE_BPW = "metrics.roofline_bits_per_weight"
# Recorded only where decode beat its ceiling (roofline_fraction is then left out), with the finding.
CEILING_FINDING = "tags.finding.ceiling_below_measured"
ABOVE_CEILING_RATIO = "metrics.roofline_measured_over_ceiling"
# Settings that tell configurations apart in a plot's legend (when they vary within the data).
SERIES_KEYS = (DEVICE, "params.model.name", QUANT_P, DEPTH, KV_K, KV_V, POWER_MODE, "params.backend.n_gen",
               "params.backend.n_prompt", "params.backend.n_gpu_layers", "params.backend.flash_attn",
               "params.backend.threads")
MAX_SERIES = 10
MAX_TIMELINES = 12
TELEMETRY_CHANNELS = (("power_w", "power (W)"), ("gpu_freq_mhz", "GPU clock (MHz)"), ("temp_c", "temperature (°C)"),
                      ("temp_max_c", "max temperature (°C)"))


@dataclass(frozen=True)
class ReportFiles:
    html_path: Path
    markdown_path: Path
    pngs: dict[str, Path]  # section key (quant_ladder, context_scaling, power_modes, telemetry_<i>) -> file


@dataclass
class _Section:
    key: str
    title: str
    text: str = ""
    figures: list[tuple[str, bytes]] = field(default_factory=list)  # (file stem, PNG bytes)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines shown as a list under the text (a choice and its reasons)
    # (caption, markdown, the same as a frame for HTML): blocks another module renders as markdown (memory audits)
    blocks: list[tuple[str, str, pd.DataFrame]] = field(default_factory=list)
    missing: str = ""  # "not enough data for ...": why nothing is drawn
    alts: dict[str, str] = field(default_factory=dict)  # file stem -> what the figure's axes show (the img alt text)


# --------------------------------------------------------------------------------------------
# Small pure helpers


def bits_per_weight(quant: str) -> float:
    """Bits per weight of a llama.cpp quant: 8 x bytes per weight of its dominant ggml type."""
    return bytes_per_weight(dominant_ggml_type(quant)) * 8.0


def pareto_frontier(power: Sequence[float], speed: Sequence[float]) -> list[int]:
    """Indices of the points no other point dominates (power <= and speed >=, one strictly), by power."""
    idx = sorted(range(len(power)), key=lambda i: (power[i], -speed[i]))
    out, best = [], -math.inf
    for i in idx:
        if speed[i] > best:
            out.append(i)
            best = speed[i]
    return out


def _col(df: pd.DataFrame, *names: str) -> Optional[pd.Series]:
    for n in names:
        if n in df.columns and df[n].notna().any():
            return df[n]
    return None


def _num(s: Optional[pd.Series]) -> Optional[pd.Series]:
    return None if s is None else pd.to_numeric(s, errors="coerce")


def _tpj_column(df: pd.DataFrame, phase: str = "decode") -> Optional[str]:
    names = [c for c in df.columns if TPJ_RE.match(c) and df[c].notna().any()]
    for c in names:
        if c.startswith(f"metrics.{phase}_"):
            return c
    bare = [c for c in names if not re.match(r"^metrics\.(prefill|decode)_", c)]
    return bare[0] if bare else None


# Report tables show 4 significant digits; every column of the frame, in its order.
_REPORT_FLOAT = "%.4g"


def _md_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_(no rows)_\n"
    return export(df, "md", columns=list(df.columns), float_format=_REPORT_FLOAT)


def _html_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "<p><em>(no rows)</em></p>"
    return export(df, "html", columns=list(df.columns), float_format=_REPORT_FLOAT)


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()


def _figure(nrows: int = 1, ncols: int = 1, size=(8.0, 4.5), **kw):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes.ravel().tolist()


# --------------------------------------------------------------------------------------------
# Data preparation


def _trial_rows(df: pd.DataFrame) -> pd.DataFrame:
    if "tags.jbench.kind" in df.columns:
        df = df[df["tags.jbench.kind"].fillna("trial") == "trial"]
    return df


def _finished(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "FINISHED"] if "status" in df.columns else df


def _varying(df: pd.DataFrame, exclude: Sequence[str]) -> list[str]:
    keys = []
    for k in SERIES_KEYS:
        if k in exclude or k not in df.columns:
            continue
        if df[k].astype(str).nunique(dropna=False) > 1:
            keys.append(k)
    return keys


_SHORT = {DEVICE: "device", "params.model.name": "model", QUANT_P: "quant", DEPTH: "depth", KV_K: "K",
          KV_V: "V", POWER_MODE: "power", "params.backend.n_gen": "n_gen", "params.backend.n_prompt": "n_prompt",
          "params.backend.n_gpu_layers": "ngl", "params.backend.flash_attn": "fa", "params.backend.threads": "threads"}


def _series_label(keys: list[str], values: tuple) -> str:
    if not keys:
        return "all runs"
    pairs = dict(zip(keys, values))
    if KV_K in pairs and KV_V in pairs and str(pairs[KV_K]) == str(pairs[KV_V]):
        pairs["KV"] = pairs.pop(KV_K)
        pairs.pop(KV_V)
    return ", ".join(f"{_SHORT.get(k, k.split('.', 1)[-1])}={v}" for k, v in pairs.items())


def _legend(fig, axes, extra: Sequence = ()) -> None:
    """One legend for the figure, below the plots, each label once."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if not label.startswith("_"):
                seen.setdefault(label, h)
    for h, label in extra:
        seen.setdefault(label, h)
    if seen:
        fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center", fontsize=7,
                   ncol=2 if len(seen) > 3 else len(seen), frameon=False)


def _roofline_proxy():
    from matplotlib.lines import Line2D

    return (Line2D([], [], color="grey", linestyle="--"), "roofline ceiling (dashed, same colour)")


ABOVE_CEILING_TEXT = ("above its ceiling (finding ceiling_below_measured: calibration wrong or cache-resident "
                      "model)")


def _above_ceiling_proxy():
    from matplotlib.lines import Line2D

    return (Line2D([], [], color="red", marker="x", linestyle="none", markersize=9), ABOVE_CEILING_TEXT)


def _mark_above_ceiling(ax, x: pd.Series, decode: pd.Series, ceiling: pd.Series) -> int:
    """Cross out each point whose decode rate is above its roofline ceiling; how many there were."""
    above = ceiling.notna() & (decode > ceiling)
    if above.any():
        ax.plot(x[above], decode[above], linestyle="none", marker="x", color="red", markersize=11, mew=2, zorder=5)
    return int(above.sum())


def _ceiling_note(n_above: int) -> str:
    return (f" {n_above} point(s) {ABOVE_CEILING_TEXT}, crossed out in red: a ceiling must not be beaten."
            if n_above else "")


def _quant_order(agg: pd.DataFrame) -> tuple[dict[str, int], dict[str, str], str]:
    """An ordered categorical x axis for the quants: position, tick label and axis label. Ordered by the files' real
    bits per weight when every quant has it recorded (roofline_bits_per_weight), else by the dominant ggml type's
    figure; the name breaks ties. Positions, not bits, on the axis: Q4_0 and Q4_K_M share their dominant type's 4.5
    bits and would stack, and real figures can lie a fraction of a bit apart."""
    nominal = agg.groupby("_quant", sort=False)["bits_per_weight"].first()
    real = agg.groupby("_quant", sort=False)["file_bits_per_weight"].mean() if "file_bits_per_weight" in agg else None
    use_real = real is not None and real.notna().all()
    key = (lambda q: (real[q], nominal[q], q)) if use_real else (lambda q: (nominal[q], q))
    quants = sorted(nominal.index, key=key)
    labels = {q: f"{q}\n{real[q]:.2f} bpw" if use_real else f"{q}\n~{nominal[q]:.3g} bpw" for q in quants}
    axis = ("quant, by the file's bits per weight" if use_real
            else "quant, by bits per weight of its main ggml type (~)")
    return {q: i for i, q in enumerate(quants)}, labels, axis


def _quant_ticks(ax, position: dict[str, int], labels: dict[str, str], axis: str) -> None:
    ax.set_xticks(list(position.values()))
    ax.set_xticklabels([labels[q] for q in position], fontsize=7)
    ax.set_xlim(-0.5, len(position) - 0.5)
    ax.set_xlabel(axis)


def _rates_from_zero(*axes) -> None:
    """A rate axis starts at zero: cut above it, a 25 % change looks like a collapse."""
    for ax in axes:
        ax.set_ylim(bottom=0)


def _describe(fig) -> str:
    """What each plot of a drawn figure shows: title, x ticks (or range) and y range, read back from its axes (the
    image's alt text, so a reader, or a test, sees what the picture says)."""
    parts = []
    for ax in fig.axes:
        if not ax.get_title() and not ax.get_ylabel():
            continue
        ticks = [t.get_text().replace("\n", " ") for t in ax.get_xticklabels() if t.get_text()]
        x0, x1 = ax.get_xlim()
        categorical = bool(ticks) and all(not re.fullmatch(r"[\d.,−-]+", t) for t in ticks)  # names, not numbers
        x = f"x {ax.get_xlabel()}: " + (", ".join(ticks) if categorical else f"{x0:.4g} to {x1:.4g}")
        y0, y1 = ax.get_ylim()
        parts.append(f"{ax.get_title()}: {x}; y {ax.get_ylabel()}: {y0:.4g} to {y1:.4g}")
    return ". ".join(parts)


def _rate_error(rows: pd.DataFrame, rate: str, samples: dict) -> float:
    """Std of pooled repetition samples if given, else RMS of the runs' <rate>_std."""
    series = samples.get(f"{rate}_rep") if samples else None
    if series:
        pooled = [v for r in rows["run_id"] for v in series.get(r, ())]
        if len(pooled) >= 2:
            return float(np.std(pooled, ddof=1))
    col = f"metrics.{rate}_std"
    if col in rows.columns:
        v = pd.to_numeric(rows[col], errors="coerce").dropna()
        if len(v):
            return float(np.sqrt(np.mean(np.square(v))))
    return math.nan


def _aggregate(rows: pd.DataFrame, by: list[str], samples: dict, extra: dict[str, str]) -> pd.DataFrame:
    """One row per group: runs, decode/prefill mean and error, and the mean of each extra column."""
    out = []
    for key, g in rows.groupby(by, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        rec = dict(zip(by, key))
        rec["runs"] = len(g)
        for rate, col in (("decode_tps", DECODE), ("prefill_tps", PREFILL)):
            if col in g.columns:
                vals = pd.to_numeric(g[col], errors="coerce").dropna()
                rec[rate] = float(vals.mean()) if len(vals) else math.nan
                rec[f"{rate}_err"] = _rate_error(g, rate, samples) if len(vals) else math.nan
        for name, col in extra.items():
            vals = pd.to_numeric(g[col], errors="coerce").dropna() if col in g.columns else pd.Series(dtype=float)
            rec[name] = float(vals.mean()) if len(vals) else math.nan
        out.append(rec)
    return pd.DataFrame(out)


def _rename_for_table(df: pd.DataFrame) -> pd.DataFrame:
    return df.rename(columns=lambda c: c.split(".", 1)[1] if c.startswith(("params.", "tags.", "metrics.")) else c)


# --------------------------------------------------------------------------------------------
# Sections


def _overview(df: pd.DataFrame, trials: pd.DataFrame) -> _Section:
    sec = _Section("runs", "Runs")
    exps = sorted(df["experiment"].dropna().unique()) if "experiment" in df.columns else []
    sweeps = sorted(df["tags.jbench.sweep_id"].dropna().unique()) if "tags.jbench.sweep_id" in df.columns else []
    n_ok = int((trials["status"] == "FINISHED").sum()) if "status" in trials.columns else len(trials)
    t0, t1 = (trials["start_time"].min(), trials["start_time"].max()) if "start_time" in trials.columns and len(trials) else (None, None)
    sec.text = (f"{len(trials)} trial run(s), {n_ok} finished; experiment(s): {', '.join(exps) or 'n/a'}; "
                f"sweep(s): {len(sweeps)}" + (f"; from {t0:%Y-%m-%d %H:%M} to {t1:%Y-%m-%d %H:%M} UTC" if t0 is not None and pd.notna(t0) else ""))
    cols = ["tags.jbench.sweep_id", "tags.jbench.trial_label", DEVICE, QUANT_P, DEPTH, KV_K, POWER_MODE,
            DECODE, "metrics.decode_tps_std", PREFILL, "metrics.prefill_tps_std", _tpj_column(trials) or "",
            ROOFLINE, ROOFLINE_FRACTION, ABOVE_CEILING_RATIO, "tags.roofline.regime", "status",
            "tags.jbench.failure_reason"]
    cols = [c for c in cols if c and c in trials.columns and trials[c].notna().any()]
    above = CEILING_FINDING in trials.columns and trials[CEILING_FINDING].notna().any()
    if not above:  # no run beat its ceiling: the ratio is roofline_fraction again, column for column
        cols = [c for c in cols if c != ABOVE_CEILING_RATIO]
    if above:
        sec.text += (f". {int(trials[CEILING_FINDING].notna().sum())} run(s) decoded faster than their roofline "
                     f"ceiling (finding ceiling_below_measured: calibration wrong or cache-resident model; their "
                     f"roofline_fraction is left out, the ratio is roofline_measured_over_ceiling)")
    table = trials[cols].copy()
    # A setting every run shares is said once above the table, not repeated in a column of it; the trial's label and
    # the measured values stay columns.
    keep = {"tags.jbench.trial_label"}
    same = [c for c in cols if len(table) > 1 and c not in keep and not c.startswith("metrics.")
            and table[c].notna().all() and table[c].astype(str).nunique() == 1]
    if same:
        sec.text += ". Same for every run: " + ", ".join(
            f"{_rename_for_table(table[[c]]).columns[0]} {table[c].iloc[0]}" for c in same)
        table = table.drop(columns=same)
    if len(table) > 500:
        sec.text += f". The table lists the newest 500 of {len(table)} runs"
        table = table.tail(500)
    sec.tables.append(("one row per trial run", _rename_for_table(table)))
    return sec


def _quant_ladder(rows: pd.DataFrame, samples: dict) -> _Section:
    sec = _Section("quant_ladder", "Quant ladder")
    quant = _col(rows, QUANT_P, QUANT_T)
    if quant is None or DECODE not in rows.columns:
        sec.missing = "not enough data for the quant ladder: no finished run has a quant and decode_tps"
        return sec
    rows = rows.assign(_quant=quant.astype(str)).dropna(subset=[DECODE])
    bpw, unknown = {}, []
    for q in rows["_quant"].unique():
        try:
            bpw[q] = bits_per_weight(q)
        except RooflineError:
            unknown.append(q)
    rows = rows[rows["_quant"].isin(bpw)]
    keys = _varying(rows, exclude=(QUANT_P,))
    tpj = _tpj_column(rows)
    agg = _aggregate(rows, keys + ["_quant"], samples,
                     {"tokens_per_joule": tpj or "", "roofline_decode_tps": ROOFLINE, "file_bits_per_weight": FILE_BPW})
    if agg.empty:
        sec.missing = "not enough data for the quant ladder: no finished run with a known quant"
        return sec
    agg["bits_per_weight"] = agg["_quant"].map(bpw)
    position, tick_labels, x_label = _quant_order(agg)
    agg["_x"] = agg["_quant"].map(position)
    series = [(k, g.sort_values("_x")) for k, g in agg.groupby(keys, sort=False)] if keys else [((), agg.sort_values("_x"))]
    series = [(k if isinstance(k, tuple) else (k,), g) for k, g in series if g["_quant"].nunique() >= 2]
    if not series:
        sec.missing = ("not enough data for the quant ladder: it needs finished runs at two or more quants of "
                       "an otherwise identical configuration")
        return sec
    series = sorted(series, key=lambda kg: -len(kg[1]))[:MAX_SERIES]
    has_tpj = agg["tokens_per_joule"].notna().any()
    fig, axes = _figure(1, 2 if has_tpj else 1, size=(11.0 if has_tpj else 8.0, 5.0 + 0.18 * len(series)))
    ax = axes[0]
    any_roof, n_above = False, 0
    for i, (key, g) in enumerate(series):
        color = f"C{i % 10}"
        ax.errorbar(g["_x"], g["decode_tps"], yerr=g["decode_tps_err"].fillna(0), marker="o",
                    color=color, capsize=3, label=_series_label(keys, key))
        roof = g.dropna(subset=["roofline_decode_tps"])
        if len(roof):
            any_roof = True
            ax.plot(roof["_x"], roof["roofline_decode_tps"], linestyle="--", color=color, alpha=0.7)
            n_above += _mark_above_ceiling(ax, g["_x"], g["decode_tps"], g["roofline_decode_tps"])
        if has_tpj:
            t = g.dropna(subset=["tokens_per_joule"])
            if len(t):
                axes[1].plot(t["_x"], t["tokens_per_joule"], marker="s", color=color)
    ax.set_ylabel("decode tok/s")
    ax.set_title("decode speed per quant")
    if has_tpj:
        axes[1].set_ylabel("decode tokens per joule")
        axes[1].set_title("energy efficiency per quant")
    for a in axes:
        a.grid(alpha=0.3)
        _quant_ticks(a, position, tick_labels, x_label)
    _rates_from_zero(*axes)
    _legend(fig, axes, ([_roofline_proxy()] if any_roof else []) + ([_above_ceiling_proxy()] if n_above else []))
    sec.figures.append(("quant_ladder", _png(fig)))
    sec.alts["quant_ladder"] = _describe(fig)
    table = agg.rename(columns={"_quant": "quant"}).sort_values(keys + ["_x"]).drop(columns="_x")
    table = table.dropna(axis=1, how="all")
    sec.tables.append(("mean over runs per quant; err = standard deviation of repetitions", _rename_for_table(table)))
    if unknown:
        sec.text = f"Quants without a known bits-per-weight figure, left out: {', '.join(sorted(unknown))}."
    sec.text = (sec.text + _ceiling_note(n_above)).strip()
    return sec


def _context_scaling(rows: pd.DataFrame, samples: dict) -> _Section:
    sec = _Section("context_scaling", "Context scaling")
    depth = _num(_col(rows, DEPTH))
    if depth is None or DECODE not in rows.columns:
        sec.missing = "not enough data for context scaling: no finished run records params.backend.depth and decode_tps"
        return sec
    rows = rows.assign(_depth=depth).dropna(subset=["_depth", DECODE])
    rows = rows.assign(_kv=(rows[KV_K].astype(str) if KV_K in rows.columns else "f16"))
    if KV_V in rows.columns:
        rows["_kv"] = [k if str(v) == k else f"K {k} / V {v}" for k, v in zip(rows["_kv"], rows[KV_V].astype(str))]
    keys = _varying(rows, exclude=(DEPTH, KV_K, KV_V))
    agg = _aggregate(rows, ["_kv"] + keys + ["_depth"], samples, {"roofline_decode_tps": ROOFLINE})
    groups = [(k, g.sort_values("_depth")) for k, g in agg.groupby(["_kv"] + keys, sort=False)]
    groups = [(k if isinstance(k, tuple) else (k,), g) for k, g in groups if g["_depth"].nunique() >= 2]
    if not groups:
        sec.missing = ("not enough data for context scaling: it needs finished runs at two or more depths "
                       "(params.backend.depth) of an otherwise identical configuration")
        return sec
    groups = sorted(groups, key=lambda kg: -len(kg[1]))[:MAX_SERIES]
    has_prefill = "prefill_tps" in agg.columns and agg["prefill_tps"].notna().any()
    fig, axes = _figure(1, 2 if has_prefill else 1, size=(11.0 if has_prefill else 8.0, 5.0 + 0.18 * len(groups)))
    any_roof, n_above = False, 0
    for i, (key, g) in enumerate(groups):
        color = f"C{i % 10}"
        label = f"KV {key[0]}" + (f", {_series_label(keys, key[1:])}" if keys else "")
        axes[0].errorbar(g["_depth"], g["decode_tps"], yerr=g["decode_tps_err"].fillna(0), marker="o", color=color,
                         capsize=3, label=label)
        roof = g.dropna(subset=["roofline_decode_tps"])
        if len(roof):
            any_roof = True
            axes[0].plot(roof["_depth"], roof["roofline_decode_tps"], linestyle="--", color=color, alpha=0.7)
            n_above += _mark_above_ceiling(axes[0], g["_depth"], g["decode_tps"], g["roofline_decode_tps"])
        if has_prefill:
            axes[1].errorbar(g["_depth"], g["prefill_tps"], yerr=g["prefill_tps_err"].fillna(0), marker="o",
                             color=color, capsize=3, label=label)
    for ax, what in zip(axes, ("decode", "prefill")):
        ax.set_xlabel("context depth (tokens in the KV cache)")
        ax.set_ylabel(f"{what} tok/s")
        ax.set_title(f"{what} speed vs context depth")
        ax.grid(alpha=0.3)
    _rates_from_zero(*axes)
    _legend(fig, axes, ([_roofline_proxy()] if any_roof else []) + ([_above_ceiling_proxy()] if n_above else []))
    sec.figures.append(("context_scaling", _png(fig)))
    sec.alts["context_scaling"] = _describe(fig)
    sec.text = (sec.text + _ceiling_note(n_above)).strip()
    table = agg.rename(columns={"_kv": "kv_type", "_depth": "depth"}).dropna(axis=1, how="all")
    sec.tables.append(("mean over runs per depth and KV type", _rename_for_table(table)))
    return sec


def _power_modes(rows: pd.DataFrame, samples: dict) -> _Section:
    sec = _Section("power_modes", "Power modes")
    power = _num(_col(rows, POWER_W))
    if power is None or DECODE not in rows.columns:
        sec.missing = "not enough data for power modes: no finished run has metrics.decode_avg_power_w"
        return sec
    mode = _col(rows, POWER_MODE, "tags.power.mode_actual")
    rows = rows.assign(_power=power, _mode=(mode.astype(str) if mode is not None else "(default)"))
    rows = rows.dropna(subset=["_power", DECODE])
    tpj = _tpj_column(rows)
    key = ["tags.jbench.config_hash"] if "tags.jbench.config_hash" in rows.columns else ["run_id"]
    agg = _aggregate(rows, ["_mode"] + _varying(rows, exclude=(POWER_MODE,)) + key, samples,
                     {"decode_avg_power_w": "_power", "tokens_per_joule": tpj or ""})
    if len(agg) < 2:
        sec.missing = "not enough data for power modes: it needs two or more configurations with decode power measured"
        return sec
    front = pareto_frontier(list(agg["decode_avg_power_w"]), list(agg["decode_tps"]))
    agg["pareto"] = [i in front for i in range(len(agg))]
    has_tpj = agg["tokens_per_joule"].notna().any()
    fig, axes = _figure(1, 2 if has_tpj else 1, size=(11.0 if has_tpj else 8.0, 4.8))
    ax = axes[0]
    modes = list(dict.fromkeys(agg["_mode"]))
    for i, m in enumerate(modes):
        g = agg[agg["_mode"] == m]
        ax.errorbar(g["decode_avg_power_w"], g["decode_tps"], yerr=g["decode_tps_err"].fillna(0), fmt="o",
                    color=f"C{i % 10}", capsize=3, label=f"mode {m}")
    fr = agg.iloc[front].sort_values("decode_avg_power_w")
    ax.step(fr["decode_avg_power_w"], fr["decode_tps"], where="post", color="black", linestyle=":",
            label="Pareto frontier")
    ax.set_xlabel("average power during decode (W)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("speed vs power")
    ax.grid(alpha=0.3)
    if has_tpj:
        per_mode = agg.groupby("_mode", sort=False)["tokens_per_joule"].mean().dropna()
        axes[1].bar([str(m) for m in per_mode.index], per_mode.values, color=[f"C{modes.index(m) % 10}" for m in per_mode.index])
        axes[1].set_xlabel("power mode")
        axes[1].set_ylabel("decode tokens per joule")
        axes[1].set_title("tokens per joule per power mode")
        axes[1].grid(alpha=0.3, axis="y")
    _rates_from_zero(*axes)
    _legend(fig, axes[:1])
    sec.figures.append(("power_modes", _png(fig)))
    sec.alts["power_modes"] = _describe(fig)
    table = agg.rename(columns={"_mode": "power_mode"}).drop(columns=key).dropna(axis=1, how="all")
    sec.tables.append(("mean over runs per configuration; pareto = on the speed/power frontier", _rename_for_table(table)))
    if has_tpj:
        per_mode = agg.groupby("_mode", sort=False).agg(configurations=("runs", "size"),
                                                        decode_tokens_per_joule=("tokens_per_joule", "mean"))
        sec.tables.append(("tokens per joule per power mode (mean over configurations)",
                           per_mode.reset_index().rename(columns={"_mode": "power_mode"})))
    return sec


# Output quality and memory (docs/choosing.md)

KLD, KLD_ERR = "metrics.quality_kld_mean", "metrics.quality_kld_mean_err"
SAME_TOP, SAME_TOP_ERR = "metrics.quality_same_top_pct", "metrics.quality_same_top_pct_err"
QUALITY_MEANING, QUALITY_STATUS = "tags.quality.meaning", "tags.quality.status"
QUALITY_REFERENCE = "tags.quality.reference"
# The bar as the runs may carry it (a param or tag of the quality config); the report's own option wins.
BAR_COLUMNS = {"max_kld": ("params.quality.max_kld", "tags.quality.max_kld"),
               "min_same_top_pct": ("params.quality.min_same_top_pct", "tags.quality.min_same_top_pct")}
MODEL = "params.model.name"
MEMORY_COLUMNS = (("peak_rss_mib", "metrics.memory_peak_rss_mib"), ("predicted_mib", "metrics.memory_predicted_mib"),
                  ("prediction_error_pct", "metrics.memory_prediction_error_pct"),
                  ("backend_total_mib", "metrics.memory_backend_total_mib"),
                  ("unexplained_mib", "metrics.memory_unexplained_mib"),
                  ("ram_over_idle_mib", "metrics.memory_ram_over_idle_mib"),
                  ("gpu_over_idle_mib", "metrics.memory_gpu_over_idle_mib"),
                  ("swap_over_idle_mib", "metrics.memory_swap_over_idle_mib"))
MAX_AUDITS = 40


def _has(df: pd.DataFrame, *cols: str) -> bool:
    return any(c in df.columns and pd.to_numeric(df[c], errors="coerce").notna().any() for c in cols)


def _report_bar(rows: pd.DataFrame, option: Optional[QualityBar]) -> tuple[Optional[QualityBar], str]:
    """The quality bar and where it came from: the report's option, else the runs' quality.* params or tags (the
    strictest when runs differ)."""
    if option is not None and not option.empty:
        return option, "the report's option"
    found: dict[str, Optional[float]] = {}
    for name, cols in BAR_COLUMNS.items():
        vals = pd.concat([pd.to_numeric(rows[c], errors="coerce") for c in cols if c in rows.columns] or
                         [pd.Series(dtype=float)]).dropna()
        found[name] = None if vals.empty else float(vals.min() if name == "max_kld" else vals.max())
    bar = QualityBar(found["max_kld"], found["min_same_top_pct"])
    return (None, "") if bar.empty else (bar, "the runs' quality config")


def _first(g: pd.DataFrame, col: str) -> Any:
    if col not in g.columns:
        return None
    vals = g[col].dropna()
    return vals.iloc[0] if len(vals) else None


def _model_device_groups(rows: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per model and device, as the quality plots are drawn: one figure each."""
    by = [c for c in (MODEL, DEVICE) if c in rows.columns]
    if not by:
        return [("all runs", rows)]
    out = []
    for key, g in rows.groupby(by, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        out.append((", ".join(str(k) for k in key if isinstance(k, str) and k) or "all runs", g))
    return out


def _point_label(keys: list[str], values: tuple) -> str:
    """A point's name on a plot: a name (Q4_0, q8_0) as it is, a number with its key (depth=4096)."""
    parts = []
    for k, v in zip(keys, values):
        text = str(v)
        short = _SHORT.get(k, k.split(".", 1)[-1])
        parts.append(text if isinstance(v, str) and not text.replace(".", "").isdigit() and k not in (KV_K, KV_V)
                     else f"{short}={text}")
    return " ".join(parts)


def _quality_rows(rows: pd.DataFrame, samples: dict) -> tuple[pd.DataFrame, list[str]]:
    """One row per configuration of a model/device group: its label, quant and KV types, decode and prefill (mean,
    error), tokens per joule, the quality figures, the file's bits per weight, memory, the quality tags."""
    key = ["tags.jbench.config_hash"] if "tags.jbench.config_hash" in rows.columns else ["run_id"]
    keys = _varying(rows, exclude=(DEVICE, MODEL))
    tpj = _tpj_column(rows)
    extra = {"quality_kld_mean": KLD, "quality_kld_mean_err": KLD_ERR, "quality_same_top_pct": SAME_TOP,
             "quality_same_top_pct_err": SAME_TOP_ERR, "decode_tokens_per_joule": tpj or "",
             "roofline_bits_per_weight": FILE_BPW, "memory_peak_rss_mib": "metrics.memory_peak_rss_mib",
             "memory_ram_over_idle_mib": "metrics.memory_ram_over_idle_mib"}
    agg = _aggregate(rows, keys + key, samples, extra)
    for c in ("decode_tps", "decode_tps_err"):  # a table without decode figures still has the columns
        if c not in agg.columns:
            agg[c] = math.nan
    firsts = {c: [] for c in (QUANT_P, KV_K, KV_V, QUALITY_MEANING, QUALITY_REFERENCE)}
    labels = []
    for _, g in rows.groupby(keys + key, sort=False, dropna=False):
        for c in firsts:
            firsts[c].append(_first(g, c))
        labels.append(_first(g, "tags.jbench.trial_label"))
    for c, vals in firsts.items():
        agg[c] = vals
    agg["label"] = [_point_label(keys, tuple(r[k] for k in keys)) if keys else (lb or "all runs")
                    for (_, r), lb in zip(agg.iterrows(), labels)]
    return agg.drop(columns=key), keys


def _quality_figure(agg: pd.DataFrame, choice: Choice, bar: Optional[QualityBar], title: str):
    """decode tok/s (and decode tokens per joule) against mean KLD, Pareto fronts marked, the bar and the choice."""
    has_tpj = agg["decode_tokens_per_joule"].notna().any()
    fig, axes = _figure(1, 2 if has_tpj else 1, size=(11.0 if has_tpj else 8.0, 5.0))
    panels = [("decode_tps", "decode_tps_err", "decode tok/s", "speed")]
    if has_tpj:
        panels.append(("decode_tokens_per_joule", None, "decode tokens per joule", "energy"))
    fronts = {}
    for ax, (y, yerr, ylabel, what) in zip(axes, panels):
        pts = agg.dropna(subset=["quality_kld_mean", y])
        for i, (_, r) in enumerate(pts.iterrows()):
            ax.errorbar([r["quality_kld_mean"]], [r[y]],
                        xerr=[0 if pd.isna(r["quality_kld_mean_err"]) else r["quality_kld_mean_err"]],
                        yerr=[0 if yerr is None or pd.isna(r.get(yerr)) else r[yerr]], fmt="o", color=f"C{i % 10}",
                        capsize=3, label="_point")  # named by its annotation, not in the legend
            ax.annotate(str(r["label"]), (r["quality_kld_mean"], r[y]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        front = pareto_front(pts, "quality_kld_mean", y, x_better="lower", y_better="higher")
        fronts[what] = front
        fr = pts.loc[front].sort_values("quality_kld_mean")
        if len(fr):
            ax.step(fr["quality_kld_mean"], fr[y], where="post", color="black", linestyle=":",
                    label="Pareto front")
            ax.plot(fr["quality_kld_mean"], fr[y], linestyle="none", marker="o", markersize=12, mfc="none",
                    mec="black", label="_front")
        if bar is not None and bar.max_kld is not None:
            ax.axvline(bar.max_kld, color="red", linestyle="--", alpha=0.7, label=f"bar: mean KLD <= {bar.max_kld:g}")
        if choice.chosen is not None and choice.key in pts.index:
            ax.plot([pts.loc[choice.key, "quality_kld_mean"]], [pts.loc[choice.key, y]], linestyle="none",
                    marker="*", markersize=16, color="gold", mec="black", label="choice within the bar")
        ax.set_xlabel("mean KL divergence from the reference (nat; lower is better)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{what} vs quality: {title}", fontsize=9)
        ax.margins(x=0.12, y=0.12)  # room for the points' names
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    _rates_from_zero(*axes)
    _legend(fig, axes)
    return fig, fronts


def _quality(rows: pd.DataFrame, samples: dict, option: Optional[QualityBar]) -> _Section:
    sec = _Section("quality", "Quality and memory: the choice within the quality bar")
    figures = [pd.to_numeric(rows[c], errors="coerce").notna() for c in (KLD, SAME_TOP) if c in rows.columns]
    measured = rows[np.logical_or.reduce(figures)] if figures else rows.iloc[0:0]
    bar, source = _report_bar(rows, option)
    sec.text = (f"Quality bar: {bar.describe()} (from {source}). A configuration meets it when its mean plus "
                f"1.645 x its standard error is within it; an interval that straddles it is 'within noise'."
                if bar is not None else "No quality bar set (quality.max_kld, quality.min_same_top_pct, or the "
                "report's option): each model and device gets its speed/quality Pareto front instead.")
    if QUALITY_STATUS in rows.columns:
        without = rows[rows[QUALITY_STATUS].notna() & ~rows.index.isin(measured.index)]
        if len(without):
            reasons = "; ".join(sorted({str(v) for v in without[QUALITY_STATUS]}))
            sec.text += f" {len(without)} finished trial(s) have no quality figures: {reasons}."
    if measured.empty:
        sec.missing = "no finished trial has quality figures (metrics.quality_kld_mean): no choice is made"
        return sec
    groups = _model_device_groups(measured)
    tables = []
    for n, (title, g) in enumerate(groups, start=1):
        agg, _ = _quality_rows(g, samples)
        choice = choose(agg, bar)
        prefix = f"{title}: " if len(groups) > 1 else ""
        sec.notes += [prefix + line for line in choice.lines()]
        stem = f"quality_{n}"
        if agg["quality_kld_mean"].notna().any() and agg["decode_tps"].notna().any():
            fig, fronts = _quality_figure(agg, choice, bar, title)
            sec.figures.append((stem, _png(fig)))
            sec.alts[stem] = _describe(fig)
        else:
            fronts = {}
        verdicts = {c.key: c for c in choice.candidates}
        table = pd.DataFrame({
            "model / device": title, "configuration": agg["label"], "quant": agg[QUANT_P],
            "kv": [(k if k == v or v is None else f"{k}/{v}") if k is not None else None
                   for k, v in zip(agg[KV_K], agg[KV_V])],
            "file_bits_per_weight": agg["roofline_bits_per_weight"],
            "kld_mean": agg["quality_kld_mean"], "kld_err": agg["quality_kld_mean_err"],
            "kld_bound_95": [verdicts[k].kld_bound if k in verdicts else None for k in agg.index],
            "same_top_pct": agg["quality_same_top_pct"], "same_top_err": agg["quality_same_top_pct_err"],
            "decode_tps": agg["decode_tps"], "decode_tokens_per_joule": agg["decode_tokens_per_joule"],
            "peak_rss_mib": agg["memory_peak_rss_mib"],
            "verdict": [("chosen" if k == choice.key else verdicts[k].verdict) if k in verdicts and bar is not None
                        else None for k in agg.index],
            "pareto_speed": [k in fronts.get("speed", ()) for k in agg.index],
            "pareto_energy": [k in fronts.get("energy", ()) for k in agg.index] if "energy" in fronts else None,
            "reference": agg[QUALITY_REFERENCE],
        })
        tables.append(table.dropna(axis=1, how="all"))
    sec.tables.append(("per configuration: quality against the reference (err: about one standard error; bound: "
                       "mean + 1.645 err), speed, energy and peak memory; pareto = on that front",
                       pd.concat(tables, ignore_index=True)))
    return sec


def _trial_name(r: pd.Series) -> str:
    label = r.get("tags.jbench.trial_label")
    return label if isinstance(label, str) and label else str(r.get("run_id", ""))[:12]


def _memory(rows: pd.DataFrame) -> _Section:
    sec = _Section("memory", "Memory")
    cols = [c for _, c in MEMORY_COLUMNS if c in rows.columns]
    has = rows[[c for c in cols]].apply(pd.to_numeric, errors="coerce").notna().any(axis=1) if cols else None
    if has is None or not has.any():
        sec.missing = "no finished trial has memory figures (metrics.memory_*)"
        return sec
    rows = rows[has]
    table = pd.DataFrame({"trial": [_trial_name(r) for _, r in rows.iterrows()]}, index=rows.index)
    for c in (QUANT_P, KV_K, DEPTH):
        if c in rows.columns:
            table[c] = rows[c]
    for name, c in MEMORY_COLUMNS:
        if c in rows.columns:
            table[name] = pd.to_numeric(rows[c], errors="coerce")
    if "tags.memory.status" in rows.columns:
        table["memory_status"] = rows["tags.memory.status"]
    table = table.dropna(axis=1, how="all")
    if "prediction_error_pct" in table.columns and table["prediction_error_pct"].notna().any():
        err = table["prediction_error_pct"].dropna()
        worst = err.abs().idxmax()
        sec.text = (f"Prediction error (100 x (measured - predicted) / measured; positive: the prediction was short): "
                    f"median {err.median():.3g} %, largest {err[worst]:.3g} % ({table.loc[worst, 'trial']}) over "
                    f"{len(err)} trial(s).")
    sec.tables.append(("per trial: the measured peak (MiB) beside the prediction and its error",
                       _rename_for_table(table.reset_index(drop=True))))
    if memory_audit is None:
        sec.text = (sec.text + " The per-trial memory audit needs jbench.analysis.memory, which this installation "
                    "lacks.").strip()
        return sec
    for n, (_, r) in enumerate(rows.iterrows()):
        if n == MAX_AUDITS:
            sec.text = (sec.text + f" Audits of the first {MAX_AUDITS} of {len(rows)} trials.").strip()
            break
        metrics = {c[len("metrics."):]: float(v) for c, v in r.items()
                   if c.startswith("metrics.") and isinstance(v, (int, float)) and not pd.isna(v)}
        tags = {c[len("tags."):]: v for c, v in r.items() if c.startswith("tags.") and isinstance(v, str)}
        lines = memory_audit.audit(metrics, tags)
        if not lines:
            continue
        frame = pd.DataFrame([{"what": a.label, "mib": a.mib, "source": a.source} for a in lines])
        sec.blocks.append((f"memory audit: {_trial_name(r)}", memory_audit.audit_markdown(lines), frame))
    return sec


def _advice(advice: Any) -> _Section:
    from jbench.reporting.advice import advice_table, pareto_png

    goal = advice.goal
    sec = _Section("advice", "Advice: the best configuration under constraints")
    sec.text = (f"{'Maximise' if goal.direction > 0 else 'Minimise'} {goal.objective}"
                + (f" subject to {', '.join(str(c) for c in goal.constraints)}" if goal.constraints else "")
                + f", each configuration meeting them with probability >= {goal.confidence:g}: "
                + ("BEST: " if advice.outcome == "found" else "NO VERDICT: ") + advice.message + ".")
    sec.notes = [f"not significantly worse than the best (Welch, alpha {goal.alpha:g}): {c.label}"
                 for c in advice.runners_up]
    sec.tables.append(("every configuration: the objective's mean and standard error, P(met) per constraint, the "
                       "verdict", advice_table(advice)))
    if advice.front:
        x, y = advice.front_metrics
        sec.figures.append(("advice_pareto", pareto_png(advice)))
        sec.alts["advice_pareto"] = f"{y} against {x}: every configuration by verdict, the Pareto front, the best"
    return sec


def _phase_windows(tel: pd.DataFrame) -> list[tuple[str, float, float]]:
    if "phase" not in tel.columns:
        return []
    out: list[tuple[str, float, float]] = []
    cur, start, last = None, None, None
    for t, p in zip(tel["t"], tel["phase"]):
        p = p if isinstance(p, str) and p else None
        if p != cur:
            if cur is not None:
                out.append((cur, start, t))  # a phase lasts until the first sample of the next one
            cur, start = p, t
        last = t
    if cur is not None:
        out.append((cur, start, last))
    return out


def _telemetry(telemetry: pd.DataFrame, trials: pd.DataFrame) -> _Section:
    sec = _Section("telemetry", "Telemetry timelines")
    if telemetry is None or telemetry.empty or "t" not in telemetry.columns:
        sec.missing = "not enough data for telemetry timelines: no telemetry samples (columns t, power_w, ...)"
        return sec
    channels = [(c, label) for c, label in TELEMETRY_CHANNELS if c in telemetry.columns and telemetry[c].notna().any()]
    if not channels:
        sec.missing = "not enough data for telemetry timelines: no power_w, gpu_freq_mhz or temp_c samples"
        return sec
    # [{"run_id"?, "phase", "t0"/"start", "t1"/"end"}], e.g. the runner's telemetry/windows.json
    extra_windows = [(w.get("run_id"), w["phase"], float(w.get("t0", w.get("start"))), float(w.get("t1", w.get("end"))))
                     for w in (telemetry.attrs.get("phases") or [])]
    by_run = list(telemetry.groupby("run_id", sort=False)) if "run_id" in telemetry.columns else [(None, telemetry)]
    if len(by_run) > MAX_TIMELINES:
        sec.text = f"Showing the first {MAX_TIMELINES} of {len(by_run)} runs with telemetry."
        by_run = by_run[:MAX_TIMELINES]
    labels = {}
    if "tags.jbench.trial_label" in trials.columns:
        labels = dict(zip(trials["run_id"], trials["tags.jbench.trial_label"]))
    summary = []
    phase_colors: dict[str, str] = {}
    for i, (run_id, g) in enumerate(by_run):
        g = g.sort_values("t")
        t_first = float(g["t"].min())  # device clock: plot seconds since the run's first sample
        windows = _phase_windows(g) + [(ph, t0, t1) for rid, ph, t0, t1 in extra_windows if rid in (None, run_id)]
        windows = [(ph, t0 - t_first, t1 - t_first) for ph, t0, t1 in windows]
        g = g.assign(t=g["t"] - t_first)
        fig, axes = _figure(len(channels), 1, size=(9.0, 1.8 * len(channels) + 0.8), sharex=True)
        for ax, (c, label) in zip(axes, channels):
            ax.plot(g["t"], g[c], linewidth=1.0, color="C0")
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
            for phase, t0, t1 in windows:
                color = phase_colors.setdefault(phase, f"C{(len(phase_colors) + 1) % 10}")
                ax.axvspan(t0, t1, color=color, alpha=0.15, label=phase)
        handles, names = axes[0].get_legend_handles_labels()
        uniq = dict(zip(names, handles))
        if uniq:
            axes[0].legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right")
        axes[-1].set_xlabel("time since the first sample (s)")
        title = labels.get(run_id, run_id) if run_id is not None else "telemetry"
        axes[0].set_title(f"{title}" + (f" ({str(run_id)[:12]})" if run_id is not None and title != run_id else ""), fontsize=9)
        sec.figures.append((f"telemetry_{i + 1}", _png(fig)))
        for phase, t0, t1 in windows or [("(whole series)", float(g["t"].min()), float(g["t"].max()))]:
            w = g[(g["t"] >= t0) & (g["t"] <= t1)]
            rec = {"run": title, "phase": phase, "t0_s": t0, "t1_s": t1, "samples": len(w)}
            if "power_w" in w.columns:
                rec["mean_power_w"] = float(w["power_w"].mean()) if len(w) else math.nan
            if "gpu_freq_mhz" in w.columns:
                rec["mean_gpu_freq_mhz"] = float(w["gpu_freq_mhz"].mean()) if len(w) else math.nan
            for c in ("temp_c", "temp_max_c"):
                if c in w.columns:
                    rec["max_temp_c"] = float(w[c].max()) if len(w) else math.nan
            summary.append(rec)
    sec.tables.append(("per run and phase", pd.DataFrame(summary)))
    return sec


def _findings(df: pd.DataFrame) -> _Section:
    sec = _Section("findings", "Findings")
    cols = [c for c in df.columns if c.startswith("tags.finding.")]
    rows = []
    for c in cols:
        for _, r in df[df[c].notna()].iterrows():
            who = r.get("tags.jbench.trial_label")
            if not isinstance(who, str):
                who = f"sweep {r.get('tags.jbench.sweep_id')}" if r.get("tags.jbench.kind") == "sweep" else r["run_id"][:12]
            rows.append({"finding": c[len("tags.finding."):], "value": r[c], "run": who, "run_id": r["run_id"]})
    if not rows:
        sec.missing = "no findings recorded (no run has a tag finding.*)"
        return sec
    sec.tables.append(("tags finding.* of the runs", pd.DataFrame(rows)))
    return sec


# --------------------------------------------------------------------------------------------
# Rendering

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;font-size:.8em;margin:.5em 0 1.5em}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:left;vertical-align:top}
td .num{display:block;text-align:right;font-variant-numeric:tabular-nums}th{background:#f4f4f4}
img{max-width:100%;height:auto;border:1px solid #eee}.missing{color:#8a5a00;background:#fff7e6;padding:.5em;border-left:3px solid #e0a000}
caption{caption-side:top;text-align:left;color:#555;font-style:italic}.tablewrap{overflow-x:auto}
"""


def _render_html(title: str, sections: list[_Section], pngs: dict[str, bytes]) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>", "<ul>"]
    parts += [f'<li><a href="#{s.key}">{html.escape(s.title)}</a></li>' for s in sections]
    parts.append("</ul>")
    for s in sections:
        parts.append(f'<h2 id="{s.key}">{html.escape(s.title)}</h2>')
        if s.missing:
            parts.append(f'<p class="missing">{html.escape(s.missing)}</p>')
        if s.text:
            parts.append(f"<p>{html.escape(s.text)}</p>")
        if s.notes:
            parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in s.notes) + "</ul>")
        for stem, _ in s.figures:
            data = base64.b64encode(pngs[stem]).decode("ascii")
            alt = html.escape(f"{stem}: {s.alts[stem]}" if s.alts.get(stem) else stem)
            parts.append(f'<p><img alt="{alt}" src="data:image/png;base64,{data}"></p>')
        for caption, table in s.tables:
            parts.append(f'<p><em>{html.escape(caption)}</em></p><div class="tablewrap">{_html_table(table)}</div>')
        for caption, _, table in s.blocks:
            parts.append(f'<p><em>{html.escape(caption)}</em></p><div class="tablewrap">{_html_table(table)}</div>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _render_markdown(title: str, sections: list[_Section], files: dict[str, Path]) -> str:
    lines = [f"# {title}", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.missing:
            lines += [f"_{s.missing}_", ""]
        if s.text:
            lines += [s.text, ""]
        if s.notes:
            lines += [f"- {n}" for n in s.notes] + [""]
        for stem, _ in s.figures:
            lines += [f"![{stem}]({files[stem].name})", ""]
        for caption, table in s.tables:
            lines += [f"_{caption}_", "", _md_table(table)]
        for caption, markdown, _ in s.blocks:
            lines += [f"_{caption}_", "", markdown.rstrip("\n"), ""]
    return "\n".join(lines)


def build_report(
    df: pd.DataFrame,
    samples: SamplesArg = None,
    telemetry: Optional[pd.DataFrame] = None,
    *,
    out_dir: str | Path,
    title: str = "jbench report",
    quality_bar: Optional[QualityBar] = None,
    advice: Any = None,
) -> ReportFiles:
    """Write report.html, report.md and the PNGs into out_dir (created); see the module doc.

    samples: {stepped metric: {run_id: values}} (a flat {run_id: values} is decode_tps_rep), or a
    callable (run_ids, stepped metric) -> {run_id: values}; used for error bars only.
    telemetry: samples with columns t (s), power_w, gpu_freq_mhz, temp_c or temp_max_c (any present),
    optional run_id (one timeline per run) and phase (a label per sample; contiguous samples with the
    same label form a shaded window); windows may also come as telemetry.attrs["phases"] =
    [{"run_id": ..., "phase": ..., "t0"/"start": ..., "t1"/"end": ...}], which is what
    `jbench.tracking.reader.telemetry_frame` returns from the runs' telemetry artifacts.
    quality_bar: the bar of the choice within the quality bar (wins over the runs' quality.max_kld /
    quality.min_same_top_pct params or tags). The quality and memory sections appear only when some finished
    trial has such figures.
    advice: the advisor's answer over these runs (jbench.analysis.advice.Advice, `jbench report --goal`): a section
    with its table and, when it has a Pareto front, the plot.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials = _trial_rows(df)
    finished = _finished(trials)
    norm = normalize_samples(samples)
    if callable(norm):
        ids = list(finished["run_id"])
        norm = {m: dict(norm(ids, m)) for m in ("decode_tps_rep", "prefill_tps_rep")} if ids else {}
    sections = [
        _overview(df, trials),
        _quant_ladder(finished, norm),
        _context_scaling(finished, norm),
        _power_modes(finished, norm),
    ]
    # Sections of figures older stores do not have: shown only where some finished trial recorded them.
    if _has(finished, KLD, SAME_TOP) or (QUALITY_STATUS in finished.columns and finished[QUALITY_STATUS].notna().any()):
        sections.append(_quality(finished, norm, quality_bar))
    if _has(finished, *(c for _, c in MEMORY_COLUMNS)):
        sections.append(_memory(finished))
    if advice is not None:
        sections.append(_advice(advice))
    if telemetry is not None:
        sections.append(_telemetry(telemetry, trials))
    sections.append(_findings(df))
    pngs: dict[str, bytes] = {stem: data for s in sections for stem, data in s.figures}
    files: dict[str, Path] = {}
    for stem, data in pngs.items():
        path = out / f"{stem}.png"
        path.write_bytes(data)
        files[stem] = path
    html_path = out / "report.html"
    md_path = out / "report.md"
    html_path.write_text(_render_html(title, sections, pngs), encoding="utf-8")
    md_path.write_text(_render_markdown(title, sections, files), encoding="utf-8")
    return ReportFiles(html_path, md_path, files)


def export_frame(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a run table as Parquet (.parquet, .pq: needs pyarrow) or CSV (.csv, optionally compressed,
    e.g. .csv.gz). Datetimes stay UTC. Returns the path. Other suffixes raise ValueError."""
    path = Path(path)
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".parquet", ".pq"):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(f"writing {path.name} needs pyarrow (pip install pyarrow); or export to .csv") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        # Object columns mix str and missing values; keep them as strings for a stable schema.
        out = df.copy()
        for c in out.columns:
            if out[c].dtype == object:
                out[c] = out[c].map(lambda v: v if v is None or isinstance(v, str) else str(v))
        out.to_parquet(path, index=False)
        return path
    if ".csv" in suffixes:
        path.parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(path, index=False)
        return path
    raise ValueError(f"cannot tell the format of '{path.name}': use a .parquet, .pq or .csv file name")
