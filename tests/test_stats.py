"""jbench.analysis.stats: the one home of jbench's statistics (describe, intervals, percentiles)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from jbench.analysis.stats import describe, mean_interval, percentile


def test_describe_and_its_t_interval():
    xs = [41.2, 40.8, 41.9, 40.5, 41.1]
    st = describe(xs)
    assert (st.n, st.median, st.min, st.max) == (5, 41.1, 40.5, 41.9)
    assert st.mean == pytest.approx(np.mean(xs)) and st.std == pytest.approx(np.std(xs, ddof=1))
    ref = scipy_stats.t.interval(0.95, 4, loc=np.mean(xs), scale=scipy_stats.sem(xs))
    assert st.ci95 == pytest.approx(ref, rel=1e-12)
    assert st.cv == pytest.approx(np.std(xs, ddof=1) / np.mean(xs))
    assert mean_interval(5, st.mean, st.std, 0.99) == pytest.approx(
        scipy_stats.t.interval(0.99, 4, loc=st.mean, scale=st.std / math.sqrt(5)), rel=1e-12)


def test_describe_degenerate_samples():
    one = describe([3.0])
    assert one.n == 1 and math.isnan(one.std) and all(math.isnan(v) for v in one.ci95) and math.isnan(one.cv)
    empty = describe([])
    assert empty.n == 0 and math.isnan(empty.mean) and all(math.isnan(v) for v in empty.ci95)
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
