"""Confirmation of a nightly alarm (pure): which builds to interleave, and the paired test that decides.

A regression found by the nightly (over its history, or by the two-sweep gate) is re-measured before it is
reported: the build of the last good night (A) and the build of the newest night (B) run interleaved on the same
unit in the same power state, A B A B ... (jbench.confirm does the running). This module holds the decisions
around that run:

`alarms(report)`: the regressions to confirm, from either report: over the history (jbench.analysis.history: a
series' change starting on the newest nights; the night before it is the last good one) or from the two-sweep gate
(jbench.analysis.regress, used until a configuration has enough nights: the newest sweep against its baseline's
newest sweep). One Alarm per unit x configuration, with its alarmed metrics.

`targets(report, runs)`: for each alarm, the two builds from the runs' tags
(`backend.binary_dir`: where the build ran, `backend.build_commit`: what it says it is), taken from the night before
the change and from the newest night. No A/B is possible, and the alarm stands unconfirmed with the reason, when:
  * a night's runs do not say where their build is (runs recorded before jbench recorded `backend.binary_dir`, or a
    backend that has no build directory);
  * both nights ran the same directory with the same commit: the build did not change, so the change is not in it
    (a device, model or load change the fingerprint did not catch) and interleaving a build with itself says nothing;
  * both nights ran the same directory but different commits: the previous build was replaced in place and is gone
    (keep one directory per build to make confirmation possible).

`paired_change(a, b, direction)`: the pairs (A_i, B_i) give relative changes d_i = (B_i - A_i) / A_i; a one-sample
Student t-test of d gives the mean change, its confidence interval and p. The alarm is confirmed when the change is
worse (by the metric's direction) and significant (p < alpha) and at least `min_effect` (the configured threshold);
otherwise it is not confirmed and leaves the exit code, the JUnit failures and the regressed units (`settle` writes
the verdicts back: a history series per metric; a two-sweep configuration stands when any of its rates is
confirmed).
Pairing removes what drifts slowly between pairs (temperature, background load) from the comparison.

The same-night control (jbench.sweeps.control runs it): a pinned reference build measured on the same unit and
in the same power state as the build under test, counterbalanced (T R ... R T), every night it is on. Most of a
night's noise (clocks, thermal state, background load) is shared by both builds, so a code change is judged on
the per-night paired ratio, never on the absolute series:

`trial_ratio(test_trials, reference_trials, direction, earlier=...)`, what the nightly judges by: the ratio of the
two builds' geometric means that night (test / reference) with the trial as the unit. Repetitions of one trial
share its process and its moment, so they are not independent (on the GPU host a trial's mean moved twice as far
from its build's other trial as its repetitions' spread explains, and a per-repetition test flagged 3 of 39
same-build configuration-nights at alpha 0.01); the interval and p-value come from the spread of trial means within
one build and night, pooled over tonight and the configuration's earlier nights, at a t quantile of the pooled
degrees of freedom. The verdict: a regression when the ratio is worse by the metric's direction, p < alpha and
|ratio - 1| >= min_effect. `night_ratio(test, reference, direction)` is the per-repetition Welch version
(analysis.stats.ratio_test), for rates that are not grouped in trials.

`reference_shift_trials(previous, tonight)` (and the per-repetition `reference_shift`): the reference build against
itself on its previous control night, the same test: the reference's own absolute series. When it moved, the environment moved (a JetPack update, a new power
profile, a fan) and moves both builds: `control_verdict` calls a night whose paired ratio holds but whose
reference moved an "environment change", never blamed on the build.

`repetitions_for(cv, half_width)`: repetitions per build to resolve a ratio to +-half_width at a measured
within-night spread. The noise budget around it: `within_night_spread(nights)` pools the spread of ln(rate) within
each build's repetitions of each earlier night (what a night's paired ratio sees; the settled repetitions only, the
cold ones set aside), and `noise_budget(spreads, configured=..., half_width=...)` takes the noisiest unit x rate's
spread to the repetitions per build tonight, bounded, or keeps the configured count with the reason (no target, no
earlier night, too few degrees of freedom to trust a spread).

`settle_by_control(report, verdicts)`: the absolute report's alarms of configurations the control judged tonight
take the control's verdict (a regression stands only when the paired ratio says so); the rest are left to the
re-measuring confirmation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from jbench.analysis.compare import CONFIG_HASH
from jbench.analysis.history import (DEVICE, IMPROVEMENT, METRICS, NO_CHANGE, SWEEP, UNIT, HistoryReport,
                                     SeriesResult)
from jbench.analysis.regress import REGRESSION, ConfigResult, RegressReport

__all__ = ["ConfirmSettings", "Alarm", "BuildRef", "Target", "Skipped", "PairedChange", "alarms", "targets",
           "paired_change", "settle", "NightRatio", "ReferenceShift", "ControlVerdict", "night_ratio",
           "reference_shift", "control_verdict", "repetitions_for", "trial_ratio", "trial_spread", "reference_shift_trials", "settle_by_control", "ENV_CHANGE", "Spread",
           "NoiseBudget", "within_night_spread", "noise_budget", "half_width_at"]

BINARY_DIR = "tags.backend.binary_dir"
BUILD_COMMIT = "tags.backend.build_commit"
PLACE = "tags.farm.place"


@dataclass(frozen=True)
class ConfirmSettings:
    pairs: int = 6  # A B pairs; 6 pairs separate a 2 % change at 0.5 % per-trial noise (t ~ 7, p ~ 0.001)
    alpha: float = 0.01  # the paired t-test's significance
    min_effect: float = 0.01  # the threshold: a smaller confirmed change clears the alarm
    repetitions: Optional[int] = None  # per trial; None: the configuration's own

    def problems(self) -> list[str]:
        out = []
        if self.pairs < 3:
            out.append(f"confirmation pairs {self.pairs}: at least 3 are needed for a paired t-test")
        if not 0 < self.alpha < 0.5:
            out.append(f"confirmation alpha {self.alpha}: give a significance level between 0 and 0.5, e.g. 0.01")
        if not 0 <= self.min_effect < 1:
            out.append(f"confirmation threshold {self.min_effect}: give a relative change between 0 and 1, e.g. 0.01")
        if self.repetitions is not None and self.repetitions < 1:
            out.append(f"confirmation repetitions {self.repetitions}: give at least 1")
        return out


@dataclass(frozen=True)
class BuildRef:
    binary_dir: str
    commit: str  # "" when the run did not record one
    sweep_id: str  # the night it ran

    def describe(self) -> str:
        return f"{self.binary_dir} (commit {self.commit or 'unknown'}, night {self.sweep_id})"


@dataclass
class Alarm:
    """A regression of one unit x configuration to confirm: its alarmed metrics, the last good night and the
    newest night, and the report's verdicts the confirmation settles (SeriesResult or ConfigResult)."""

    unit: str
    config_hash: str
    label: str
    metrics: list[str]
    before_sweep: str
    newest_sweep: str
    verdicts: list = field(default_factory=list)


