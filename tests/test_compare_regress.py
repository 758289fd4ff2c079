"""compare and regress on synthetic run tables shaped like runs_frame's output (no MLflow, no device)."""

from __future__ import annotations

import itertools
import json
import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from jbench.analysis.compare import CompareError, compare
from jbench.analysis.regress import RegressError, check_metric, regress
from jbench.analysis.stats import WelchInterval, mann_whitney_u, min_attainable_p, ratio_test, t_ppf, welch_interval

T0 = pd.Timestamp("2025-03-01T02:00:00Z")


def history(
    *,
    sweeps: int = 6,
    configs: tuple[str, ...] = ("cfgA", "cfgB", "cfgC"),
    reps: int = 5,
    cv: float = 0.01,
    drift: float = 0.003,
    last_factor: dict | float = 1.0,
    seed: int = 0,
    base_rate: float = 40.0,
    fingerprint: dict | None = None,
    last_fingerprint: dict | None = None,
    device: str = "orin-nx",
):
    """Trial rows and decode/prefill repetition samples of `sweeps` nightly sweeps.

    Each repetition is rate * (1 + N(0, cv)); each sweep shifts every rate by N(0, drift) (night-to-night
    drift); the last sweep multiplies config c's rate by last_factor[c] (or by last_factor for all)."""
    rng = np.random.default_rng(seed)
    fp = {"jetson.jetpack": "6.2", "jetson.l4t": "36.4.3", "backend.build_commit": "b4500a1",
          "model.sha256": "ab" * 32, "host.kernel": "Linux 5.15.148-tegra aarch64", **(fingerprint or {})}
    rows, dec, pre = [], {}, {}
    for s in range(sweeps):
        sweep_id = f"sweep-{s:03d}"
        night = 1.0 + rng.normal(0, drift)
        last = s == sweeps - 1
        tags = {**fp, **(last_fingerprint or {})} if last else fp
        for i, c in enumerate(configs):
            factor = (last_factor.get(c, 1.0) if isinstance(last_factor, dict) else last_factor) if last else 1.0
            rate = base_rate * (1 + 0.1 * i) * night * factor
            d = list(rate * (1 + rng.normal(0, cv, reps)))
            p = list(rate * 20 * (1 + rng.normal(0, cv, reps)))
            run_id = f"r{s:03d}{i:02d}{seed:04d}"
            dec[run_id], pre[run_id] = d, p
            start = T0 + pd.Timedelta(days=s, minutes=i)
            row = {"run_id": run_id, "experiment": "nightly", "status": "FINISHED", "start_time": start,
                   "end_time": start + pd.Timedelta(seconds=30), "params.model.quant": c,
                   "metrics.decode_tps": float(np.mean(d)), "metrics.prefill_tps": float(np.mean(p)),
                   "tags.jbench.kind": "trial", "tags.jbench.config_hash": f"hash-{c}",
                   "tags.jbench.sweep_id": sweep_id, "tags.jbench.trial_label": f"model.quant={c}",
                   "tags.device.name": device}
            row.update({f"tags.{k}": v for k, v in tags.items()})
            rows.append(row)
    return pd.DataFrame(rows), {"decode_tps_rep": dec, "prefill_tps_rep": pre}


def by_config(report):
    return {r.config_hash: r for r in report.results}


# --------------------------------------------------------------------------------------------
# Statistics


def test_mann_whitney_exact_known_values():
    full = mann_whitney_u([6, 7, 8, 9, 10], [1, 2, 3, 4, 5])
    assert full.method == "exact" and full.u == 25 and full.p_value == pytest.approx(2 / 252)
    assert min_attainable_p(5, 5) == pytest.approx(2 / 252)
    assert min_attainable_p(4, 4) == pytest.approx(2 / 70)
    same = mann_whitney_u([1, 2, 3], [1.5, 2.5, 3.5])
    assert 0.5 < same.p_value <= 1.0
    tied = mann_whitney_u([1, 1, 1], [1, 1, 1])
    assert tied.p_value == 1.0 and tied.method == "asymptotic"
    assert math.isnan(mann_whitney_u([], [1, 2]).p_value)


def _exact_two_sided_p(x, y):
    """Mann-Whitney p by enumerating every split of the pooled (tie-free) values: 2 x the smaller tail."""
    pooled = sorted(list(x) + list(y))
    rank = {v: i + 1 for i, v in enumerate(pooled)}
    n1 = len(x)
    u = sum(rank[v] for v in x) - n1 * (n1 + 1) / 2
    us = [sum(c) - n1 * (n1 + 1) / 2 for c in itertools.combinations(range(1, len(pooled) + 1), n1)]
    low, high = sum(v <= u for v in us), sum(v >= u for v in us)
    return u, min(1.0, 2 * min(low, high) / len(us))


