"""Regression gate: each configuration's newest sweep against its baseline history (pure).

Input: a run table from `jbench.tracking.runs_frame` (trial runs; add sweep runs with
kinds=("trial", "sweep") when the baseline tag sits on sweep parent runs) and the repetition samples
of its runs (a mapping {stepped metric: {run_id: values}}, or a callable (run_ids, stepped metric) ->
{run_id: values} so that only the runs under test are read).

For each (device, config hash) over FINISHED trial runs, where the device is the physical unit (tag
device.unit, set by a sweep over a device class: units of one class differ, so each is its own history)
or else the device entry (device.name):
  * now: the newest sweep of that configuration (sweeps ordered by their first run's start time),
    or the sweep(s) named by `current`;
  * baseline (`baseline=`):
      'last'          the sweep of that configuration just before `now`;
      'all'           every earlier sweep of that configuration;
      TAG             runs tagged jbench.baseline=TAG (on the trial run or on its sweep's parent run);
      SWEEP_ID        that sweep's runs;
      DATE            (YYYY-MM-DD[...], naive = UTC) every run of the configuration started before it;
    the `now` sweep is never part of its own baseline.
  * per rate (default decode_tps and prefill_tps), samples pooled over runs (`compare.samples_for`):
      change     = (mean_now - mean_base) / mean_base
      noise      = CV of the pooled baseline samples (sample std / mean): the configuration's
                   measured noise, between-sweep drift included when the baseline spans sweeps
      threshold  = max(min_change (3 %), noise_factor (3) x noise)
      p          = two-sided Mann-Whitney U, now vs baseline
      regression  when p < alpha (0.01) and change < -threshold;
      improvement when p < alpha and change > +threshold; else no change.
    A side with fewer than min_samples (3) samples, or sample sizes whose smallest attainable
    p-value is not below alpha (e.g. 4 vs 4 repetitions: 2/70), is "insufficient data", never a pass.
  * fingerprint: tags jetson.jetpack, jetson.l4t, backend.build_commit, model.sha256, host.kernel,
    jbench.protocol_version of the
    newest baseline run vs the newest run now; any difference is reported as
    "fingerprint changed: <tag> <old> -> <new>". A difference of the environment (every tag but the backend
    build, CODE_TAGS) gives the configuration status 'changed-environment' instead of
    regression/improvement/pass: the change is not blamed on code. A new backend build alone is the code under
    test: the configuration is judged as usual, with the build change shown as the suspect.

Configuration status (first that applies): insufficient-data (no rate testable), changed-environment,
regression (any rate), insufficient-data (some rate untestable), improvement, pass.
Exit code: 1 when any configuration has status 'regression'; else 3 ("no verdict") when any
configuration is insufficient-data or there is none to check (an untested configuration must not
turn a CI job green); else 0.
With many configurations, alpha = 0.01 alone would flag about 1 in 100 stable ones; the effect-size
floor (3 % and 3x noise) is what keeps the false-positive rate on noise near zero.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import pandas as pd

from jbench.analysis.compare import (
    CONFIG_HASH,
    SamplesArg,
    _fmt,
    _fmt_p,
    _jsonable,
    finished_trials,
    normalize_samples,
)
from jbench.analysis.stats import describe, mann_whitney_u, min_attainable_p
from jbench.core.exitcodes import ExitCode

__all__ = ["FINGERPRINT_TAGS", "CODE_TAGS", "environment_changes", "MetricCheck", "ConfigResult", "NoData",
           "RegressError", "RegressReport", "regress"]


# jbench.protocol_version: a change of the measurement protocol (jbench.core.protocol) changes what a figure means;
# at a change point it is reported as a changed environment, never blamed on the code.
FINGERPRINT_TAGS = ("jetson.jetpack", "jetson.l4t", "backend.build_commit", "model.sha256", "host.kernel",
                    "jbench.protocol_version")
# The code under test: a difference here is reported as the suspect, and the change is still judged (it is what a
# nightly exists to catch). Every other fingerprint tag is the environment, which a change is never blamed on.
CODE_TAGS = ("backend.build_commit",)


def environment_changes(changes: Sequence[str]) -> list[str]:
    """The fingerprint differences ("<tag> <old> -> <new>...") that are not the code under test."""
    return [c for c in changes if c.split(" ", 1)[0] not in CODE_TAGS]
DEFAULT_METRICS = ("decode_tps", "prefill_tps")

PASS = "pass"
REGRESSION = "regression"
IMPROVEMENT = "improvement"
INSUFFICIENT = "insufficient-data"
CHANGED_ENV = "changed-environment"
NO_CHANGE = "no change"

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}")
SWEEP = "tags.jbench.sweep_id"
DEVICE = "tags.device.name"
UNIT = "tags.device.unit"  # the unit that ran a class sweep's trial (its device.name is the class)
BASELINE_TAG = "tags.jbench.baseline"


class RegressError(ValueError):
    """The regression check cannot run as asked; the message says why."""


class NoData(RegressError):
    """Nothing to test (no finished trial runs): no verdict, not a user error."""


@dataclass(frozen=True)
class MetricCheck:
    metric: str
    verdict: str  # regression | improvement | no change | insufficient-data
    n_base: int
    n_now: int
    mean_base: float
    mean_now: float
    change: float  # relative: (now - base) / base
    noise_cv: float
    threshold: float  # relative change needed (besides p < alpha)
    p_value: float
    reason: str = ""  # why the data is insufficient


@dataclass
class ConfigResult:
    device: str
    config_hash: str
    label: str
    status: str
    now_sweep: str
    baseline_sweeps: list[str]
    checks: list[MetricCheck]
    fingerprint_changes: list[str] = field(default_factory=list)
    note: str = ""
    confirmed: Optional[bool] = None  # set by a confirmation (jbench.confirm); False clears the regression
    confirmation: str = ""  # what the confirmation measured, or why it did not run

    @property
    def counts_as_regression(self) -> bool:
        return self.status == REGRESSION and self.confirmed is not False

    @property
    def message(self) -> str:
        parts = []
        for c in self.checks:
            if c.verdict == INSUFFICIENT:
                parts.append(f"{c.metric}: insufficient data ({c.reason})")
            else:
                parts.append(f"{c.metric}: {c.verdict}, {c.change * 100:+.2f} % "
                             f"({_fmt(c.mean_base)} -> {_fmt(c.mean_now)} tok/s, p={_fmt_p(c.p_value)}, "
                             f"threshold {c.threshold * 100:.1f} %, noise CV {c.noise_cv * 100:.2f} %)")
        if self.fingerprint_changes:
            parts.append("fingerprint changed: " + "; ".join(self.fingerprint_changes))
        if self.note:
            parts.append(self.note)
        if self.confirmation:
            parts.append("confirmation: " + self.confirmation)
        return "; ".join(parts)


@dataclass
class RegressReport:
    results: list[ConfigResult]
    baseline: str
    alpha: float
    min_change: float
    noise_factor: float

    @property
    def exit_code(self) -> int:
        if any(r.counts_as_regression for r in self.results):
            return ExitCode.FAILED
        if not self.results or any(r.status == INSUFFICIENT for r in self.results):
            return ExitCode.NO_VERDICT
        return 0

    @property
    def verdict_reason(self) -> str:
        """Why there is no verdict ("" when there is one)."""
        if self.exit_code != ExitCode.NO_VERDICT:
            return ""
        if not self.results:
            return "no configuration to check"
        untested = [r for r in self.results if r.status == INSUFFICIENT]
        reasons = sorted({c.reason for r in untested for c in r.checks if c.verdict == INSUFFICIENT and c.reason})
        return (f"insufficient data for {len(untested)} of {len(self.results)} configuration(s): "
                + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def alarms(self) -> list[ConfigResult]:
        """The regressions a confirmation step would re-measure."""
        return [r for r in self.results if r.status == REGRESSION]

    @property
    def table(self) -> pd.DataFrame:
        rows = []
        for r in self.results:
            for c in r.checks:
                rows.append({"device": r.device, "config_hash": r.config_hash, "label": r.label, "status": r.status,
                             "metric": c.metric, "verdict": c.verdict, "n_base": c.n_base, "n_now": c.n_now,
                             "mean_base": c.mean_base, "mean_now": c.mean_now, "change_pct": c.change * 100,
                             "threshold_pct": c.threshold * 100, "noise_cv_pct": c.noise_cv * 100,
                             "p_value": c.p_value, "now_sweep": r.now_sweep,
                             "baseline_sweeps": ",".join(r.baseline_sweeps),
                             "fingerprint_changes": "; ".join(r.fingerprint_changes), "reason": c.reason})
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "rule": {"alpha": self.alpha, "min_change": self.min_change, "noise_factor": self.noise_factor},
            "exit_code": self.exit_code,
            "verdict": {ExitCode.FAILED: "regression", ExitCode.NO_VERDICT: "no verdict"}.get(self.exit_code, "pass"),
            "no_verdict_reason": self.verdict_reason,
            "counts": self.counts(),
            "configurations": [
                {"device": r.device, "config_hash": r.config_hash, "label": r.label, "status": r.status,
                 "now_sweep": r.now_sweep, "baseline_sweeps": r.baseline_sweeps,
                 "fingerprint_changes": r.fingerprint_changes, "message": r.message,
                 "confirmed": r.confirmed, "confirmation": r.confirmation,
                 "checks": [{k: _jsonable(v) for k, v in c.__dict__.items()} for c in r.checks]}
                for r in self.results
            ],
        }

    def to_markdown(self) -> str:
        counts = self.counts()
        head = {ExitCode.FAILED: "FAIL: performance regression",
                ExitCode.NO_VERDICT: f"NO VERDICT: {self.verdict_reason}"}.get(self.exit_code, "OK: no regression")
        lines = [
            f"# jbench regress: {head}",
            "",
            f"Baseline: `{self.baseline}`. Rule: regression when p < {self.alpha} (two-sided Mann-Whitney U on "
            f"repetition samples) and the drop exceeds max({self.min_change:.0%}, {self.noise_factor:g} x the "
            "configuration's noise CV).",
            "",
            "Configurations: " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"),
            "",
            "| status | device | configuration | rate | baseline | now | change | threshold | p | note |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        order = {REGRESSION: 0, CHANGED_ENV: 1, INSUFFICIENT: 2, IMPROVEMENT: 3, PASS: 4}
        for r in sorted(self.results, key=lambda r: (order.get(r.status, 9), r.device, r.label)):
            fp = ("fingerprint changed: " + "; ".join(r.fingerprint_changes)) if r.fingerprint_changes else ""
            for i, c in enumerate(r.checks):
                note = c.reason if c.verdict == INSUFFICIENT else c.verdict
                if i == 0 and fp:
                    note = f"{note}; {fp}" if note else fp
                if i == 0 and r.note:
                    note = f"{note}; {r.note}"
                if i == 0 and r.confirmation:
                    note = f"{note}; confirmation: {r.confirmation}"
                change = "n/a" if not math.isfinite(c.change) else f"{c.change * 100:+.2f} %"
                lines.append(
                    f"| {r.status if i == 0 else ''} | {r.device if i == 0 else ''} | "
                    f"{(r.label + ' `' + r.config_hash + '`') if i == 0 else ''} | {c.metric} | "
                    f"{_fmt(c.mean_base)} (n={c.n_base}) | {_fmt(c.mean_now)} (n={c.n_now}) | {change} | "
                    f"{c.threshold * 100:.1f} % | {_fmt_p(c.p_value)} | {note} |")
        return "\n".join(lines) + "\n"

    def to_junit_xml(self, suite_name: str = "jbench.regress", *, per_metric: bool = False) -> str:
        """JUnit XML: one <testcase> per configuration (per_metric: per configuration and rate); <failure> on
        regression, <skipped> on insufficient data; changed-environment and improvement pass with the details in
        <system-out>. A rate's case fails only when its configuration's status is regression (a drop beside a
        fingerprint change is not blamed on code)."""
        cases = []  # (classname, name, "failure" | "skipped" | "", message, system-out)
        for r in self.results:
            classname = f"{suite_name}.{r.device or 'device'}"
            if not per_metric:
                kind = ("failure" if r.counts_as_regression
                        else "skipped" if r.status == INSUFFICIENT else "")
                message = _first_line(r, REGRESSION) if kind == "failure" else "insufficient data: " + r.message
                cases.append((classname, f"{r.label} [{r.config_hash}]", kind, message,
                              f"status: {r.status}\n{r.message}\n"))
                continue
            for c in r.checks:
                one = ConfigResult(r.device, r.config_hash, r.label, r.status, r.now_sweep, r.baseline_sweeps, [c],
                                   r.fingerprint_changes, r.note, r.confirmed, r.confirmation)
                kind = ("failure" if c.verdict == REGRESSION and r.counts_as_regression
                        else "skipped" if c.verdict == INSUFFICIENT else "")
                message = _first_line(one, REGRESSION) if kind == "failure" else "insufficient data: " + c.reason
                cases.append((classname, f"{r.label} [{r.config_hash}] {c.metric}", kind, message,
                              f"configuration status: {r.status}\n{one.message}\n"))
        suite = ET.Element("testsuite", name=suite_name, tests=str(len(cases)),
                           failures=str(sum(c[2] == "failure" for c in cases)), errors="0",
                           skipped=str(sum(c[2] == "skipped" for c in cases)))
        props = ET.SubElement(suite, "properties")
        for k, v in (("baseline", self.baseline), ("alpha", self.alpha), ("min_change", self.min_change),
                     ("noise_factor", self.noise_factor)):
            ET.SubElement(props, "property", name=k, value=str(v))
        for classname, name, kind, message, out in cases:
            case = ET.SubElement(suite, "testcase", classname=classname, name=name)
            if kind == "failure":
                ET.SubElement(case, "failure", message=message, type="regression").text = out.split("\n", 1)[1]
            elif kind == "skipped":
                ET.SubElement(case, "skipped", message=message)
            ET.SubElement(case, "system-out").text = out
        ET.indent(suite)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def _first_line(r: ConfigResult, verdict: str) -> str:
    for c in r.checks:
        if c.verdict == verdict:
            return f"{c.metric} {c.change * 100:+.2f} % (p={_fmt_p(c.p_value)}, threshold {c.threshold * 100:.1f} %)"
    return verdict


# --------------------------------------------------------------------------------------------


def check_metric(base: Sequence[float], now: Sequence[float], metric: str, *, alpha: float = 0.01,
                 min_change: float = 0.03, noise_factor: float = 3.0, min_samples: int = 3) -> MetricCheck:
    """The rule of the module doc for one rate (higher is better)."""
    nb, nn = len(base), len(now)
    base_stats = describe(list(base))
    mb, mn, cv = base_stats.mean, describe(list(now)).mean, base_stats.cv
    threshold = max(min_change, noise_factor * cv) if math.isfinite(cv) else min_change
    change = (mn - mb) / mb if nb and nn and mb else math.nan
    reason = ""
    if nb == 0:
        reason = "no baseline runs"
    elif nn == 0:
        reason = "no samples now"
    elif nb < min_samples or nn < min_samples:
        reason = f"{nb} baseline / {nn} current samples (need >= {min_samples} each)"
    elif min_attainable_p(nb, nn) >= alpha:
        reason = (f"{nb} baseline / {nn} current samples cannot reach p < {alpha} "
                  f"(smallest possible p = {min_attainable_p(nb, nn):.3g})")
    if reason:
        p = mann_whitney_u(now, base).p_value if nb and nn else math.nan
        return MetricCheck(metric, INSUFFICIENT, nb, nn, mb, mn, change, cv, threshold, p, reason)
    p = mann_whitney_u(now, base).p_value
    verdict = NO_CHANGE
    if p < alpha and change < -threshold:
        verdict = REGRESSION
    elif p < alpha and change > threshold:
        verdict = IMPROVEMENT
    return MetricCheck(metric, verdict, nb, nn, mb, mn, change, cv, threshold, p)


def _parse_date(text: str) -> Optional[pd.Timestamp]:
    if not _DATE_RE.match(text):
        return None
    try:
        ts = pd.Timestamp(text)
    except (ValueError, TypeError):
        return None
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def _baseline_kind(df: pd.DataFrame, baseline: str) -> tuple[str, Any]:
    if baseline in ("last", "all"):
        return baseline, None
    if BASELINE_TAG in df.columns and (df[BASELINE_TAG] == baseline).any():
        return "tag", baseline
    if SWEEP in df.columns and (df[SWEEP] == baseline).any():
        return "sweep", baseline
    date = _parse_date(baseline)
    if date is not None:
        return "date", date
    raise RegressError(
        f"baseline '{baseline}' is not 'last', 'all', a jbench.baseline tag value, a sweep id or a date "
        "(YYYY-MM-DD) in the selected runs")


def _fingerprint(row: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Optional[str]]:
    out = {}
    for k in keys:
        v = row.get(f"tags.{k}")
        out[k] = v if isinstance(v, str) and v != "" else None
    return out


def _pooled(rows: list[dict], metric: str, series: Mapping[str, Sequence[float]]) -> list[float]:
    """As compare.samples_for, over row dicts: repetition samples of the runs, else per-run values."""
    out = [float(v) for r in rows for v in series.get(r["run_id"], ()) if v is not None and math.isfinite(float(v))]
    if out:
        return out
    col = f"metrics.{metric}"
    vals = []
    for r in rows:
        v = r.get(col)
        if isinstance(v, (int, float, np.floating)) and math.isfinite(float(v)):
            vals.append(float(v))
    return vals


def _label(rows: list[dict]) -> str:
    last = rows[-1]
    label = last.get("tags.jbench.trial_label")
    if isinstance(label, str) and label:
        return label
    quant = last.get("tags.model.quant")
    return f"model.quant={quant}" if isinstance(quant, str) else "(config)"


def regress(
    df: pd.DataFrame,
    samples: SamplesArg,
    *,
    baseline: str = "last",
    current: Union[None, str, Sequence[str]] = None,
    metrics: Sequence[str] = DEFAULT_METRICS,
    alpha: float = 0.01,
    min_change: float = 0.03,
    noise_factor: float = 3.0,
    min_samples: int = 3,
    fingerprint_tags: Sequence[str] = FINGERPRINT_TAGS,
) -> RegressReport:
    """Check every (device, config hash) of `df` as the module doc describes."""
    trials = finished_trials(df)
    if trials.empty:
        raise NoData("no finished trial runs to check")
    if SWEEP not in trials.columns or trials[SWEEP].isna().all():
        raise RegressError("the runs carry no jbench.sweep_id tag")
    kind, value = _baseline_kind(df, baseline)
    tagged_sweeps: set[str] = set()
    if kind == "tag" and "tags.jbench.kind" in df.columns and SWEEP in df.columns:
        parents = df[(df["tags.jbench.kind"] == "sweep") & (df[BASELINE_TAG] == value)]
        tagged_sweeps = set(parents[SWEEP].dropna())
    current_ids = None if current is None else ({current} if isinstance(current, str) else set(current))

    # Plain row dicts from here: per-configuration pandas slicing of a 10,000-run table is what costs.
    keep = ["run_id", "start_time", SWEEP, DEVICE, UNIT, CONFIG_HASH, BASELINE_TAG, "tags.jbench.trial_label",
            "tags.model.quant", *(f"tags.{k}" for k in fingerprint_tags), *(f"metrics.{m}" for m in metrics)]
    trials = trials.loc[trials[SWEEP].notna(), [c for c in dict.fromkeys(keep) if c in trials.columns]]
    trials = trials.sort_values(["start_time", "run_id"], kind="stable")
    by_config: dict[tuple[str, str], list[dict]] = {}
    for rec in trials.to_dict("records"):
        unit, device = rec.get(UNIT), rec.get(DEVICE)
        device = unit if isinstance(unit, str) and unit else device if isinstance(device, str) else ""
        by_config.setdefault((device, rec[CONFIG_HASH]), []).append(rec)

    groups = []
    for (device, h), rows in by_config.items():
        sweep_start: dict[str, Any] = {}
        for r in rows:  # rows are in start order, so a sweep's first row is its start
            sweep_start.setdefault(r[SWEEP], r["start_time"])
        order = list(sweep_start)
        if current_ids is not None:
            now_sweeps = [s for s in order if s in current_ids]
            if not now_sweeps:
                continue
        else:
            now_sweeps = [order[-1]]
        now_set = set(now_sweeps)
        now_rows = [r for r in rows if r[SWEEP] in now_set]
        rest = [r for r in rows if r[SWEEP] not in now_set]
        earlier = order[: order.index(now_sweeps[0])]
        if kind == "last":
            base_rows = [r for r in rest if earlier and r[SWEEP] == earlier[-1]]
        elif kind == "all":
            ok = set(earlier)
            base_rows = [r for r in rest if r[SWEEP] in ok]
        elif kind == "tag":
            base_rows = [r for r in rest if r[SWEEP] in tagged_sweeps or r.get(BASELINE_TAG) == value]
        elif kind == "sweep":
            base_rows = [r for r in rest if r[SWEEP] == value]
        else:  # date
            base_rows = [r for r in rest if r["start_time"] < value]
        groups.append((device, h, rows, now_sweeps, now_rows, base_rows))

    # Read only the samples of the runs under test (a callable loader is asked once per metric).
    norm = normalize_samples(samples)
    if callable(norm):
        needed = list(dict.fromkeys(r["run_id"] for g in groups for part in (g[4], g[5]) for r in part))
        norm = {f"{m}_rep": dict(norm(needed, f"{m}_rep")) if needed else {} for m in metrics}

    results = []
    for device, h, rows, now_sweeps, now_rows, base_rows in groups:
        checks = []
        for m in metrics:
            series = norm.get(f"{m}_rep", {})
            checks.append(check_metric(_pooled(base_rows, m, series), _pooled(now_rows, m, series), m, alpha=alpha,
                                       min_change=min_change, noise_factor=noise_factor, min_samples=min_samples))
        changes = []
        if base_rows:
            fb = _fingerprint(base_rows[-1], fingerprint_tags)
            fn = _fingerprint(now_rows[-1], fingerprint_tags)
            changes = [f"{k} {fb[k] or '(none)'} -> {fn[k] or '(none)'}" for k in fingerprint_tags if fb[k] != fn[k]]
        verdicts = [c.verdict for c in checks]
        if all(v == INSUFFICIENT for v in verdicts):
            status = INSUFFICIENT
        elif environment_changes(changes):
            status = CHANGED_ENV
        elif REGRESSION in verdicts:
            status = REGRESSION
        elif INSUFFICIENT in verdicts:
            status = INSUFFICIENT
        elif IMPROVEMENT in verdicts:
            status = IMPROVEMENT
        else:
            status = PASS
        note = ""
        if status == CHANGED_ENV and any(v in (REGRESSION, IMPROVEMENT) for v in verdicts):
            note = "the change coincides with a fingerprint change: not attributed to code"
        elif changes and status in (REGRESSION, IMPROVEMENT):
            note = "the backend build changed with it: the build is the suspect (`jbench bisect` finds the commit)"
        results.append(ConfigResult(
            device=device, config_hash=str(h), label=_label(rows), status=status,
            now_sweep=",".join(now_sweeps), baseline_sweeps=list(dict.fromkeys(r[SWEEP] for r in base_rows)),
            checks=checks, fingerprint_changes=changes, note=note))
    return RegressReport(results, baseline, alpha, min_change, noise_factor)
