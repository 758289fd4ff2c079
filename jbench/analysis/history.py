"""Regression detection over a nightly history (pure): change points per configuration x unit x metric.

Input: a run table from `jbench.tracking.runs_frame` (trial runs of one experiment, every night's sweep).

Series. For each unit (tag device.unit, set by a class sweep; else device.name) and configuration identity
(jbench.config_hash), one point per night: the mean of the metric over that sweep's FINISHED runs of the
configuration (`sweep.rounds` gives several), nights ordered by the sweep's start (its first run). Metrics
(`METRICS`): decode_tps, prefill_tps, decode_tokens_per_joule (higher is better) and ttft_ms_p50 (lower is
better); a metric a configuration never measured has no series (no verdict is expected of it).

Detection (`detect_changes`), like Apache Otava's E-divisive + t-test, with ruptures as the change-point search:
  1. the series is scaled by its noise: sigma from the median absolute deviation of night-to-night differences
     (a step moves one difference only, so it barely inflates sigma);
  2. `ruptures.Pelt` (l2 cost, `min_size` nights per segment) with penalty `penalty x log(n)` proposes
     candidate change points, over the newest `window` nights (60: the verdict is about the newest nights);
  3. each candidate is tested between the segments around it: two-sample t (`test`: "student" pools the two
     segments' variances, as Otava does; "welch" does not) on the nightly points, giving p, the relative effect
     (mean_after - mean_before) / mean_before and its 95 % confidence interval. A candidate stands when
     p < alpha and |effect| >= min_effect; the weakest failing candidate is dropped and its neighbours retested
     until every remaining one stands;
  4. at a standing change the fingerprints of the nights around it are compared (`FINGERPRINT_TAGS`: JetPack,
     L4T, kernel, backend build commit, model file hash, the power state read back); a difference of the
     environment (every tag but the backend build) makes the change "changed-environment": reported, not blamed
     on code. A new backend build alone is the code under test: the change is judged, with the build as suspect.
The settings (`DetectorSettings`, defaults `DEFAULT_SETTINGS`) were chosen with bench/regress_sensitivity.py on
simulated histories with the noise jbench measures (docs/regress.md, docs/PERFORMANCE.md).

Verdict per configuration x unit x metric (`verdict`):
  no verdict      fewer than `min_nights` nights (the result says how many more are needed);
  regression / improvement / changed-environment
                  the newest standing change starts within the newest `recent` nights (direction from the metric:
                  a TTFT increase is a regression);
  no change       otherwise -- unless an earlier standing change was never reported (`Reported`, read from what
                  earlier nightlies recorded in the store): a change that became significant only after it left the
                  newest `recent` nights is then reported once, with its first night (`SeriesResult.late`), so a
                  late detection is never "no change" forever.
Exit code (`HistoryReport.exit_code`): 1 when any series is a regression; else 3 when any series has no
verdict, or there is none; else 0 -- the codes of `jbench regress` (jbench.analysis.regress).

The confirmation step (jbench.confirm, run by `jbench nightly`: the previous and the new build re-measured
interleaved) takes the regressions from `HistoryReport.alarms()` and sets `SeriesResult.confirmed` (False clears
the alarm from the exit code, the JUnit failures and the regressed units) without touching detection.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import numpy as np
import pandas as pd

from jbench.analysis.compare import CONFIG_HASH, _fmt, _fmt_p, _jsonable, finished_trials
from jbench.analysis.regress import FINGERPRINT_TAGS as PAIRWISE_FINGERPRINT
from jbench.analysis.regress import environment_changes
from jbench.analysis.stats import t_ppf
from jbench.core.exitcodes import ExitCode
from jbench.core.metrics import metric as declared_metric

__all__ = ["METRICS", "FINGERPRINT_TAGS", "DetectorSettings", "DEFAULT_SETTINGS", "Night", "Series", "Change",
           "SeriesResult", "HistoryReport", "HistoryError", "build_series", "detect_changes", "judge", "history",
           "ChangeKey", "Reported", "reported_changes", "judge_series",
           "REGRESSION", "IMPROVEMENT", "NO_CHANGE", "NO_VERDICT", "CHANGED_ENV"]

# The series judged, each metric -> +1 when higher is better, -1 when lower is; direction and unit as declared.
METRICS: dict[str, int] = {m: declared_metric(m).sign
                           for m in ("decode_tps", "prefill_tps", "ttft_ms_p50", "decode_tokens_per_joule")}
UNITS = {m: declared_metric(m).unit for m in METRICS}
# What a night's environment is: the pairwise gate's fingerprint plus the power state read back from the device.
FINGERPRINT_TAGS = (*PAIRWISE_FINGERPRINT, "power.mode_actual", "power.jetson_clocks_actual")

REGRESSION = "regression"
IMPROVEMENT = "improvement"
NO_CHANGE = "no change"
NO_VERDICT = "no verdict"
CHANGED_ENV = "changed-environment"

SWEEP = "tags.jbench.sweep_id"
DEVICE = "tags.device.name"
UNIT = "tags.device.unit"


class HistoryError(ValueError):
    """The history cannot be read as asked; the message says why."""


@dataclass(frozen=True)
class DetectorSettings:
    penalty: float = 2.0  # PELT penalty per change point, x log(n), on the noise-scaled series
    min_size: int = 2  # nights per segment (the newest level must last this long to be seen)
    alpha: float = 0.001  # t-test significance for a change to stand
    min_effect: float = 0.01  # |relative effect| below this is no change, however significant
    recent: int = 3  # a change starting within the newest `recent` nights decides the verdict
    min_nights: int = 8  # fewer nights: no verdict
    test: str = "student"  # "student" (pooled variance, as Otava) | "welch"
    window: int = 60  # only the newest nights are searched: older ones add cost (PELT is O(n^2)), not power


    def __post_init__(self) -> None:
        if self.test not in ("student", "welch"):
            raise HistoryError(f"test '{self.test}' is not 'student' or 'welch'")
        if self.min_size < 1 or self.recent < 1 or self.min_nights < 2 * self.min_size or self.window < self.min_nights:
            raise HistoryError("min_size >= 1, recent >= 1, min_nights >= 2 x min_size and window >= min_nights "
                               "are needed")


DEFAULT_SETTINGS = DetectorSettings()


@dataclass(frozen=True)
class Night:
    sweep_id: str
    start: pd.Timestamp
    value: float
    n_runs: int
    fingerprint: Mapping[str, Optional[str]] = field(default_factory=dict)

    @property
    def date(self) -> str:
        return self.start.strftime("%Y-%m-%d") if isinstance(self.start, pd.Timestamp) else str(self.start)


@dataclass
class Series:
    unit: str
    config_hash: str
    label: str
    metric: str
    nights: list[Night]

    @property
    def direction(self) -> int:
        return METRICS.get(self.metric, 1)

    @property
    def values(self) -> np.ndarray:
        return np.array([n.value for n in self.nights], dtype=float)


@dataclass(frozen=True)
class Change:
    index: int  # the first night of the new level
    n_before: int
    n_after: int
    mean_before: float
    mean_after: float
    effect: float  # relative: (after - before) / before
    ci_low: float  # 95 % interval of the relative effect
    ci_high: float
    p_value: float
    direction: str  # regression | improvement (the metric's better side taken into account)
    sweep_id: str = ""
    date: str = ""
    fingerprint_changes: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return CHANGED_ENV if environment_changes(self.fingerprint_changes) else self.direction

    def describe(self, unit: str = "") -> str:
        where = f"from night {self.index + 1}" + (f" ({self.sweep_id}, {self.date})" if self.sweep_id else "")
        text = (f"{self.kind} {where}: {self.effect * 100:+.2f} % (95 % CI {self.ci_low * 100:+.2f} … "
                f"{self.ci_high * 100:+.2f} %), {_fmt(self.mean_before)} -> {_fmt(self.mean_after)}"
                f"{(' ' + unit) if unit else ''}, p={_fmt_p(self.p_value)}, {self.n_before} vs {self.n_after} nights")
        if self.fingerprint_changes:
            text += "; fingerprint changed: " + "; ".join(self.fingerprint_changes)
            if not environment_changes(self.fingerprint_changes):
                text += " (the build is the suspect: `jbench bisect` finds the commit)"
        return text


# A reported change: (unit, configuration hash, metric, sweep id of its first night).
ChangeKey = tuple[str, str, str, str]


@dataclass(frozen=True)
class Reported:
    """What earlier nights reported, as the store holds it (jbench.sweeps.nightly reads it from the tags of the
    earlier nightly parent runs). `changes`: every change a night reported (a history verdict other than "no change",
    or a pairwise regression / improvement); `judged`: the sweep ids of the nights whose nightly recorded what it
    reported. Only a change whose first night is among `judged` can be reported late: of an older one the store
    cannot say whether it was reported (a store written before the record existed)."""

    changes: frozenset[ChangeKey] = frozenset()
    judged: frozenset[str] = frozenset()

    def covers(self, series: "Series", change: "Change") -> bool:
        """Was `change` (or the same change found a night earlier or later) reported?"""
        near = {n.sweep_id for n in series.nights[max(0, change.index - 1):change.index + 2]}
        return any((series.unit, series.config_hash, series.metric, s) in self.changes for s in near)


@dataclass
class SeriesResult:
    series: Series
    verdict: str
    changes: list[Change]  # every standing change, oldest first
    noise_cv: float  # the nightly points' noise (robust sigma / median)
    needs_nights: int = 0  # with no verdict: how many more nights are needed
    confirmed: Optional[bool] = None  # set by a confirmation step; None: not confirmed either way
    confirmation: str = ""  # what the confirmation step measured, or why it did not run
    late: Optional[Change] = None  # an older change never reported until now: it decides the verdict

    @property
    def deciding(self) -> Optional[Change]:
        """The change behind a regression / improvement / changed-environment verdict."""
        if self.late is not None:
            return self.late
        return self.changes[-1] if self.verdict in (REGRESSION, IMPROVEMENT, CHANGED_ENV) and self.changes else None

    @property
    def message(self) -> str:
        s = self.series
        if self.verdict == NO_VERDICT:
            return (f"no verdict: {len(s.nights)} night(s), needs {self.needs_nights} more "
                    f"(at least {len(s.nights) + self.needs_nights})")
        head = f"{self.verdict}; noise CV {self.noise_cv * 100:.2f} % over {len(s.nights)} nights"
        if self.deciding is not None:
            late = (f"; reported late: found {len(s.nights) - self.late.index} night(s) after it began, no earlier "
                    "night reported it") if self.late is not None else ""
            return self.deciding.describe(UNITS.get(s.metric, "")) + f"; noise CV {self.noise_cv * 100:.2f} %" + late
        older = "; ".join(c.describe(UNITS.get(s.metric, "")) for c in self.changes)
        return head + (f"; earlier: {older}" if older else "")


# --------------------------------------------------------------------------------------------
# Detection on one series of nightly values


def noise_sigma(values: Sequence[float]) -> float:
    """Robust sigma of nightly points: 1.4826 x MAD of consecutive differences / sqrt(2) (a step moves one
    difference only); falls back to the sample std when the MAD is 0."""
    y = np.asarray(values, dtype=float)
    if y.size < 3:
        return float(np.std(y, ddof=1)) if y.size == 2 else math.nan
    d = np.diff(y)
    sigma = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)
    if not sigma > 0:
        sigma = float(np.std(y, ddof=1))
    return sigma


def _t_test(a: np.ndarray, b: np.ndarray, test: str) -> tuple[float, float, float]:
    """(p, half width of the 95 % interval of mean(b) - mean(a), diff) of a two-sample t-test."""
    from jbench.analysis.stats import _scipy_stats

    na, nb = a.size, b.size
    diff = float(b.mean() - a.mean())
    va = float(a.var(ddof=1)) if na > 1 else 0.0
    vb = float(b.var(ddof=1)) if nb > 1 else 0.0
    if test == "student" or na < 2 or nb < 2:
        dof = na + nb - 2
        if dof < 1:
            return math.nan, math.nan, diff
        pooled = ((na - 1) * va + (nb - 1) * vb) / dof
        se = math.sqrt(pooled * (1.0 / na + 1.0 / nb))
    else:
        se2 = va / na + vb / nb
        se = math.sqrt(se2)
        dof = se2 ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1)) if se2 > 0 else math.inf
    if se == 0:  # identical nights on each side
        return (1.0 if diff == 0 else 0.0), 0.0, diff
    p = float(2.0 * _scipy_stats().t.sf(abs(diff) / se, dof))
    return p, t_ppf(0.975, dof) * se, diff


def _candidates(y: np.ndarray, s: DetectorSettings) -> list[int]:
    import ruptures as rpt

    n = y.size
    if n < 2 * s.min_size:
        return []
    sigma = noise_sigma(y)
    scale = sigma if math.isfinite(sigma) and sigma > 0 else max(abs(float(np.median(y))) * 1e-6, 1e-12)
    z = ((y - np.median(y)) / scale).reshape(-1, 1)
    ends = rpt.Pelt(model="l2", min_size=s.min_size, jump=1).fit(z).predict(pen=s.penalty * math.log(n))
    return [int(e) for e in ends[:-1]]


def detect_changes(values: Sequence[float], settings: DetectorSettings = DEFAULT_SETTINGS, *,
                   direction: int = 1) -> list[Change]:
    """The standing changes of one series (module doc, steps 1-3), oldest first; no fingerprints."""
    y = np.asarray(values, dtype=float)
    cps = _candidates(y, settings)
    while cps:
        bounds = [0, *cps, y.size]
        tested = []
        for i, cp in enumerate(cps):
            a, b = y[bounds[i]:cp], y[cp:bounds[i + 2]]
            p, half, diff = _t_test(a, b, settings.test)
            base = float(a.mean())
            effect = diff / base if base else math.nan
            ok = (math.isfinite(p) and p < settings.alpha and math.isfinite(effect)
                  and abs(effect) >= settings.min_effect)
            tested.append((ok, p, cp, a.size, b.size, base, float(b.mean()), effect, half))
        failing = [t for t in tested if not t[0]]
        if not failing:
            out = []
            for _, p, cp, na, nb, base, after, effect, half in tested:
                better = effect * direction > 0
                out.append(Change(cp, na, nb, base, after, effect, (effect - half / abs(base)) if base else math.nan,
                                  (effect + half / abs(base)) if base else math.nan, p,
                                  IMPROVEMENT if better else REGRESSION))
            return out
        weakest = max(failing, key=lambda t: (t[1] if math.isfinite(t[1]) else 2.0))
        cps = [c for c in cps if c != weakest[2]]
    return []


def judge(values: Sequence[float], settings: DetectorSettings = DEFAULT_SETTINGS, *,
          direction: int = 1) -> tuple[str, list[Change], int]:
    """(verdict, standing changes, nights still needed) of one series of nightly values, fingerprints aside."""
    n = len(values)
    if n < settings.min_nights:
        return NO_VERDICT, [], settings.min_nights - n
    off = max(0, n - settings.window)
    changes = [replace(c, index=c.index + off)
               for c in detect_changes(list(values)[off:], settings, direction=direction)]
    if changes and changes[-1].index >= n - settings.recent:
        return changes[-1].direction, changes, 0
    return NO_CHANGE, changes, 0


# --------------------------------------------------------------------------------------------
# Series from a run table


def _fingerprint(row: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Optional[str]]:
    out = {}
    for k in keys:
        v = row.get(f"tags.{k}")
        out[k] = v if isinstance(v, str) and v != "" else None
    return out


def build_series(df: pd.DataFrame, *, metrics: Sequence[str] = tuple(METRICS),
                 current: Union[None, str, Sequence[str]] = None,
                 fingerprint_tags: Sequence[str] = FINGERPRINT_TAGS) -> list[Series]:
    """Nightly series per unit x configuration x metric (module doc). `current`: judge only configurations
    measured in these sweeps, with their history up to the newest of them (the nights after it are left out)."""
    trials = finished_trials(df)
    if trials.empty:
        return []
    if SWEEP not in trials.columns or trials[SWEEP].isna().all():
        raise HistoryError("the runs carry no jbench.sweep_id tag: they were not recorded by a sweep")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise HistoryError(f"unknown metric(s) {', '.join(unknown)}: choose from {', '.join(METRICS)}")
    trials = trials[trials[SWEEP].notna()].sort_values(["start_time", "run_id"], kind="stable")
    sweep_start = trials.groupby(SWEEP, sort=False)["start_time"].min().sort_values(kind="stable")
    order = {s: i for i, s in enumerate(sweep_start.index)}
    current_ids = None if current is None else ({current} if isinstance(current, str) else set(current))
    if current_ids is not None and not current_ids & set(order):
        raise HistoryError(f"sweep(s) {', '.join(sorted(current_ids))} not among the experiment's finished trials")
    last = max((order[s] for s in current_ids if s in order), default=None) if current_ids else None

    keep = ["run_id", "start_time", SWEEP, DEVICE, UNIT, CONFIG_HASH, "tags.jbench.trial_label", "tags.model.quant",
            *(f"tags.{k}" for k in fingerprint_tags), *(f"metrics.{m}" for m in metrics)]
    rows = trials[[c for c in dict.fromkeys(keep) if c in trials.columns]].to_dict("records")
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if last is not None and order[r[SWEEP]] > last:
            continue
        unit, device = r.get(UNIT), r.get(DEVICE)
        key = unit if isinstance(unit, str) and unit else device if isinstance(device, str) else ""
        groups.setdefault((key, str(r[CONFIG_HASH])), []).append(r)

    out = []
    for (unit, h), grows in sorted(groups.items()):
        if current_ids is not None and not any(r[SWEEP] in current_ids for r in grows):
            continue  # not measured tonight: nothing expected of it
        by_night: dict[str, list[dict]] = {}
        for r in grows:
            by_night.setdefault(r[SWEEP], []).append(r)
        nights_order = sorted(by_night, key=lambda s: order[s])
        label = grows[-1].get("tags.jbench.trial_label")
        if not (isinstance(label, str) and label):
            quant = grows[-1].get("tags.model.quant")
            label = f"model.quant={quant}" if isinstance(quant, str) else "(config)"
        for m in metrics:
            col = f"metrics.{m}"
            nights = []
            for s in nights_order:
                vals = [float(r[col]) for r in by_night[s]
                        if isinstance(r.get(col), (int, float, np.floating)) and math.isfinite(float(r[col]))]
                if vals:
                    nights.append(Night(s, sweep_start[s], float(np.mean(vals)), len(vals),
                                        _fingerprint(by_night[s][-1], fingerprint_tags)))
            if nights:
                out.append(Series(unit, h, label, m, nights))
    return out


def _fingerprint_changes(nights: Sequence[Night], index: int) -> tuple[str, ...]:
    """Differences between the night before a change and its first night; the detected night can be one off,
    so the pairs one night either side are looked at when that pair shows none."""
    for i in (index, index - 1, index + 1):
        if 1 <= i < len(nights):
            a, b = nights[i - 1].fingerprint, nights[i].fingerprint
            diff = tuple(f"{k} {a.get(k) or '(none)'} -> {b.get(k) or '(none)'} (night {i + 1}, {nights[i].sweep_id})"
                         for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k))
            if diff:
                return diff
    return ()


def judge_series(series: Series, settings: DetectorSettings = DEFAULT_SETTINGS,
                 reported: Optional[Reported] = None) -> SeriesResult:
    """One series' verdict; with `reported` (what earlier nights reported) an older standing change that was never
    reported decides the verdict instead of "no change" (module doc)."""
    y = series.values
    verdict, changes, needs = judge(y, settings, direction=series.direction)
    sigma = noise_sigma(y)
    med = float(np.median(y)) if y.size else math.nan
    cv = sigma / abs(med) if med and math.isfinite(sigma) else math.nan
    changes = [replace(c, sweep_id=series.nights[c.index].sweep_id, date=series.nights[c.index].date,
                       fingerprint_changes=_fingerprint_changes(series.nights, c.index)) for c in changes]
    if verdict in (REGRESSION, IMPROVEMENT) and changes[-1].kind == CHANGED_ENV:
        verdict = CHANGED_ENV  # the environment changed with it; a new backend build alone is the code under test
    late = None
    if verdict == NO_CHANGE and reported is not None:
        missed = [c for c in changes if series.nights[c.index].sweep_id in reported.judged
                  and not reported.covers(series, c)]
        if missed:  # the newest change no night reported: significant only after it left the newest nights
            late = missed[-1]
            verdict = late.kind
    return SeriesResult(series, verdict, changes, cv, needs, late=late)


def reported_changes(report: Any) -> list[ChangeKey]:
    """The changes a report reports (history: each series' deciding change; pairwise: each rate judged a regression
    or an improvement, its first night the sweep judged), to be recorded with the night and read back as
    `Reported`."""
    out: list[ChangeKey] = []
    if isinstance(report, HistoryReport):
        for r in report.results:
            c = r.deciding
            if c is not None:
                out.append((r.series.unit, r.series.config_hash, r.series.metric, c.sweep_id))
        return out
    for r in getattr(report, "results", []):
        out += [(r.device, r.config_hash, c.metric, r.now_sweep) for c in r.checks
                if c.verdict in (REGRESSION, IMPROVEMENT)]
    return out


@dataclass
class HistoryReport:
    results: list[SeriesResult]
    settings: DetectorSettings

    @property
    def exit_code(self) -> int:
        if any(r.verdict == REGRESSION and r.confirmed is not False for r in self.results):
            return ExitCode.FAILED
        if not self.results or any(r.verdict == NO_VERDICT for r in self.results):
            return ExitCode.NO_VERDICT
        return 0

    def alarms(self) -> list[SeriesResult]:
        """The regressions a confirmation step would re-measure."""
        return [r for r in self.results if r.verdict == REGRESSION]

    @property
    def verdict_reason(self) -> str:
        if self.exit_code != ExitCode.NO_VERDICT:
            return ""
        if not self.results:
            return "no configuration to check"
        nv = [r for r in self.results if r.verdict == NO_VERDICT]
        most = max(r.needs_nights for r in nv)
        return (f"{len(nv)} of {len(self.results)} series have too few nights (need {self.settings.min_nights}; "
                f"up to {most} more night(s) to go)")

    @property
    def regressed_units(self) -> list[str]:
        return sorted({r.series.unit for r in self.alarms() if r.confirmed is not False})

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.verdict] = out.get(r.verdict, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": "history",
            "settings": self.settings.__dict__,
            "exit_code": self.exit_code,
            "verdict": {ExitCode.FAILED: "regression", ExitCode.NO_VERDICT: "no verdict"}.get(self.exit_code, "pass"),
            "no_verdict_reason": self.verdict_reason,
            "counts": self.counts(),
            "series": [{"unit": r.series.unit, "config_hash": r.series.config_hash, "label": r.series.label,
                        "metric": r.series.metric, "verdict": r.verdict, "nights": len(r.series.nights),
                        "needs_nights": r.needs_nights, "noise_cv": _jsonable(r.noise_cv), "message": r.message,
                        "confirmed": r.confirmed, "confirmation": r.confirmation,
                        "reported_late": r.late is not None,
                        "changes": [{k: _jsonable(v) if not isinstance(v, tuple) else list(v)
                                     for k, v in c.__dict__.items()} for c in r.changes]}
                       for r in self.results],
        }

    def to_markdown(self) -> str:
        head = {ExitCode.FAILED: "FAIL: performance regression on " + ", ".join(self.regressed_units),
                ExitCode.NO_VERDICT: f"NO VERDICT: {self.verdict_reason}"}.get(self.exit_code, "OK: no regression")
        s = self.settings
        counts = self.counts()
        lines = [
            f"# jbench regress (history): {head}", "",
            f"Change points (ruptures PELT, penalty {s.penalty:g} x log n, segments of >= {s.min_size} nights) "
            f"tested with a {s.test.capitalize()} t-test between the nights around them: a change stands when p < {s.alpha:g} and "
            f"|effect| >= {s.min_effect:.1%}; it decides the verdict when it starts within the newest {s.recent} "
            f"nights. No verdict under {s.min_nights} nights.", "",
            "Series: " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"), "",
            "| verdict | unit | configuration | metric | nights | newest | noise CV | change | 95 % CI | p | first night | note |",
            "|---|---|---|---|---:|---:|---:|---:|---|---:|---|---|",
        ]
        rank = {REGRESSION: 0, CHANGED_ENV: 1, NO_VERDICT: 2, IMPROVEMENT: 3, NO_CHANGE: 4}
        for r in sorted(self.results, key=lambda r: (rank.get(r.verdict, 9), r.series.unit, r.series.label,
                                                      r.series.metric)):
            se, c = r.series, r.deciding
            newest = _fmt(se.nights[-1].value) if se.nights else "n/a"
            cv = "n/a" if not math.isfinite(r.noise_cv) else f"{r.noise_cv * 100:.2f} %"
            if c is not None:
                change = f"{c.effect * 100:+.2f} %"
                ci = f"{c.ci_low * 100:+.2f} … {c.ci_high * 100:+.2f} %"
                p, first = _fmt_p(c.p_value), f"{c.sweep_id} ({c.date})"
                note = ("fingerprint changed: " + "; ".join(c.fingerprint_changes)) if c.fingerprint_changes else ""
                if r.late is not None:
                    note = (f"reported late: found {len(se.nights) - c.index} night(s) after it began"
                            + (f"; {note}" if note else ""))
            else:
                change = ci = p = first = ""
                note = (f"needs {r.needs_nights} more night(s)" if r.verdict == NO_VERDICT
                        else f"{len(r.changes)} earlier change(s), newest from {r.changes[-1].sweep_id}"
                        if r.changes else "")
            if r.confirmed is not None or r.confirmation:
                note = (note + "; " if note else "") + ("confirmation: " + (r.confirmation or (
                    "confirmed" if r.confirmed else "not confirmed")))
            lines.append(f"| {r.verdict} | {se.unit} | {se.label} `{se.config_hash}` | {se.metric} | "
                         f"{len(se.nights)} | {newest} | {cv} | {change} | {ci} | {p} | {first} | {note} |")
        return "\n".join(lines) + "\n"

    def to_junit_xml(self, suite_name: str = "jbench.regress", *, per_metric: bool = True) -> str:
        """One <testcase> per unit x configuration x metric (classname SUITE.UNIT): <failure> on a regression,
        <skipped> on no verdict; the rest pass with the details in <system-out>. Always per metric (`per_metric`
        is accepted for the pairwise report's signature)."""
        suite = ET.Element("testsuite", name=suite_name, tests=str(len(self.results)),
                           failures=str(sum(r.verdict == REGRESSION and r.confirmed is not False
                                            for r in self.results)),
                           errors="0", skipped=str(sum(r.verdict == NO_VERDICT for r in self.results)))
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="mode", value="history")
        for k, v in self.settings.__dict__.items():
            ET.SubElement(props, "property", name=k, value=str(v))
        for r in self.results:
            se = r.series
            case = ET.SubElement(suite, "testcase", classname=f"{suite_name}.{se.unit or 'device'}",
                                 name=f"{se.label} [{se.config_hash}] {se.metric}")
            out = f"verdict: {r.verdict}\n{r.message}\n" + (f"confirmation: {r.confirmation}\n" if r.confirmation else "")
            if r.verdict == REGRESSION and r.confirmed is not False:
                ET.SubElement(case, "failure", message=r.message.split(";")[0][:500], type="regression").text = out
            elif r.verdict == NO_VERDICT:
                ET.SubElement(case, "skipped", message=r.message)
            ET.SubElement(case, "system-out").text = out
        ET.indent(suite)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def history(df: pd.DataFrame, *, metrics: Sequence[str] = tuple(METRICS),
            current: Union[None, str, Sequence[str]] = None, settings: DetectorSettings = DEFAULT_SETTINGS,
            fingerprint_tags: Sequence[str] = FINGERPRINT_TAGS, reported: Optional[Reported] = None) -> HistoryReport:
    """Judge every series of `df` (module doc); `reported`: what earlier nights reported (None: nothing is known of
    them, and no change is reported late)."""
    series = build_series(df, metrics=metrics, current=current, fingerprint_tags=fingerprint_tags)
    return HistoryReport([judge_series(s, settings, reported) for s in series], settings)


def max_nights(df: pd.DataFrame) -> int:
    """The most nights any configuration of `df` has on one unit (how `jbench regress` picks its mode)."""
    trials = finished_trials(df)
    if trials.empty or SWEEP not in trials.columns:
        return 0
    unit = trials[UNIT] if UNIT in trials.columns else pd.Series(np.nan, index=trials.index)
    device = trials[DEVICE] if DEVICE in trials.columns else pd.Series("", index=trials.index)
    key = unit.where(unit.notna() & (unit != ""), device).astype(str)
    counts = trials.assign(_k=key).groupby(["_k", CONFIG_HASH])[SWEEP].nunique()
    return int(counts.max()) if len(counts) else 0
