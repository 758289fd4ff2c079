"""Statistics over samples, the one home for jbench (pure functions on scipy and numpy).

- `describe`: n, mean, sample std (n - 1), median, min, max; `SampleStats.cv` (std / mean).
- `rate_interval`: confidence interval of a positive rate from its samples, on the log scale (never below 0).
- `t_ppf`: Student t quantile (scipy.special.stdtrit, as scipy.stats.t.ppf), any real degrees of freedom.
- `welch_interval`: Welch t confidence interval for mean(b) - mean(a), with the Welch-Satterthwaite
  degrees of freedom.
- `ratio_test`: B against A for positive rates: the ratio of geometric means with its Welch t interval and
  the p-value of the same test on ln(values), so the interval excludes 1 exactly when p < 1 - confidence;
  and the smallest change the samples could flag.
- `mann_whitney_u`: two-sided Mann-Whitney U test (scipy.stats.mannwhitneyu): the exact null
  distribution when there are no ties and both sides have <= EXACT_MAX_N samples, else the normal
  approximation with tie correction and continuity correction.
- `min_attainable_p`: the smallest two-sided Mann-Whitney p-value two sample sizes can give.
- `percentile`: linear interpolation between closest ranks (numpy's default, Hyndman-Fan type 7).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "EXACT_MAX_N",
    "MannWhitney",
    "SampleStats",
    "WelchInterval",
    "describe",
    "mann_whitney_u",
    "mean_interval",
    "min_attainable_p",
    "percentile",
    "rate_interval",
    "RatioTest",
    "ratio_test",
    "t_ppf",
    "welch_interval",
]

EXACT_MAX_N = 50  # exact Mann-Whitney distribution up to this many samples a side (no ties)


def _scipy_stats():
    """scipy.stats, imported on first use: it costs about 1.5 s, which the CLI's start should not pay
    (numpy, below, is imported where used for the same reason)."""
    from scipy import stats

    return stats


# --------------------------------------------------------------------------------------------
# Describing one sample


@dataclass(frozen=True)
class SampleStats:
    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); NaN for a single sample
    median: float
    min: float
    max: float

    @property
    def cv(self) -> float:
        """Coefficient of variation, std / mean; NaN when undefined."""
        if self.n < 2 or not self.mean:
            return math.nan
        return self.std / self.mean


def describe(samples: Sequence[float]) -> SampleStats:
    if not samples:
        nan = math.nan
        return SampleStats(0, nan, nan, nan, nan, nan)
    std = statistics.stdev(samples) if len(samples) > 1 else math.nan
    return SampleStats(
        n=len(samples),
        mean=statistics.fmean(samples),
        std=std,
        median=statistics.median(samples),
        min=min(samples),
        max=max(samples),
    )


def t_ppf(q: float, df: float) -> float:
    """Quantile q of Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    # scipy.special's inverse of the t distribution is what scipy.stats.t.ppf computes, at a fifth of the import cost:
    # every trial's interval needs it, and that path should not import scipy.stats.
    from scipy.special import stdtrit

    return float(stdtrit(df, q))


def mean_interval(n: int, mean: float, std: float, confidence: float = 0.95) -> tuple[float, float]:
    """Student t confidence interval of a mean from n samples with sample std; NaN bounds for n < 2."""
    if n < 2:
        return (math.nan, math.nan)
    half = t_ppf(1.0 - (1.0 - confidence) / 2.0, n - 1) * std / math.sqrt(n)
    return (mean - half, mean + half)


def rate_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Confidence interval of a rate (tok/s) from its repetitions, computed on the log scale:

        exp(mean(ln x) +- t_{1-(1-c)/2, n-1} * sd(ln x) / sqrt(n))

    A rate is positive and its noise multiplicative, so the interval is that of the geometric mean and never
    reaches 0 (the plain t interval of the mean goes negative for 3 noisy repetitions). At a few % noise it
    equals the t interval of the mean within rounding. NaN bounds for fewer than 2 samples or a value <= 0."""
    if len(samples) < 2 or any(not v > 0 for v in samples):
        return (math.nan, math.nan)
    logs = [math.log(v) for v in samples]
    low, high = mean_interval(len(logs), statistics.fmean(logs), statistics.stdev(logs), confidence)
    return (math.exp(low), math.exp(high))


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default,
    type 7); NaN for no values."""
    if len(values) == 0:
        return math.nan
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


# --------------------------------------------------------------------------------------------
# Two samples


@dataclass(frozen=True)
class WelchInterval:
    diff: float  # mean_b - mean_a
    low: float
    high: float
    df: float  # Welch-Satterthwaite degrees of freedom (inf when both variances are 0)


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> WelchInterval:
    """Welch t confidence interval for mean(b) - mean(a); NaN bounds with fewer than 2 samples a side.

        (mean_b - mean_a) +- t_{1-(1-c)/2, nu} * sqrt(s_a^2/n_a + s_b^2/n_b),
        nu = (s_a^2/n_a + s_b^2/n_b)^2 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1))
    """
    import numpy as np

    a_ = np.asarray(a, dtype=float)
    b_ = np.asarray(b, dtype=float)
    if a_.size == 0 or b_.size == 0:
        return WelchInterval(math.nan, math.nan, math.nan, math.nan)
    diff = float(b_.mean() - a_.mean())
    if a_.size < 2 or b_.size < 2:
        return WelchInterval(diff, math.nan, math.nan, math.nan)
    va, vb = float(a_.var(ddof=1)) / a_.size, float(b_.var(ddof=1)) / b_.size
    se2 = va + vb
    if se2 == 0:
        return WelchInterval(diff, diff, diff, math.inf)
    dof = se2 ** 2 / (va ** 2 / (a_.size - 1) + vb ** 2 / (b_.size - 1))
    half = t_ppf(1.0 - (1.0 - confidence) / 2.0, dof) * math.sqrt(se2)
    return WelchInterval(diff, diff - half, diff + half, dof)