def test_mann_whitney_exact_against_enumeration():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n1, n2 = (int(v) for v in rng.integers(1, 7, 2))
        x, y = rng.normal(0, 1, n1), rng.normal(rng.normal(0, 0.7), 1, n2)
        ours = mann_whitney_u(x, y)
        u, p = _exact_two_sided_p(x, y)
        assert ours.method == "exact" and ours.u == u and ours.p_value == pytest.approx(p, rel=1e-12)


def test_mann_whitney_asymptotic_by_formula():
    """Ties: the normal approximation with tie-corrected variance and continuity correction."""
    rng = np.random.default_rng(2)
    for _ in range(60):
        n1, n2 = (int(v) for v in rng.integers(2, 60, 2))
        x, y = np.round(rng.normal(0, 1, n1), 1), np.round(rng.normal(0.3, 1, n2), 1)
        ours = mann_whitney_u(x, y)
        pooled = np.concatenate([x, y])
        ranks = pd.Series(pooled).rank().to_numpy()
        u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2
        n = n1 + n2
        ties = np.unique(pooled, return_counts=True)[1]
        var = n1 * n2 / 12 * ((n + 1) - (ties ** 3 - ties).sum() / (n * (n - 1)))
        z = (abs(u1 - n1 * n2 / 2) - 0.5) / math.sqrt(var)
        p = min(1.0, math.erfc(z / math.sqrt(2))) if z > 0 else 1.0
        assert ours.method == "asymptotic" and ours.u == u1 and ours.p_value == pytest.approx(p, rel=1e-9)
    # Values the hand-written implementation gave before scipy took over (unchanged).
    assert mann_whitney_u([1, 1, 2], [1, 2, 2]).p_value == pytest.approx(0.6192567541768621, rel=1e-12)
    assert mann_whitney_u([1, 2, 3], [1.5, 2.5, 3.5]).p_value == pytest.approx(0.7, rel=1e-12)
    assert mann_whitney_u(list(range(51)), [v + 0.5 for v in range(3)]).method == "asymptotic"  # > 50 a side


