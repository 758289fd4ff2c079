"""jbench.analysis.stats: the one home of jbench's statistics (describe, intervals, percentiles)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from jbench.analysis.stats import describe, mean_interval, percentile, rate_interval, ratio_test


def test_describe_and_its_t_interval():
    xs = [41.2, 40.8, 41.9, 40.5, 41.1]
    st = describe(xs)
    assert (st.n, st.median, st.min, st.max) == (5, 41.1, 40.5, 41.9)
    assert st.mean == pytest.approx(np.mean(xs)) and st.std == pytest.approx(np.std(xs, ddof=1))
    ref = scipy_stats.t.interval(0.95, 4, loc=np.mean(xs), scale=scipy_stats.sem(xs))
    assert mean_interval(5, st.mean, st.std) == pytest.approx(ref, rel=1e-12)
    assert st.cv == pytest.approx(np.std(xs, ddof=1) / np.mean(xs))
    assert mean_interval(5, st.mean, st.std, 0.99) == pytest.approx(
        scipy_stats.t.interval(0.99, 4, loc=st.mean, scale=st.std / math.sqrt(5)), rel=1e-12)


def test_describe_degenerate_samples():
    one = describe([3.0])
    assert one.n == 1 and math.isnan(one.std) and math.isnan(one.cv)
    assert all(math.isnan(v) for v in mean_interval(1, 3.0, math.nan))
    empty = describe([])
    assert empty.n == 0 and math.isnan(empty.mean)
    assert math.isnan(describe([0.0, 0.0]).cv)  # mean 0: undefined, not a division error


def _closest_ranks(values, q):
    """Linear interpolation between closest ranks, written out (what the latency metrics always used)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def test_percentile_is_numpys_linear_type_7():
    rng = np.random.default_rng(3)
    for _ in range(200):
        values = list(rng.lognormal(3, 1, int(rng.integers(1, 40))))
        for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(_closest_ranks(values, q), rel=1e-12)
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("q, df", [(0.975, 2), (0.975, 1.5), (0.995, 10), (0.5, 3), (0.025, 4), (0.9, 250)])
def test_t_quantile_is_scipy_stats_t_ppf(q, df):
    from scipy import stats

    from jbench.analysis.stats import t_ppf

    assert t_ppf(q, df) == pytest.approx(float(stats.t.ppf(q, df)), rel=1e-12, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Rates: intervals on the log scale


def test_rate_interval_is_the_log_scale_t_interval_and_stays_positive():
    xs = [41.2, 40.8, 41.9, 40.5, 41.1]
    logs = np.log(xs)
    ref = np.exp(scipy_stats.t.interval(0.95, 4, loc=logs.mean(), scale=scipy_stats.sem(logs)))
    assert rate_interval(xs) == pytest.approx(tuple(ref), rel=1e-12)
    # At 1 % noise it is the plain t interval of the mean within 0.05 %.
    plain = scipy_stats.t.interval(0.95, 4, loc=np.mean(xs), scale=scipy_stats.sem(xs))
    assert rate_interval(xs) == pytest.approx(plain, rel=5e-4)
    # Three noisy repetitions (a loaded machine, measured: 9.87 +- 10.80 tok/s): the mean's t interval goes
    # below 0 tok/s; the rate's does not.
    noisy = [22.3, 2.1, 5.2]
    assert mean_interval(3, float(np.mean(noisy)), float(np.std(noisy, ddof=1)))[0] < 0
    low, high = rate_interval(noisy)
    assert 0 < low < min(noisy) and high > max(noisy)
    assert all(math.isnan(v) for v in rate_interval([5.0]))
    assert all(math.isnan(v) for v in rate_interval([5.0, 0.0]))


def test_ratio_test_is_scipys_welch_test_on_logs():
    rng = np.random.default_rng(4)
    for _ in range(50):
        na, nb = (int(v) for v in rng.integers(2, 9, 2))
        a = 50 * np.exp(rng.normal(0, rng.uniform(0.005, 0.4), na))
        b = 50 * rng.uniform(0.5, 1.5) * np.exp(rng.normal(0, rng.uniform(0.005, 0.4), nb))
        r = ratio_test(list(a), list(b), 0.95)
        ref = scipy_stats.ttest_ind(np.log(b), np.log(a), equal_var=False)
        assert r.p_value == pytest.approx(ref.pvalue, rel=1e-9)
        ci = ref.confidence_interval(0.95)
        assert (r.low, r.high) == pytest.approx((math.exp(ci.low), math.exp(ci.high)), rel=1e-9)
        assert r.ratio == pytest.approx(math.exp(np.log(b).mean() - np.log(a).mean()), rel=1e-12)


def test_ratio_interval_and_verdict_agree_and_never_cross_zero():
    """The one property compare's verdict rests on: the interval excludes 1 exactly when p < 1 - confidence;
    and a ratio's lower end is above 0 (no change below -100 %), however noisy."""
    rng = np.random.default_rng(7)
    checked = flagged = 0
    for _ in range(2000):
        n = int(rng.integers(2, 7))
        cv = rng.uniform(0.005, 0.8)
        a = 30 * np.exp(rng.normal(0, cv, n))
        b = 30 * rng.choice([0.5, 0.9, 1.0, 1.1]) * np.exp(rng.normal(0, cv, n))
        for conf in (0.95, 0.99):
            r = ratio_test(list(a), list(b), conf)
            if abs(abs(math.log(r.ratio)) - math.log1p(r.detectable)) < 1e-9:
                continue  # on the boundary itself floating point decides
            excludes = not (r.low <= 1.0 <= r.high)
            assert excludes == (r.p_value < 1 - conf), (a, b, conf, r)
            assert 0 < r.low <= r.ratio <= r.high
            # detectable: a ratio beyond 1 +- detectable (on the log scale) is flagged, one within is not
            assert excludes == (abs(math.log(r.ratio)) > math.log1p(r.detectable))
            checked += 1
            flagged += excludes
    assert checked > 3900 and flagged > 300 and checked - flagged > 300  # both verdicts were exercised


def test_three_repetitions_a_side_can_decide():
    """Mann-Whitney's smallest p at 3 vs 3 is 0.100: it can never flag a change. The t test on logs can, when
    the change is large against the measured noise; and it says which change is the smallest it could flag."""
    a = [50.2, 49.6, 50.5]  # 1 % noise
    b = [45.1, 44.8, 45.6]  # -10 %
    r = ratio_test(a, b)
    assert r.p_value < 0.001 and r.high < 1.0
    assert 0.005 < r.detectable < 0.05  # a few % at this noise
    same = ratio_test(a, [50.0, 50.4, 49.7])
    assert same.p_value > 0.05 and same.low < 1.0 < same.high


def test_ratio_test_says_why_it_cannot_test():
    assert "at least 2" in ratio_test([5.0], [4.0, 4.1]).reason
    assert math.isnan(ratio_test([5.0], [4.0, 4.1]).p_value)
    assert ratio_test([5.0], [4.0, 4.1]).ratio == pytest.approx(math.sqrt(4.0 * 4.1) / 5.0)
    assert "no variation" in ratio_test([5.0, 5.0], [4.0, 4.0]).reason
    assert "<= 0" in ratio_test([5.0, 0.0], [4.0, 4.1]).reason
    assert "no samples" in ratio_test([], [4.0]).reason