@dataclass
class Target:
    """One alarm to re-measure, with the two builds."""

    alarm: Alarm
    previous: BuildRef  # A: the last good night's build
    new: BuildRef  # B: the newest night's build
    place: Optional[str] = None  # the farm place the unit was leased as, when it came from a coordinator

    @property
    def unit(self) -> str:
        return self.alarm.unit

    @property
    def config_hash(self) -> str:
        return self.alarm.config_hash

    @property
    def label(self) -> str:
        return self.alarm.label

    @property
    def metrics(self) -> list[str]:
        return self.alarm.metrics


@dataclass
class Skipped:
    """An alarm that cannot be confirmed: it stands, unconfirmed, with the reason."""

    alarm: Alarm
    reason: str


@dataclass(frozen=True)
class PairedChange:
    metric: str
    n_pairs: int
    mean_a: float
    mean_b: float
    change: float  # mean relative change (B - A) / A over the pairs
    ci_low: float  # (1 - alpha) interval of the mean relative change
    ci_high: float
    p_value: float
    worse: bool  # the change is in the metric's bad direction
    confirmed: bool
    reason: str = ""  # why it is not confirmed, or what is missing
    pairs: list[tuple[float, float]] = field(default_factory=list)

    def describe(self) -> str:
        if self.n_pairs == 0:
            return f"{self.metric}: {self.reason}"
        pct = lambda x: f"{x * 100:+.2f} %"  # noqa: E731
        text = (f"{self.metric}: previous {self.mean_a:.4g} vs new {self.mean_b:.4g} over {self.n_pairs} pairs, "
                f"paired change {pct(self.change)} (CI {pct(self.ci_low)} … {pct(self.ci_high)}), "
                f"p={self.p_value:.2g}: {'confirmed' if self.confirmed else 'not confirmed'}")
        return text + (f" ({self.reason})" if self.reason else "")


