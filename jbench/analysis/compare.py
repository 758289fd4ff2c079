"""Compare two selections of runs (sweeps, runs or tags) configuration by configuration (pure).

Input: two run tables as `jbench.tracking.runs_frame` returns them (selection A, the reference, and
selection B), and optionally the repetition samples of their runs. Configurations are matched by
the tag `jbench.config_hash` (the trial's semantic configuration: device, backend settings, model,
quant); FINISHED trial runs only.

Samples of a rate in a selection (per configuration): the per-repetition values of the rate
(`<metric>_rep`, e.g. `decode_tps_rep`) of every run of that configuration in the selection, pooled;
for a rate without a repetition series (tokens per joule), the per-run values of the metric.
`samples` maps a stepped metric name to {run_id: [values]} (`{"decode_tps_rep": {...}}`); a flat
{run_id: [values]} is read as `decode_tps_rep`, what `jbench.tracking.repetition_samples` returns by
default.

Statistics, per matched configuration and rate, A -> B:
  * change_pct = 100 * (mean_B - mean_A) / mean_A, means over the pooled samples.
  * Confidence interval (default 95 %): the Welch t interval on the difference of means
        (mean_B - mean_A) +- t_{1-(1-c)/2, nu} * sqrt(s_A^2/n_A + s_B^2/n_B),
    nu = Welch-Satterthwaite degrees of freedom, expressed in % of mean_A (mean_A taken as fixed,
    so the interval ignores the uncertainty of the denominator: fine while the CV of A is small).
    Needs >= 2 samples on each side, else NaN.
  * p_value: two-sided Mann-Whitney U test on the pooled samples (`stats.mann_whitney_u`): the exact
    null distribution when there are no ties and both sides have <= 50 samples, else the normal
    approximation with tie correction and continuity correction. NaN with an empty side.
  * significant: p_value < alpha (default 0.05).

The statistics themselves (Welch interval, Mann-Whitney U, t quantiles) live in jbench.analysis.stats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import pandas as pd

from jbench.analysis.stats import mann_whitney_u, welch_interval

__all__ = [
    "CompareError",
    "Comparison",
    "compare",
    "rate_metrics",
    "samples_for",
]

CONFIG_HASH = "tags.jbench.config_hash"
BASE_RATES = ("prefill_tps", "decode_tps")
# Tokens-per-joule metric names: `<phase>_tokens_per_joule[_above_idle]` (also `_tokens_per_j`, `_tpj`) or bare.
TPJ_RE = re.compile(r"^metrics\.((?:[a-z0-9]+_)?(?:tokens_per_joule|tokens_per_j|tpj)(?:_above_idle)?)$")

Samples = Mapping[str, Mapping[str, Sequence[float]]]
SamplesArg = Union[None, Samples, Mapping[str, Sequence[float]], Callable[[list[str], str], Mapping[str, Sequence[float]]]]


class CompareError(ValueError):
    """The two selections cannot be compared; the message says why."""


# --------------------------------------------------------------------------------------------
# Samples out of run tables


def normalize_samples(samples: SamplesArg) -> Union[Samples, Callable]:
    """{stepped metric: {run_id: values}}; a flat {run_id: values} is decode_tps_rep; callables pass."""
    if samples is None:
        return {}
    if callable(samples) and not isinstance(samples, Mapping):
        return samples
    if not samples:
        return {}
    first = next(iter(samples.values()))
    if isinstance(first, Mapping):
        return samples  # type: ignore[return-value]
    return {"decode_tps_rep": samples}  # type: ignore[dict-item]


def rate_metrics(*frames: pd.DataFrame) -> list[str]:
    """The rates to compare: prefill_tps and decode_tps, then tokens-per-joule metrics, each when
    some run in every given frame has it."""
    def present(name: str) -> bool:
        col = f"metrics.{name}"
        return all(col in f.columns and f[col].notna().any() for f in frames)

    names = [m for m in BASE_RATES if present(m)]
    tpj = sorted({m.group(1) for f in frames for c in f.columns if (m := TPJ_RE.match(c))})
    return names + [m for m in tpj if present(m)]


def finished_trials(df: pd.DataFrame) -> pd.DataFrame:
    """FINISHED trial rows that carry a config hash."""
    if df is None or df.empty or CONFIG_HASH not in df.columns:
        return df.iloc[0:0] if df is not None else pd.DataFrame()
    keep = df[CONFIG_HASH].notna()
    if "status" in df.columns:
        keep &= df["status"] == "FINISHED"
    if "tags.jbench.kind" in df.columns:
        keep &= df["tags.jbench.kind"].fillna("trial") == "trial"
    return df[keep]


def samples_for(rows: pd.DataFrame, metric: str, samples: SamplesArg) -> tuple[list[float], str]:
    """Pooled samples of a rate over the given runs, and their kind ("repetitions" or "runs").

    Repetition series (`<metric>_rep`) where recorded for these runs; else the per-run metric values."""
    norm = normalize_samples(samples)
    ids = list(rows["run_id"]) if "run_id" in rows.columns else []
    stepped = f"{metric}_rep"
    if callable(norm):
        series = norm(ids, stepped) if ids else {}
    else:
        series = norm.get(stepped, {})
    pooled: list[float] = []
    for run_id in ids:
        pooled.extend(float(v) for v in series.get(run_id, ()) if v is not None and math.isfinite(float(v)))
    if pooled:
        return pooled, "repetitions"
    col = f"metrics.{metric}"
    if col not in rows.columns:
        return [], "runs"
    values = pd.to_numeric(rows[col], errors="coerce").dropna()
    return [float(v) for v in values if math.isfinite(v)], "runs"


def config_label(rows: pd.DataFrame) -> str:
    """A readable name for a configuration: the newest run's trial label, with its device."""
    last = rows.iloc[-1]
    label = last.get("tags.jbench.trial_label") if "tags.jbench.trial_label" in rows.columns else None
    if not isinstance(label, str) or not label:
        quant = last.get("tags.model.quant") if "tags.model.quant" in rows.columns else None
        label = f"model.quant={quant}" if isinstance(quant, str) else "(config)"
    return label