def test_student_t_quantiles():
    assert t_ppf(0.975, 4) == pytest.approx(2.7764451051977987, rel=1e-10)
    assert t_ppf(0.975, 1) == pytest.approx(12.706204736174698, rel=1e-9)
    assert t_ppf(0.995, 10) == pytest.approx(3.16927267261695, rel=1e-10)
    assert t_ppf(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert t_ppf(0.025, 7) == pytest.approx(-t_ppf(0.975, 7))
    assert scipy_stats.t.cdf(t_ppf(0.9, 3.3), 3.3) == pytest.approx(0.9, abs=1e-10)
    with pytest.raises(ValueError):
        t_ppf(1.0, 3)


def test_welch_interval_by_hand():
    a, b = [10.0, 11.0, 12.0], [13.0, 15.0, 14.0, 16.0]
    wi = welch_interval(a, b)
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 4
    dof = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    half = t_ppf(0.975, dof) * math.sqrt(va + vb)
    assert wi.diff == pytest.approx(3.5)
    assert (wi.low, wi.high) == pytest.approx((3.5 - half, 3.5 + half))
    assert math.isnan(welch_interval([1.0], [2.0, 3.0]).low)
    # scipy's own Welch test gives the same interval.
    ref = scipy_stats.ttest_ind(b, a, equal_var=False).confidence_interval(0.95)
    assert (wi.low, wi.high) == pytest.approx((ref.low, ref.high), rel=1e-10)
    assert welch_interval([2.0, 2.0], [3.0, 3.0]) == WelchInterval(1.0, 1.0, 1.0, math.inf)


# --------------------------------------------------------------------------------------------
# compare


def test_compare_no_configuration_in_common_raises():
    a, s = history(sweeps=1, configs=("x", "y"))
    b, s2 = history(sweeps=1, configs=("z",), seed=1)
    with pytest.raises(CompareError, match=r"no configuration in common between A \(2 configuration\(s\)\) and B \(1\); "
                       r"they differ in model.quant \(A: x, y; B: z\): compare along it with --along model.quant"):
        compare(a, b, {**s["decode_tps_rep"], **s2["decode_tps_rep"]})
    with pytest.raises(CompareError, match="selection A has no finished trial runs"):
        compare(a.iloc[0:0], b)


def test_compare_table_and_json():
    df, samples = history(sweeps=2, configs=("x", "y", "z"), last_factor={"x": 0.9}, seed=3)
    df["metrics.decode_tokens_per_joule"] = df["metrics.decode_tps"] / 12.0
    a = df[df["tags.jbench.sweep_id"] == "sweep-000"]
    b = df[(df["tags.jbench.sweep_id"] == "sweep-001") & (df["params.model.quant"] != "z")]
    result = compare(a, b, samples)
    assert result.only_in_a == ["z"] and result.only_in_b == []  # labels, not hashes
    assert result.metrics == ["prefill_tps", "decode_tps", "decode_tokens_per_joule"]
    t = result.table.set_index(["config_hash", "metric"])
    x = t.loc[("hash-x", "decode_tps")]
    assert x["n_a"] == 5 and x["n_b"] == 5 and x["samples"] == "repetitions"
    assert -13 < x["change_pct"] < -7 and x["ci_low_pct"] < x["change_pct"] < x["ci_high_pct"] < 0
    ref = scipy_stats.ttest_ind(np.log(samples["decode_tps_rep"][b["run_id"].iloc[0]]),
                                np.log(samples["decode_tps_rep"][a["run_id"].iloc[0]]), equal_var=False)
    assert x["p_value"] == pytest.approx(ref.pvalue, rel=1e-9) and x["p_value"] < 1e-4 and x["significant"]
    assert 0 < x["detectable_pct"] < 3  # 1 % noise, 5 vs 5: a change of a few % is visible
    y = t.loc[("hash-y", "decode_tps")]
    assert abs(y["change_pct"]) < 3
    tpj = t.loc[("hash-x", "decode_tokens_per_joule")]
    assert tpj["samples"] == "runs" and tpj["n_a"] == 1 and math.isnan(tpj["ci_low_pct"])
    assert tpj["note"] == "1 vs 1 samples: a test needs at least 2 on each side" and not tpj["significant"]
    doc = json.loads(json.dumps(result.to_dict()))  # JSON-able, NaN as null
    assert doc["only_in_a"] == ["z"] and len(doc["rows"]) == 6 and doc["alpha"] == 0.05
    md = result.to_markdown()
    assert "| decode_tps |" in md and "Only in A (not compared): z" in md
    assert "Not tested: x decode_tokens_per_joule: 1 vs 1 samples" in md
    assert re.search(r"Smallest detectable change at these sample sizes \(5 vs 5\) and the noise measured: "
                     r"-\d\.\d\d % / \+\d\.\d\d % \(\w \w+\) to -\d\.\d\d % / \+\d\.\d\d %", md), md
    assert 0 < x["detectable_drop_pct"] < x["detectable_pct"] < 3
    # A loader (run_ids, stepped metric) -> samples gives the same table.
    loaded = compare(a, b, lambda ids, m: {r: samples[m][r] for r in ids if r in samples.get(m, {})})
    pd.testing.assert_frame_equal(loaded.table, result.table)


def test_compare_interval_and_verdict_agree_on_every_row():
    """The verdict is the interval's: a row is significant exactly when its interval excludes 0 %, and no bound
    is at or below -100 % (a rate cannot fall below 0 tok/s), also at 3 repetitions and 50 % noise."""
    seen = set()
    for seed, cv in itertools.product(range(15), (0.01, 0.1, 0.5)):
        df, samples = history(sweeps=2, configs=("x", "y"), reps=3, cv=cv, last_factor={"x": 0.8}, seed=seed)
        # 50 % normal noise can draw a rate <= 0; a measured rate never is
        samples = {m: {r: [abs(v) for v in vs] for r, vs in s.items()} for m, s in samples.items()}
        t = compare(df[df["tags.jbench.sweep_id"] == "sweep-000"], df[df["tags.jbench.sweep_id"] == "sweep-001"],
                    samples).table
        excludes = (t["ci_low_pct"] > 0) | (t["ci_high_pct"] < 0)
        assert (excludes == t["significant"]).all()
        assert (t["ci_low_pct"] > -100).all()
        seen |= set(t["significant"])
    assert seen == {True, False}


def test_compare_interval_coverage_and_null_p_values():
    """Under no change, the 95 % interval covers no change about 95 % of the time and p < 0.05 about 5 %;
    with a true -4 % change the interval covers -4 % about as often."""
    rng = np.random.default_rng(11)
    cover0 = cover4 = small_p = 0
    n = 400
    for _ in range(n):
        a = list(50 * (1 + rng.normal(0, 0.02, 6)))
        b = list(50 * (1 + rng.normal(0, 0.02, 6)))
        c = list(48 * (1 + rng.normal(0, 0.02, 6)))
        r = ratio_test(a, b)
        cover0 += r.low <= 1 <= r.high
        small_p += r.p_value < 0.05
        r4 = ratio_test(a, c)
        cover4 += r4.low <= 0.96 <= r4.high
    assert 0.91 <= cover0 / n <= 0.98
    assert 0.91 <= cover4 / n <= 0.98
    assert 0.02 <= small_p / n <= 0.09
    # The Welch interval on the difference itself (still a building block) covers as well.
    cover = sum(welch_interval(list(50 * (1 + rng.normal(0, 0.02, 6))),
                               list(50 * (1 + rng.normal(0, 0.02, 6)))).low <= 0 for _ in range(200))
    assert cover > 150


def trial_rows(cells, *, sweep="s1", reps=3, seed=0, device="local"):
    """Trial rows with the params a real run records (so identity can be computed from them), one per cell
    ({key: value} overriding the defaults below), and their decode repetition samples (rate from `rate`)."""
    from jbench.core.identity import _config_digest, identity_items_from_flat

    rng = np.random.default_rng(seed)
    rows, dec = [], {}
    for i, cell in enumerate(cells):
        cell = dict(cell)
        rate = cell.pop("rate")
        params = {"device.name": device, "backend.name": "llamacpp", "model.name": "gemma3_270m",
                  "model.quant": "Q4_0", "backend.n_gen": "64", **cell}
        run_id = f"{sweep}-{i:02d}-{seed}"
        dec[run_id] = list(rate * (1 + rng.normal(0, 0.01, reps)))
        row = {"run_id": run_id, "experiment": "quant_ladder", "status": "FINISHED",
               "start_time": T0 + pd.Timedelta(minutes=i), "metrics.decode_tps": float(np.mean(dec[run_id])),
               "tags.jbench.kind": "trial", "tags.jbench.sweep_id": sweep, "tags.device.name": device,
               "tags.jbench.config_hash": _config_digest(identity_items_from_flat(params)),
               "tags.jbench.trial_label": params["model.quant"]}
        row.update({f"params.{k}": v for k, v in params.items()})
        rows.append(row)
    return pd.DataFrame(rows), {"decode_tps_rep": dec}


def test_compare_along_a_key_holds_the_others_equal():
    cells = [{"model.quant": q, "backend.n_gen": g, "rate": r}
             for q, g, r in (("Q4_0", "64", 60.0), ("Q4_0", "128", 58.0), ("Q8_0", "64", 45.0),
                             ("Q8_0", "128", 44.0), ("Q8_0", "256", 43.0))]
    df, samples = trial_rows(cells)
    q4, q8 = df[df["params.model.quant"] == "Q4_0"], df[df["params.model.quant"] == "Q8_0"]
    with pytest.raises(CompareError, match=r"no configuration in common .*they differ in .*model.quant \(A: Q4_0; "
                                           r"B: Q8_0\)"):
        compare(q4, q8, samples)
    result = compare(q4, q8, samples, along=["model.quant"])
    t = result.table
    assert list(t["label"]) == ["Q4_0 → Q8_0 n_gen=64", "Q4_0 → Q8_0 n_gen=128"]
    assert t["change_pct"].iloc[0] == pytest.approx(-25, abs=2) and t["significant"].all()
    assert (t["config_hash"] != t["config_hash_b"]).all()
    assert result.only_in_b == ["Q8_0 n_gen=256"] and result.only_in_a == []
    md = result.to_markdown()
    assert md.startswith("Along model.quant: each configuration of A against the one of B that differs only there.")
    assert "Only in B (not compared): Q8_0 n_gen=256" in md
    # A side that holds two values of the key for one configuration would pool them: refused.
    q8_later, s3 = trial_rows([{"model.quant": "Q8_0", "rate": 45.0}], sweep="s3")
    both = {"decode_tps_rep": {**samples["decode_tps_rep"], **s3["decode_tps_rep"]}}
    with pytest.raises(CompareError, match=r"A holds several values of model.quant for one configuration "
                                           r"\(Q4_0, Q8_0\): select one"):
        compare(df, q8_later, both, along=["model.quant"])
    with pytest.raises(CompareError, match=r"no run of A or B records 'model.qaunt' \(did you mean model.quant\?\): "
                                           r"compare along an identity key, e.g. one where A and B differ: "
                                           r"backend.n_gen, model.quant"):
        compare(q4, q8, samples, along=["model.qaunt"])
    # Along a key, but the selections differ elsewhere too: said, with where.
    other, s2 = trial_rows([{"model.quant": "Q8_0", "backend.n_gen": "64", "backend.depth": "512", "rate": 40.0}],
                           sweep="s2")
    with pytest.raises(CompareError, match=r"no configuration of A matches one of B along model.quant .*"
                                           r"backend.depth \(A: 0; B: 512\)"):
        compare(q4, other, {"decode_tps_rep": {**samples["decode_tps_rep"], **s2["decode_tps_rep"]}},
                along=["model.quant"])


def test_compare_refuses_a_selection_against_itself_or_overlapping():
    df, samples = trial_rows([{"model.quant": "Q4_0", "rate": 60.0}, {"model.quant": "Q8_0", "rate": 45.0}])
    with pytest.raises(CompareError, match=r"A and B select the same 2 run\(s\): compared with itself"):
        compare(df, df, samples)
    with pytest.raises(CompareError, match=r"1 run\(s\) are in both A and B \(s1-00-0\): a run cannot be its own "
                                           r"baseline"):
        compare(df, df.iloc[:1], samples)


def test_only_in_labels_name_configurations_apart():
    df, samples = trial_rows([{"model.quant": "Q4_0", "rate": 60.0}, {"model.quant": "Q8_0", "rate": 45.0},
                              {"model.quant": "Q8_0", "backend.n_gen": "128", "rate": 44.0}])
    b, s2 = trial_rows([{"model.quant": "Q4_0", "rate": 59.0}], sweep="s2")
    result = compare(df, b, {"decode_tps_rep": {**samples["decode_tps_rep"], **s2["decode_tps_rep"]}})
    # named by the keys that vary, as the sweep summary names trials (the trial label alone says Q8_0 twice)
    assert result.only_in_a == ["Q8_0 n_gen=64", "Q8_0 n_gen=128"]
    assert list(result.table["label"]) == ["Q4_0 n_gen=64"]
    # runs without params (nothing to name them by) that share a trial label: each gets its short hash
    hist, hs = history(sweeps=2, configs=("x", "y", "z"), seed=5)
    hist = hist.drop(columns=["params.model.quant"]).assign(**{"tags.jbench.trial_label": "same"})
    a = hist[hist["tags.jbench.sweep_id"] == "sweep-000"]
    rows = compare(a, hist[hist["tags.jbench.sweep_id"] == "sweep-001"], hs).table
    assert list(dict.fromkeys(rows["label"])) == ["same (hash-x)", "same (hash-y)", "same (hash-z)"]
    result = compare(a, hist[(hist["tags.jbench.sweep_id"] == "sweep-001") & (hist["run_id"] != "r001020005")], hs)
    assert result.only_in_a == ["same"]  # alone in its list: no hash needed


# --------------------------------------------------------------------------------------------
# regress


def test_true_five_percent_regression_is_caught():
    df, samples = history(sweeps=6, last_factor={"cfgB": 0.95}, seed=5)
    for baseline in ("last", "all"):
        rep = regress(df, samples, baseline=baseline)
        res = by_config(rep)
        assert res["hash-cfgB"].status == "regression", (baseline, res["hash-cfgB"].message)
        assert res["hash-cfgA"].status == "pass" and res["hash-cfgC"].status == "pass"
        assert rep.exit_code == 1
        check = res["hash-cfgB"].checks[0]
        assert check.metric == "decode_tps" and check.p_value < 0.01 and check.change == pytest.approx(-0.05, abs=0.015)
    junit = ET.fromstring(rep.to_junit_xml())
    cases = junit.findall("testcase")
    assert len(cases) == 3 and junit.get("failures") == "1"
    failed = [c for c in cases if c.find("failure") is not None]
    assert len(failed) == 1 and "cfgB" in failed[0].get("name")
    md = rep.to_markdown()
    assert md.startswith("# jbench regress: FAIL") and "| regression |" in md


def test_five_percent_regression_detection_rate_over_seeds():
    """CV 1 %, 5 repetitions, 5 baseline sweeps: the 5 % drop is caught essentially always against the
    whole history, and nearly always against only the previous sweep (5 vs 5 samples, whose
    estimated CV sometimes lifts the 3x-noise threshold above 5 %)."""
    caught = {"all": 0, "last": 0}
    seeds = range(100)
    for seed in seeds:
        df, samples = history(sweeps=6, configs=("cfgA",), last_factor=0.95, seed=seed)
        for baseline in caught:
            caught[baseline] += regress(df, samples, baseline=baseline).results[0].status == "regression"
    assert caught["all"] >= 97
    assert caught["last"] >= 85


@pytest.mark.slow
def test_noise_with_the_same_mean_is_not_flagged():
    """3,000 configuration checks of pure noise (CV 1 %, night-to-night drift 0.3 %): no regression and no
    improvement at p < 0.01 with the 3 % floor, although Mann-Whitney alone is often 'significant' on drift."""
    flagged = significant = total = 0
    for seed in range(500):
        df, samples = history(sweeps=6, configs=("a", "b", "c"), seed=1000 + seed)
        for baseline in ("last", "all"):
            rep = regress(df, samples, baseline=baseline)
            for r in rep.results:
                total += 1
                flagged += r.status in ("regression", "improvement")
                significant += any(c.p_value < 0.01 for c in r.checks)
            assert rep.exit_code == 0
    assert total == 3000 and flagged == 0
    assert significant > 0  # the effect-size floor, not the p-value, is what keeps these quiet


def test_noise_floor_scales_with_measured_noise():
    rng = np.random.default_rng(2)
    base = list(100 * (1 + rng.normal(0, 0.03, 20)))  # CV ~3 %: threshold ~9 %
    now = list(95 * (1 + rng.normal(0, 0.03, 5)))
    c = check_metric(base, now, "decode_tps")
    assert c.threshold > 0.06 and c.verdict == "no change"
    quiet = list(100 * (1 + rng.normal(0, 0.001, 20)))  # CV 0.1 %: threshold is the 3 % floor
    c = check_metric(quiet, list(98 * (1 + rng.normal(0, 0.001, 5))), "decode_tps")
    assert c.threshold == pytest.approx(0.03) and c.p_value < 0.01 and c.verdict == "no change"
    c = check_metric(quiet, list(96 * (1 + rng.normal(0, 0.001, 5))), "decode_tps")
    assert c.verdict == "regression"


def test_improvement_is_reported_and_does_not_fail():
    df, samples = history(sweeps=4, last_factor={"cfgA": 1.08}, seed=9)
    rep = regress(df, samples, baseline="all")
    assert by_config(rep)["hash-cfgA"].status == "improvement"
    assert rep.exit_code == 0


def test_fingerprint_change_is_annotated_not_blamed_on_code():
    df, samples = history(sweeps=5, last_factor=0.94, last_fingerprint={"jetson.jetpack": "6.1",
                                                                       "backend.build_commit": "c0ffee1"}, seed=4)
    rep = regress(df, samples, baseline="last")
    assert rep.exit_code == 0
    for r in rep.results:
        assert r.status == "changed-environment"
        assert "jetson.jetpack 6.2 -> 6.1" in r.fingerprint_changes
        assert "backend.build_commit b4500a1 -> c0ffee1" in r.fingerprint_changes
        assert "fingerprint changed: " in r.message and "not attributed to code" in r.message
        assert r.checks[0].verdict == "regression"  # the drop is still measured and shown
    junit = ET.fromstring(rep.to_junit_xml())
    assert junit.get("failures") == "0"
    assert all("fingerprint changed" in c.find("system-out").text for c in junit.findall("testcase"))
    assert "fingerprint changed: jetson.jetpack 6.2 -> 6.1" in rep.to_markdown()


def test_a_new_backend_build_alone_is_the_code_under_test():
    # Only the build changed: the drop is judged (a nightly exists to catch it), with the build named as suspect.
    df, samples = history(sweeps=5, last_factor=0.94, last_fingerprint={"backend.build_commit": "c0ffee1"}, seed=4)
    rep = regress(df, samples, baseline="last")
    assert rep.exit_code == 1
    for r in rep.results:
        assert r.status == "regression" and "backend.build_commit b4500a1 -> c0ffee1" in r.fingerprint_changes
        assert "the build is the suspect" in r.note


def test_insufficient_data_is_not_a_pass():
    # Two repetitions a sweep: fewer than 3 on the current side.
    df, samples = history(sweeps=4, reps=2, last_factor=0.5, seed=6)
    rep = regress(df, samples, baseline="last")
    assert {r.status for r in rep.results} == {"insufficient-data"}
    assert rep.exit_code == 3  # no verdict: an untested configuration never turns CI green
    assert rep.to_markdown().startswith("# jbench regress: NO VERDICT: insufficient data for 3 of 3")
    assert "need >= 3" in rep.results[0].checks[0].reason
    junit = ET.fromstring(rep.to_junit_xml())
    assert junit.get("skipped") == "3"
    assert all(c.find("skipped") is not None for c in junit.findall("testcase"))
    # 4 vs 4 samples cannot reach p < 0.01 (smallest p = 2/70): insufficient too.
    df, samples = history(sweeps=2, reps=4, last_factor=0.5, seed=6)
    r = regress(df, samples, baseline="last").results[0]
    assert r.status == "insufficient-data" and "cannot reach p < 0.01" in r.checks[0].reason
    # A single sweep has no baseline.
    df, samples = history(sweeps=1, seed=6)
    r = regress(df, samples).results[0]
    assert r.status == "insufficient-data" and r.checks[0].reason == "no baseline runs"
    # No repetition samples at all: one value per run is not a repetition series.
    df, _ = history(sweeps=3, seed=6)
    r = regress(df, {}, baseline="last").results[0]
    assert r.status == "insufficient-data"


def test_baseline_selectors_tag_sweep_and_date():
    df, samples = history(sweeps=6, last_factor={"cfgA": 0.95}, seed=8)
    # TAG on the sweep parent runs (runs_frame(kinds=("trial", "sweep"))).
    parents = pd.DataFrame([{"run_id": f"p{s}", "experiment": "nightly", "status": "FINISHED",
                             "start_time": T0 + pd.Timedelta(days=s), "tags.jbench.kind": "sweep",
                             "tags.jbench.sweep_id": f"sweep-{s:03d}",
                             "tags.jbench.baseline": "golden" if s in (1, 2) else None} for s in range(6)])
    rep = regress(pd.concat([df, parents], ignore_index=True), samples, baseline="golden")
    r = by_config(rep)["hash-cfgA"]
    assert r.baseline_sweeps == ["sweep-001", "sweep-002"] and r.status == "regression"
    # TAG on trial runs.
    tagged = df.assign(**{"tags.jbench.baseline": np.where(df["tags.jbench.sweep_id"] == "sweep-003", "v1.2", None)})
    assert by_config(regress(tagged, samples, baseline="v1.2"))["hash-cfgA"].baseline_sweeps == ["sweep-003"]
    # A sweep id.
    assert by_config(regress(df, samples, baseline="sweep-000"))["hash-cfgA"].baseline_sweeps == ["sweep-000"]
    # A date: every run before it.
    r = by_config(regress(df, samples, baseline="2025-03-03"))["hash-cfgA"]
    assert r.baseline_sweeps == ["sweep-000", "sweep-001"] and r.checks[0].n_base == 10
    # 'last' and an explicit current sweep.
    r = by_config(regress(df, samples, baseline="last", current="sweep-003"))["hash-cfgA"]
    assert r.now_sweep == "sweep-003" and r.baseline_sweeps == ["sweep-002"]
    with pytest.raises(RegressError, match="baseline 'nope'"):
        regress(df, samples, baseline="nope")


def test_samples_loader_reads_only_the_runs_under_test():
    df, samples = history(sweeps=8, configs=("a", "b"), last_factor={"a": 0.9}, seed=12)
    asked = []

    def load(run_ids, metric):
        asked.append((metric, sorted(run_ids)))
        return {r: samples[metric][r] for r in run_ids}

    rep = regress(df, load, baseline="last")
    assert by_config(rep)["hash-a"].status == "regression"
    assert [m for m, _ in asked] == ["decode_tps_rep", "prefill_tps_rep"]
    wanted = df[df["tags.jbench.sweep_id"].isin(["sweep-006", "sweep-007"])]["run_id"]
    assert asked[0][1] == sorted(wanted)


def test_configurations_are_checked_per_device():
    d1, s1 = history(sweeps=4, configs=("a",), device="nx-1", seed=20, last_factor=0.9)
    d2, s2 = history(sweeps=4, configs=("a",), device="nx-2", seed=21)
    d2["run_id"] = d2["run_id"] + "-2"
    s2 = {m: {k + "-2": v for k, v in s.items()} for m, s in s2.items()}
    rep = regress(pd.concat([d1, d2]), {m: {**s1[m], **s2[m]} for m in s1}, baseline="all")
    status = {(r.device, r.config_hash): r.status for r in rep.results}
    assert status == {("nx-1", "hash-a"): "regression", ("nx-2", "hash-a"): "pass"}
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["exit_code"] == 1 and d["counts"] == {"regression": 1, "pass": 1}


def test_serving_trials_are_compared_level_by_level_at_the_loads_both_ran():
    """Two serving configurations (without and with a draft), two trials each: output tok/s and tokens/J per level,
    matched by load; a load only one side ran is not compared; one trial a side gives a rate and no interval."""
    from jbench.core.identity import _config_digest, identity_items_from_flat

    rows, series = [], {"serving_level_load": {}, "serving_output_tps": {}, "serving_output_tokens_per_joule": {}}
    speed = {None: {1: 100.0, 2: 180.0, 4: 300.0}, "Q4_0": {1: 150.0, 2: 250.0, 4: 330.0, 8: 340.0}}
    for i, (draft, trial) in enumerate(itertools.product((None, "Q4_0"), (0, 1))):
        params = {"device.name": "local", "backend.name": "llamacpp", "model.name": "gemma3_270m",
                  "model.quant": "F16", "backend.scenario": "serving", "serving.load": "concurrency",
                  **({"backend.draft": draft} if draft else {})}
        run_id = f"r{i}"
        loads = list(speed[draft])
        wobble = 1 + (0.01 if trial else -0.01)
        series["serving_level_load"][run_id] = [float(x) for x in loads]
        series["serving_output_tps"][run_id] = [speed[draft][x] * wobble for x in loads]
        # No energy in the last level's window: that level has no tokens/J (NaN), so no sample.
        series["serving_output_tokens_per_joule"][run_id] = [speed[draft][x] / 100 * wobble for x in loads[:-1]] + [
            math.nan]
        row = {"run_id": run_id, "experiment": "serving", "status": "FINISHED",
               "start_time": T0 + pd.Timedelta(minutes=i), "metrics.serving_output_tps": 1.0,
               "metrics.serving_output_tokens_per_joule": 1.0, "tags.jbench.kind": "trial",
               "tags.jbench.sweep_id": "s1", "tags.device.name": "local",
               "tags.jbench.config_hash": _config_digest(identity_items_from_flat(params)),
               "tags.jbench.trial_label": f"draft={draft}"}
        row.update({f"params.{k}": v for k, v in params.items()})
        rows.append(row)
    df = pd.DataFrame(rows)
    a, b = df[df["params.backend.draft"].isna()], df[df["params.backend.draft"] == "Q4_0"]
    result = compare(a, b, series, along=["backend.draft"])
    t = result.table
    tps = t[t["metric"] == "serving_output_tps"]
    assert [lbl.rsplit(" @ ", 1)[1] for lbl in tps["label"]] == ["1 in flight", "2 in flight", "4 in flight"]
    assert list(tps["change_pct"].round(1)) == [50.0, 38.9, 10.0]
    assert (tps["n_a"] == 2).all() and (tps["samples"] == "levels").all() and tps["significant"].all()
    tpj = t[t["metric"] == "serving_output_tokens_per_joule"]
    assert [lbl.rsplit(" @ ", 1)[1] for lbl in tpj["label"]] == ["1 in flight", "2 in flight"]  # 4: no energy in A
    md = result.to_markdown()
    assert "Serving rows (`@ load`): one sample per level run at that load" in md
    # Through a loader, as `jbench compare` reads the store (one call per series): the same table.
    loader = lambda ids, name: {i: series.get(name, {})[i] for i in ids if i in series.get(name, {})}  # noqa: E731
    assert compare(a, b, loader, along=["backend.draft"]).table.equals(t)
    # One trial a side: the change, and no interval, with the reason.
    one = compare(a.iloc[:1], b.iloc[:1], series, along=["backend.draft"]).table
    row = one[one["metric"] == "serving_output_tps"].iloc[0]
    assert row["change_pct"] == pytest.approx(50.0) and math.isnan(row["ci_low_pct"])
    assert "1 vs 1 samples" in row["note"]


@pytest.mark.slow
def test_a_key_set_to_null_selects_the_runs_that_do_not_record_it(tmp_path, capsys):
    """`backend.draft=null` names the trials without a draft (a null config key is not logged as a param); a key no
    run records is a typo and selects nothing."""
    import click
    from mlflow.tracking import MlflowClient

    from jbench.cli.stored import _results_tracker, _selection

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("speculative", artifact_location=str(tmp_path / "artifacts"))
    ids = {}
    for name, params in (("plain", {}), ("draft", {"backend.draft": "Q4_0"})):
        run = client.create_run(exp, tags={"jbench.kind": "trial", "jbench.config_hash": name,
                                           "jbench.sweep_id": "s1"})
        for k, v in {"model.quant": "F16", **params}.items():
            client.log_param(run.info.run_id, k, v)
        client.set_terminated(run.info.run_id)
        ids[name] = run.info.run_id
    tracker = _results_tracker(str(tmp_path))
    assert list(_selection(tracker, "backend.draft=null")["run_id"]) == [ids["plain"]]
    assert list(_selection(tracker, "backend.draft=Q4_0")["run_id"]) == [ids["draft"]]
    with pytest.raises(click.exceptions.Exit):
        _selection(tracker, "backend.drfat=null")
    assert "'backend.drfat=null' selects no trial runs" in capsys.readouterr().err