def _unit_of(df: pd.DataFrame) -> pd.Series:
    unit = df[UNIT] if UNIT in df.columns else pd.Series(None, index=df.index, dtype=object)
    device = df[DEVICE] if DEVICE in df.columns else pd.Series("", index=df.index, dtype=object)
    return unit.where(unit.notna() & (unit != ""), device).astype(str)


def _build_of(rows: pd.DataFrame, sweep_id: str) -> Optional[BuildRef]:
    night = rows[rows[SWEEP] == sweep_id]
    if night.empty or BINARY_DIR not in night.columns:
        return None
    last = night.sort_values("start_time", kind="stable").iloc[-1]
    d = last.get(BINARY_DIR)
    if not isinstance(d, str) or not d:
        return None
    commit = last.get(BUILD_COMMIT)
    return BuildRef(d, commit if isinstance(commit, str) else "", sweep_id)


def alarms(report: HistoryReport | RegressReport) -> list[Alarm]:
    """The regressions of `report` to confirm, one per unit x configuration (module doc)."""
    out: list[Alarm] = []
    if isinstance(report, HistoryReport):
        grouped: dict[tuple[str, str], list[SeriesResult]] = {}
        for r in report.alarms():
            if r.confirmed is not None:  # already judged (by the same-night control)
                continue
            grouped.setdefault((r.series.unit, r.series.config_hash), []).append(r)
        for (unit, h), results in grouped.items():
            change, nights = results[0].deciding, results[0].series.nights
            before = nights[change.index - 1].sweep_id if change is not None and change.index >= 1 else ""
            out.append(Alarm(unit, h, results[0].series.label, [r.series.metric for r in results], before,
                             nights[-1].sweep_id, list(results)))
        return out
    for r in report.results:
        if r.status != REGRESSION or r.confirmed is not None:
            continue
        metrics = [c.metric for c in r.checks if c.verdict == REGRESSION]
        before = r.baseline_sweeps[-1] if r.baseline_sweeps else ""
        out.append(Alarm(r.device, r.config_hash, r.label, metrics, before, r.now_sweep.split(",")[-1], [r]))
    return out


def targets(report: HistoryReport | RegressReport, runs: pd.DataFrame) -> tuple[list[Target], list[Skipped]]:
    """The alarms of `report` with the builds to interleave, or the reason none can be (module doc)."""
    found = alarms(report)
    if not found:
        return [], []
    df = runs.assign(_unit=_unit_of(runs)) if len(runs) else runs
    out, skipped = [], []
    for alarm in found:
        rows = df[(df["_unit"] == alarm.unit) & (df[CONFIG_HASH].astype(str) == alarm.config_hash)] if len(df) else df
        if not alarm.before_sweep or rows.empty:
            skipped.append(Skipped(alarm, "no night before the change to take the previous build from"))
            continue
        a, b = _build_of(rows, alarm.before_sweep), _build_of(rows, alarm.newest_sweep)
        if a is None or b is None:
            which = alarm.before_sweep if a is None else alarm.newest_sweep
            skipped.append(Skipped(alarm, f"the runs of night {which} do not record where their build is (tag "
                                          "backend.binary_dir): nothing to interleave"))
            continue
        if a.binary_dir == b.binary_dir:
            if a.commit and b.commit and a.commit != b.commit:
                reason = (f"the previous build (commit {a.commit}) was replaced in place by commit {b.commit} in "
                          f"{a.binary_dir}: keep one directory per build (e.g. backend.binary_dir=/opt/llama.cpp/"
                          "<commit>/bin) so that the previous build can be measured again")
            else:
                reason = (f"the build did not change at the change (both nights ran {a.binary_dir}, commit "
                          f"{a.commit or 'unknown'}): the change is not in the build, so there is nothing to "
                          "interleave; look at the device and the fingerprint")
            skipped.append(Skipped(alarm, reason))
            continue
        place = rows[PLACE].dropna().iloc[-1] if PLACE in rows.columns and rows[PLACE].notna().any() else None
        out.append(Target(alarm, a, b, place))
    return out, skipped


def direction(metric: str) -> int:
    """+1 when higher is better (rates, tokens/J), -1 when lower is (latencies)."""
    return METRICS.get(metric, 1)