def _device(rows: pd.DataFrame) -> str:
    if "tags.device.name" in rows.columns:
        v = rows["tags.device.name"].dropna()
        if len(v):
            return str(v.iloc[-1])
    return ""


# --------------------------------------------------------------------------------------------
# Compare


@dataclass
class Comparison:
    table: pd.DataFrame  # one row per (configuration, rate); columns in TABLE_COLUMNS
    only_in_a: list[str] = field(default_factory=list)  # config hashes
    only_in_b: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    confidence: float = 0.95
    alpha: float = 0.05

    TABLE_COLUMNS = ("config_hash", "device", "label", "metric", "samples", "n_a", "n_b", "mean_a", "mean_b",
                     "change_pct", "ci_low_pct", "ci_high_pct", "p_value", "test", "significant")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (NaN -> None)."""
        rows = []
        for rec in self.table.to_dict(orient="records"):
            rows.append({k: _jsonable(v) for k, v in rec.items()})
        return {
            "confidence": self.confidence,
            "alpha": self.alpha,
            "interval": "Welch t interval on mean_b - mean_a, in % of mean_a",
            "test": "two-sided Mann-Whitney U on pooled repetition samples",
            "metrics": list(self.metrics),
            "rows": rows,
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
        }

    def to_markdown(self) -> str:
        lines = [f"| configuration | device | rate | n A | n B | mean A | mean B | change | "
                 f"{self.confidence:.0%} CI | p (MWU) |",
                 "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
        for r in self.table.itertuples(index=False):
            ci = "n/a" if math.isnan(r.ci_low_pct) else f"[{r.ci_low_pct:+.2f} %, {r.ci_high_pct:+.2f} %]"
            mark = " *" if r.significant else ""
            lines.append(
                f"| {r.label} `{r.config_hash}` | {r.device} | {r.metric} | {r.n_a} | {r.n_b} | {_fmt(r.mean_a)} | "
                f"{_fmt(r.mean_b)} | {_pct(r.change_pct)}{mark} | {ci} | {_fmt_p(r.p_value)} |")
        notes = [f"\n\\* p < {self.alpha}. Samples: per-repetition rates pooled over a configuration's runs "
                 "(`runs`: one value per run where no repetition series exists)."]
        if self.only_in_a:
            notes.append(f"Only in A (not compared): {', '.join(self.only_in_a)}")
        if self.only_in_b:
            notes.append(f"Only in B (not compared): {', '.join(self.only_in_b)}")
        return "\n".join(lines + notes) + "\n"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, float)):
        return None if not math.isfinite(float(v)) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def _fmt(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _pct(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:+.2f} %"


def _fmt_p(p: float) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def compare(
    a: pd.DataFrame,
    b: pd.DataFrame,
    samples: SamplesArg = None,
    *,
    metrics: Optional[Sequence[str]] = None,
    confidence: float = 0.95,
    alpha: float = 0.05,
) -> Comparison:
    """Per configuration in both A and B and per rate, B's change against A (see the module doc).

    Raises CompareError when a selection has no finished trial runs or when A and B have no
    configuration in common.
    """
    ta, tb = finished_trials(a), finished_trials(b)
    if ta.empty:
        raise CompareError("selection A has no finished trial runs with a jbench.config_hash")
    if tb.empty:
        raise CompareError("selection B has no finished trial runs with a jbench.config_hash")
    ha, hb = set(ta[CONFIG_HASH]), set(tb[CONFIG_HASH])
    common = ha & hb
    if not common:
        raise CompareError(
            f"no configuration in common between A and B (A has {len(ha)} configuration(s), B has {len(hb)}); "
            "compare selections that ran the same configurations (same device, backend settings, model and quant)")
    names = list(metrics) if metrics is not None else rate_metrics(ta, tb)
    samples = normalize_samples(samples)
    if callable(samples):  # a loader: ask once per rate for every run of both selections
        ids = list(dict.fromkeys([*ta["run_id"], *tb["run_id"]]))
        samples = {f"{m}_rep": dict(samples(ids, f"{m}_rep")) for m in names}
    order = list(dict.fromkeys(h for h in ta[CONFIG_HASH] if h in common))
    records = []
    for h in order:
        ra, rb = ta[ta[CONFIG_HASH] == h], tb[tb[CONFIG_HASH] == h]
        label, device = config_label(rb), _device(rb) or _device(ra)
        for m in names:
            xa, kind_a = samples_for(ra, m, samples)
            xb, kind_b = samples_for(rb, m, samples)
            if not xa and not xb:
                continue
            mean_a = float(np.mean(xa)) if xa else math.nan
            mean_b = float(np.mean(xb)) if xb else math.nan
            wi = welch_interval(xa, xb, confidence)
            scale = 100.0 / mean_a if xa and mean_a else math.nan
            mw = mann_whitney_u(xb, xa)
            records.append({
                "config_hash": h, "device": device, "label": label, "metric": m,
                "samples": kind_a if kind_a == kind_b else f"{kind_a}/{kind_b}",
                "n_a": len(xa), "n_b": len(xb), "mean_a": mean_a, "mean_b": mean_b,
                "change_pct": (mean_b - mean_a) * scale,
                "ci_low_pct": wi.low * scale, "ci_high_pct": wi.high * scale,
                "p_value": mw.p_value, "test": mw.method,
                "significant": bool(math.isfinite(mw.p_value) and mw.p_value < alpha),
            })
    table = pd.DataFrame.from_records(records, columns=list(Comparison.TABLE_COLUMNS))
    return Comparison(table, sorted(ha - hb), sorted(hb - ha), names, confidence, alpha)