@dataclass(frozen=True)
class MannWhitney:
    u: float  # U statistic of the first sample (number of pairs (x, y) with x > y, ties count 1/2)
    p_value: float  # two-sided
    method: str  # "exact" | "asymptotic" | "n/a"


def mann_whitney_u(x: Sequence[float], y: Sequence[float]) -> MannWhitney:
    """Two-sided Mann-Whitney U test of x against y (scipy.stats.mannwhitneyu).

    Exact p-value when there are no ties and both samples have at most EXACT_MAX_N values; otherwise
    the normal approximation with the tie-corrected variance and a continuity correction of 1/2.
    Every value tied: p = 1 (no evidence of a difference). An empty side: NaN, method "n/a".
    """
    xs = [float(v) for v in x]
    ys = [float(v) for v in y]
    n1, n2 = len(xs), len(ys)
    if n1 == 0 or n2 == 0:
        return MannWhitney(math.nan, math.nan, "n/a")
    if any(math.isnan(v) for v in xs + ys):
        raise ValueError("samples contain NaN")
    distinct = len(set(xs + ys))
    if distinct == 1:
        return MannWhitney(n1 * n2 / 2.0, 1.0, "asymptotic")
    method = "exact" if distinct == n1 + n2 and max(n1, n2) <= EXACT_MAX_N else "asymptotic"
    res = _scipy_stats().mannwhitneyu(xs, ys, alternative="two-sided", use_continuity=True, method=method)
    return MannWhitney(float(res.statistic), min(1.0, float(res.pvalue)), method)


def min_attainable_p(n1: int, n2: int) -> float:
    """The smallest two-sided Mann-Whitney p-value samples of these sizes can give (no ties): all of
    one sample above all of the other, 2 / C(n1+n2, n1). When it is not below the significance level,
    the test cannot reject whatever the data, so the comparison has too little data."""
    if n1 < 1 or n2 < 1:
        return 1.0
    return min(1.0, 2.0 / math.comb(n1 + n2, n1))


@dataclass(frozen=True)
class RatioTest:
    """B against A for positive rates, one test on ln(values): the Welch t test and its interval.

    The interval excludes a ratio of 1 exactly when p_value < 1 - confidence (same statistic, same degrees of
    freedom), and as a ratio it never reaches 0: B/A - 1 stays above -100 %."""

    ratio: float  # geometric mean of B / geometric mean of A
    low: float  # confidence interval of the ratio
    high: float
    p_value: float  # two-sided Welch t test of mean(ln B) = mean(ln A)
    df: float  # Welch-Satterthwaite degrees of freedom of the ln values
    detectable: float  # the smallest rise these samples could flag: exp(t * se) - 1 (a ratio above 1 + this)
    reason: str = ""  # why the interval and test are NaN ("" when computed)

    @property
    def detectable_drop(self) -> float:
        """The smallest drop these samples could flag, 1 - exp(-t * se) (a ratio below 1 - this): on the log
        scale as far from no change as `detectable`, so a little smaller."""
        return 1.0 - 1.0 / (1.0 + self.detectable)


def ratio_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> RatioTest:
    """B's rate against A's (see RatioTest), from their samples; NaN fields with the reason when there is too
    little to test: fewer than 2 samples on a side, a value <= 0, or no variation on either side."""
    nan = math.nan
    if not a or not b:
        return RatioTest(nan, nan, nan, nan, nan, nan, "no samples on a side")
    if any(not v > 0 for v in [*a, *b]):
        return RatioTest(nan, nan, nan, nan, nan, nan, "a value <= 0: no ratio")
    la, lb = [math.log(v) for v in a], [math.log(v) for v in b]
    ratio = math.exp(statistics.fmean(lb) - statistics.fmean(la))
    if len(a) < 2 or len(b) < 2:
        return RatioTest(ratio, nan, nan, nan, nan, nan,
                         f"{len(a)} vs {len(b)} samples: a test needs at least 2 on each side")
    wi = welch_interval(la, lb, confidence)
    if not math.isfinite(wi.df):  # both sides without variation: no noise estimate, so no test
        return RatioTest(ratio, nan, nan, nan, nan, nan, "no variation within either side: no noise estimate")
    from scipy.special import stdtr

    se = math.sqrt(statistics.variance(la) / len(la) + statistics.variance(lb) / len(lb))
    p = min(1.0, 2.0 * float(stdtr(wi.df, -abs(wi.diff) / se)))
    return RatioTest(ratio, math.exp(wi.low), math.exp(wi.high), p, wi.df, math.expm1(wi.high - wi.diff))