def settle(alarm: Alarm, changes: list["PairedChange"], *, not_run: str = "") -> None:
    """Write the confirmation back into the report's verdicts. A history series takes its metric's verdict; a
    two-sweep configuration stands when any of its alarmed rates is confirmed. Fewer than 3 pairs (or `not_run`)
    decide nothing: the verdict stays, with the reason."""
    by_metric = {c.metric: c for c in changes}
    for v in alarm.verdicts:
        if isinstance(v, SeriesResult):
            c = by_metric.get(v.series.metric)
            if not_run or c is None:
                v.confirmation = f"not confirmed either way: {not_run or 'not measured'}"
            else:
                v.confirmed = c.confirmed if c.n_pairs >= 3 else None
                v.confirmation = c.describe()
        elif isinstance(v, ConfigResult):
            decided = [c for c in changes if c.n_pairs >= 3]
            if not_run or not decided:
                v.confirmation = f"not confirmed either way: {not_run or 'too few pairs'}"
            else:
                v.confirmed = any(c.confirmed for c in decided)
                v.confirmation = "; ".join(c.describe() for c in changes)


def paired_change(a: Sequence[float], b: Sequence[float], direction: int, *, metric: str = "",
                  alpha: float = ConfirmSettings.alpha, min_effect: float = ConfirmSettings.min_effect) -> PairedChange:
    """The paired test of B against A (module doc). Pairs with a missing or non-finite value on either side are
    left out; fewer than 3 pairs decide nothing (not confirmed, with the reason)."""
    from jbench.analysis.stats import _scipy_stats, t_ppf

    pairs = [(float(x), float(y)) for x, y in zip(a, b)
             if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y)) and float(x)]
    n = len(pairs)
    nan = math.nan
    if n < 3:
        return PairedChange(metric, n, nan, nan, nan, nan, nan, nan, False, False,
                            f"{n} complete pair(s): a paired test needs at least 3", pairs)
    d = [(y - x) / x for x, y in pairs]
    mean = sum(d) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    if sd == 0:
        p, low, high = (0.0 if mean else 1.0), mean, mean
    else:
        se = sd / math.sqrt(n)
        t = mean / se
        p = float(2 * _scipy_stats().t.sf(abs(t), n - 1))
        half = t_ppf(1 - alpha / 2, n - 1) * se
        low, high = mean - half, mean + half
    worse = mean * direction < 0
    confirmed = worse and p < alpha and abs(mean) >= min_effect
    reason = ""
    if not confirmed:
        if not worse:
            reason = "the new build is not worse than the previous one"
        elif p >= alpha:
            reason = f"not significant at alpha {alpha:g}"
        else:
            reason = f"smaller than the threshold {min_effect:.1%}"
    mean_a = sum(x for x, _ in pairs) / n
    mean_b = sum(y for _, y in pairs) / n
    return PairedChange(metric, n, mean_a, mean_b, mean, low, high, p, worse, confirmed, reason, pairs)


# --- The same-night control ---------------------------------------------------------------------------------------

ENV_CHANGE = "environment change"
NO_VERDICT = "no verdict"


@dataclass(frozen=True)
class NightRatio:
    """The build under test against the reference on one night, one unit x configuration x metric."""

    metric: str
    n_test: int  # per-repetition rates of each build that night
    n_reference: int
    ratio: float  # geometric mean of test / geometric mean of reference
    low: float  # (1 - alpha) interval of the ratio
    high: float
    p_value: float
    cv: float  # within-night spread: the pooled SD of ln(rate) of both builds (about the per-repetition CV)
    detectable: float  # the smallest relative change this night could flag (on the log scale, a rise)
    verdict: str  # regression | improvement | no change | no verdict
    reason: str = ""
    # With the trial as the unit (trial_ratio): trials of each build tonight, and the trial-to-trial spread of
    # ln trial means the interval came from, with its degrees of freedom; 0 / NaN for the per-repetition test.
    k_test: int = 0
    k_reference: int = 0
    dof: int = 0
    trial_sd: float = math.nan

    def describe(self) -> str:
        if self.verdict == NO_VERDICT and not math.isfinite(self.p_value):
            return f"{self.metric}: no verdict ({self.reason})"
        pct = lambda x: f"{(x - 1) * 100:+.2f} %"  # noqa: E731
        spread = (f"{self.k_test}+{self.k_reference} trials of {self.n_test}+{self.n_reference} repetitions, "
                  f"trial-to-trial spread {self.trial_sd * 100:.2f} % ({self.dof} dof)" if self.k_test else
                  f"{self.n_test}+{self.n_reference} repetitions, within-night spread {self.cv * 100:.2f} %")
        return (f"{self.metric}: test/reference {pct(self.ratio)} (CI {pct(self.low)} … {pct(self.high)}), "
                f"p={self.p_value:.2g}, {spread}: {self.verdict}" + (f" ({self.reason})" if self.reason else ""))


def _finite_positive(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v)) and float(v) > 0]


def _pooled_log_sd(a: Sequence[float], b: Sequence[float]) -> float:
    la, lb = [math.log(v) for v in a], [math.log(v) for v in b]
    dof = len(la) + len(lb) - 2
    if dof < 1:
        return math.nan
    ss = sum((x - sum(la) / len(la)) ** 2 for x in la) + sum((x - sum(lb) / len(lb)) ** 2 for x in lb)
    return math.sqrt(ss / dof)


def night_ratio(test: Sequence[float], reference: Sequence[float], direction: int, *, metric: str = "",
                alpha: float = 0.01, min_effect: float = 0.01) -> NightRatio:
    """The paired ratio of one night (module doc). Non-finite or non-positive rates are left out; fewer than 2 a
    side (or no spread at all) decide nothing."""
    from jbench.analysis.stats import ratio_test

    t, r = _finite_positive(test), _finite_positive(reference)
    rt = ratio_test(r, t, confidence=1 - alpha)
    cv = _pooled_log_sd(t, r) if t and r else math.nan
    if not math.isfinite(rt.p_value):
        return NightRatio(metric, len(t), len(r), rt.ratio, math.nan, math.nan, math.nan, cv, math.nan, NO_VERDICT,
                          rt.reason)
    change = rt.ratio - 1
    worse = change * direction < 0
    if rt.p_value >= alpha or abs(change) < min_effect:
        verdict = NO_CHANGE
        reason = (f"not significant at alpha {alpha:g}" if rt.p_value >= alpha
                  else f"smaller than the threshold {min_effect:.1%}")
    else:
        verdict, reason = (REGRESSION if worse else IMPROVEMENT), ""
    return NightRatio(metric, len(t), len(r), rt.ratio, rt.low, rt.high, rt.p_value, cv, rt.detectable, verdict,
                      reason)


def _trial_means(trials: Sequence[Sequence[float]]) -> list[float]:
    """ln of each trial's geometric mean rate (trials without a usable rate left out)."""
    out = []
    for reps in trials:
        logs = [math.log(v) for v in _finite_positive(reps)]
        if logs:
            out.append(sum(logs) / len(logs))
    return out


def trial_spread(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """(pooled SD, dof) of ln trial means within each group (one build on one night: its trials' means); a group
    needs 2 trials."""
    ss, dof = 0.0, 0
    for g in groups:
        if len(g) < 2:
            continue
        mean = sum(g) / len(g)
        ss += sum((x - mean) ** 2 for x in g)
        dof += len(g) - 1
    return (math.sqrt(ss / dof) if dof else math.nan), dof


def trial_ratio(test: Sequence[Sequence[float]], reference: Sequence[Sequence[float]], direction: int, *,
                earlier: Sequence[Sequence[float]] = (), metric: str = "", alpha: float = 0.01,
                min_effect: float = 0.01) -> NightRatio:
    """The night's paired ratio with the trial as the unit: `test` and `reference` are tonight's trials of each
    build (each its per-repetition rates). Repetitions of one trial share its process, its clocks and whatever
    ran beside it, so they are not independent: on the GPU host a trial's mean moved 0.67 % from its build's other
    trial that night, twice what its repetitions' spread explains. So the ratio is the geometric mean of the test
    trials' means over the reference's, and its interval comes from the spread of trial means within one build and
    night, pooled over tonight's two builds and `earlier` (the same configuration's earlier nights: groups of ln
    trial means, one group per build and night), with a t quantile at the pooled degrees of freedom."""
    from jbench.analysis.stats import t_ppf

    t_means, r_means = _trial_means(test), _trial_means(reference)
    n_t = sum(len(_finite_positive(x)) for x in test)
    n_r = sum(len(_finite_positive(x)) for x in reference)
    cv = _pooled_log_sd([v for x in test for v in _finite_positive(x)],
                        [v for x in reference for v in _finite_positive(x)]) if n_t and n_r else math.nan
    if not t_means or not r_means:
        return NightRatio(metric, n_t, n_r, math.nan, math.nan, math.nan, math.nan, cv, math.nan, NO_VERDICT,
                          "no trial of one build finished", len(t_means), len(r_means))
    diff = sum(t_means) / len(t_means) - sum(r_means) / len(r_means)
    ratio = math.exp(diff)
    sd, dof = trial_spread([t_means, r_means, *earlier])
    if not dof or not math.isfinite(sd) or sd == 0:
        why = ("one trial per build and no earlier night of this configuration: no trial-to-trial spread to judge "
               "by" if not dof else "no spread between trials")
        return NightRatio(metric, n_t, n_r, ratio, math.nan, math.nan, math.nan, cv, math.nan, NO_VERDICT, why,
                          len(t_means), len(r_means), dof, sd)
    se = sd * math.sqrt(1 / len(t_means) + 1 / len(r_means))
    half = t_ppf(1 - alpha / 2, dof) * se
    from scipy.special import stdtr

    p = min(1.0, 2.0 * float(stdtr(dof, -abs(diff) / se)))
    change = ratio - 1
    worse = change * direction < 0
    if p >= alpha or abs(change) < min_effect:
        verdict = NO_CHANGE
        reason = f"not significant at alpha {alpha:g}" if p >= alpha else f"smaller than the threshold {min_effect:.1%}"
    else:
        verdict, reason = (REGRESSION if worse else IMPROVEMENT), ""
    return NightRatio(metric, n_t, n_r, ratio, math.exp(diff - half), math.exp(diff + half), p, cv,
                      math.expm1(half), verdict, reason, len(t_means), len(r_means), dof, sd)


@dataclass(frozen=True)
class ReferenceShift:
    """The reference build tonight against itself on its previous control night (the same build)."""

    metric: str
    previous_sweep: str
    ratio: float  # tonight / previous night, geometric means of the reference's per-repetition rates
    low: float
    high: float
    p_value: float
    moved: bool  # significant and at least the threshold, either way
    reason: str = ""

    def describe(self) -> str:
        if not math.isfinite(self.p_value):
            return f"reference {self.metric}: not compared with night {self.previous_sweep or '-'} ({self.reason})"
        pct = lambda x: f"{(x - 1) * 100:+.2f} %"  # noqa: E731
        return (f"reference {self.metric} against night {self.previous_sweep}: {pct(self.ratio)} (CI {pct(self.low)}"
                f" … {pct(self.high)}), p={self.p_value:.2g}: {'moved' if self.moved else 'steady'}")


def reference_shift(previous: Sequence[float], tonight: Sequence[float], *, metric: str = "", previous_sweep: str = "",
                    alpha: float = 0.01, min_effect: float = 0.01) -> ReferenceShift:
    """Did the reference's absolute rate move since its previous control night (module doc)?"""
    from jbench.analysis.stats import ratio_test

    a, b = _finite_positive(previous), _finite_positive(tonight)
    rt = ratio_test(a, b, confidence=1 - alpha)
    if not math.isfinite(rt.p_value):
        return ReferenceShift(metric, previous_sweep, rt.ratio, math.nan, math.nan, math.nan, False,
                              rt.reason if a else "no earlier night of this reference")
    moved = rt.p_value < alpha and abs(rt.ratio - 1) >= min_effect
    return ReferenceShift(metric, previous_sweep, rt.ratio, rt.low, rt.high, rt.p_value, moved)


def reference_shift_trials(previous: Sequence[Sequence[float]], tonight: Sequence[Sequence[float]], *,
                           earlier: Sequence[Sequence[float]] = (), metric: str = "", previous_sweep: str = "",
                           alpha: float = 0.01, min_effect: float = 0.01) -> ReferenceShift:
    """`reference_shift` with the trial as the unit (as `trial_ratio`): the reference's trials tonight against its
    trials on its previous control night, the interval from the pooled trial-to-trial spread."""
    if not _trial_means(previous):
        return ReferenceShift(metric, previous_sweep, math.nan, math.nan, math.nan, math.nan, False,
                              "no earlier night of this reference")
    r = trial_ratio(tonight, previous, +1, earlier=earlier, metric=metric, alpha=alpha, min_effect=min_effect)
    if not math.isfinite(r.p_value):
        return ReferenceShift(metric, previous_sweep, r.ratio, math.nan, math.nan, math.nan, False, r.reason)
    moved = r.p_value < alpha and abs(r.ratio - 1) >= min_effect
    return ReferenceShift(metric, previous_sweep, r.ratio, r.low, r.high, r.p_value, moved)


@dataclass
class ControlVerdict:
    """One unit x configuration x metric judged by the same-night control."""

    unit: str
    config_hash: str  # the build under test's configuration
    label: str
    paired: NightRatio
    shift: Optional[ReferenceShift] = None
    verdict: str = NO_VERDICT  # regression | improvement | no change | environment change | no verdict
    reason: str = ""

    @property
    def metric(self) -> str:
        return self.paired.metric

    def describe(self) -> str:
        text = f"{self.unit} {self.label} [{self.config_hash}]: {self.verdict}: {self.paired.describe()}"
        if self.shift is not None:
            text += f"; {self.shift.describe()}"
        return text + (f" ({self.reason})" if self.reason else "")


def control_verdict(unit: str, config_hash: str, label: str, paired: NightRatio,
                    shift: Optional[ReferenceShift] = None, *, void: str = "") -> ControlVerdict:
    """The night's verdict for the build under test: the paired ratio decides a code change; a ratio that holds
    while the reference itself moved is an environment change (it moved both builds). `void`: why the control
    cannot be trusted tonight (e.g. the reference was replaced in place): no verdict."""
    if void:
        return ControlVerdict(unit, config_hash, label, paired, shift, NO_VERDICT, void)
    if paired.verdict in (REGRESSION, IMPROVEMENT, NO_VERDICT):
        return ControlVerdict(unit, config_hash, label, paired, shift, paired.verdict, paired.reason)
    if shift is not None and shift.moved:
        return ControlVerdict(unit, config_hash, label, paired, shift, ENV_CHANGE,
                              f"both builds moved by about {(shift.ratio - 1) * 100:+.1f} %: not the build")
    return ControlVerdict(unit, config_hash, label, paired, shift, NO_CHANGE)


def repetitions_for(cv: float, half_width: float = 0.01, *, alpha: float = 0.01, at_least: int = 3,
                    at_most: int = 200) -> Optional[int]:
    """Repetitions per build (pooled over the night's trials of that build) for the paired ratio's (1 - alpha)
    interval to be at most +-half_width at a within-night spread `cv` (SD of ln(rate)): the smallest n with
    t(1 - alpha/2, 2n - 2) * cv * sqrt(2 / n) <= ln(1 + half_width). None when `cv` is unknown, or more than
    `at_most` would be needed."""
    from jbench.analysis.stats import t_ppf

    if not (isinstance(cv, (int, float)) and math.isfinite(cv) and cv >= 0) or half_width <= 0:
        return None
    target = math.log1p(half_width)
    for n in range(max(2, at_least), at_most + 1):
        if t_ppf(1 - alpha / 2, 2 * n - 2) * cv * math.sqrt(2 / n) <= target:
            return n
    return None


def half_width_at(cv: float, n: int, *, alpha: float = 0.01) -> float:
    """The relative half-width (on the ratio scale) of the paired ratio's (1 - alpha) interval with n repetitions
    per build at a within-night spread `cv` (SD of ln(rate)); the inverse of `repetitions_for`."""
    from jbench.analysis.stats import t_ppf

    if n < 2 or not math.isfinite(cv):
        return math.nan
    return math.expm1(t_ppf(1 - alpha / 2, 2 * n - 2) * cv * math.sqrt(2 / n))


MIN_SPREAD_DOF = 4  # a spread from fewer degrees of freedom is too uncertain to size a night by (F(4): x0.5..x2.9)


@dataclass(frozen=True)
class Spread:
    """The within-night spread of one unit x rate of a configuration over its earlier nights."""

    what: str  # e.g. "decode_tps on u1"
    sd: float  # pooled SD of ln(rate) within each build's repetitions of a night (about the per-repetition CV)
    dof: int  # its degrees of freedom (repetitions less one per build and night)
    nights: int  # the earlier nights it pools


def within_night_spread(nights: dict[str, Sequence[Sequence[float]]], *, what: str = "") -> Spread:
    """Pool the spread of ln(rate) within each group of repetitions (one build on one night; `nights`: night ->
    its groups), so that neither night-to-night shifts nor the difference between the builds count: only what a
    night's paired ratio sees. Non-finite or non-positive rates are left out; a group needs 2."""
    ss, dof, used = 0.0, 0, 0
    for groups in nights.values():
        counted = False
        for g in groups:
            logs = [math.log(v) for v in _finite_positive(g)]
            if len(logs) < 2:
                continue
            mean = sum(logs) / len(logs)
            ss += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
            counted = True
        used += counted
    return Spread(what, math.sqrt(ss / dof) if dof else math.nan, dof, used)


@dataclass(frozen=True)
class NoiseBudget:
    """Tonight's repetitions per build of one configuration, and why."""

    repetitions: int  # per build over the night (the sweep's rounds split them: ceil(n / rounds) per trial)
    chosen: bool  # True: from the spread; False: the configured backend.repetitions
    reason: str
    spread: Optional[Spread] = None  # the spread that decided (the noisiest one)
    half_width: float = math.nan  # the interval the count reaches at that spread (relative, e.g. 0.01)

    def describe(self) -> str:
        return f"{self.repetitions} repetitions per build ({self.reason})"


def noise_budget(spreads: Sequence[Spread], *, configured: int, half_width: Optional[float], alpha: float = 0.01,
                 at_least: int = 3, at_most: int = 30, min_dof: int = MIN_SPREAD_DOF) -> NoiseBudget:
    """The repetitions per build for the paired ratio's (1 - alpha) interval to be at most +-half_width at the
    noisiest of `spreads` (each unit x rate of the configuration: every one must reach the target), within
    [at_least, at_most]; the configured count, with the reason, when there is no target or no spread to trust."""
    if half_width is None:
        return NoiseBudget(configured, False, "configured: no target interval (farm.target_interval_pct=null)")
    known = [s for s in spreads if math.isfinite(s.sd) and s.dof >= min_dof]
    if not known:
        best = max(spreads, key=lambda s: s.dof, default=None)
        why = ("no earlier night with per-repetition rates of this configuration" if best is None or best.dof == 0
               else f"the earlier nights' spread has {best.dof} degree(s) of freedom, fewer than {min_dof}")
        return NoiseBudget(configured, False, f"configured: {why}")
    worst = max(known, key=lambda s: s.sd)
    target = f"+-{half_width * 100:.2f} % at {(1 - alpha) * 100:g} %"
    source = (f"within-night spread {worst.sd * 100:.2f} % of {worst.what or 'the rate'} over {worst.nights} "
              f"night(s), {worst.dof} dof")
    n = repetitions_for(worst.sd, half_width, alpha=alpha, at_least=at_least, at_most=at_most)
    if n is None:
        reached = half_width_at(worst.sd, at_most, alpha=alpha)
        return NoiseBudget(at_most, True, f"{source}: capped at {at_most}, which reaches +-{reached * 100:.2f} %, "
                                          f"not {target}", worst, reached)
    reached = half_width_at(worst.sd, n, alpha=alpha)
    # At the floor a smaller count would have reached the target too: the bound chose, not the spread.
    floor = " (the floor)" if n == at_least and n > 2 and half_width_at(worst.sd, n - 1, alpha=alpha) <= half_width \
        else ""
    return NoiseBudget(n, True, f"{source}: {n}{floor} for {target}", worst, reached)


def settle_by_control(report: HistoryReport | RegressReport, verdicts: Sequence[ControlVerdict]) -> int:
    """The report's alarms of unit x configuration x metric the control decided tonight take its verdict (a
    history series per metric; a two-sweep configuration stands when any of its alarmed rates is a paired
    regression). Returns how many alarms it settled; the others are left for the re-measuring confirmation."""
    decided = {(v.unit, v.config_hash, v.metric): v for v in verdicts if v.verdict != NO_VERDICT}
    settled = 0
    if isinstance(report, HistoryReport):
        for r in report.alarms():
            v = decided.get((r.series.unit, r.series.config_hash, r.series.metric))
            if v is None or r.confirmed is not None:
                continue
            r.confirmed = v.verdict == REGRESSION
            r.confirmation = f"same-night control: {v.verdict}: {v.paired.describe()}"
            settled += 1
        return settled
    for r in report.alarms():
        if r.confirmed is not None:
            continue
        metrics = [c.metric for c in r.checks if c.verdict == REGRESSION]
        mine = [decided[k] for k in ((r.device, r.config_hash, m) for m in metrics) if k in decided]
        if not mine:
            continue
        r.confirmed = any(v.verdict == REGRESSION for v in mine)
        r.confirmation = "same-night control: " + "; ".join(f"{v.verdict}: {v.paired.describe()}" for v in mine)
        settled += 1
    return settled
